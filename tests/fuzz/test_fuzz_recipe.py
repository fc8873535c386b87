"""Fuzzing recipe files (``workbench.quant.recipe.load_recipe``, ``LLM(quant="recipe.json")``): a
valid recipe file - a W4A8 g32 SmoothQuant mix with overrides and a skipped layer, calibrated on a
JSONL file that its ``calibration`` spec names - is mutated one change at a time (any JSON value,
retyped, removed or added at any level, or the file's bytes) and used the way ``LLM(quant=...)``
uses it: the recipe resolved, its calibration windows rebuilt from the spec, a small model
quantized with it.

The outcome is a correct load (every field of the recipe of its declared type and range, the
recipe equal to itself after a JSON round trip, the quantized model's logits finite) or a one-line
ConfigError / DataError naming the recipe file.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzzkit import (Shown, check_refusal, dump_json, fuzz, get_value, json_paths, mutated_bytes, mutated_json, note,
                     outcome)

import workbench
from workbench.data import jsonl_windows
from workbench.errors import ConfigError, DataError
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights
from workbench.quant.recipe import FALLBACKS, METHODS, QuantRecipe, save_recipe

RECIPE = QuantRecipe(weight_bits=4, group=32, act_bits=8, smooth=0.5, skip=("embed_tokens", "lm_head", "o_proj"),
                     overrides=(("down_proj", {"weight_bits": 8, "group": None}),
                                ("layers.0.mlp.up_proj", {"group": 16})))
KEYS = ("format", "version", "name", "recipe", "calibration", "weight_bits", "group", "per_channel", "symmetric",
        "method", "group_fallback", "skip", "overrides", "act_bits", "smooth", "dataset", "data_relative", "sha256",
        "text_field", "group_field", "split", "evaluation_fraction", "context", "max_windows")
IDS = torch.tensor([[1, 2, 3, 5, 8]])


@pytest.fixture(scope="module")
def tok():
    return Shown(workbench.Tokenizer(workbench.BUNDLED_MODEL), "<the bundled tokenizer>")


@pytest.fixture(scope="module")
def base():
    cfg = ModelConfig(vocab_size=workbench.Tokenizer(workbench.BUNDLED_MODEL).vocab_size, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return Shown(init_weights(CausalLM(cfg), seed=0).eval(), "<a one-layer model>")


@pytest.fixture(scope="module")
def valid(tmp_path_factory, tok):
    """The valid recipe file's document (its calibration spec names a JSONL file next to it)."""
    root = tmp_path_factory.mktemp("recipe")
    data = root / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": f"Row {i}: the list type has methods; a tuple does not.",
                                        "source": f"doc{i // 2}"}) + "\n" for i in range(8)))
    _, spec = jsonl_windows(data, tok.value, context=16, max_windows=2, split="calibration")
    path = save_recipe(root / "recipe.json", RECIPE, calibration=spec, quality={"ppl": 1.01})
    return Shown(json.loads(path.read_text()), "<the valid recipe file>")


def use(path, tok, base):
    """LLM(model, quant=path): the file resolved, its calibration windows rebuilt from its spec,
    the model quantized in place."""
    llm = workbench.LLM(copy.deepcopy(base.value), tokenizer=tok.value, quant=str(path), threads=1)
    return llm.loaded.model.recipe, llm.loaded.model


def check_recipe_fields(r: QuantRecipe) -> None:
    """Every field of its declared type and range (a load that took "yes" for a bool is no load)."""
    assert type(r.weight_bits) is int and r.weight_bits in (4, 8)
    assert r.group is None or (type(r.group) is int and r.group >= 2 and r.group % 2 == 0)
    assert type(r.per_channel) is bool and type(r.symmetric) is bool
    assert r.method in METHODS and r.group_fallback in FALLBACKS
    assert r.act_bits is None or (type(r.act_bits) is int and r.act_bits == 8)
    assert r.smooth is None or (type(r.smooth) in (int, float) and math.isfinite(r.smooth) and 0 <= r.smooth <= 1)
    assert isinstance(r.skip, tuple) and all(isinstance(s, str) and s for s in r.skip)
    for name, changes in r.overrides:
        assert isinstance(name, str) and name and isinstance(changes, dict)
        check_recipe_fields(QuantRecipe(**{**{k: v for k, v in vars(r).items() if k != "overrides"}, **changes}))
    assert QuantRecipe.from_dict(json.loads(json.dumps(r.to_dict(), allow_nan=False))) == r
    assert r.name and r.layer_settings("model.layers.0.mlp.down_proj", 96)["bits"] in (4, 8)


def run_case(tmp_path, text: bytes | str, tok, base, what: str):
    path = tmp_path / "recipe.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    kind, got = outcome(lambda: use(path, tok, base), (ConfigError, DataError), max_bytes=256 * 2**20,
                        trace_python=False)
    if kind == "error":
        check_refusal(got, [path])
        note(f"{what}: refused")
        return got
    recipe, model = got
    check_recipe_fields(recipe)
    with torch.inference_mode():
        assert torch.isfinite(model(IDS)).all()
    note(f"{what}: loaded")
    return None


@st.composite
def mutation(draw, valid):
    doc = valid.value
    if draw(st.integers(0, 9)) == 0:
        new, what = draw(mutated_bytes(json.dumps(doc).encode()))
        return Shown(new, f"bytes: {what}", area="bytes")
    paths = json_paths(doc)
    weights = [p for p in paths if p[:1] == ("recipe",)] * 3 + [p for p in paths if p[:1] == ("calibration",)] + paths
    new, path, action = draw(mutated_json(doc, KEYS, weights))
    area = "recipe" if path[:1] == ("recipe",) else "calibration" if path[:1] == ("calibration",) else "document"
    return Shown(dump_json(new), f"{action} at {list(path)}: {get_value(new, path)!r:.200}", area=area)


@fuzz(ci=300, deadline_ms=8000)
@given(data=st.data())
def test_fuzz_recipe_file(valid, tmp_path, tok, base, data):
    case = data.draw(mutation(valid), label="mutation")
    run_case(tmp_path, case.value, tok, base, case.area)


def test_the_valid_recipe_file_is_used(valid, tmp_path, tok, base):
    assert run_case(tmp_path, dump_json(valid.value), tok, base, "valid") is None


# ---- what the fuzzing found, kept as regular tests ----------------------------------------------------

def _edited(valid, path, value):
    doc = json.loads(json.dumps(valid.value))
    d = doc
    for k in path[:-1]:
        d = d[k]
    if value is KeyError:
        del d[path[-1]]
    else:
        d[path[-1]] = value
    return dump_json(doc)


@pytest.mark.parametrize("path, value, needles", [
    # a string where a bool belongs was taken as true (any non-empty string is truthy)
    (("recipe", "per_channel"), "True", ["field 'recipe'", "'per_channel' must be true or false"]),
    (("recipe", "overrides", 0, 1, "symmetric"), "no", ["'overrides' for 'down_proj'", "'symmetric'"]),
    # 4.0 passed the `in (4, 8)` check, then failed in the quantizer: TypeError (1 << 3.0)
    (("recipe", "weight_bits"), 4.0, ["'weight_bits' must be 4 or 8, got 4.0"]),
    # true passed as alpha 1
    (("recipe", "smooth"), True, ["'smooth'"]),
    (("recipe", "act_bits"), 8.0, ["'act_bits'"]),
    # a skip entry no layer has: quantize_model's error did not name the file
    (("recipe", "skip", 0), "EMBED_TOKENS", ["'skip' names 'EMBED_TOKENS'"]),
    # the calibration spec: a missing field, a wrong type, a file that is not there - named with the recipe file
    (("calibration", "dataset"), KeyError, ["field 'calibration'", "needs the fields dataset, context, split"]),
    (("calibration", "context"), "16", ["field 'calibration'", "'context' must be an integer"]),
    (("calibration", "split"), ["calibration"], ["field 'calibration'", "'split' must be one of"]),
    (("calibration", "group_field"), 7, ["field 'calibration'", "'group_field'"]),
    (("calibration",), "calib.jsonl", ["field 'calibration' must be an object"]),
    (("calibration", "dataset"), "/nowhere/calib.jsonl", ["field 'calibration'", "is not there"]),
])
def test_recipe_values_found_by_fuzzing_are_refused_by_name(valid, tmp_path, tok, base, path, value, needles):
    err = run_case(tmp_path, _edited(valid, path, value), tok, base, "regression")
    assert err is not None and all(n in str(err) for n in needles), err


@pytest.mark.parametrize("text", ["[" * 100_000, '{"format": "workbench-quant-recipe", "version": ' + "9" * 5000 + "}"])
def test_json_that_python_cannot_parse_is_a_recipe_error(tmp_path, tok, base, text):
    """Nesting past the recursion limit (RecursionError) and a 5,000-digit integer (ValueError)
    escaped load_recipe's JSON error handling."""
    err = run_case(tmp_path, text, tok, base, "regression")
    assert "not a JSON recipe file" in str(err)


def test_a_folder_or_a_fifo_named_like_a_recipe_file_is_refused_unopened(tmp_path):
    import os

    from workbench.quant.recipe import load_recipe

    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")                 # opening it to read would block forever
    for name in ("dir.json", "fifo.json"):
        kind, err = outcome(lambda: load_recipe(tmp_path / name), (ConfigError,), seconds=5)
        assert kind == "error" and "not a regular file" in check_refusal(err, [tmp_path / name])

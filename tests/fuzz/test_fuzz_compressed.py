"""Fuzzing compressed-tensors checkpoints: a valid one (a tiny random model quantized with four
config groups: int4 g32 asymmetric, int4 per-tensor asymmetric with an int8 zero point, int8
per-channel asymmetric, int4 g32 symmetric with int8 activations) is mutated one change at a time
and loaded the way ``LLM(folder)`` loads it (:meth:`workbench.engine.loaded.LoadedModel.load`):

* ``quantization_config`` of config.json: any JSON value, retyped, removed or added at any level;
* the rest of config.json: the same, at the top level;
* the safetensors header of a quantized tensor (``weight_packed``, ``weight_scale``,
  ``weight_zero_point``, ``weight_shape``): its dtype, its shape, both with the byte count kept
  (so the header passes and the layer check must refuse it), its offsets, renamed, removed, added;
* ``weight_shape``'s values, NaN / Inf scales;
* the file truncated, its header's bytes corrupted;
* the recipe side file ``workbench_recipe.json``.

The outcome is a correct load (the logits of the valid checkpoint, bit for bit, where the change
was to the quantized layers) or a one-line CheckpointError / ConfigError naming the file; a change
that makes the stored tensors disagree with the config must be refused.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzzkit import (MiB, check_refusal, dump_json, fuzz, get_value, json_paths, mutated_bytes, mutated_json, note,
                     outcome)

from workbench.engine.loaded import LoadedModel
from workbench.errors import CheckpointError, ConfigError
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights
from workbench.quant import quantize_model, save_compressed
from workbench.quant.recipe import QuantRecipe

RECIPE = QuantRecipe(weight_bits=4, group=32, symmetric=False,
                     overrides=(("o_proj", {"per_channel": False, "group": None}),
                                ("down_proj", {"weight_bits": 8, "group": None}),
                                ("gate_proj", {"symmetric": True, "act_bits": 8})))
IDS = torch.tensor([[1, 2, 3, 5, 8]])
FILES = ("config.json", "model.safetensors", "workbench_recipe.json")
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
ST_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "F8_E4M3",
             "F8_E5M2", "F8_E8M0", "C64", "F6_E2M3", "F6_E3M2", "F4"]
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
            "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}
QC_KEYS = ("quant_method", "format", "quantization_status", "config_groups", "ignore", "kv_cache_scheme",
           "sparsity_config", "transform_config", "global_compression_ratio", "targets", "weights",
           "input_activations", "output_activations", "num_bits", "type", "symmetric", "strategy", "group_size",
           "dynamic", "actorder", "block_structure", "observer", "group_0", "group_1", "group_2", "group_3")
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "rope_scaling", "tie_word_embeddings", "torch_dtype", "architectures", "model_type")
SIDE_KEYS = ("format", "version", "recipe", "weight_bits", "group", "per_channel", "symmetric", "method",
             "group_fallback", "skip", "overrides", "act_bits", "smooth", "layers", "rel_error", "checkpoint")


class Case:
    """One mutated checkpoint: its files, whether it must be refused, whether a load must give the
    valid logits; shown (in a falsifying example) as what was changed."""

    def __init__(self, files: dict, must_refuse: bool, same_logits: bool, what: str, kind: str) -> None:
        self.files, self.must_refuse, self.same_logits = files, must_refuse, same_logits
        self.what, self.kind = what, kind

    def __repr__(self) -> str:
        return self.what


class Valid(dict):
    def __repr__(self) -> str:
        return "<the valid checkpoint>"


# ---- the valid checkpoint --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """``{name: bytes}`` of the valid checkpoint's files, its header, and its reference logits."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = init_weights(CausalLM(cfg), seed=0).eval()
    quantize_model(model, RECIPE)
    folder = tmp_path_factory.mktemp("compressed") / "valid"
    info = save_compressed(model, folder)
    assert len(info["groups"]) == 4
    files = {f: (folder / f).read_bytes() for f in FILES}
    n = struct.unpack("<Q", files["model.safetensors"][:8])[0]
    header = json.loads(files["model.safetensors"][8:8 + n])
    ref = _load(folder)
    with torch.inference_mode():
        logits = ref.model(IDS)
    return Valid({"files": files, "header": header, "header_len": n, "logits": logits, "folder": folder,
            "config": json.loads(files["config.json"]), "side": json.loads(files["workbench_recipe.json"]),
            "layers": _layers(ref.model)})


def _load(folder: Path):
    return LoadedModel.load(folder, tokenizer=_TOK, device="cpu", threads=1)


_TOK = None


@pytest.fixture(scope="module", autouse=True)
def _tokenizer():
    """LLM(folder) reads the folder's tokenizer; these checkpoints have none, so one object is
    handed in (what the fuzzing is about is the checkpoint)."""
    global _TOK
    import workbench

    _TOK = workbench.Tokenizer(workbench.BUNDLED_MODEL)
    yield
    _TOK = None


def _layers(model) -> dict:
    from workbench.quant.apply import QuantLinear

    return {n: (m.bits, m.quantized.group, m.zeros is not None, m.act_bits) for n, m in model.named_modules()
            if isinstance(m, QuantLinear)}


def _write(folder: Path, files: dict[str, bytes]) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name, data in files.items():
        if data is not None:
            (folder / name).write_bytes(data)


def _safetensors(header: dict, data: bytes, pad: bool = True) -> bytes:
    raw = json.dumps(header, allow_nan=True).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _data(valid) -> bytes:
    return valid["files"]["model.safetensors"][8 + valid["header_len"]:]


def _quantized_names(valid) -> list[str]:
    return sorted(k for k in valid["header"] if k.endswith(SUFFIXES))


# ---- the check ------------------------------------------------------------------------------------

def check(valid, folder: Path, files: dict[str, bytes], must_refuse: bool, same_logits: bool, fields=()):
    _write(folder, files)
    budget = 64 * MiB + 16 * sum(len(v) for v in files.values() if v is not None)
    kind, got = outcome(lambda: _load(folder), (CheckpointError, ConfigError), max_bytes=budget, trace_python=False)
    if kind == "error":
        check_refusal(got, [folder], fields)
        return got
    assert not must_refuse, "this checkpoint disagrees with its config but loaded"
    with torch.inference_mode():
        logits = got.model(IDS)
    assert logits.shape == valid["logits"].shape and torch.isfinite(logits).all()
    if same_logits:
        assert _layers(got.model) == valid["layers"], "the quantized layers' settings changed"
        assert torch.equal(logits, valid["logits"]), "a checkpoint that loads must give the valid one's logits"
    return None


# ---- the mutations ----------------------------------------------------------------------------------

@st.composite
def config_mutation(draw, valid):
    """quantization_config changed anywhere (most draws), or a top-level config.json field."""
    cfg = valid["config"]
    if draw(st.integers(0, 3)):
        paths = [p for p in json_paths(cfg) if p[:1] == ("quantization_config",)]
        keys, same = QC_KEYS, True
    else:
        paths = [p for p in json_paths(cfg) if len(p) <= 1 and p[:1] != ("quantization_config",)]
        keys, same = CONFIG_KEYS, False
    new, path, action = draw(mutated_json(cfg, keys, paths))
    files = dict(valid["files"], **{"config.json": dump_json(new).encode()})
    return Case(files, False, same, f"config.json {action} at {list(path)}: {get_value(new, path)!r:.200}",
                "config.json quantization_config" if same else "config.json top level")


@st.composite
def header_mutation(draw, valid):
    """One quantized tensor's header entry changed; the file rewritten with a consistent length."""
    header = json.loads(json.dumps(valid["header"]))
    name = draw(st.sampled_from(_quantized_names(valid)))
    entry = header[name]
    n_bytes = entry["data_offsets"][1] - entry["data_offsets"][0]
    kind = draw(st.sampled_from(["dtype", "shape", "reshape", "redtype", "offsets", "rename", "remove", "add", "json"]))
    must_refuse = True
    if kind == "dtype":
        entry["dtype"] = draw(st.sampled_from(ST_DTYPES) | st.text(max_size=6) | st.integers())
    elif kind == "shape":
        entry["shape"] = draw(st.lists(st.integers(0, 2**40) | st.sampled_from([0, 1, 2, 64, 2**63]), max_size=4)
                              | st.sampled_from([None, "64", [[2]], [1.5], [-1]]))
    elif kind == "reshape":                   # the same element count: the header check passes
        numel = n_bytes // ITEMSIZE[entry["dtype"]]
        divisors = [d for d in range(1, numel + 1) if numel % d == 0]
        a = draw(st.sampled_from(divisors))
        entry["shape"] = draw(st.sampled_from([[numel], [a, numel // a], [numel // a, a], [1, numel],
                                               [a, 1, numel // a]]))
    elif kind == "redtype":                   # the same byte count
        size = ITEMSIZE[entry["dtype"]]
        numel = n_bytes // size
        entry["dtype"] = draw(st.sampled_from([d for d, s in ITEMSIZE.items() if s == size]))
        if draw(st.booleans()):
            other = draw(st.sampled_from([d for d, s in ITEMSIZE.items() if (n_bytes % s == 0)]))
            entry["dtype"], entry["shape"] = other, [n_bytes // ITEMSIZE[other]]
        del numel
    elif kind == "offsets":
        entry["data_offsets"] = draw(st.lists(st.integers(-1, 2**64), min_size=0, max_size=3)
                                     | st.sampled_from([None, [0], "0,4", [0.0, 4.0]]))
    elif kind == "rename":
        base = name.rsplit(".", 1)[0]
        header[base + "." + draw(st.sampled_from(["weight", "weight_g_idx", "input_scale", "weight_zero_point",
                                                  "weight_packed", "bias", "weight_scale_inv"]))] = header.pop(name)
    elif kind == "remove":
        del header[name]
    elif kind == "add":
        base = name.rsplit(".", 1)[0]
        header[base + "." + draw(st.sampled_from(["weight_g_idx", "input_scale", "weight", "weight_zero_point"]))] = \
            dict(entry)
    else:
        header, _, _ = draw(mutated_json(header, ("dtype", "shape", "data_offsets", "__metadata__")))
        must_refuse = False
    same = json.dumps(header, sort_keys=True) == json.dumps(valid["header"], sort_keys=True)
    if same or (kind == "rename" and name not in header and not any(k != name and k not in valid["header"]
                                                                    for k in header)):
        must_refuse = False
    if kind in ("reshape", "redtype") and not same:
        # accepted alternatives: a per-tensor scale / zero point [1] or [1, 1]; weight_shape I64 or I32
        # (I32 holds 4 bytes: not the same byte count as [2] I64); a scale's F16 / BF16 (not the same bytes)
        e, orig = header[name], valid["header"][name]
        alt_shape = {tuple(orig["shape"])}
        if orig["shape"] in ([1], [1, 1]):
            alt_shape |= {(1,), (1, 1)}
        if e["dtype"] == orig["dtype"] and tuple(e["shape"]) in alt_shape:
            must_refuse = False
    files = dict(valid["files"], **{"model.safetensors": _safetensors(header, _data(valid))})
    return Case(files, must_refuse, True, f"header {kind} of {name}: {header.get(name)}", f"header {kind}")


@st.composite
def value_mutation(draw, valid):
    """weight_shape holding other numbers, or a scale NaN / Inf."""
    data = bytearray(_data(valid))
    names = _quantized_names(valid)
    if draw(st.booleans()):
        name = draw(st.sampled_from([n for n in names if n.endswith("weight_shape")]))
        a, b = valid["header"][name]["data_offsets"]
        old = list(struct.unpack("<2q", data[a:b]))
        odd = st.sampled_from([0, 1, -1, 32, 64, 96, 2**62, -2**63, 2**63 - 1]) | st.integers(-2**63, 2**63 - 1)
        new = draw(st.lists(odd, min_size=2, max_size=2) | st.just(old[::-1]))
        data[a:b] = struct.pack("<2q", *new)
        must_refuse = new != old
        what, kind = f"{name} holds {new}", "weight_shape values"
    else:
        name = draw(st.sampled_from([n for n in names if n.endswith("weight_scale")]))
        a, b = valid["header"][name]["data_offsets"]
        i = draw(st.integers(0, (b - a) // 4 - 1))
        v = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        data[a + 4 * i:a + 4 * i + 4] = struct.pack("<f", v)
        must_refuse, what, kind = True, f"{name}[{i}] = {v}", "non-finite scale"
    st_bytes = valid["files"]["model.safetensors"][:8 + valid["header_len"]] + bytes(data)
    return Case(dict(valid["files"], **{"model.safetensors": st_bytes}), must_refuse, True, what, kind)


@st.composite
def byte_mutation(draw, valid):
    """The file truncated anywhere, or its header's bytes (length prefix included) corrupted."""
    raw = valid["files"]["model.safetensors"]
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(raw) - 1) | st.sampled_from([0, 4, 7, 8, 9, 8 + valid["header_len"]]))
        return Case(dict(valid["files"], **{"model.safetensors": raw[:cut]}), True, True, f"truncated to {cut} bytes",
                    "truncated")
    new, what = draw(mutated_bytes(raw, (0, 8 + valid["header_len"])))
    return Case(dict(valid["files"], **{"model.safetensors": new}), False, True, f"header bytes: {what}",
                "header bytes")


@st.composite
def side_file_mutation(draw, valid):
    side = valid["side"]
    choice = draw(st.integers(0, 5))
    if choice == 0:
        raw = draw(st.binary(max_size=64))
        return Case(dict(valid["files"], **{"workbench_recipe.json": raw}), False, True, f"side file bytes {raw!r}",
                    "side file bytes")
    new, path, action = draw(mutated_json(side, SIDE_KEYS))
    return Case(dict(valid["files"], **{"workbench_recipe.json": dump_json(new).encode()}), False, True,
                f"side file {action} at {list(path)}: {get_value(new, path)!r:.200}", "side file json")


# How often each kind of change is drawn (of 20).
WEIGHTS = {config_mutation: 6, header_mutation: 6, value_mutation: 2, byte_mutation: 4, side_file_mutation: 2}


@st.composite
def _mutation(draw, valid):
    kind = draw(st.sampled_from([k for k, n in WEIGHTS.items() for _ in range(n)]))
    return draw(kind(valid))


# ---- the fuzz test ----------------------------------------------------------------------------------

@fuzz(ci=300)
@given(data=st.data())
def test_fuzz_compressed_checkpoint(valid, tmp_path, data):
    case = data.draw(_mutation(valid), label="mutation")
    err = check(valid, tmp_path / "ck", case.files, case.must_refuse, case.same_logits)
    note(f"{case.kind}: {'refused' if err else 'loaded'}")


def test_the_valid_checkpoint_loads(valid, tmp_path):
    assert check(valid, tmp_path / "ck", valid["files"], False, True) is None


# ---- what the fuzzing found, kept as regular tests ----------------------------------------------------

def _edit_config(valid, edit) -> dict:
    cfg = json.loads(valid["files"]["config.json"])
    edit(cfg["quantization_config"])
    return dict(valid["files"], **{"config.json": dump_json(cfg).encode()})


def _set(path, value):
    def edit(qc):
        d = qc
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


G0 = ("config_groups", "group_0")


@pytest.mark.parametrize("edit, field", [
    # a list / object where a string is expected: TypeError (unhashable) in the format lookup
    (_set(G0 + ("format",), ["pack-quantized"]), "group_0.format"),
    (_set(("format",), {"x": 1}), "quantization_config.format"),
    # input_activations a string: AttributeError ('str' object has no attribute 'get')
    (_set(G0 + ("input_activations",), "None"), "group_0.input_activations"),
    (_set(G0 + ("input_activations",), {"num_bits": 8.5, "type": "int", "strategy": "token", "dynamic": True,
                                        "symmetric": True}), "input_activations.num_bits"),
    (_set(G0 + ("weights", "type"), ["int"]), "weights.type"),
    (_set(G0 + ("weights", "strategy"), ["group"]), "weights.strategy"),
    (_set(G0 + ("weights", "num_bits"), True), "weights.num_bits"),
    (_set(G0 + ("weights", "group_size"), True), "weights.group_size"),
    # a pattern that backtracks exponentially: the loader hung in re.match; now matched in time (and
    # matching nothing, the layers it named are left dense: their packed tensors are refused)
    (_set(G0 + ("targets",), ["re:(.*)*x"]), "q_proj"),
    # a pattern that does not compile: re.error
    (_set(("ignore",), ["lm_head", "re:["]), "quantization_config.ignore"),
    (_set(G0 + ("targets",), ["re:a{99999999999}"]), "group_0.targets"),
    # a group name with a newline: the message stays one line
    (lambda qc: qc["config_groups"].update({"bad\nname": "W4A16"}), "config_groups['bad\\nname']"),
])
def test_config_values_found_by_fuzzing_are_refused_by_name(valid, tmp_path, edit, field):
    err = check(valid, tmp_path / "ck", _edit_config(valid, edit), True, True, fields=[field])
    assert isinstance(err, CheckpointError) and "config.json" in str(err)


def test_integral_float_bits_load_as_ints(valid, tmp_path):
    """num_bits 4.0 (pydantic, which compressed-tensors reads configs with, takes it as 4) loads the
    same model; it was a TypeError in the unpacking (a float slice index)."""
    files = _edit_config(valid, _set(G0 + ("weights", "num_bits"), 4.0))
    assert check(valid, tmp_path / "ck", files, False, True) is None


def test_a_pattern_past_its_time_limit_is_refused_by_name(valid, tmp_path, monkeypatch):
    """The `regex` module matches the patterns re backtracks on forever in microseconds; whatever
    still takes longer than REGEX_SECONDS is refused, naming the pattern and its field."""
    import regex

    from workbench.quant import compressed_config

    class Slow:
        def match(self, name, timeout=None):
            raise TimeoutError("regex timed out")

    real = regex.compile
    monkeypatch.setattr(regex, "compile", lambda p, *a, **k: Slow() if p == "slow" else real(p, *a, **k))
    files = _edit_config(valid, _set(G0 + ("targets",), ["re:slow"]))
    err = check(valid, tmp_path / "ck", files, True, True, fields=["group_0.targets"])
    assert f"takes more than {compressed_config.REGEX_SECONDS:g} s" in str(err)


@pytest.mark.parametrize("edit, field", [
    # the recipe side file's 'layers' as a string: AttributeError ('str' object has no attribute 'get')
    (lambda d: d.update(layers="model.layers.0"), "field 'layers'"),
    (lambda d: d["layers"]["model.layers.0.mlp.up_proj"].update(rel_error="0.08"), "'rel_error'"),
    (lambda d: d["layers"]["model.layers.0.mlp.up_proj"].update(rel_error=math.nan), "'rel_error'"),
])
def test_side_file_values_found_by_fuzzing_are_refused_by_name(valid, tmp_path, edit, field):
    doc = json.loads(valid["files"]["workbench_recipe.json"])
    edit(doc)
    files = dict(valid["files"], **{"workbench_recipe.json": dump_json(doc).encode()})
    err = check(valid, tmp_path / "ck", files, True, True, fields=[field])
    assert "workbench_recipe.json" in str(err)

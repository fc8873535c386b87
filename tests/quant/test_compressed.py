"""compressed-tensors ``pack-quantized`` checkpoints, both ways, against the library that defines them.

(a) our W4A16 g128 export of the bundled model (its down_proj is 704 wide: g128 falls back to
    g64 there, so two config groups) and a W8A16 export load in transformers (compressed-tensors
    decompresses them on the CPU) with the logits of our engine on the same folder, and the same
    greedy tokens;
(b) checkpoints the compressed-tensors library writes itself, here and now (its
    ``apply_quantization_config``, its ``calculate_qparams``, ``ModelCompressor``): W4A16 g64
    and W8A16 per channel against transformers, an asymmetric W4A16 g64 against the library's own
    decompression (transformers 5.24 + compressed-tensors 0.20.1 cannot load packed zero
    points: it allocates them unpacked, whoever wrote the file);
(c) what we refuse, by name;
(d) our export read back by us: the same integers and scales, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_fixtures

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

import workbench as wb  # noqa: E402
from workbench.errors import CheckpointError, ConfigError  # noqa: E402
from workbench.quant import is_compressed_checkpoint, load_compressed, quantize_model, save_compressed  # noqa: E402
from workbench.quant.apply import QuantLinear  # noqa: E402
from workbench.quant.compressed import SIDE_FILE  # noqa: E402
from workbench.quant.recipe import QuantRecipe  # noqa: E402

from hf_fixtures import quiet_transformers  # noqa: E402

if not (wb.BUNDLED_MODEL / "model.safetensors").is_file():
    pytest.skip("bundled model weights not present", allow_module_level=True)

TOL = 1e-3                    # max |Δlogit| in float32
PROMPTS = ["The list type", "Dictionaries are"]
NEW_TOKENS = 16


def _export(folder: Path, recipe, **kw) -> dict:
    m = wb.load_model(device="cpu")
    quantize_model(m, recipe, **kw)
    return save_compressed(m, folder, tokenizer_folder=wb.BUNDLED_MODEL)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct-ours")
    out = {}
    for spec in ("w4a16:g128", "w8a16"):
        out[spec] = root / spec.replace(":", "-")
        _export(out[spec], spec)
    return out


def _hf_load(folder: Path):
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by transformers' own forward (no generate(): its EOS / length rules differ)."""
    cur = list(ids)
    for _ in range(n):
        cur.append(int(model(input_ids=torch.tensor([cur]), use_cache=False).logits[0, -1].argmax()))
    return cur[len(ids):]


@torch.no_grad()
def _ours_logits(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits [T, V] two ways: one forward over the prompt (the dequantize-then-matmul
    reference for many rows) and a 3-token prefill then one token per step through the KV cache
    (the backend's op: torch's packed CPU matmul for a single row)."""
    x = torch.tensor([ids])
    full = model(x)[0]
    cache = model.new_cache(1, len(ids))
    steps = [model(x[:, :3], 0, cache)[0]] + [model(x[:, t:t + 1], t, cache)[0] for t in range(3, len(ids))]
    return full, torch.cat(steps)


def _compare(name: str, oracle, oracle_greedy, llm: wb.LLM, dense_logits=None) -> float:
    """max |Δlogit| of our engine's model against ``oracle(ids) -> [T, V]`` over both prompts
    and both of our paths; the greedy tokens of our engine equal ``oracle_greedy(ids)``."""
    worst = 0.0
    for p in PROMPTS:
        ids = llm.tokenizer.encode(p + " and the dictionary methods")
        ref = oracle(ids)
        for ours in _ours_logits(llm.model, ids):
            worst = max(worst, float((ours - ref).abs().max()))
        if dense_logits is not None:      # the check has teeth: quantization moves the logits far more
            assert float((dense_logits(ids) - ref).abs().max()) > 10 * TOL
    print(f"max |Δlogit| {name}: {worst:.3g}")          # the measured figure (pytest -s shows it)
    assert worst <= TOL, f"{name}: max |Δlogit| {worst:.3g} > {TOL}"
    sp = wb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == oracle_greedy(llm.tokenizer.encode(p)), f"{name}: greedy tokens differ for {p!r}"
    return worst


@pytest.fixture(scope="module")
def dense_logits():
    m = wb.load_model(device="cpu")
    return lambda ids: m(torch.tensor([ids]))[0].detach()


# ---- (a) our export in transformers ------------------------------------------------------------

@pytest.mark.parametrize("spec", ["w4a16:g128", "w8a16"])
def test_our_export_loads_in_transformers_with_our_logits(exports, spec, dense_logits):
    folder = exports[spec]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    groups = list(qc["config_groups"].values())
    if spec == "w4a16:g128":      # down_proj (704 wide) falls back to g64: its own group, layers named
        assert [(g["weights"]["num_bits"], g["weights"]["strategy"], g["weights"]["group_size"], len(g["targets"]))
                for g in groups] == [(4, "group", 128, 36), (4, "group", 64, 6)]
        assert all(t.endswith("down_proj") for t in groups[1]["targets"])
    else:                          # one setting everywhere: the class target, as llm-compressor writes it
        assert [(g["weights"]["num_bits"], g["weights"]["strategy"], g["targets"]) for g in groups] == \
            [(8, "channel", ["Linear"])]
    hf = _hf_load(folder)
    llm = wb.LLM(folder)
    assert llm.quant_placement["layers"] == {"cpu": 42}           # the engine runs torch's packed CPU ops
    assert llm.model.recipe.name == QuantRecipe.parse(spec).name
    _compare(f"ours {spec} -> transformers", lambda ids: hf(input_ids=torch.tensor([ids])).logits[0].detach(),
             lambda ids: _hf_greedy(hf, ids, NEW_TOKENS), llm, dense_logits)


# ---- (b) the library's own checkpoints in our engine -------------------------------------------

def _library_checkpoint(folder: Path, bits: int, strategy: str, symmetric: bool):
    """The bundled model through compressed-tensors' own API, saved as it saves; returns the
    library's in-memory model (compressed; its first forward decompresses it)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(wb.BUNDLED_MODEL), dtype=torch.float32).eval()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=64 if strategy == "group" else None)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for mod in model.modules():
            if not hasattr(mod, "quantization_scheme"):
                continue
            w = mod.weight
            grouped = w.unflatten(-1, (-1, 64)) if strategy == "group" else w.unsqueeze(1)
            scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)      # min-max, its rounding
            mod.weight_scale.copy_(scale.reshape(mod.weight_scale.shape))
            if not symmetric:
                mod.weight_zero_point.copy_(zp.reshape(mod.weight_zero_point.shape))
            mod.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(wb.BUNDLED_MODEL / f, folder / f)
    return model


@pytest.mark.parametrize("bits,strategy,symmetric,name", [
    (4, "group", True, "w4a16-g64-sym-rtn-fallback=pow2"),
    (8, "channel", True, "w8a16-per-channel-sym-rtn"),
    (4, "group", False, "w4a16-g64-asym-rtn-fallback=pow2"),
])
def test_library_checkpoint_runs_in_our_engine(tmp_path, bits, strategy, symmetric, name, dense_logits):
    lib_model = _library_checkpoint(tmp_path, bits, strategy, symmetric)
    assert is_compressed_checkpoint(tmp_path) and not (tmp_path / SIDE_FILE).exists()
    llm = wb.LLM(tmp_path)
    assert llm.model.recipe.name == name and llm.model.recipe.method == "rtn"      # derived: no side file
    assert llm.model.quant_checkpoint["method_recorded"] is False
    if bits == 4 and symmetric:           # the library's symmetric int4 grid reaches -8; ours stops at -7
        assert min(int(m.quantized.int_values().min()) for m in llm.model.modules() if isinstance(m, QuantLinear)) == -8
    if symmetric:
        hf = _hf_load(tmp_path)
        oracle = hf
    else:
        oracle = lib_model                # its first forward decompresses the packed zero points itself
    _compare(f"compressed-tensors w{bits} {strategy} {'sym' if symmetric else 'asym'} -> ours",
             lambda ids: oracle(input_ids=torch.tensor([ids])).logits[0].detach(),
             lambda ids: _hf_greedy(oracle, ids, NEW_TOKENS), llm, dense_logits)


# ---- (c) refusals ------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_qc(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    fn(state)
    save_file(state, str(folder / "model.safetensors"))


G0 = "config_groups.group_0"
DOWN = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("edit,needles", [
    (lambda q: q.update(format="float-quantized"), ["quantization_config.format", "float-quantized", "FP8"]),
    (lambda q: q.update(format="nvfp4-pack-quantized"), ["nvfp4-pack-quantized", "NVFP4"]),
    (lambda q: q.update(format="marlin-24"), ["marlin-24"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), [f"{G0}.weights.type", "float"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), [f"{G0}.weights.actorder", "g_idx"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[64, 64]),
     [f"{G0}.weights.strategy", "block"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), [f"{G0}.weights.num_bits", "3"]),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int",
                                                                        "strategy": "tensor", "dynamic": False}),
     [f"{G0}.input_activations.strategy", "per token"]),
    (lambda q: q.update(quantization_status="frozen"), ["quantization_status", "frozen"]),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), ["kv_cache_scheme"]),
    (lambda q: (q["config_groups"]["group_0"].update(targets=["Linear"]), q.update(ignore=[])),
     ["quantizes 'lm_head'", "ignore"]),
    (lambda q: q["config_groups"]["group_0"].update(targets=["LlamaAttention"]), ["LlamaAttention", "targets"]),
])
def test_unsupported_configs_are_refused_by_field(exports, tmp_path, edit, needles):
    folder = _copy(exports["w4a16:g128"], tmp_path / "ckpt")
    _edit_qc(folder, edit)
    with pytest.raises(CheckpointError) as e:
        load_compressed(folder)
    msg = str(e.value)
    assert str(folder / "config.json") in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize("edit,needles", [
    (lambda s: s.pop(f"{DOWN}.weight_scale"), [f"'{DOWN}.weight_scale' is missing", "group_1"]),
    (lambda s: s.update({f"{DOWN}.weight_packed": s[f"{DOWN}.weight_packed"][:, :40].contiguous()}),
     [f"'{DOWN}.weight_packed' has shape (256, 40)", "(256, 88)"]),
    (lambda s: s.update({f"{DOWN}.weight_packed": s[f"{DOWN}.weight_packed"].to(torch.int16)}),
     [f"'{DOWN}.weight_packed' has dtype I16", "I32"]),
    (lambda s: s.update({f"{DOWN}.weight_shape": torch.tensor([256, 700])}),
     [f"'{DOWN}.weight_shape' holds [256, 700]"]),
    (lambda s: s.update({f"{DOWN}.weight_g_idx": torch.zeros(704, dtype=torch.int32)}),
     [f"'{DOWN}.weight_g_idx'", "actorder"]),
    (lambda s: s.update({f"{DOWN}.weight": torch.zeros(256, 704)}), [f"'{DOWN}.weight' is stored dense, and also"]),
    (lambda s: s.update({"model.norm.weight": torch.zeros(99)}), ["model.norm.weight", "hidden_size"]),
])
def test_bad_tensors_are_refused_by_name(exports, tmp_path, edit, needles):
    folder = _copy(exports["w4a16:g128"], tmp_path / "ckpt")
    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError) as e:
        load_compressed(folder)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_layer_left_dense_but_stored_packed_and_stale_side_file(exports, tmp_path):
    folder = _copy(exports["w4a16:g128"], tmp_path / "a")
    _edit_qc(folder, lambda q: q["ignore"].append(DOWN))
    with pytest.raises(CheckpointError, match=f"'{DOWN}.weight_packed' is stored, but .* leaves '{DOWN}' dense"):
        load_compressed(folder)
    folder = _copy(exports["w4a16:g128"], tmp_path / "b")
    doc = json.loads((folder / SIDE_FILE).read_text())
    doc["recipe"]["group"] = 32                               # a recipe file from other weights
    (folder / SIDE_FILE).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=f"{SIDE_FILE}: the recipe gives .* does not belong"):
        load_compressed(folder)


def test_the_dense_loader_and_llm_point_the_way(exports):
    folder = exports["w4a16:g128"]
    with pytest.raises(CheckpointError, match=r"compressed-tensors checkpoint .*workbench\.LLM\(folder\)"):
        wb.load_model(folder)
    with pytest.raises(ConfigError, match="quantized checkpoint .* drop quant="):
        wb.LLM(folder, quant="w8a16")
    assert is_compressed_checkpoint(folder) and not is_compressed_checkpoint(wb.BUNDLED_MODEL)
    assert not is_compressed_checkpoint("bundled") and not is_compressed_checkpoint("/nonexistent")
    with pytest.raises(ConfigError, match="no quantized layers"):
        save_compressed(wb.load_model(device="cpu"), folder.parent / "dense")


# ---- (d) round trip ----------------------------------------------------------------------------

MIX = QuantRecipe(weight_bits=4, group=128, skip=("embed_tokens", "lm_head", "model.layers.5.mlp.up_proj"),
                  overrides=(("down_proj", {"weight_bits": 8, "group": None, "symmetric": False}),
                             ("layers.0.self_attn.o_proj", {"group": None, "per_channel": False, "symmetric": False}),
                             ("layers.1.self_attn.q_proj", {"weight_bits": 8, "group": None, "act_bits": 8})))


def _quant_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _assert_same_integers(a, b) -> None:
    qa, qb = _quant_layers(a), _quant_layers(b)
    assert list(qa) == list(qb)
    for n in qa:
        x, y = qa[n], qb[n]
        assert torch.equal(x.qweight, y.qweight) and x.qweight.dtype == y.qweight.dtype, n
        assert torch.equal(x.scales, y.scales) and y.scales.dtype == torch.float32, n
        assert (x.zeros is None and y.zeros is None) or torch.equal(x.zeros, y.zeros), n
        assert (x.bits, x.group, x.act_bits) == (y.bits, y.group, y.act_bits), n
        assert {k: v for k, v in x.settings.items()} == y.settings, n


def test_round_trip_is_bit_exact_for_a_per_layer_mix(tmp_path):
    m = wb.load_model(device="cpu")
    quantize_model(m, MIX)
    info = save_compressed(m, tmp_path / "mix", tokenizer_folder=wb.BUNDLED_MODEL, dtype="bfloat16")
    # g128 / g64 fallback for the 4-bit groups, int8 asymmetric channel, int4 asymmetric tensor, W8A8
    assert sorted((g["num_bits"], g["strategy"], g["group_size"], g["symmetric"], g["act_bits"], len(g["layers"]))
                  for g in info["groups"].values()) == [
        (4, "group", 128, True, None, 33), (4, "tensor", None, False, None, 1),
        (8, "channel", None, False, None, 6), (8, "channel", None, True, 8, 1)]
    assert "model.layers.5.mlp.up_proj" in info["dense"] and info["dtype"] == "bfloat16"
    notes = " | ".join(info["notes"])               # what vLLM would not take, said when writing
    assert "one scale per tensor" in notes and "int-quantized" in notes
    assert "model.layers.5.{gate_proj,up_proj} have different settings" in notes
    back = load_compressed(tmp_path / "mix")
    _assert_same_integers(m, back)
    assert back.recipe == MIX                                 # the side file's recipe, checked against the layers
    for n, layer in _quant_layers(back).items():
        assert layer.rel_error == _quant_layers(m)[n].rel_error
    # without the side file the recipe is derived from the config groups: other words, same layers
    (tmp_path / "mix" / SIDE_FILE).unlink()
    derived = load_compressed(tmp_path / "mix")
    _assert_same_integers(m, derived)
    assert derived.recipe.method == "rtn" and derived.recipe.skips("model.layers.5.mlp.up_proj")
    # and what we read we write again as it was
    save_compressed(derived, tmp_path / "again")
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "mix" / "model.safetensors"))
    b = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if "weight_" in k)


def test_round_trip_keeps_method_and_calibration_report(tmp_path, bundled_tokenizer):
    from workbench.data import heldout_split

    calib = heldout_split(bundled_tokenizer, 128)["calibration"][:2]
    m = wb.load_model(device="cpu")
    quantize_model(m, "w4a16:g128:gptq", calibration=calib)
    save_compressed(m, tmp_path / "gptq", extra={"calibration": {"source": "test", "windows": 2}})
    back = load_compressed(tmp_path / "gptq")
    _assert_same_integers(m, back)
    assert back.recipe.method == "gptq" and back.quant_checkpoint["method_recorded"]
    assert back.quant_calibration["sequences"] == 2
    assert json.loads((tmp_path / "gptq" / SIDE_FILE).read_text())["calibration"] == {"source": "test", "windows": 2}

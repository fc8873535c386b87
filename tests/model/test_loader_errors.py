"""Bad input to ``workbench.load_model``: every problem a user can cause is a ``WorkbenchError``
whose message names the file / tensor / field and what was expected.

The good checkpoints here are written with the workbench's own ``save_model`` and with
``safetensors`` directly (no transformers import: these tests stay fast); the transformers
oracle lives in test_model_oracle.py.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import workbench  # noqa: E402
from workbench import ModelConfig, WorkbenchError  # noqa: E402
from workbench.errors import CheckpointError, ConfigError  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402

# Small enough to be instant; GQA 2:1, untied so that lm_head.weight is a real tensor.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False)
WEIGHTS = "model.safetensors"


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make_model(**overrides) -> CausalLM:
    return init_weights(CausalLM(ModelConfig(**{**TINY, **overrides})), seed=0).eval()


@pytest.fixture
def good(tmp_path) -> Path:
    """A valid workbench checkpoint folder: config.json + model.safetensors."""
    folder = tmp_path / "good"
    workbench.save_model(make_model(), folder)
    return folder


def load(folder) -> CausalLM:
    return workbench.load_model(folder, device="cpu", dtype="float32")


def raises(folder_or_spec, *substrings, exc=WorkbenchError) -> str:
    """load_model must raise ``exc`` (a WorkbenchError) whose message holds every substring."""
    with pytest.raises(exc) as info:
        load(folder_or_spec)
    assert isinstance(info.value, WorkbenchError)
    msg = str(info.value)
    for s in substrings:
        assert str(s) in msg, f"{s!r} not in error message: {msg}"
    return msg


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DELETE:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


_DELETE = object()


def rewrite_tensors(folder: Path, edit) -> None:
    """Load model.safetensors, let ``edit(state)`` change the dict, write it back."""
    state = load_file(str(folder / WEIGHTS))
    edit(state)
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})


# ---- the good path ---------------------------------------------------------------------------


def test_good_checkpoint_round_trips(good):
    ref = make_model()
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load(good)(ids), ref(ids))


@pytest.mark.parametrize("arch,window", [("Qwen2ForCausalLM", 8), ("Qwen2ForCausalLM", None),
                                         ("MistralForCausalLM", 8)])
def test_save_model_round_trips_the_sliding_window(tmp_path, arch, window):
    model = make_model(architecture=arch, sliding_window=window, qkv_bias=arch.startswith("Qwen2"))
    workbench.save_model(model, tmp_path)
    assert load(tmp_path).config.sliding_window == window


def test_preset_tiny_loads_and_gives_logits():
    model = workbench.load_model("preset:tiny", device="cpu")
    ids = torch.randint(0, 512, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    assert tuple(out.shape) == (3, 5, 512)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied preset stays tied


def test_loading_never_unpickles(good, monkeypatch):
    """A good load must not touch torch.load / pickle, even with a pickled file next to it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the loader tried to unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    (good / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    model = load(good)
    assert isinstance(model, workbench.CausalLM)


# ---- folder and config.json ------------------------------------------------------------------


def test_folder_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    raises(missing, "no-such-model", "not found", "preset:tiny", exc=CheckpointError)


def test_path_is_a_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    raises(f, "model.safetensors", "folder", exc=CheckpointError)


def test_folder_without_config(tmp_path, good):
    (good / "config.json").unlink()
    raises(good, "config.json", "not found", str(good), exc=CheckpointError)


def test_config_is_invalid_json(good):
    (good / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    raises(good, "config.json", "not valid JSON", exc=CheckpointError)


@pytest.mark.parametrize("content", ["[1, 2, 3]", '"LlamaForCausalLM"', "null"])
def test_config_is_not_an_object(good, content):
    (good / "config.json").write_text(content)
    raises(good, "config.json", "object")


def test_no_safetensors(good):
    (good / WEIGHTS).unlink()
    msg = raises(good, str(good), "no *.safetensors", exc=CheckpointError)
    assert "pickled" not in msg


def test_only_pickled_checkpoint_is_refused(good):
    (good / WEIGHTS).unlink()
    (good / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    raises(good, "pytorch_model.bin", "pickled checkpoints are never loaded", exc=CheckpointError)


def test_unsupported_architecture(good):
    edit_config(good, architectures=["GPT2LMHeadModel"])
    raises(good, "config.json", "'architectures'", "GPT2LMHeadModel",
           "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", exc=ConfigError)


@pytest.mark.parametrize("value", [_DELETE, [], None])
def test_missing_architectures(good, value):
    edit_config(good, architectures=value)
    raises(good, "config.json", "'architectures'", "missing", "LlamaForCausalLM", exc=ConfigError)


def test_missing_required_field(good):
    edit_config(good, hidden_size=_DELETE)
    raises(good, "config.json", "hidden_size", "missing", exc=ConfigError)


@pytest.mark.parametrize("field,value", [("hidden_size", "32"), ("num_hidden_layers", 0),
                                         ("vocab_size", -1), ("num_key_value_heads", 2.0)])
def test_bad_integer_field(good, field, value):
    edit_config(good, **{field: value})
    raises(good, "config.json", f"'{field}'", "positive integer", repr(value), exc=ConfigError)


def test_heads_not_multiple_of_kv_heads(good):
    edit_config(good, num_attention_heads=4, num_key_value_heads=3)
    raises(good, "config.json", "'num_attention_heads'", "'num_key_value_heads'", "multiple", exc=ConfigError)


def test_unsupported_rope_type_old_style(good):
    edit_config(good, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32})
    raises(good, "config.json", "rope_type", "'yarn'", "llama3", "linear", exc=ConfigError)


def test_unsupported_rope_type_new_style(good):
    edit_config(good, rope_scaling=_DELETE, rope_theta=_DELETE,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    raises(good, "config.json", "rope_type", "'yarn'", exc=ConfigError)


def test_rope_scaling_without_factor(good):
    edit_config(good, rope_scaling={"rope_type": "linear"})
    raises(good, "config.json", "factor", exc=ConfigError)


@pytest.mark.parametrize("field,value", [("rope_scaling", "linear"), ("rope_scaling", [4.0]),
                                         ("rope_theta", "big"), ("rms_norm_eps", -1e-6),
                                         ("sliding_window", "8")])
def test_bad_rope_and_float_fields(good, field, value):
    if field == "sliding_window":
        edit_config(good, architectures=["MistralForCausalLM"], model_type="mistral")
    edit_config(good, **{field: value})
    raises(good, "config.json", f"'{field}'", exc=ConfigError)


@pytest.mark.parametrize("scaling,field", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor"),
    ({"rope_type": "linear", "factor": "4"}, "factor"),
    ({"type": "llama3", "factor": 0}, "factor"),
])
def test_bad_rope_scaling_numbers(good, scaling, field):
    edit_config(good, rope_scaling=scaling)
    raises(good, "config.json", f"rope_scaling.{field}", exc=ConfigError)


def test_qwen2_window_on_some_layers_is_refused(good):
    edit_config(good, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
                sliding_window=8, max_window_layers=1)
    raises(good, "config.json", "max_window_layers", "sliding window", exc=ConfigError)


def test_unknown_preset():
    raises("preset:nope", "nope", "available", "tiny", "llama-3.2-1b", "qwen2.5-0.5b", exc=ConfigError)


def test_bad_dtype_and_device(good):
    with pytest.raises(ConfigError, match="int8"):
        workbench.load_model(good, device="cpu", dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            workbench.load_model(good, device="cuda", dtype="float32")


# ---- safetensors files -----------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["half", "4 bytes", "0 bytes", "inside header", "last byte"])
def test_truncated_safetensors(good, cut):
    path = good / WEIGHTS
    data = path.read_bytes()
    keep = {"half": len(data) // 2, "4 bytes": 4, "0 bytes": 0, "inside header": 20,
            "last byte": len(data) - 1}[cut]
    path.write_bytes(data[:keep])
    raises(good, WEIGHTS, "truncated", exc=CheckpointError)


def test_truncated_names_the_cut_tensor(good):
    path = good / WEIGHTS
    data = path.read_bytes()
    (n,) = __import__("struct").unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    path.write_bytes(data[:-1])
    raises(good, WEIGHTS, f"'{last}'", "truncated", exc=CheckpointError)


_NORM = "model.norm.weight"  # F32 [32]: 128 data bytes


@pytest.mark.parametrize("header,expect", [
    (b"not json at all", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({_NORM: 5}).encode(), f"'{_NORM}'"),
    (json.dumps({_NORM: {"dtype": "F32", "shape": [32]}}).encode(), "data_offsets"),
    (json.dumps({_NORM: {"dtype": "F32", "shape": [32], "data_offsets": [64, 0]}}).encode(), "data_offsets"),
    (json.dumps({_NORM: {"dtype": "F32", "shape": [32], "data_offsets": [0, 64]}}).encode(), "needs 128 bytes"),
], ids=["not-json", "not-utf8", "not-object", "entry-not-object", "no-offsets", "reversed-offsets",
        "offsets-vs-shape"])
def test_corrupt_safetensors_header(good, header, expect):
    path = good / WEIGHTS
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 128)
    raises(good, WEIGHTS, expect, exc=CheckpointError)


@pytest.mark.parametrize("data_bytes,extra", [(256, {}), (128, {"model.rotary_emb.inv_freq": [0, 128]})],
                         ids=["trailing-bytes", "overlapping-tensors"])
def test_safetensors_rejected_by_the_reader(good, data_bytes, extra):
    """Headers that pass the size checks but that the safetensors reader refuses (bytes not
    covered by any tensor; two tensors on the same bytes — the second an ignored exported
    buffer): still a CheckpointError naming the file, not a bare SafetensorError."""
    # The rest of the checkpoint is intact: every header check (sizes, names, shapes against the
    # config) passes and the reader is what refuses the file.
    path = good / WEIGHTS
    data = path.read_bytes()
    (n,) = __import__("struct").unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    norm = header[_NORM]["data_offsets"]
    header.update({k: {"dtype": "F32", "shape": [32], "data_offsets": [norm[0] + v[0], norm[0] + v[1]]}
                   for k, v in extra.items()})
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body + b"\0" * (data_bytes - 128))
    raises(good, WEIGHTS, "cannot read safetensors", exc=CheckpointError)


def test_wrong_tensor_shape(good):
    name = "model.layers.1.self_attn.k_proj.weight"  # [kv_size 16, hidden 32]
    rewrite_tensors(good, lambda s: s.__setitem__(name, torch.zeros(24, 32)))
    raises(good, WEIGHTS, f"'{name}'", "(24, 32)", "(16, 32)", exc=CheckpointError)


def test_missing_tensor(good):
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensors(good, lambda s: s.pop(name))
    raises(good, name, "missing", exc=CheckpointError)


def test_missing_lm_head_when_untied(good):
    rewrite_tensors(good, lambda s: s.pop("lm_head.weight"))
    raises(good, "lm_head.weight", "missing", exc=CheckpointError)


def test_tied_checkpoint_may_omit_or_carry_lm_head(tmp_path):
    folder = tmp_path / "tied"
    workbench.save_model(make_model(tie_word_embeddings=True), folder)
    assert "lm_head.weight" not in load_file(str(folder / WEIGHTS))
    model = load(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # some exporters write the tied head too: accepted (and still tied)
    rewrite_tensors(folder, lambda s: s.__setitem__("lm_head.weight", s["model.embed_tokens.weight"].clone()))
    model = load(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["model.layers.2.mlp.up_proj.weight", "model.layers.0.self_attn.o_proj.bias",
                                  "something.else"])
def test_unexpected_tensor(good, name):
    rewrite_tensors(good, lambda s: s.__setitem__(name, torch.zeros(4)))
    raises(good, WEIGHTS, f"'{name}'", "unexpected", exc=CheckpointError)


def test_exported_rotary_buffer_is_ignored(good):
    rewrite_tensors(good, lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)))
    load(good)


def test_non_float_tensor(good):
    name = "model.norm.weight"
    rewrite_tensors(good, lambda s: s.__setitem__(name, torch.ones(32, dtype=torch.int64)))
    raises(good, WEIGHTS, f"'{name}'", "I64", "float", exc=CheckpointError)


# ---- sharded checkpoints ---------------------------------------------------------------------


def shard(folder: Path, n: int = 3) -> list[str]:
    """Split model.safetensors into n shards plus model.safetensors.index.json."""
    state = load_file(str(folder / WEIGHTS))
    (folder / WEIGHTS).unlink()
    names = sorted(state)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, f in enumerate(files):
        part = {k: state[k] for k in names[i::n]}
        save_file(part, str(folder / f), metadata={"format": "pt"})
        weight_map.update({k: f for k in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return files


def test_sharded_checkpoint_loads(good):
    ref = load(good)
    shard(good)
    ids = torch.arange(10).view(2, 5)
    with torch.no_grad():
        assert torch.equal(load(good)(ids), ref(ids))


def test_sharded_index_lists_missing_shard(good):
    files = shard(good)
    (good / files[1]).unlink()
    raises(good, "model.safetensors.index.json", files[1], "missing", exc=CheckpointError)


def test_sharded_index_is_invalid(good):
    shard(good)
    (good / "model.safetensors.index.json").write_text('{"weights": {}}')
    raises(good, "model.safetensors.index.json", "weight_map", exc=CheckpointError)


def test_truncated_shard(good):
    files = shard(good)
    path = good / files[2]
    path.write_bytes(path.read_bytes()[:-10])
    raises(good, files[2], "truncated", exc=CheckpointError)


def test_missing_tensor_across_shards(good):
    shard(good)
    # a tensor the index maps but whose shard does not hold it: reported as missing
    files = sorted(good.glob("model-*.safetensors"))
    state = load_file(str(files[0]))
    victim = sorted(state)[0]
    state.pop(victim)
    save_file(state, str(files[0]), metadata={"format": "pt"})
    raises(good, victim, "missing", exc=CheckpointError)


def test_errors_are_user_facing_subclasses():
    assert issubclass(CheckpointError, WorkbenchError) and issubclass(ConfigError, WorkbenchError)
    assert not issubclass(WorkbenchError, (TypeError, KeyError, AttributeError))


def test_copying_a_checkpoint_keeps_it_loadable(good, tmp_path):
    # sanity: nothing above depends on absolute paths stored inside the folder
    dst = tmp_path / "copy"
    shutil.copytree(good, dst)
    load(dst)


# ---- a loader that checks before it allocates ------------------------------------------------
# Each input below used to be accepted silently, crash with a traceback, hang, or allocate
# gigabytes before failing.  Config fields are bounded before anything is built; shapes are
# checked against the safetensors headers (not the data) before the model is built.

import os  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

from workbench.model.config import MAX_HIDDEN_LAYERS, MAX_POSITION_EMBEDDINGS  # noqa: E402
from workbench.model.loader import read_safetensors_header  # noqa: E402


@contextmanager
def deadline(seconds: float):
    """Fail (TimeoutError, not a WorkbenchError) instead of hanging or allocating for minutes
    when a check regresses; a no-op where SIGALRM is unavailable or off the main thread."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def boom(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def raises_fast(folder, *substrings, exc=WorkbenchError, limit: float = 2.0) -> str:
    t0 = time.perf_counter()
    with deadline(max(10.0, 5 * limit)):
        msg = raises(folder, *substrings, exc=exc)
    elapsed = time.perf_counter() - t0
    assert elapsed < limit, f"took {elapsed:.2f} s to refuse (limit {limit} s): {msg}"
    return msg


def test_a_million_layers_fails_fast(good):
    edit_config(good, num_hidden_layers=1_000_000)
    raises_fast(good, "config.json", "'num_hidden_layers'", "1000000", str(MAX_HIDDEN_LAYERS), exc=ConfigError)


@pytest.mark.parametrize("head_dim", [8, _DELETE], ids=["head_dim-given", "head_dim-derived"])
def test_hidden_size_2_pow_40(good, head_dim):
    edit_config(good, hidden_size=2**40, head_dim=head_dim)
    raises_fast(good, "config.json", "'hidden_size'", str(2**40), exc=ConfigError)


@pytest.mark.parametrize("field,value", [("vocab_size", 2**40), ("intermediate_size", 2**40),
                                         ("num_attention_heads", 2**20), ("head_dim", 2**20)])
def test_other_sizes_are_bounded(good, field, value):
    edit_config(good, **{field: value})
    raises_fast(good, "config.json", f"'{field}'", str(value), exc=ConfigError)


def test_max_position_embeddings_10_pow_12(good):
    edit_config(good, max_position_embeddings=10**12)
    raises_fast(good, "config.json", "'max_position_embeddings'", str(10**12), str(MAX_POSITION_EMBEDDINGS),
                exc=ConfigError)


def test_long_context_within_bounds_loads(good):
    edit_config(good, max_position_embeddings=2**24)
    assert load(good).config.max_position_embeddings == 2**24


@pytest.mark.parametrize("shape", [
    # Llama-3.1 405B, Llama-3 70B, Qwen2.5 72B (config.json values)
    dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
         num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072),
    dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
         num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192),
    dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
         num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=32768),
], ids=["llama-3.1-405b", "llama-3-70b", "qwen2.5-72b"])
def test_real_large_shapes_pass_the_bounds(shape):
    cfg = ModelConfig(**shape, torch_dtype="bfloat16")
    assert cfg.num_parameters() > 7 * 10**10


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_unknown_torch_dtype(good, key):
    edit_config(good, torch_dtype=_DELETE, dtype=_DELETE)
    edit_config(good, **{key: "int3"})
    raises_fast(good, "config.json", f"'{key}'", "'int3'", "bfloat16", exc=ConfigError)


@pytest.mark.parametrize("value", ["float16", "bfloat16", "float32", "torch.bfloat16"])
def test_known_torch_dtypes_load(good, value):
    edit_config(good, torch_dtype=value)
    load(good)


@pytest.mark.parametrize("field,value", [("rope_theta", float("inf")), ("rms_norm_eps", float("inf")),
                                         ("rope_scaling", {"rope_type": "linear", "factor": float("inf")}),
                                         ("tie_word_embeddings", "false"), ("eos_token_id", "</s>"),
                                         ("bos_token_id", 1.0), ("eos_token_id", [2, "3"])])
def test_bad_field_types_and_non_finite_numbers(good, field, value):
    edit_config(good, **{field: value})
    raises_fast(good, "config.json", f"'{field}", exc=ConfigError)


def test_directory_named_model_safetensors(good):
    (good / WEIGHTS).unlink()
    (good / WEIGHTS).mkdir()
    msg = raises_fast(good, WEIGHTS, "not a regular file", "directory", exc=CheckpointError)
    assert "\n" not in msg


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_named_model_safetensors_does_not_hang(good):
    (good / WEIGHTS).unlink()
    os.mkfifo(good / WEIGHTS)
    raises_fast(good, WEIGHTS, "not a regular file", exc=CheckpointError)


def test_shard_that_is_a_directory(good):
    files = shard(good)
    (good / files[0]).unlink()
    (good / files[0]).mkdir()
    raises_fast(good, files[0], "not a regular file", exc=CheckpointError)


def _poison(name: str, value: float, dtype=None):
    def edit(state):
        t = state[name].clone() if dtype is None else state[name].to(dtype)
        t.view(-1)[3] = value
        state[name] = t
    return edit


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_non_finite_weights_are_refused(good, value, dtype):
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_tensors(good, _poison(name, value, dtype))
    raises_fast(good, WEIGHTS, f"'{name}'", "finite", "check_finite=False", exc=CheckpointError)


def test_non_finite_names_the_first_bad_tensor(good):
    rewrite_tensors(good, _poison("model.layers.1.mlp.down_proj.weight", float("nan")))
    rewrite_tensors(good, _poison("model.layers.0.self_attn.q_proj.weight", float("inf")))
    msg = raises(good, "'model.layers.0.self_attn.q_proj.weight'", exc=CheckpointError)
    assert "down_proj" not in msg


def test_non_finite_check_opt_out(good):
    name = "model.norm.weight"
    rewrite_tensors(good, _poison(name, float("nan")))
    model = workbench.load_model(good, device="cpu", dtype="float32", check_finite=False)
    assert torch.isnan(model.model.norm.weight).sum() == 1


@pytest.mark.parametrize("dtype,value", [(torch.float32, 3e38), (torch.bfloat16, 3e38), (torch.float16, 6e4)],
                         ids=["f32", "bf16", "f16"])
def test_large_finite_weights_are_not_mistaken_for_inf(good, dtype, value):
    """The cheap pass sums each tensor; a sum that overflows must not be reported as Inf."""
    name = "model.embed_tokens.weight"
    rewrite_tensors(good, lambda s: s.__setitem__(name, torch.full(tuple(s[name].shape), value, dtype=dtype)))
    assert torch.isfinite(load(good).model.embed_tokens.weight).all()


@pytest.mark.parametrize("field,value,tensor,got", [
    ("hidden_size", 48, "model.embed_tokens.weight", 32),
    ("vocab_size", 80, "model.embed_tokens.weight", 64),
    ("intermediate_size", 64, "model.layers.0.mlp.gate_proj.weight", 48),
    ("num_attention_heads", 8, "model.layers.0.self_attn.q_proj.weight", 32),
    ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight", 16),
    ("head_dim", 16, "model.layers.0.self_attn.q_proj.weight", 32),
    ("num_hidden_layers", 3, "model.layers.2", 2),
    ("num_hidden_layers", 1, "model.layers.1", 2),
])
def test_config_does_not_match_the_tensors(good, field, value, tensor, got):
    edit_config(good, **{field: value})
    raises_fast(good, "config.json", f"'{field}'", str(value), WEIGHTS, tensor, str(got), exc=CheckpointError)


def test_config_far_larger_than_the_files(good):
    """Llama-3-70B shapes over a 60 kB checkpoint: refused from the file sizes, before any model
    (even on the meta device) is built."""
    big = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    edit_config(good, **big)
    n = ModelConfig(**big).num_parameters()
    raises_fast(good, "config.json", f"{n:,}", "parameters", WEIGHTS, f"{(good / WEIGHTS).stat().st_size:,}",
                exc=CheckpointError)


def test_unknown_dtype_in_a_header(good):
    header = {_NORM: {"dtype": "Q3", "shape": [32], "data_offsets": [0, 128]}}
    raw = json.dumps(header).encode()
    (good / WEIGHTS).write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 128)
    raises_fast(good, WEIGHTS, f"'{_NORM}'", "unknown dtype", "'Q3'", exc=CheckpointError)


def _write_raw(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file from (dtype, shape, itemsize) entries, zero data."""
    header, offset = {}, 0
    for name, (dtype, shape, itemsize) in tensors.items():
        size = itemsize
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_quantized_tensors_pass_the_header_check(tmp_path):
    """Packed int32 weights and their scales are valid safetensors (a later issue loads them)."""
    path = tmp_path / WEIGHTS
    _write_raw(path, {"model.layers.0.mlp.up_proj.qweight": ("I32", [4, 48], 4),
                      "model.layers.0.mlp.up_proj.scales": ("F16", [1, 48], 2),
                      "model.layers.0.mlp.up_proj.qzeros": ("I32", [1, 6], 4),
                      "model.layers.0.mlp.up_proj.g_idx": ("I32", [32], 4),
                      "x.u8": ("U8", [7], 1), "x.i8": ("I8", [7], 1), "x.f8": ("F8_E4M3", [7], 1)})
    assert read_safetensors_header(path)["model.layers.0.mlp.up_proj.qweight"]["dtype"] == "I32"


@pytest.mark.parametrize("dtype,torch_dtype", [("I32", torch.int32), ("I8", torch.int8), ("U8", torch.uint8)])
def test_integer_weight_is_refused_as_quantized(good, dtype, torch_dtype):
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_tensors(good, lambda s: s.__setitem__(name, torch.zeros(tuple(s[name].shape), dtype=torch_dtype)))
    raises_fast(good, WEIGHTS, f"'{name}'", dtype, "float", "quantized checkpoints are not loaded yet",
                exc=CheckpointError)


def test_quantization_config_is_refused_clearly(good):
    edit_config(good, quantization_config={"quant_method": "gptq", "bits": 4})
    raises_fast(good, "config.json", "'quantization_config'", "gptq", "not loaded yet", exc=CheckpointError)


def test_expected_shapes_match_the_model():
    """The loader's header check computes shapes from the config; they must be the model's."""
    from workbench.model.loader import expected_shapes

    for over in ({}, dict(tie_word_embeddings=True), dict(architecture="Qwen2ForCausalLM", qkv_bias=True),
                 dict(qkv_bias=True, o_bias=True, mlp_bias=True), dict(head_dim=16)):
        cfg = ModelConfig(**{**TINY, **over})
        with torch.device("meta"):
            model = CausalLM(cfg)
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            want.pop("lm_head.weight")
        got = {k: shape for k, (shape, _fields) in expected_shapes(cfg).items()}
        assert got == want, over


def test_cli_prints_one_line_for_a_bad_folder(good):
    import subprocess
    import sys

    edit_config(good, num_hidden_layers=1_000_000)
    with deadline(60):
        r = subprocess.run([sys.executable, "-m", "workbench.cli.main", "info", "--model", str(good)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'num_hidden_layers'" in r.stderr


@pytest.mark.parametrize("weight_map,expect", [({"model.norm.weight": "../elsewhere.safetensors"}, "outside"),
                                               ({"model.norm.weight": 3}, "weight_map")])
def test_sharded_index_with_bad_shard_names(good, weight_map, expect):
    shard(good)
    (good / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raises_fast(good, "model.safetensors.index.json", expect, exc=CheckpointError)


@pytest.mark.parametrize("name,want", [("float32", torch.float32), ("float", torch.float32),
                                       ("torch.float16", torch.float16), ("bf16", torch.bfloat16),
                                       ("float64", torch.float32)])
def test_default_gpu_dtype_reads_every_accepted_torch_dtype(name, want):
    from workbench.model.loader import default_dtype

    assert default_dtype(torch.device("cuda"), name) is want      # a pure function: no GPU needed
    assert default_dtype(torch.device("cpu"), name) is torch.float32


def test_cli_refuses_non_finite_weights_unless_told(good, capsys):
    """The opt-out reaches the command line: exit 2 with the one-line reason, then
    ``--no-check-finite`` loads and generates."""
    from workbench.cli.main import main

    import shutil

    shutil.copy(Path(workbench.BUNDLED_MODEL) / "tokenizer.json", good)     # the CLI loads the folder's tokenizer
    rewrite_tensors(good, _poison("model.norm.weight", float("nan")))
    args = ["generate", "--model", str(good), "--device", "cpu", "--threads", "1", "--token-ids", "1 2 3",
            "--max-tokens", "2", "--json"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "non-finite" in err and "--no-check-finite" in err and "Traceback" not in err
    assert main(args + ["--no-check-finite"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["token_ids"]) == 2


@pytest.mark.parametrize("value", ["compressed-tensors", ["gptq"], 4])
def test_a_quantization_config_that_is_no_object_is_refused_clearly(good, value):
    edit_config(good, quantization_config=value)
    raises_fast(good, "config.json", "'quantization_config' must be an object", type(value).__name__,
                exc=CheckpointError)


# ---- what an outside attack found: a shard linked outside the folder, file bytes in errors, ----------------
# ---- a malformed generation_config.json ----------------------------------------------------------------------
# A shard symlinked to /etc/passwd was opened, and the error printed its first 8 bytes as an
# integer (the "header length"); a malformed generation_config.json gave a traceback.

PASSWD = b"root:x:0:0:root:/root:/bin/bash\n" * 64
PASSWD_AS_LENGTH = str(int.from_bytes(PASSWD[:8], "little"))       # what the old error printed


def test_a_shard_linked_outside_the_folder_is_refused_unread(good, tmp_path, monkeypatch):
    secret = tmp_path / "elsewhere" / "passwd"
    secret.parent.mkdir()
    secret.write_bytes(PASSWD)
    (good / WEIGHTS).unlink()
    (good / WEIGHTS).symlink_to(secret)
    opened = []
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: opened.append(self) or real_open(self, *a, **k))
    msg = raises(good, WEIGHTS, "a symbolic link to", str(secret), "outside the model folder", exc=CheckpointError)
    assert "\n" not in msg and PASSWD_AS_LENGTH not in msg
    assert not [p for p in opened if p.name == WEIGHTS], "the link was opened"


def test_a_shard_in_the_index_linked_outside_is_refused(good, tmp_path):
    files = shard(good)
    secret = tmp_path / "passwd"
    secret.write_bytes(PASSWD)
    (good / files[1]).unlink()
    (good / files[1]).symlink_to(secret)
    msg = raises(good, files[1], "outside the model folder", exc=CheckpointError)
    assert PASSWD_AS_LENGTH not in msg


def test_a_linked_subfolder_in_the_index_is_refused(good, tmp_path):
    files = shard(good)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(str(good / files[0]), outside / files[0])
    (good / "sub").symlink_to(outside, target_is_directory=True)
    index = json.loads((good / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: ("sub/" + v if v == files[0] else v) for k, v in index["weight_map"].items()}
    (good / "model.safetensors.index.json").write_text(json.dumps(index))
    raises(good, files[0], "outside the model folder", exc=CheckpointError)


def test_links_inside_the_folder_and_the_hugging_face_cache_layout_load(good, tmp_path):
    # a link to another file of the folder
    (good / "weights").mkdir()
    shutil.move(str(good / WEIGHTS), good / "weights" / "blob")
    (good / WEIGHTS).symlink_to(Path("weights") / "blob")
    load(good)
    # models--org--name/snapshots/REV/* -> ../../blobs/HASH, as huggingface_hub writes its cache
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for name in ("config.json", WEIGHTS):
        shutil.copy(good / name, blobs / f"hash-{name}")
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / f"hash-{name}")
    load(snap)


def test_a_file_that_is_not_safetensors_is_named_without_its_bytes(good):
    (good / WEIGHTS).write_bytes(PASSWD)                                  # a regular file, in the folder
    msg = raises(good, WEIGHTS, "not a safetensors file", exc=CheckpointError)
    assert PASSWD_AS_LENGTH not in msg and "\n" not in msg
    (good / WEIGHTS).write_bytes((10**6).to_bytes(8, "little") + b"{}")   # plausible, but past the end
    msg = raises(good, WEIGHTS, "not a safetensors file, or a truncated one", "truncated", exc=CheckpointError)
    assert "1000000" not in msg.replace(",", "")


def _tokenizer_folder(tmp_path, generation_config: bytes | None) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir(parents=True)
    shutil.copy(workbench.BUNDLED_MODEL / "tokenizer.json", folder)
    if generation_config is not None:
        (folder / "generation_config.json").write_bytes(generation_config)
    return folder


@pytest.mark.parametrize("data, words", [
    (b'{"eos_token_id": 0,', ["not valid JSON", "'eos_token_id'"]),
    (b"\xff\xfe{}", ["not valid JSON"]),
    (b"[1, 2]", ["expected a JSON object", "'eos_token_id'"]),
    (b'{"eos_token_id": "</s>"}', ["field 'eos_token_id'", "'</s>'"]),
    (b'{"eos_token_id": [true]}', ["field 'eos_token_id'"]),
    (b'{"eos_token_id": []}', ["field 'eos_token_id'"]),
    (b"[" * 100_000, ["not valid JSON"]),
], ids=["truncated", "not-utf8", "a-list", "a-string", "a-bool", "empty-list", "nested"])
def test_a_malformed_generation_config_is_one_line_naming_the_file_and_field(tmp_path, data, words):
    folder = _tokenizer_folder(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        workbench.Tokenizer(folder)
    msg = str(e.value)
    assert str(folder / "generation_config.json") in msg and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_the_cli_names_a_malformed_generation_config_without_a_traceback(tmp_path, capsys):
    from workbench.cli.main import main

    folder = tmp_path / "model"
    shutil.copytree(workbench.BUNDLED_MODEL, folder)
    (folder / "generation_config.json").write_text('{"eos_token_id": 0,')
    assert main(["generate", "--model", str(folder), "--device", "cpu", "--max-tokens", "2", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "generation_config.json: not valid JSON" in err
    assert len(err.strip().splitlines()) == 1


def test_a_good_generation_config_gives_the_eos_ids(tmp_path):
    assert workbench.Tokenizer(_tokenizer_folder(tmp_path, b'{"eos_token_id": [0, 7]}')).eos_token_ids == {0, 7}
    # no field: config.json's (as transformers reads them)
    folder = _tokenizer_folder(tmp_path / "b", b'{"bos_token_id": 0}')
    (folder / "config.json").write_text('{"eos_token_id": 5}')
    assert workbench.Tokenizer(folder).eos_token_ids == {5}

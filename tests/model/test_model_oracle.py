"""The transformers oracle: ``workbench.load_model`` on a checkpoint written by
``transformers.save_pretrained`` must reproduce transformers' float32 logits.

For each configuration (GQA ratios, head dims, tied/untied, biases, RoPE scaling, sliding
windows) a random ``transformers`` model is built offline, saved into a temporary folder and
loaded by the workbench; then

(a) a full forward on a [B, T] batch,
(b) token-by-token decoding with the KV cache (short prefill, then one token per call),
(c) a chunked prefill (5 + 7 tokens) followed by decoding

must match transformers' full forward with relative L2 error <= 1e-4.  Configurations with a
feature that only shows at some positions (sliding window, RoPE scaling) also check that the
feature *does* change transformers' logits on this input, so a workbench that ignored it would
fail.  Two config.json styles (transformers 5 ``rope_parameters`` and the older top-level
``rope_theta`` + ``rope_scaling``) and a sharded checkpoint are covered too.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_fixtures, also under --import-mode=importlib

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import workbench  # noqa: E402

from hf_fixtures import (  # noqa: E402
    assert_close_report,
    build_hf_model,
    hf_logits,
    random_ids,
    read_config_json,
    rel_err,
    save_hf_checkpoint,
    to_old_rope_style,
    write_config_json,
)

RTOL = 1e-4
B, T = 2, 16                 # batch and sequence length of every check
PREFILL = 3                  # (b): prompt length before token-by-token decoding
CHUNKS = (5, 7)              # (c): two prefill chunks, then decode the remaining T - 12 tokens
FEATURE_MIN_EFFECT = 1e-2    # a feature under test must move transformers' logits at least this much

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16, "rope_theta": 10000.0}
_LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}

# id -> (family, config overrides, overrides that switch the feature under test off or None)
CASES = {
    # MHA (nkv = nh), untied, head_dim = hidden / heads
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4), None),
    # GQA 4:1, tied embeddings
    "llama-gqa4-tied": ("llama", dict(num_attention_heads=8, num_key_value_heads=2,
                                      tie_word_embeddings=True), None),
    # MQA, attention_bias (q/k/v/o) and mlp_bias, hidden 48 (head_dim 12)
    "llama-mqa-bias": ("llama", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1,
                                     attention_bias=True, mlp_bias=True), None),
    # explicit head_dim != hidden / heads (q_size 96 != hidden 64)
    "llama-headdim24": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24), None),
    # Llama 3.1 RoPE scaling with a small original context so that it matters at T = 16
    "llama-rope-llama3": ("llama", dict(num_key_value_heads=2, rope_parameters=dict(_LLAMA3),
                                        tie_word_embeddings=True),
                          dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # linear (position interpolation) RoPE scaling, non-default theta
    "llama-rope-linear": ("llama", dict(num_key_value_heads=2, rope_parameters=dict(_LINEAR)),
                          dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    # Qwen2: q/k/v bias, no o bias, GQA 2:1, tied
    "qwen2-gqa-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                       None),
    # Qwen2: MQA, 6 heads of 16, untied, large theta
    "qwen2-mqa": ("qwen2", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=1,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6}), None),
    # Qwen2 with a sliding window on every layer (max_window_layers = 0)
    "qwen2-window-all": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=0),
                         dict(use_sliding_window=False)),
    # Qwen2 with use_sliding_window but max_window_layers = num layers: transformers uses full
    # attention everywhere, so the window must NOT be applied
    "qwen2-window-flag-no-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                                  max_window_layers=2),
                                    dict(max_window_layers=0)),
    # Mistral: head_dim 32 with hidden 64 / 4 heads, sliding window shorter than the sequence
    "mistral-headdim32-window": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                 sliding_window=6),
                                 dict(sliding_window=None)),
    # Mistral: MQA, no window, tied
    "mistral-mqa-tied": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
                                         tie_word_embeddings=True), None),
}

# Largest relative error seen, per architecture and check, printed at the end of the module.
MAX_REL: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))


def _record(case_id: str, check: str, rel: float) -> None:
    arch = CASES[case_id][0] if case_id in CASES else case_id
    MAX_REL[arch][check] = max(MAX_REL[arch][check], rel)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls: one intra-op thread is ~100x faster than two on a loaded 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", autouse=True)
def _report_errors(request):
    yield
    rep = request.config.pluginmanager.get_plugin("terminalreporter")
    if rep is None or not MAX_REL:
        return
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    lines = ["", "transformers oracle: max relative L2 error per architecture"]
    for arch in sorted(MAX_REL):
        checks = ", ".join(f"{k}={v:.2e}" for k, v in sorted(MAX_REL[arch].items()))
        lines.append(f"  {arch:8s} {checks}")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            for line in lines:
                rep.write_line(line)
    else:
        for line in lines:
            rep.write_line(line)


class Case:
    def __init__(self, case_id, hf_model, folder, wb_model, ids, ref):
        self.id, self.hf, self.folder, self.wb, self.ids, self.ref = case_id, hf_model, folder, wb_model, ids, ref


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    torch.manual_seed(0)
    family, overrides, _ = CASES[request.param]
    hf = build_hf_model(family, seed=len(request.param), **overrides)
    folder = save_hf_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    wb = workbench.load_model(folder, device="cpu", dtype="float32")
    ids = random_ids(B, T, seed=1)
    return Case(request.param, hf, folder, wb, ids, hf_logits(hf, ids))


def test_full_forward(case):
    with torch.no_grad():
        out = case.wb(case.ids)
    assert out.dtype == torch.float32 and tuple(out.shape) == (B, T, case.ref.shape[-1])
    _record(case.id, "full", assert_close_report(out, case.ref, RTOL, f"{case.id} full forward"))


def _decode(model, ids, prefill_chunks):
    """Prefill ``ids`` in chunks of the given sizes, then one token per call; all logits."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
    outs, t = [], 0
    with torch.no_grad():
        for n in prefill_chunks:
            outs.append(model(ids[:, t:t + n], t, cache))
            t += n
        while t < ids.shape[1]:
            outs.append(model(ids[:, t:t + 1], t, cache))
            t += 1
    assert cache.length == ids.shape[1]
    return torch.cat(outs, dim=1)


def test_decode_with_kv_cache(case):
    out = _decode(case.wb, case.ids, [PREFILL])
    _record(case.id, "decode", assert_close_report(out, case.ref, RTOL, f"{case.id} token-by-token decode"))


def test_chunked_prefill_then_decode(case):
    out = _decode(case.wb, case.ids, list(CHUNKS))
    _record(case.id, "chunked", assert_close_report(out, case.ref, RTOL, f"{case.id} chunked prefill 5+7"))


@pytest.mark.parametrize("case_id", [k for k, v in CASES.items() if v[2] is not None])
def test_feature_changes_the_oracle(case_id):
    """The feature a case is about (window, RoPE scaling) changes transformers' logits on this
    input, so a workbench that ignored it (or applied it wrongly) could not pass the checks above."""
    family, overrides, contrast = CASES[case_id]
    hf = build_hf_model(family, seed=len(case_id), **overrides)
    other = build_hf_model(family, seed=len(case_id), **{**overrides, **contrast})
    other.load_state_dict(hf.state_dict())
    ids = random_ids(B, T, seed=1)
    rel, _ = rel_err(hf_logits(other, ids), hf_logits(hf, ids))
    assert rel > FEATURE_MIN_EFFECT, f"{case_id}: toggling the feature changes logits by only {rel:.2e}"


def test_logits_to_keep_matches_last_positions(case):
    with torch.no_grad():
        out = case.wb(case.ids, logits_to_keep=1)
    assert_close_report(out, case.ref[:, -1:], RTOL, f"{case.id} logits_to_keep=1")


def test_start_pos_without_cache(case):
    """``model(ids, start_pos)`` with no cache: RoPE at positions start.., still causal
    (transformers: ``position_ids = start + arange(T)``)."""
    start = 5
    pos = torch.arange(start, start + T).expand(B, T)
    with torch.no_grad():
        ref = case.hf(input_ids=case.ids, position_ids=pos, use_cache=False).logits.float()
        out = case.wb(case.ids, start)
    _record(case.id, "offset", assert_close_report(out, ref, RTOL, f"{case.id} start_pos={start} without cache"))


# ---- config.json styles ------------------------------------------------------------------------


@pytest.mark.parametrize("case_id,type_key", [
    ("llama-rope-llama3", "rope_type"),
    ("llama-rope-linear", "rope_type"),
    ("llama-rope-linear", "type"),        # the oldest style: rope_scaling {"type": "linear", ...}
    ("qwen2-mqa", "rope_type"),           # plain RoPE: rope_scaling null, rope_theta 1e6
    ("mistral-headdim32-window", "rope_type"),
])
def test_old_and_new_config_styles_give_identical_logits(case_id, type_key, tmp_path):
    torch.manual_seed(0)
    family, overrides, _ = CASES[case_id]
    hf = build_hf_model(family, seed=7, **overrides)
    new_dir = save_hf_checkpoint(hf, tmp_path / "new")
    new_cfg = read_config_json(new_dir)
    assert "rope_parameters" in new_cfg, "transformers 5 writes rope_parameters"

    old_dir = save_hf_checkpoint(hf, tmp_path / "old")
    old_cfg = to_old_rope_style(new_cfg, key=type_key)
    assert "rope_parameters" not in old_cfg and "rope_theta" in old_cfg
    write_config_json(old_dir, old_cfg)

    ids = random_ids(B, T, seed=3)
    with torch.no_grad():
        new_out = workbench.load_model(new_dir, device="cpu", dtype="float32")(ids)
        old_out = workbench.load_model(old_dir, device="cpu", dtype="float32")(ids)
    assert torch.equal(new_out, old_out), "old-style config: " + repr(rel_err(old_out, new_out))
    _record(case_id, "config-style", assert_close_report(new_out, hf_logits(hf, ids), RTOL, case_id))

    # The rewritten file is a faithful old-style config: transformers reads it the same way.
    from transformers import AutoModelForCausalLM

    hf_old = AutoModelForCausalLM.from_pretrained(str(old_dir), attn_implementation="eager").eval()
    assert_close_report(hf_logits(hf_old, ids), hf_logits(hf, ids), 1e-6, "transformers on old-style config")


# ---- sharded checkpoint ------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", ["llama-gqa4-tied", "qwen2-mqa"])
def test_sharded_checkpoint(case_id, tmp_path):
    torch.manual_seed(0)
    family, overrides, _ = CASES[case_id]
    hf = build_hf_model(family, seed=11, **overrides)
    folder = save_hf_checkpoint(hf, tmp_path, max_shard_size="20KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").is_file() and len(shards) > 1, shards
    wb = workbench.load_model(folder, device="cpu", dtype="float32")
    ids = random_ids(B, T, seed=5)
    with torch.no_grad():
        out = wb(ids)
    _record(case_id, "sharded", assert_close_report(out, hf_logits(hf, ids), RTOL, f"{case_id} sharded"))
    out = _decode(wb, ids, [PREFILL])
    assert_close_report(out, hf_logits(hf, ids), RTOL, f"{case_id} sharded decode")

"""Per-op backends (``workbench.transforms.backends``): each op switched alone, the registry's errors, the
CLI's spec parser, and the engines with every Triton op on giving the eager greedy tokens.

Runs on the CPU under the Triton interpreter (set before the kernel modules are imported).
Tolerance for the per-op logits check: ``1e-4`` absolute / relative in float32 -- one fused op
differs from its reference by a few ulp (see test_kernels_pointwise / _attention), and two
layers, the final norm and the LM head amplify that by at most ~10x at these sizes; a wrong
row, position or slot is O(1).  ``eager`` must be bitwise the reference model.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel modules create their jit functions
pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")

import workbench  # noqa: E402
import workbench_kernels  # noqa: E402
from workbench.transforms.backends import (  # noqa: E402
    BACKENDS, OPS, BackendMLP, apply_backends, available_backends, current_backends, describe_backends,
    parse_backend_spec, remove_backends, resolve_ops, using_backends)
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.errors import ConfigError  # noqa: E402
from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.model.decoder import MLP, CausalLM, init_weights  # noqa: E402
from workbench_kernels.flash_prefill import flash_prefill_paged_ref  # noqa: E402
from workbench_kernels.paged_decode import paged_decode_ref as paged_decode_kernel_ref  # noqa: E402

from conftest import BUNDLED_READY  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)

# kernel wrapper(s) an op launches in the steps below (prefill + decode on a contiguous cache)
WRAPPERS = {"rmsnorm": {"rmsnorm", "add_rmsnorm"}, "rope": {"rope_kv_write"}, "swiglu": {"swiglu"},
            "attention_prefill": {"flash_prefill"}, "attention_decode": {"paged_decode"},
            "sampling": set()}    # sampling is the engine's step, not the model's (tests/engine/test_one_engine.py)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return init_weights(CausalLM(cfg), seed=5).eval().to(DEVICE)


def run_steps(model, prompt=(3, 17, 42, 5, 8, 60, 1), decode=(9, 33)):
    """Prefill ``prompt``, then decode ``decode`` one token at a time: logits of every call."""
    cache = model.new_cache(1, len(prompt) + len(decode))
    outs, pos = [], 0
    with torch.inference_mode():
        for ids in [list(prompt)] + [[t] for t in decode]:
            outs.append(model(torch.tensor([ids], device=DEVICE), pos, cache))
            pos += len(ids)
    return outs


def launches_during(fn):
    before = dict(workbench_kernels.LAUNCHES)
    fn()
    delta = {k: v - before.get(k, 0) for k, v in workbench_kernels.LAUNCHES.items()}
    return {k for k, v in delta.items() if v}


# ---- per-op toggles -----------------------------------------------------------------------------
@pytest.mark.parametrize("op", list(OPS))
def test_each_op_alone_on_triton_matches_the_reference(tiny, op):
    ref = run_steps(tiny)
    model = copy.deepcopy(tiny)
    apply_backends(model, {op: "triton"})
    assert current_backends(model) == {o: ("triton" if o == op else "eager") for o in OPS}
    out = []
    assert launches_during(lambda: out.extend(run_steps(model))) == WRAPPERS[op], \
        f"{op}=triton must launch its kernel(s) and no other op's"
    for i, (a, b) in enumerate(zip(out, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"{op}=triton, call {i}: {m}")


def test_eager_backend_is_bitwise_the_reference_and_launches_nothing(tiny):
    ref = run_steps(tiny)
    model = apply_backends(copy.deepcopy(tiny), {op: "eager" for op in OPS})
    assert type(model.model.layers[0].mlp) is BackendMLP
    out = []
    assert launches_during(lambda: out.extend(run_steps(model))) == set()
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_using_backends_restores_and_remove_backends_undoes(tiny):
    model = copy.deepcopy(tiny)
    keys = list(model.state_dict())
    with using_backends(model, rmsnorm="triton"):
        assert current_backends(model)["rmsnorm"] == "triton"
        with using_backends(model, {"swiglu": "triton", "rmsnorm": "eager"}):
            assert current_backends(model)["rmsnorm"] == "eager"
            assert current_backends(model)["swiglu"] == "triton"
        assert current_backends(model) == {**{o: "eager" for o in OPS}, "rmsnorm": "triton"}
    assert type(model.model.layers[1].mlp) is MLP, "leaving the outermost block gives the plain model back"
    assert current_backends(model) == {o: "eager" for o in OPS}
    apply_backends(model, swiglu="triton")
    remove_backends(model)
    assert type(model.model.layers[1].mlp) is MLP and model.model.layers[1].mlp.ops is None
    assert list(model.state_dict()) == keys, "the transformation swaps classes only: the state dict is unchanged"


def test_bad_names_raise_config_error_naming_the_choices(tiny):
    with pytest.raises(ConfigError, match="unknown op 'layernorm'; ops: rmsnorm, rope, swiglu"):
        apply_backends(copy.deepcopy(tiny), {"layernorm": "triton"})
    with pytest.raises(ConfigError, match="unknown backend 'cuda' for op 'rmsnorm'; backends: eager, triton, compile"):
        apply_backends(copy.deepcopy(tiny), rmsnorm="cuda")
    with pytest.raises(ConfigError, match="expected a workbench CausalLM"):
        apply_backends(torch.nn.Linear(2, 2), rmsnorm="triton")
    assert current_backends(tiny) == {o: "eager" for o in OPS}, "a failed apply changes nothing"


def test_parse_backend_spec():
    assert parse_backend_spec("triton") == {op: "triton" for op in OPS}
    assert parse_backend_spec("eager") == {op: "eager" for op in OPS}
    assert parse_backend_spec("rmsnorm=triton, swiglu=compile") == {"rmsnorm": "triton", "swiglu": "compile"}
    assert parse_backend_spec("triton,attention_prefill=eager") == {**{op: "triton" for op in OPS},
                                                                    "attention_prefill": "eager"}
    assert parse_backend_spec("") == {} and parse_backend_spec(None) == {}
    with pytest.raises(ConfigError, match=r"part 'rmsnorm=fast'.*unknown backend 'fast'; backends: eager, "):
        parse_backend_spec("rope=triton,rmsnorm=fast")
    with pytest.raises(ConfigError, match=r"part 'norm=triton'.*unknown op 'norm'; ops: rmsnorm, rope"):
        parse_backend_spec("norm=triton")
    with pytest.raises(ConfigError, match=r"part '=triton'.*expected BACKEND or OP=BACKEND"):
        parse_backend_spec("=triton")
    with pytest.raises(ConfigError, match="unknown backend 'trition'"):
        parse_backend_spec("trition")


def test_describe_backends(tiny):
    model = copy.deepcopy(tiny)
    d = describe_backends(model)
    assert d["backend"] == "eager" and d["triton_interpreter"] is False
    apply_backends(model, parse_backend_spec("rmsnorm=triton"))
    d = describe_backends(model)
    assert d["backend"] == "mixed" and d["ops"]["rmsnorm"] == "triton"
    assert d["backends"].startswith("rmsnorm=triton rope=eager")
    assert d["triton_interpreter"] is (DEVICE == "cpu")
    apply_backends(model, parse_backend_spec("triton"))
    assert describe_backends(model)["backend"] == "triton"


def test_compile_backend_one_op(tiny):
    """torch.compile of one op (swiglu) inside the model: the same logits as the reference.
    On a CPU, Inductor generates C++ and needs a compiler; a first compile takes ~10 s here."""
    if DEVICE == "cpu" and shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("torch.compile on a CPU needs a C++ compiler (none on PATH)")
    model = apply_backends(copy.deepcopy(tiny), swiglu="compile")
    assert resolve_ops({"swiglu": "compile"}).swiglu is model.model.layers[0].mlp.ops.swiglu
    ref, out = run_steps(tiny, decode=()), run_steps(model, decode=())
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)


def test_choices_listed_are_the_ones_that_exist():
    assert BACKENDS == ("eager", "triton", "compile")
    for kernel_file, (wrappers, refs) in workbench_kernels.KERNELS.items():
        module = __import__(f"workbench_kernels.{kernel_file}", fromlist=["_"])
        for name in wrappers + refs:
            assert callable(getattr(module, name)), f"KERNELS lists {kernel_file}.{name}, which does not exist"


# ---- the attention entry points on a paged layout ----------------------------------------------
def paged_layout(seed=0, nh=4, nkv=2, hd=16, page=5, num_blocks=12):
    """Three sequences in a pool of blocks of 5 with scattered block ids: a 3-token chunk after a
    cached prefix of 4 (7 keys), a 6-token chunk after 7 (13 keys, over three blocks) and a whole
    4-token prompt; every last block is partly filled, table rows padded with a repeated id."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(num_blocks, page, nkv, hd, generator=g).to(DEVICE) for _ in range(2))
    i32 = dict(dtype=torch.int32, device=DEVICE)
    seq_lens, q_lens = torch.tensor([7, 13, 4], **i32), [3, 6, 4]
    tables = torch.tensor([[3, 1, 1], [2, 5, 7], [9, 9, 9]], **i32)
    cu = torch.tensor([0, 3, 9, 13], **i32)
    q = torch.randn(13, nh, hd, generator=g).to(DEVICE)
    qd = torch.randn(3, nh, hd, generator=g).to(DEVICE)          # one decode query per sequence
    return q, qd, kc, vc, tables, cu, seq_lens, max(q_lens)


def _compile_ok():
    return DEVICE != "cpu" or shutil.which(os.environ.get("CXX", "c++")) is not None


def test_every_backend_of_the_attention_ops_has_every_entry_point():
    assert OPS["attention_prefill"] == ("attention_prefill", "attention_prefill_paged")
    for op in ("attention_prefill", "attention_decode"):
        for b in available_backends(op):
            ops = resolve_ops({op: b}, DEVICE)
            assert all(callable(getattr(ops, e)) for e in OPS[op]), (op, b)


@pytest.mark.parametrize("backend,window", [("eager", None), ("eager", 4), ("triton", None), ("triton", 4),
                                            ("compile", 4)])
def test_attention_prefill_paged_matches_the_reference_on_ragged_chunks(backend, window):
    """Ragged chunks whose queries are the last q_len of their keys (causal mask bottom-right),
    keys read through block tables from partly filled blocks; a window shorter than a chunk's
    context.  Reference: the kernel module's per-sequence float32 gather-and-attend."""
    if backend == "compile" and not _compile_ok():
        pytest.skip("torch.compile on a CPU needs a C++ compiler (none on PATH)")
    q, _, kc, vc, tables, cu, seq_lens, max_q = paged_layout()
    ops = resolve_ops({"attention_prefill": backend}, DEVICE)
    out = []
    used = launches_during(lambda: out.append(ops.attention_prefill_paged(q, kc, vc, tables, cu, seq_lens, max_q,
                                                                          sliding_window=window)))
    assert used == ({"flash_prefill"} if backend == "triton" else set())
    ref = flash_prefill_paged_ref(q, kc, vc, tables, cu, seq_lens, sliding_window=window)
    assert out[0].shape == q.shape
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    if window is not None:      # the window really cuts keys here
        assert not torch.allclose(ref, flash_prefill_paged_ref(q, kc, vc, tables, cu, seq_lens), atol=1e-3)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_attention_decode_with_a_window_shorter_than_the_context(backend):
    _, qd, kc, vc, tables, _, seq_lens, _ = paged_layout(seed=1)
    ops = resolve_ops({"attention_decode": backend}, DEVICE)
    for window in (None, 3, 6):
        out = []
        used = launches_during(lambda: out.append(ops.attention_decode(qd, kc, vc, tables, seq_lens,
                                                                       sliding_window=window)))
        assert ("paged_decode" in used) if backend == "triton" else not used
        ref = paged_decode_kernel_ref(qd, kc, vc, tables, seq_lens, sliding_window=window)
        torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"window {window}: {m}")
    # positional: the contract's argument order
    torch.testing.assert_close(ops.attention_decode(qd, kc, vc, tables, seq_lens, 3),
                               paged_decode_kernel_ref(qd, kc, vc, tables, seq_lens, sliding_window=3),
                               atol=1e-5, rtol=1e-5)


def test_windowed_model_decodes_on_the_kernel_past_the_window(tiny):
    """A Mistral-style sliding window (4) shorter than the context (7 prompt tokens + 2 decode
    steps): BackendAttention stays on the paged decode kernel and gives the reference logits."""
    cfg = copy.deepcopy(tiny.config)
    cfg.sliding_window = 4
    windowed = init_weights(CausalLM(cfg), seed=7).eval().to(DEVICE)
    ref = run_steps(windowed)
    model = apply_backends(copy.deepcopy(windowed), attention_decode="triton")
    before = dict(workbench_kernels.LAUNCHES)
    out = run_steps(model)
    assert workbench_kernels.LAUNCHES.get("paged_decode", 0) - before.get("paged_decode", 0) \
        == 2 * cfg.num_hidden_layers, "every decode step of every layer on the kernel"
    for i, (a, b) in enumerate(zip(out, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"call {i}: {m}")


# ---- the engines --------------------------------------------------------------------------------
PROMPTS = ["Python is", "The list", "def f(x):"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bundled():
    if not BUNDLED_READY:
        pytest.skip("bundled model weights not present (data/reference-model/model.safetensors)")
    llm = workbench.LLM(device=DEVICE)
    params = workbench.SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    eager = [o.token_ids for o in llm.generate(PROMPTS, params)]
    return llm, params, eager


def test_engine_with_all_triton_ops_gives_the_eager_greedy_tokens(bundled):
    llm, params, eager = bundled
    assert all(len(t) == NEW_TOKENS for t in eager), "the test needs full-length outputs (no early EOS)"
    with using_backends(llm.model, parse_backend_spec("triton")):
        assert set(current_backends(llm.model).values()) == {"triton"}
        got = []
        used = launches_during(lambda: got.extend(o.token_ids for o in llm.generate(PROMPTS, params)))
    # every op ran its Triton kernel, sampling too (greedy requests: the argmax kernel)
    assert used == set().union(*WRAPPERS.values()) | {"greedy_tokens"}, "every op ran its Triton kernel"
    assert got == eager


def test_paged_kv_engine_with_all_triton_ops_gives_the_eager_greedy_tokens(bundled):
    """The same through a paged KV pool (block size 5: partly filled last blocks), where the
    RoPE kernel writes K/V into pool slots and decode attention reads them through block tables."""
    llm, params, eager = bundled
    # a small pool: under the interpreter every launch copies its tensor arguments (the pool too)
    paged = workbench.LLM(llm.model, tokenizer=llm.tokenizer,
                          kv=PagedKVConfig(block_size=5, num_blocks=8, enable_prefix_caching=False))
    short = workbench.SamplingParams(temperature=0, max_tokens=6)     # prompt 3 + 6: blocks of 5 fill and spill
    with using_backends(llm.model, parse_backend_spec("triton")):
        got = [o.token_ids for o in paged.generate(PROMPTS[:1], short)]
    assert got[0] == eager[0][:6]
    assert paged.kv_pool.manager.num_used_blocks == 0


def test_batched_engine_with_all_triton_ops_gives_the_eager_greedy_tokens(bundled):
    """The batched engine's steps go through the model's own DecoderLayer.forward, so every
    kernel runs there (the fused residual add + RMSNorm, RoPE fused with the paged K/V write,
    paged decode attention, paged flash prefill), and the tokens stay eager's."""
    from workbench.engine import LLMEngine

    llm, params, eager = bundled
    with using_backends(llm.model, parse_backend_spec("triton")):
        engine = LLMEngine(workbench.LLM(llm.model, tokenizer=llm.tokenizer))
        got = []
        used = launches_during(lambda: got.extend(o.token_ids for o in engine.generate(PROMPTS, params)))
    assert used == {"rmsnorm", "add_rmsnorm", "swiglu", "rope_kv_write", "paged_decode", "flash_prefill",
                    "greedy_tokens"}
    assert got == eager

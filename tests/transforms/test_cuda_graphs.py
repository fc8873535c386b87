"""Static-buffer decode (``workbench.transforms.cuda_graphs``): on a CPU, ``capture()`` says in one line that
graphs need CUDA and the same static path runs eagerly; it must give the reference engine's
greedy tokens, with eager and with Triton ops, and batch sequences into buckets exactly.
Launch counting (``launches_per_decode_step``) is checked against the model's structure.

Every model is on ``DEVICE``: on a GPU machine the same tests capture and replay real graphs
(backend 'triton' refuses a CPU model when the kernels are compiled rather than interpreted).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel modules create their jit functions
pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")

import workbench  # noqa: E402
from workbench.transforms.backends import OPS, apply_backends, current_backends, parse_backend_spec  # noqa: E402
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.transforms.cuda_graphs import NO_CUDA, GraphedDecoder, launches_per_decode_step  # noqa: E402
from workbench.errors import ConfigError, WorkbenchError  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402
from workbench_kernels._testing import assert_close  # noqa: E402

from conftest import BUNDLED_READY  # noqa: E402

torch.set_num_threads(1)
# On a GPU machine the kernels are compiled, not interpreted, and backend 'triton' refuses a CPU
# model: every model here lives on DEVICE (and the graphs are then really captured and replayed).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
PROMPTS = ["Python is", "The list", "def f(x):"]


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return init_weights(CausalLM(cfg), seed=7).eval().to(DEVICE)


@pytest.fixture(scope="module")
def bundled():
    if not BUNDLED_READY:
        pytest.skip("bundled model weights not present (data/reference-model/model.safetensors)")
    llm = workbench.LLM(device=DEVICE)
    params = workbench.SamplingParams(temperature=0, max_tokens=12)
    ref = [o.token_ids for o in llm.generate(PROMPTS, params)]
    return llm, ref


@CPU_ONLY
def test_capture_on_cpu_says_so_in_one_line_and_runs_eager(tiny, capsys):
    dec = GraphedDecoder(tiny, max_len=16)
    assert dec.capture() is False and not dec.graphed
    assert capsys.readouterr().out == NO_CUDA + "\n"
    assert "CUDA" in NO_CUDA and "eager" in NO_CUDA
    with pytest.raises(WorkbenchError, match="CUDA graphs need a CUDA device"):
        dec.capture(strict=True)


def static_llm(llm, max_model_len: int, **kw):
    """The engine with decode steps on the static buffers (the path CUDA graphs capture)."""
    return workbench.LLM(llm.model, tokenizer=llm.tokenizer, max_model_len=max_model_len, static_decode=True, **kw)


def test_static_decode_gives_the_reference_greedy_tokens(bundled):
    llm, ref = bundled
    static = static_llm(llm, 32)
    assert "static-decode" in static.engine.describe()
    params = workbench.SamplingParams(temperature=0, max_tokens=12)
    assert [o.token_ids for o in static.generate(PROMPTS, params)] == ref
    # several sequences at once: bucketed steps, rows kept packed as sequences end
    batched = static_llm(llm, 32, scheduler=workbench.SchedulerConfig(max_num_seqs=4))
    outs = batched.generate(PROMPTS, [workbench.SamplingParams(temperature=0, max_tokens=n) for n in (12, 5, 9)])
    assert [o.token_ids for o in outs] == [ref[0], ref[1][:5], ref[2][:9]]
    assert max(r.num_seqs for r in batched.engine.step_records) == 3


def test_static_decode_with_all_triton_ops_gives_the_reference_greedy_tokens(bundled):
    """RoPE + KV write by slot index and decode attention over the whole static cache, with the
    positions as tensors: the graph-safe path, run eagerly under the interpreter."""
    llm, ref = bundled
    before = current_backends(llm.model)
    apply_backends(llm.model, parse_backend_spec("triton"))
    try:
        dec = GraphedDecoder(llm.model, max_len=16)
        assert dec.backends == {op: "triton" for op in OPS}
        out = static_llm(llm, 16).generate(PROMPTS[0], workbench.SamplingParams(temperature=0, max_tokens=6))[0]
        assert out.token_ids == ref[0][:6]
    finally:
        apply_backends(llm.model, before)


def test_a_batch_in_a_bucket_equals_each_sequence_alone(tiny):
    """Three sequences at different positions in the bucket of 4 (one padding row writing to the
    scratch row): each row's logits are the reference model's for that sequence alone."""
    prompts = [[3, 9, 27, 5], [11, 2], [40, 41, 42, 43, 44, 45, 46]]
    nxt = [7, 8, 9]
    dec = GraphedDecoder(tiny, max_len=12, buckets=(1, 4))
    for row, ids in enumerate(prompts):
        dec.prefill(row, ids)
    logits = dec.decode(nxt, [len(p) for p in prompts])
    assert logits.shape == (3, tiny.config.vocab_size) and dec.bucket_for(3) == 4
    for row, ids in enumerate(prompts):
        with torch.inference_mode():
            want = tiny(torch.tensor([ids + [nxt[row]]], device=DEVICE))[0, -1]
        # fp32: the same ops with another batch size (matmul kernels differ by a few ulp)
        tol = 1e-5 if DEVICE == "cpu" else 1e-4
        assert_close(logits[row], want, atol=tol, rtol=tol, name=f"row {row}")
    with pytest.raises(WorkbenchError, match="exceeds the largest bucket"):
        dec.bucket_for(5)
    with pytest.raises(ConfigError, match="buckets must be positive"):
        GraphedDecoder(tiny, max_len=12, buckets=(0,))


def test_launches_per_decode_step(tiny):
    """Triton: one launch per fused op, per layer: rmsnorm, rope_kv_write, paged_decode,
    add_rmsnorm, swiglu (5 L) and the final norm; the reference launches none and more aten ops."""
    L = tiny.config.num_hidden_layers
    mlp_class = type(tiny.model.layers[0].mlp)        # MLP, or BackendMLP after a GraphedDecoder
    eager = launches_per_decode_step(tiny, {op: "eager" for op in OPS})
    fused = launches_per_decode_step(tiny, parse_backend_spec("triton"))
    assert eager["triton"] == 0 and eager["aten"] > 0 and eager["total"] == eager["aten"]
    assert fused["triton"] == 5 * L + 1
    assert fused["aten"] < eager["aten"], (fused, eager)
    assert fused["backends"].startswith("rmsnorm=triton") and fused["graphed"] is False
    static = launches_per_decode_step(tiny, parse_backend_spec("triton"), graphed=True)
    on_gpu = torch.cuda.is_available()
    assert static["graphed"] is on_gpu
    # a graph replay launches nothing through the Python wrappers; eager, the same 5 L + 1
    assert static["triton"] == (0 if on_gpu else 5 * L + 1)
    assert current_backends(tiny) == {op: "eager" for op in OPS}, "the model is left as it was"
    assert type(tiny.model.layers[0].mlp) is mlp_class


def test_a_replay_first_joins_the_weight_copies_an_eager_step_submitted(tiny):
    """Weight streaming on CUDA: a prefill (eager) submits the next step's first copies on the copy
    stream; the graph replay that follows runs no hooks, so GraphedDecoder joins that stream first."""
    class Tr:
        kind, joins = "cuda", 0

        def join(self):
            Tr.joins += 1

    seen = []

    class G:
        def replay(self):
            seen.append(Tr.joins)

    dec = GraphedDecoder(tiny, max_len=16)
    dec.graphs[1] = (G(), torch.zeros(1, tiny.config.vocab_size, device=DEVICE))
    tiny._wb_stream = type("Stream", (), {"transport": Tr()})()
    try:
        dec.decode([3], [0])
    finally:
        del tiny._wb_stream
    assert seen == [1], "the replay ran before the copy stream was joined"

"""Per-op backends in the batched engine (``workbench.sched``): with ``rope``,
``attention_decode`` and ``attention_prefill`` on Triton, the ModelRunner routes the fused RoPE +
paged K/V write, decode attention and chunked-prefill attention through the kernels, and gives
the eager greedy tokens on the bundled model -- several requests at once, prefill split into
chunks that share steps with decode tokens, blocks of 5 so last blocks are partly filled.  With
no backends applied, the runner's eager path (the batch-invariant float64 attention) runs and
no kernel is launched.

Runs on the CPU under the Triton interpreter (set before the kernel modules are imported).
Every launch there costs ~0.1 s, so: three short prompts, six new tokens, a small pool (the
interpreter copies the pool's layer tensors at every launch).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel modules create their jit functions
pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")

import workbench  # noqa: E402
import workbench_kernels  # noqa: E402
from workbench.transforms.backends import current_backends, using_backends  # noqa: E402
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402
from workbench.sched import SchedulerConfig
from workbench.engine import LLMEngine  # noqa: E402

from conftest import BUNDLED_READY  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)

PROMPTS = ["Python is", "The list data type has", "def f(x):"]          # 3, 6 and 6 tokens
GREEDY = workbench.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TRITON = {"rope": "triton", "attention_decode": "triton", "attention_prefill": "triton"}
# kernel wrappers (workbench_kernels.LAUNCHES names) each op launches in the batched engine
WRAPPERS = {"rope": "rope_kv_write", "attention_decode": "paged_decode", "attention_prefill": "flash_prefill"}


def launches_during(fn):
    before = dict(workbench_kernels.LAUNCHES)
    fn()
    return {k: v - before.get(k, 0) for k, v in workbench_kernels.LAUNCHES.items() if v != before.get(k, 0)}


@pytest.fixture(scope="module")
def bundled():
    if not BUNDLED_READY:
        pytest.skip("bundled model weights not present (data/reference-model/model.safetensors)")
    llm = workbench.LLM(None, device=DEVICE)
    reference = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]    # the single-sequence engine
    return llm, reference


def engine(llm, **kw):
    """Chunked prefill in steps of 6 tokens (chunks share steps with decode tokens); blocks of
    5 (prompt + 6 new tokens leaves the last block partly filled); a pool of 60 slots."""
    sched = dict(max_num_seqs=4, max_num_batched_tokens=6, chunked_prefill=True)
    return LLMEngine(llm, scheduler=SchedulerConfig(**sched),
                     kv=PagedKVConfig(block_size=5, num_blocks=12, enable_prefix_caching=False), **kw)


def test_eager_batched_engine_launches_no_kernel(bundled):
    llm, reference = bundled
    assert set(current_backends(llm.model).values()) == {"eager"}
    eng = engine(llm)
    got = []
    used = launches_during(lambda: got.extend(o.token_ids for o in eng.generate(PROMPTS, GREEDY)))
    assert used == {}
    assert got == reference
    # eager chosen explicitly: the backend modules, the same runner path, still no kernel
    with using_backends(llm.model, {op: "eager" for op in TRITON}):
        again = []
        used = launches_during(lambda: again.extend(o.token_ids for o in eng.generate(PROMPTS, GREEDY)))
    assert used == {} and again == reference


def test_triton_rope_and_attention_in_the_batched_engine_give_the_eager_greedy_tokens(bundled):
    """The engine is made before the backends change: the runner reads them at every step."""
    llm, reference = bundled
    eng = engine(llm)
    got = []
    with using_backends(llm.model, TRITON):
        used = launches_during(lambda: got.extend(o.token_ids for o in eng.generate(PROMPTS, GREEDY)))
    assert got == reference
    assert set(used) == set(WRAPPERS.values()), used          # rmsnorm / swiglu stayed eager
    records = list(eng.step_records)
    assert max(r.num_seqs for r in records) == len(PROMPTS)                   # really batched
    assert any(r.prefill_tokens and r.decode_tokens for r in records)         # chunks next to decodes
    L = llm.model.config.num_hidden_layers
    steps = len(records)
    assert used["rope_kv_write"] == L * steps                                 # one fused launch per layer
    decode_steps = sum(1 for r in records if r.decode_tokens)
    prefill_steps = sum(1 for r in records if r.prefill_tokens)
    assert used["paged_decode"] == L * decode_steps
    assert used["flash_prefill"] == L * prefill_steps
    assert eng.pool.manager.num_used_blocks == 0
    # back to eager on the same engine: no kernel, the same tokens
    after = []
    used = launches_during(lambda: after.extend(o.token_ids for o in eng.generate(PROMPTS, GREEDY)))
    assert used == {} and after == reference


def test_one_op_at_a_time(bundled):
    """Only rope on Triton: only the fused RoPE + K/V write runs; attention stays on the
    runner's own path.  Only decode attention: the eager write, then the paged decode kernel."""
    llm, reference = bundled
    eng = engine(llm)
    for op in ("rope", "attention_decode"):
        got = []
        with using_backends(llm.model, {op: "triton"}):
            used = launches_during(lambda: got.extend(o.token_ids for o in eng.generate(PROMPTS[1:], GREEDY)))
        assert set(used) == {WRAPPERS[op]}, (op, used)
        assert got == reference[1:], op


def test_applied_backends_stay_after_the_engine_is_built(bundled):
    """Backends applied before the engine is made (the usual order) are honoured too, also
    with batch invariance off (plain SDPA on the eager path, the same kernels here)."""
    llm, reference = bundled
    with using_backends(llm.model, TRITON):
        eng = engine(llm, batch_invariant=False)
        assert not eng.runner.batch_invariant
        got = []
        used = launches_during(lambda: got.extend(o.token_ids for o in eng.generate(PROMPTS[:2], GREEDY)))
    assert set(WRAPPERS.values()) <= set(used)
    assert got == reference[:2]


# ---- a sliding window shorter than the contexts ----------------------------------------------
WINDOW = 8


@pytest.fixture(scope="module")
def windowed(bundled_tokenizer):
    """A random Mistral-style model (sliding window 8, GQA) with the bundled vocabulary."""
    cfg = ModelConfig(vocab_size=bundled_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=0,
                      sliding_window=WINDOW, architecture="MistralForCausalLM")
    model = init_weights(CausalLM(cfg), seed=11).eval().to(DEVICE)
    return workbench.LLM(model, tokenizer=bundled_tokenizer)


def test_sliding_window_stays_on_the_kernels_past_the_window(windowed, monkeypatch):
    """Prompts of 5, 11 and 7 tokens, 8 new tokens each: contexts grow to 19 > the window of 8,
    prefill chunks of 6 start after a cached prefix longer than the window.  Every attention
    group of every step and layer runs on a kernel (no fallback once a context passes the
    window) and the greedy tokens are the eager batched engine's and the single-sequence engine's."""
    from workbench.kv import batch as kv_batch

    prompts = [[5, 17, 300, 41, 9], [7, 120, 33, 2048, 61, 11, 95, 400, 23, 8, 71], [3, 250, 19, 88, 1000, 42, 6]]
    params = workbench.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = [windowed.generate([p], params)[0].token_ids for p in prompts]
    eager = [o.token_ids for o in engine(windowed).generate(prompts, params)]
    assert eager == single

    groups = []                                   # (decode group?, longest context, entry point or None)
    choose = kv_batch._Group.kernel

    def kernel(self, ops):
        fn = choose(self, ops)
        groups.append((self.decode, self.S, fn))
        return fn

    monkeypatch.setattr(kv_batch._Group, "kernel", kernel)
    with using_backends(windowed.model, TRITON):
        eng = engine(windowed)
        got = []
        used = launches_during(lambda: got.extend(o.token_ids for o in eng.generate(prompts, params)))
    assert got == eager
    assert all(fn is not None for _, _, fn in groups), "a group fell back to the runner's own attention"
    assert used["paged_decode"] == sum(1 for d, _, _ in groups if d)
    assert used["flash_prefill"] == sum(1 for d, _, _ in groups if not d)
    assert max(S for d, S, _ in groups if d) > 2 * WINDOW, "decode contexts pass the window"
    assert max(S for d, S, _ in groups if not d) > WINDOW, "prefill chunks after a prefix longer than the window"

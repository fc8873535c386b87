"""One engine: ``LLM`` is a front over ``LLMEngine``; every layer works in every mode; a
combination that cannot work says why.  Greedy tokens on the bundled model are identical
across the exact paths (the batched, chunked and preemption paths are in test_batched_engine)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel modules create their jit functions

import pytest  # noqa: E402
import torch  # noqa: E402

import workbench  # noqa: E402
from workbench import LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from workbench.engine.llm import ReferenceLoop, reference_generate  # noqa: E402
from workbench.errors import ConfigError  # noqa: E402
from workbench.kv.inspect import KVInspector  # noqa: E402
from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.kv.pca import fit_pca_from_model  # noqa: E402
from workbench.kv.tier_config import TierConfig  # noqa: E402

SYSTEM = "You are a helpful assistant for the Python documentation. Answer briefly. "
PROMPTS = [SYSTEM + q for q in ("What is a list?", "How do I open a file?", "What does yield do?",
                                "Explain decorators.")]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _same_model(llm, **kw):
    return workbench.LLM(llm.model, tokenizer=llm.tokenizer, **kw)


@pytest.fixture(scope="module")
def reference(bundled_llm):
    return [o.token_ids for o in bundled_llm.generate(PROMPTS, GREEDY)]


def test_reference_configuration_is_the_bare_decode_loop(bundled_llm, reference):
    """The default LLM is the engine configured as the reference (one sequence at a time, no
    chunking, a contiguous cache): its tokens are the bare loop's, and every row says so."""
    eng = bundled_llm.engine
    assert eng.kv_mode == "contiguous" and eng.scheduler.config.max_num_seqs == 1
    assert not eng.scheduler.config.chunked_prefill
    for prompt, want in zip(PROMPTS, reference):
        ids = bundled_llm.encode(prompt)[1]
        assert reference_generate(bundled_llm.model, ids, GREEDY.max_tokens) == want
    out = bundled_llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.metrics.engine == eng.describe() and out.metrics.engine.startswith("contiguous seqs=1")
    assert bundled_llm.requests_frame([out])["engine"][0] == eng.describe()
    loop = ReferenceLoop(bundled_llm.model, bundled_llm.encode(PROMPTS[0])[1], 3)
    assert [loop.step(), loop.sample(loop.forward()), loop.step()] == reference[0][:3]


def test_a_kv_config_given_to_llm_is_the_pool_it_uses(bundled_llm, reference):
    llm = _same_model(bundled_llm, kv=PagedKVConfig(block_size=8, num_blocks=37))
    assert llm.kv_pool is llm.engine.pool and llm.kv_pool.num_blocks == 37 and llm.kv_pool.block_size == 8
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.kv_pool.manager.stats.hit_tokens > 0, "the shared system prompt was reused"
    assert llm.kv_pool.manager.num_used_blocks == 0


def test_offload_restores_in_the_batched_engine(bundled_llm, reference):
    """Host offload in continuous batching: evicted prefix blocks spill to host memory and come
    back on a later hit, copied into the pool before the step that reads them."""
    eng = LLMEngine(bundled_llm, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                    kv=PagedKVConfig(block_size=4, num_blocks=24, offload="host", offload_blocks=64))
    first = eng.generate(PROMPTS[:1], GREEDY)[0].token_ids
    filler = [[int(t) for t in torch.randint(5, 900, (60,), generator=torch.Generator().manual_seed(s))]
              for s in range(3)]
    eng.generate(filler, SamplingParams(temperature=0, max_tokens=2))     # evicts the system prompt's blocks
    again = eng.generate(PROMPTS, GREEDY)
    st = eng.pool.manager.stats
    assert st.evictions > 0 and st.restored_blocks > 0 and eng.pool.offload.stats.gets == st.restored_blocks
    assert first == reference[0] and [o.token_ids for o in again] == reference
    assert again[0].num_cached_tokens > 0
    eng.pool.manager.check_invariants()
    assert eng.pool.manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiered(bundled_llm):
    calib = [torch.randint(5, 900, (96,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    basis = fit_pca_from_model(bundled_llm.model, calib)
    cfg = TierConfig(window=16, sink=2, rank=8, warm_tokens=16, chunk=4, block=8, budget=16)
    prompts = [torch.randint(5, 900, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 55, 90)]
    return cfg, basis, prompts


def test_tiers_in_the_batched_engine_equal_tiers_one_request_at_a_time(bundled_llm, tiered):
    cfg, basis, prompts = tiered
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        batched = LLMEngine(bundled_llm, tiers=cfg, tier_basis=basis,
                            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48))
        together = [o.token_ids for o in batched.generate(prompts, params)]
        alone = [batched.generate([p], params)[0].token_ids for p in prompts]
        assert max(r.num_seqs for r in batched.step_records) == 3, "they really ran together (and chunked)"
        assert together == alone
        ref_cfg = _same_model(bundled_llm, tiers=cfg, tier_basis=basis)       # the reference configuration
        assert [o.token_ids for o in ref_cfg.generate(prompts, params)] == alone
        assert ref_cfg.last_cache is not None and ref_cfg.last_cache.zone_counts().warm > 0
        assert batched.describe().startswith("tiered ")
    finally:
        from workbench.kv.tiers import remove_tiered_attention
        remove_tiered_attention(bundled_llm.model)


def test_the_pool_lifecycle_runs_in_the_batched_engine(bundled_llm):
    """Listeners, admissions and the manager's time: inspectors see the batched engine."""
    eng = LLMEngine(bundled_llm, scheduler=SchedulerConfig(max_num_seqs=4), kv=PagedKVConfig(block_size=4))
    events = []
    eng.pool.listeners.append(lambda ev, sid: events.append((ev, sid)))
    with KVInspector(eng.pool) as insp:
        outs = eng.generate(PROMPTS[:1], GREEDY) + eng.generate(PROMPTS[1:], GREEDY)   # then the rest hit
    for o in outs:
        mine = [ev for ev, sid in events if sid == o.request_id]
        assert mine[0] == "begin" and mine[-1] == "end" and mine.count("step") >= GREEDY.max_tokens - 1
    assert eng.pool.manager_seconds > 0
    recs = {r["seq_id"]: r for r in insp.records}
    assert len(recs) == len(PROMPTS) and min(r["cached_tokens"] for r in recs.values() if r["seq_id"] != "req-0") > 0
    from workbench.lab.kv_view import KVBlockMapView

    view = KVBlockMapView().attach(eng)            # the live block map on the batched engine
    eng.generate(PROMPTS[:2], GREEDY)
    assert view.events >= 2 * GREEDY.max_tokens and view.pool is eng.kv_pool
    view.detach()


def test_stream_is_a_front_over_the_engine(random_llm):
    """Two streams of one LLM interleaved: each gets only its own events; one abandoned early
    frees its KV and the other finishes with the tokens it has alone."""
    llm = _same_model(random_llm, kv=PagedKVConfig(block_size=4))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(["The list", "A function is"], params)]
    with llm.batching(2):
        a, b = llm.stream("The list", params), llm.stream("A function is", params)
        got_a = [next(a).token_id, next(a).token_id]
        got_b = [ev.token_id for ev in b]
        a.close()
    assert got_b == alone[1] and got_a == alone[0][:2]
    assert llm.kv_pool.manager.num_used_blocks == 0 and not llm.engine.has_unfinished()


def test_combinations_that_cannot_work_say_why(random_llm, tiered):
    cfg, basis, _ = tiered
    cases = [
        (dict(kv=PagedKVConfig(), tiers=cfg, tier_basis=basis), "not both"),
        (dict(kv="contiguous", scheduler=SchedulerConfig(preemption_mode="swap")), "swap"),
        (dict(tiers=cfg, tier_basis=basis, compile=True), "routing picks blocks per step on the host"),
        (dict(kv="contiguous", cuda_graphs=True), "CUDA device"),
        (dict(kv="pages"), "kv must be"),
    ]
    for kw, words in cases:
        with pytest.raises(ConfigError, match=words):
            LLMEngine(random_llm, **kw)


def test_sampling_on_the_triton_kernel(random_llm):
    """``sampling=triton``: greedy tokens are the reference's; a seeded request is reproducible
    and drawn by the kernel (Gumbel-max, so not the reference sampler's draw)."""
    import workbench_kernels
    from workbench.transforms.backends import using_backends

    llm = _same_model(random_llm)
    prompts = ["The list", "A function is"]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=6, seed=7, ignore_eos=True)
    with using_backends(llm.model, sampling="triton"):
        before = dict(workbench_kernels.LAUNCHES)
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        one = llm.generate(prompts[0], seeded)[0].token_ids
        two = llm.generate(prompts[0], seeded)[0].token_ids
        launched = {k for k, v in workbench_kernels.LAUNCHES.items() if v > before.get(k, 0)}
        assert "sampling=triton" in llm.engine.describe()
    assert got == want and one == two and len(one) == 6
    assert {"greedy_tokens", "sample_tokens"} <= launched


def test_compiled_static_decode_agrees_with_the_reference(random_llm):
    """``compile=True``: the static decode step through torch.compile (inductor's C++ on a CPU)."""
    llm = _same_model(random_llm, max_model_len=48)
    want = [o.token_ids for o in llm.generate(["The list", "A function is"], GREEDY)]
    fast = _same_model(random_llm, max_model_len=48, compile=True)
    got = [o.token_ids for o in fast.generate(["The list", "A function is"], GREEDY)]
    assert fast.engine.runner.decoder.compiled and "compile" in fast.engine.describe()
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.9 * sum(len(w) for w in want), (got, want)


def test_tiers_and_offload_serve(bundled_llm, tiered, reference):
    """The same engines behind `workbench serve`: tiers, and host offload, over HTTP; the
    configuration is in x-model-info and /metrics."""
    import json

    import httpx

    from workbench.serve import start_server

    cfg, basis, prompts = tiered
    body = {"model": "bundled", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    try:
        tiered_engine = LLMEngine(bundled_llm, tiers=cfg, tier_basis=basis, scheduler=SchedulerConfig(max_num_seqs=4))
        offload_engine = LLMEngine(bundled_llm, scheduler=SchedulerConfig(max_num_seqs=4),
                                   kv=PagedKVConfig(block_size=4, num_blocks=40, offload="host"))
        for eng, kind in ((tiered_engine, "tiered"), (offload_engine, "paged")):
            with start_server(eng) as h, httpx.Client(base_url=h.url, timeout=60) as c:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                info = json.loads(r.headers["x-model-info"])
                assert info["engine"]["kv"] == kind and info["engine"]["config"] == eng.describe()
                assert f'workbench_engine_info{{config="{eng.describe()}",kv="{kind}"' in c.get("/metrics").text
                if kind == "paged":
                    assert r.json()["choices"][0]["text"] == bundled_llm.tokenizer.decode(reference[0])
                else:                               # no paged pool to show: said so, not a fake one
                    kv = c.get("/v1/workbench/kv")
                    assert kv.status_code == 501 and "tiered cache per request" in kv.json()["error"]["message"]
    finally:
        from workbench.kv.tiers import remove_tiered_attention
        remove_tiered_attention(bundled_llm.model)


def test_a_failed_generate_leaves_nothing_queued(random_llm):
    llm = _same_model(random_llm)
    with pytest.raises(ConfigError, match="empty"):
        llm.generate(["The list", "A function is", []], GREEDY)         # the third prompt is bad
    assert not llm.engine.seqs and not llm.engine.has_unfinished()
    out = llm.generate(["The list"], GREEDY)[0]
    assert out.request_id in {r.request_ids[0] for r in llm.engine.step_records if r.request_ids}
    assert all(set(r.request_ids) <= {out.request_id} for r in list(llm.engine.step_records)[-GREEDY.max_tokens:])


def test_static_buffers_refuse_more_sequences_than_they_hold(random_llm):
    static = _same_model(random_llm, max_model_len=48, static_decode=True)
    with pytest.raises(ConfigError, match="built for 1 sequence"):
        with static.batching(2):
            pass
    with pytest.raises(ConfigError, match="batch_invariant"):
        LLMEngine(random_llm, kv="contiguous", static_decode=True, batch_invariant=True)


@pytest.mark.parametrize("argv, words", [
    (["--kv", "contiguous", "--offload", "host"], "--offload: options of the paged pool"),
    (["--tiers", "--num-blocks", "64"], "--num-blocks"),
    (["--compile", "--tiers"], "drop --tiers"),
    (["--tiers", "--kv", "contiguous"], "--kv does not apply"),
])
def test_serve_refuses_options_its_kv_layout_does_not_read(argv, words, capsys):
    from workbench.cli.main import main

    assert main(["serve", "--model", "preset:tiny", *argv]) == 2
    assert words in capsys.readouterr().err

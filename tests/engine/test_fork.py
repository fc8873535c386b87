"""Parallel sampling by forks (``add_request(..., fork_of=parent)``): on the paged pool the
prompt is computed once and its blocks are shared (copy-on-write on the partly filled last
block); every sample is exactly what it would be alone; every block comes back; a fork never
gets lost when its parent ends, fails or is preempted before its prompt is computed, or when
there is no room for it.  Contiguous KV queues forks as any request."""

from __future__ import annotations

import time

import pytest

from workbench import SamplingParams
from workbench.errors import ConfigError
from workbench.kv.inspect import KVInspector
from workbench.kv.paged import PagedKVConfig
from workbench.sched import SchedulerConfig
from workbench.engine import AsyncEngine, LLMEngine

PROMPT = "The list data type has some more methods."
BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=6, ignore_eos=True) for s in range(4)]


def engine(llm, kv=None, **sched):
    cfg = {"max_num_seqs": 8, "max_num_batched_tokens": 256, **sched}
    return LLMEngine(llm, scheduler=SchedulerConfig(**cfg), kv=kv or PagedKVConfig(block_size=BLOCK, num_blocks=64))


@pytest.fixture(scope="module")
def prompt_len(bundled_llm):
    n = len(bundled_llm.encode(PROMPT)[1])
    assert n % BLOCK, "the prompt's last block must be partial (copy-on-write is tested)"
    return n


@pytest.fixture(scope="module")
def alone(bundled_llm):
    """Tokens of PROMPT run on its own (no fork), per SamplingParams."""
    eng = engine(bundled_llm, max_num_seqs=1)
    cache = {}

    def run(params: SamplingParams):
        key = repr(params)
        if key not in cache:
            out = eng.generate([PROMPT], params)[0]
            cache[key] = (out.token_ids, out.logprobs)
        return cache[key][0]

    run.logprobs = lambda params: (run(params), cache[repr(params)][1])[1]
    return run


def submit(eng, params: list[SamplingParams], prompt=PROMPT) -> list[str]:
    parent = eng.add_request(prompt, params[0])
    return [parent] + [eng.add_request(prompt, p, fork_of=parent) for p in params[1:]]


def drain(eng, rids, max_steps=200):
    """Step until nothing is left (a fork lost in the engine would keep it stepping: bounded)."""
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return [eng.release(r) for r in rids]
        eng.step()
        eng.pool.manager.check_invariants()
    raise AssertionError(f"still unfinished after {max_steps} steps: {eng.stats()}")


def _assert_pool_back(eng):
    m = eng.pool.manager
    assert m.num_used_blocks == 0, m.block_states()   # shared or not, everything is free or cached again
    m.check_invariants()
    assert not eng.forks and eng.num_held == 0 and eng.stats()["held"] == 0


def test_greedy_forks_equal_the_prompt_alone_computed_once_on_shared_blocks(bundled_llm, alone, prompt_len):
    eng = engine(bundled_llm)
    rids = submit(eng, [GREEDY] * 4)
    assert eng.stats()["held"] == 3 and eng.stats()["waiting"] == 4 and eng.has_unfinished()
    m = eng.pool.manager
    eng.step()                                   # the prompt is computed once; the 3 forks start on its blocks
    m.check_invariants()
    tables = [m.block_table(r) for r in rids]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == -(-prompt_len // BLOCK)
    assert [m.blocks[b].ref_count for b in tables[0]] == [4] * len(tables[0])
    assert len(eng.scheduler.running) == 4 and eng.stats()["held"] == 0
    assert all(len(eng.get_output(r).token_ids) == 1 for r in rids)   # each fork sampled its first token too
    cow = m.stats.cow_copies
    eng.step()                                   # every sample writes its next token: the partial block is copied
    assert m.stats.cow_copies - cow == 3         # the last writer keeps the original
    full = prompt_len // BLOCK
    assert [m.blocks[b].ref_count for b in tables[0][:full]] == [4] * full
    assert m.num_used_blocks < 4 * -(-(prompt_len + 1) // BLOCK)
    outs = drain(eng, rids)
    want = alone(GREEDY)
    assert [o.token_ids for o in outs] == [want] * 4
    assert sum(r.prefill_tokens for r in eng.step_records) == prompt_len    # not 4 x prompt_len
    assert [o.num_cached_tokens for o in outs] == [0] + [prompt_len] * 3
    assert all(o.finish_reason == "length" and o.metrics.first_token_time is not None for o in outs)
    _assert_pool_back(eng)


def test_seeded_forks_equal_each_seed_alone_with_logprobs_from_the_shared_row(bundled_llm, alone, prompt_len):
    params = [SamplingParams(**{**vars(p), "logprobs": 2}) if i == 2 else p for i, p in enumerate(SEEDED)]
    eng = engine(bundled_llm)
    outs = drain(eng, submit(eng, params))
    assert [o.token_ids for o in outs] == [alone(p) for p in params]
    assert len({tuple(o.token_ids) for o in outs}) > 1, "different seeds, different samples"
    got, want = outs[2].logprobs, alone.logprobs(params[2])
    assert [e["token_id"] for e in got] == [e["token_id"] for e in want]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
    assert sum(r.prefill_tokens for r in eng.step_records) == prompt_len
    _assert_pool_back(eng)


def test_forks_share_prompt_logprobs_of_the_same_k_else_compute_them(bundled_llm, alone, prompt_len):
    same, other = (SamplingParams(**{**vars(GREEDY), "prompt_logprobs": k}) for k in (1, 2))
    eng = engine(bundled_llm)
    with KVInspector(eng.pool) as insp:
        outs = drain(eng, submit(eng, [same, same, other]))
    assert [o.token_ids for o in outs] == [alone(GREEDY)] * 3
    assert outs[1].num_cached_tokens == prompt_len and outs[1].prompt_logprobs == outs[0].prompt_logprobs
    assert outs[1].prompt_logprobs is not outs[0].prompt_logprobs
    assert outs[2].num_cached_tokens == 0 and len(outs[2].prompt_logprobs[1]["top"]) == 2   # computed its own
    assert sum(r.prefill_tokens for r in eng.step_records) == 2 * prompt_len
    forked = [r for r in insp.records if r["seq_id"] == outs[1].request_id]
    assert forked and forked[0]["cached_tokens"] == prompt_len      # inspectors see the fork's "begin"
    _assert_pool_back(eng)


def test_aborted_parent_or_held_fork(bundled_llm, alone):
    eng = engine(bundled_llm)
    rids = submit(eng, [GREEDY] * 3)
    assert eng.abort(rids[0])                    # before its prompt ran: the forks compute it themselves
    outs = drain(eng, rids)
    assert outs[0].finish_reason == "abort" and [o.token_ids for o in outs[1:]] == [alone(GREEDY)] * 2
    _assert_pool_back(eng)

    # mid-prompt (chunked prefill): the released forks hit the parent's committed full blocks
    eng = engine(bundled_llm, max_num_batched_tokens=BLOCK * 2)
    rids = submit(eng, [GREEDY] * 3)
    eng.step()
    eng.abort(rids[0])
    assert eng.stats()["held"] == 0 and eng.stats()["waiting"] == 2
    outs = drain(eng, rids)
    assert [o.token_ids for o in outs[1:]] == [alone(GREEDY)] * 2
    assert max(o.num_cached_tokens for o in outs[1:]) >= BLOCK * 2
    _assert_pool_back(eng)

    eng = engine(bundled_llm)
    rids = submit(eng, [GREEDY] * 4)
    assert eng.abort(rids[2]) and not eng.abort(rids[2])
    assert eng.stats()["held"] == 2
    outs = drain(eng, rids)
    assert outs[2].finish_reason == "abort" and not outs[2].token_ids
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [alone(GREEDY)] * 3
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, False, True]
    _assert_pool_back(eng)

    eng = engine(bundled_llm)                    # forget (a failed generate call): the parent and one fork
    rids = submit(eng, [GREEDY] * 3)
    eng.forget(rids[:2], "the caller gave up")
    assert list(eng.seqs) == rids[2:] and eng.scheduler.waiting == [eng.seqs[rids[2]]] and eng.num_held == 0
    assert [o.token_ids for o in drain(eng, rids[2:])] == [alone(GREEDY)]
    _assert_pool_back(eng)


def test_failures_of_the_parent_or_of_a_fork_end_only_their_own(bundled_llm, alone, failing_sampling):
    bad = SamplingParams(temperature=0.7, seed=failing_sampling, max_tokens=6)
    eng = engine(bundled_llm)
    outs = drain(eng, submit(eng, [bad, GREEDY, SEEDED[1]]))     # the parent's sampling fails
    assert outs[0].finish_reason == "error" and outs[0].error.startswith("sampling failed")
    assert [o.token_ids for o in outs[1:]] == [alone(GREEDY), alone(SEEDED[1])]   # no draw was spent on them
    _assert_pool_back(eng)

    eng = engine(bundled_llm)
    outs = drain(eng, submit(eng, [GREEDY, bad, SEEDED[1]]))     # a fork's own sampling fails
    assert outs[1].finish_reason == "error" and not outs[1].token_ids
    assert [outs[0].token_ids, outs[2].token_ids] == [alone(GREEDY), alone(SEEDED[1])]
    assert outs[2].num_cached_tokens > 0
    _assert_pool_back(eng)

    eng = engine(bundled_llm)                    # the parent's step fails: the forks are released
    execute = eng.runner.execute

    def fail_first(scheduled):
        if eng.scheduler.step_no == 1:
            raise RuntimeError("injected forward failure")
        return execute(scheduled)

    eng.runner.execute = fail_first
    outs = drain(eng, submit(eng, [GREEDY] * 3))
    assert outs[0].finish_reason == "error" and "injected forward failure" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == [alone(GREEDY)] * 2
    _assert_pool_back(eng)


def test_parent_preempted_before_its_prompt_releases_the_forks(bundled_llm, alone):
    eng = engine(bundled_llm, max_num_seqs=1, max_num_batched_tokens=BLOCK * 2)   # the prompt takes 2 steps
    rids = submit(eng, [GREEDY] * 3)
    eng.step()                                   # the first chunk of the parent's prompt
    vip = eng.add_request("A function is", GREEDY, priority=5)
    eng.step()                                   # the vip preempts it before its last chunk samples
    assert eng.seqs[rids[0]].num_preemptions == 1 and eng.num_held == 0 and eng.stats()["waiting"] == 3
    outs = drain(eng, rids + [vip])
    assert [o.token_ids for o in outs[:3]] == [alone(GREEDY)] * 3
    _assert_pool_back(eng)


def test_no_room_queues_the_extra_forks(bundled_llm, alone, prompt_len):
    eng = engine(bundled_llm, max_num_seqs=2)
    rids = submit(eng, SEEDED)
    eng.step()
    assert len(eng.scheduler.running) == 2 and len(eng.scheduler.waiting) == 2 and eng.num_held == 0
    outs = drain(eng, rids)
    assert [o.token_ids for o in outs] == [alone(p) for p in SEEDED]
    assert [o.num_cached_tokens == prompt_len for o in outs] == [False, True, False, False]
    assert sum(r.prefill_tokens for r in eng.step_records) > prompt_len     # the queued ones computed theirs
    _assert_pool_back(eng)


def test_contiguous_kv_queues_forks_as_any_request(bundled_llm, alone, prompt_len):
    eng = engine(bundled_llm, kv="contiguous")
    rids = submit(eng, [GREEDY, SEEDED[1], SEEDED[2]])
    assert eng.num_held == 0 and len(eng.scheduler.waiting) == 3
    outs = drain(eng, rids)
    assert [o.token_ids for o in outs] == [alone(GREEDY), alone(SEEDED[1]), alone(SEEDED[2])]
    assert sum(r.prefill_tokens for r in eng.step_records) == 3 * prompt_len
    assert eng.pool.manager.num_used_blocks == 0


def test_a_fork_needs_a_live_parent_with_the_same_prompt_not_yet_computed(bundled_llm):
    eng = engine(bundled_llm)
    with pytest.raises(ConfigError, match="'nope' names no unfinished request"):
        eng.add_request(PROMPT, GREEDY, fork_of="nope")
    parent = eng.add_request(PROMPT, GREEDY, request_id="p")
    with pytest.raises(ConfigError, match="'c' cannot fork 'p': their prompts differ"):
        eng.add_request(PROMPT + " More.", GREEDY, request_id="c", fork_of=parent)
    held = eng.add_request(PROMPT, GREEDY, fork_of=parent)
    sibling = eng.add_request(PROMPT, GREEDY, fork_of=held)      # a held fork's parent is shared
    assert eng.seqs[sibling].fork_of == parent and "c" not in eng.seqs and eng.num_held == 2
    eng.step()
    with pytest.raises(ConfigError, match="'c' cannot fork 'p': it has computed its prompt already"):
        eng.add_request(PROMPT, GREEDY, request_id="c", fork_of=parent)
    drain(eng, [parent, held, sibling])
    with pytest.raises(ConfigError, match="names no unfinished request"):
        eng.add_request(PROMPT, GREEDY, fork_of=parent)           # released
    _assert_pool_back(eng)


def test_async_engine_forks_and_a_late_fork_computes_its_prompt(bundled_llm, alone, prompt_len):
    eng = engine(bundled_llm)
    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}

    def on_event(ev):                            # on the engine thread
        if ev.token_id >= 0:
            tokens.setdefault(ev.request_id, []).append(ev.token_id)
        if ev.finished:
            done[ev.request_id] = ev.finish_reason

    aeng = AsyncEngine(eng)                      # not started yet: all three are taken in together, in order
    parent = aeng.submit(PROMPT, GREEDY, on_event)
    forks = [aeng.submit(PROMPT, p, on_event, fork_of=parent) for p in SEEDED[1:3]]
    def wait_for(cond, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert aeng.alive and time.monotonic() < deadline, (done, aeng.last_error)
            time.sleep(0.005)

    with aeng:
        wait_for(lambda: len(done) == 3)
        assert sum(r.prefill_tokens for r in list(eng.step_records)) == prompt_len
        late = aeng.submit(PROMPT, GREEDY, on_event, fork_of=parent)   # its parent is gone: queued as any request
        wait_for(lambda: late in done)
    assert [tokens[r] for r in [parent, *forks, late]] == [alone(GREEDY), alone(SEEDED[1]), alone(SEEDED[2]),
                                                           alone(GREEDY)]
    assert set(done.values()) == {"length"} and not eng.seqs
    _assert_pool_back(eng)

"""The admission rule as a pure function, and the hook that lets another rule drive the scheduler
(``SchedulerConfig(admission=fn)``, notebook 04's exercise 04.admit).

* :func:`admit` (the package's rule) is what the scheduler computes: a rule passed in through the
  hook's validated path gives the same schedules, step for step, on random traces (preemption,
  swapping, prefix sharing, rejections, with and without chunked prefill);
* another rule really drives admission (shortest prompt first admits in its own order);
* an invalid answer is a one-line WorkbenchError that names the broken rule, and no request or
  KV block is lost: raised at once when nothing else happened in the step, else by the next
  ``schedule()``, after the engine has carried out that step's swaps, preemptions and rejections.
"""

from __future__ import annotations

import random

import pytest

from workbench import SamplingParams
from workbench.errors import ConfigError, WorkbenchError
from workbench.kv.block_manager import BlockManager
from workbench.sched import SchedulerConfig, SeqStatus
from workbench.sched.admission import admission_problem, admit, chunk_tokens
from workbench.sched.scheduler import Scheduler
from workbench.sched.sequence import Sequence


class _Params:
    prompt_logprobs = None


def _req(i, tokens, blocks, priority=0, cached=0):
    return {"id": f"r{i}", "priority": priority, "cached": cached, "arrival": i, "tokens": tokens, "blocks": blocks}


STEP = dict(budget=64, scheduled_tokens=8, free_seqs=4, free_blocks=16, chunked_prefill=True)


# ---- the pure rule ---------------------------------------------------------------------------------
def test_admit_orders_by_priority_then_cached_prefix_then_arrival():
    waiting = [_req(0, 4, 1), _req(1, 4, 1, priority=1), _req(2, 4, 1, cached=8), _req(3, 4, 1, priority=1)]
    assert [rid for rid, _ in admit(waiting, **STEP)] == ["r1", "r3", "r2", "r0"]


def test_admit_stops_at_the_first_request_that_does_not_fit():
    assert admit([_req(0, 40, 5), _req(1, 8, 1)], **{**STEP, "free_blocks": 3}) == []
    assert admit([_req(0, 4, 1), _req(1, 4, 1)], **{**STEP, "free_seqs": 1}) == [("r0", 4)]


def test_admit_chunks_and_the_unchunked_step_of_its_own():
    assert admit([_req(0, 30, 2), _req(1, 100, 7)], **STEP) == [("r0", 30), ("r1", 26)]
    unchunked = {**STEP, "chunked_prefill": False}
    assert admit([_req(0, 100, 7), _req(1, 20, 2)], **unchunked) == [("r0", 0), ("r1", 20)]
    assert admit([_req(0, 200, 13), _req(1, 20, 2)], **{**unchunked, "scheduled_tokens": 0}) == [("r0", 200)]
    assert chunk_tokens(10, 4, others=True, chunked_prefill=False) == 0
    assert chunk_tokens(10, 4, others=False, chunked_prefill=False) == 10


@pytest.mark.parametrize("answer, rule", [
    ([("r9", 4)], "'r9' is not a waiting request"),
    ([("r0", 4), ("r0", 4)], "r0 is admitted twice"),
    ([("r0", 11)], "r0 computes 11 tokens, but it has 10 prompt tokens to compute"),
    ([("r0", 4.0)], "the number of tokens is an int"),
    ([("r0", 10), ("r1", 8), ("r2", 6)], "3 requests are admitted, but 2 sequence slots are free"),
    ([("r0", 10), ("r1", 8)], "r1 needs 8 KV blocks, 5 are free after r0 took theirs"),
    ([("r0", 10), ("r2", 50)],
     "the step computes 68 tokens (8 already scheduled + 60 admitted), over the budget of 64"),
    ("r0", "a list of (request id, tokens) pairs"),
    ([("r0",)], "each item is a (request id, tokens) pair"),
])
def test_admission_problem_names_the_rule(answer, rule):
    waiting = [_req(0, 10, 3), _req(1, 8, 8), _req(2, 50, 1)]
    got = admission_problem(answer, waiting, **{**STEP, "free_seqs": 2, "free_blocks": 8})
    assert got is not None and rule in got, got


def test_admission_problem_split_prompt_without_chunking_and_the_step_of_its_own():
    waiting = [_req(0, 100, 3)]
    off = {**STEP, "chunked_prefill": False}
    assert "chunked prefill is off" in admission_problem([("r0", 30)], waiting, **off)
    assert admission_problem([("r0", 0)], waiting, **off) is None
    assert "over the budget" in admission_problem([("r0", 100)], waiting, **off)
    assert admission_problem([("r0", 100)], waiting, **{**off, "scheduled_tokens": 0}) is None


# ---- the scheduler calls it ---------------------------------------------------------------------------
def _signature(out):
    return (out.step, [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled],
            [s.request_id for s in out.preempted], [(s.seq.request_id, s.num_tokens) for s in out.swapped_out],
            [(s.seq.request_id, s.num_cached, s.num_tokens) for s in out.swapped_in],
            [s.request_id for s in out.admitted], [(s.request_id, r) for s, r in out.rejected])


def _drive(cfg: SchedulerConfig, trace, num_blocks: int, block_size: int, steps: int = 300):
    """Run ``trace`` [(arrival, id, prompt, max_new, priority)] through a bare scheduler with a fake
    model (the next token is a function of the history); returns every step's signature."""
    m = BlockManager(num_blocks, block_size)
    sch = Scheduler(cfg, m)
    pending = sorted(trace)
    log, t = [], 0.0
    for _ in range(steps):
        t += 0.01
        while pending and pending[0][0] <= t:
            at, rid, prompt, max_new, prio = pending.pop(0)
            sch.add(Sequence(rid, list(prompt), len(prompt), _Params(), priority=prio, arrival_time=at,
                             max_new=max_new))
        if not sch.num_unfinished and not pending:
            break
        out = sch.schedule(t)
        log.append(_signature(out))
        _carry_out(out, sch)
    return log, sch, m


def _carry_out(out, sch) -> None:
    """What the engine does with a step (fake model: the next token is a function of the history)."""
    m = sch.manager
    for s in out.swapped_in:
        m.commit(s.seq.request_id, s.num_tokens)
    for s in out.scheduled:
        seq = s.seq
        seq.num_computed = s.start + s.num_tokens
        m.commit(seq.request_id, seq.num_computed)
        if s.samples:
            seq.tokens.append((sum(seq.tokens) * 31 + len(seq.tokens)) % 7)
            if seq.num_generated >= seq.max_new:
                sch.finish(seq)
    m.check_invariants()


def _random_case(seed: int):
    rng = random.Random(seed)
    shared = [rng.randint(0, 6) for _ in range(rng.choice([0, 4, 8, 12]))]
    trace = [(rng.uniform(0, 0.1), f"r{i}",
              (shared if rng.random() < 0.6 else []) + [rng.randint(0, 6) for _ in range(rng.randint(1, 40))],
              rng.randint(1, 12), rng.choice([0, 0, 1, 2])) for i in range(rng.randint(1, 12))]
    cfg = dict(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.choice([4, 8, 16, 33, 64]),
               chunked_prefill=rng.random() < 0.6, preemption_mode=rng.choice(["recompute", "swap"]),
               priority_preemption=rng.random() < 0.7, prefix_aware=rng.random() < 0.7,
               aging_s=rng.choice([None, 0.05, 5.0]), micro_batch_window_s=rng.choice([0.0, 0.0, 0.02]))
    return trace, cfg, rng.randint(4, 30), rng.choice([2, 4, 8])


@pytest.mark.parametrize("seed", range(60))
def test_the_package_rule_through_the_hook_gives_the_same_schedules(seed):
    """The validated path (a rule passed in, its answer checked and carried out) schedules exactly
    what the package's own does; the random traces preempt, swap, share prefixes and reject."""
    trace, cfg, nb, bs = _random_case(seed)
    own, _, _ = _drive(SchedulerConfig(**cfg), trace, nb, bs)
    hooked, sch, m = _drive(SchedulerConfig(**cfg, admission=lambda **kw: admit(**kw)), trace, nb, bs)
    assert hooked == own
    assert sch.num_unfinished == 0 and m.num_used_blocks == 0


def test_another_rule_drives_admission():
    def shortest_first(waiting, budget, scheduled_tokens, free_seqs, free_blocks, chunked_prefill):
        out, left = [], budget - scheduled_tokens
        for r in sorted(waiting, key=lambda r: r["tokens"]):
            if left <= 0 or len(out) >= free_seqs or r["blocks"] > free_blocks:
                break
            n = min(r["tokens"], left)
            out.append((r["id"], n))
            left, free_blocks = left - n, free_blocks - r["blocks"]
        return out

    trace = [(0.0, "long", list(range(1, 30)), 2, 0), (0.0, "short", [1, 2, 3], 2, 0), (0.0, "mid", [4] * 10, 2, 0)]
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=13)
    own, _, _ = _drive(SchedulerConfig(**cfg), trace, 32, 4)
    mine, sch, m = _drive(SchedulerConfig(**cfg, admission=shortest_first), trace, 32, 4)
    assert own[0][5] == ["long"]                       # the package's: first come, first served (a chunk of 13)
    assert sorted(mine[0][5]) == ["mid", "short"]      # shortest first: 3 + 10 tokens; the long prompt waits
    assert "long" in mine[1][5]
    assert sch.num_unfinished == 0 and m.num_used_blocks == 0


def _scheduler_with_waiting(rule, **cfg):
    m = BlockManager(16, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, admission=rule, **cfg), m)
    for i, n in enumerate((6, 5)):
        sch.add(Sequence(f"r{i}", list(range(1, n + 1)), n, _Params(), max_new=4))
    return sch, m


@pytest.mark.parametrize("rule, words", [
    (lambda **kw: [("nobody", 1)], "'nobody' is not a waiting request"),
    (lambda **kw: [("r0", 6), ("r1", 5)] * 1 + [("r0", 1)], "r0 is admitted twice"),
    (lambda **kw: [(w["id"], w["tokens"] + 20) for w in kw["waiting"]], "r0 computes 26 tokens"),
    (lambda **kw: [("r0", 6), ("r1", 5)], None),       # valid: no error
    (lambda **kw: {"r0": 6}, "a list of (request id, tokens) pairs"),
    (lambda **kw: 1 / 0, "it raised ZeroDivisionError: division by zero"),
])
def test_a_bad_answer_is_one_line_naming_the_rule_and_loses_nothing(rule, words):
    sch, m = _scheduler_with_waiting(rule)
    if words is None:
        out = sch.schedule(0.0)
        assert [s.request_id for s in out.admitted] == ["r0", "r1"]
        return
    with pytest.raises(WorkbenchError) as e:
        sch.schedule(0.0)
    msg = str(e.value)
    assert words in msg and "SchedulerConfig.admission at step 1" in msg and "\n" not in msg, msg
    assert [s.request_id for s in sch.waiting] == ["r0", "r1"] and not sch.running
    assert m.num_used_blocks == 0 and sch.step_no == 0
    sch.config.admission = None                        # the package's rule takes over: nothing was lost
    out = sch.schedule(0.0)
    assert out.step == 1 and [s.request_id for s in out.admitted] == ["r0", "r1"]


def test_over_the_blocks_and_over_the_budget_are_refused():
    sch, m = _scheduler_with_waiting(lambda **kw: [("r0", 6), ("r1", 5)])
    sch.manager = m = BlockManager(3, 4)               # r0 needs 2 blocks, r1 2: 3 in the pool
    sch.config.max_num_batched_tokens = 16
    with pytest.raises(WorkbenchError, match="r1 needs 2 KV blocks, 1 is free after r0 took theirs"):
        sch.schedule(0.0)
    sch, m = _scheduler_with_waiting(lambda **kw: [("r0", 6), ("r1", 5)])
    sch.config.max_num_batched_tokens = 8
    with pytest.raises(WorkbenchError, match=r"the step computes 11 tokens .* over the budget of 8"):
        sch.schedule(0.0)
    assert len(sch.waiting) == 2 and m.num_used_blocks == 0


def test_a_bad_answer_after_other_decisions_is_raised_by_the_next_step():
    """A step that already preempted a request (the engine must learn of it) goes on without the
    rule's admissions; the next schedule() raises, before it changes anything."""
    m = BlockManager(4, 2)
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), m)
    for rid in ("a", "b"):
        sch.add(Sequence(rid, [1, 2, 3], 3, _Params(), max_new=4))
    out = sch.schedule(0.0)
    assert [s.request_id for s in out.admitted] == ["a", "b"]
    sch.config.admission = lambda **kw: [("ghost", 1)]
    for t in range(1, 10):                             # until the full pool preempts one of them
        _carry_out(out, sch)
        out = sch.schedule(float(t))
        if out.preempted:
            break
    assert [s.request_id for s in out.preempted] == ["b"] and not out.admitted
    assert [s.seq.request_id for s in out.scheduled] == ["a"]      # the step goes on
    _carry_out(out, sch)
    step = sch.step_no
    with pytest.raises(WorkbenchError, match=f"SchedulerConfig.admission at step {step}: 'ghost' is not a waiting"):
        sch.schedule(10.0)
    assert sch.step_no == step and [s.request_id for s in sch.waiting] == ["b"]
    assert m.num_used_blocks == len(m.block_table("a"))            # only a's blocks are held
    sch.config.admission = None                        # the package's rule: everything drains, nothing lost
    for t in range(11, 40):
        out = sch.schedule(float(t))
        _carry_out(out, sch)
        if not sch.num_unfinished:
            break
    assert not sch.num_unfinished and m.num_used_blocks == 0


def test_the_rule_gets_copies_and_requests_that_never_fit_are_not_shown():
    seen = []

    def rule(waiting, **kw):
        seen.append([dict(w) for w in waiting])
        for w in waiting:
            w["tokens"] = 0                            # scribbling on its input changes nothing
        return admit(waiting=seen[-1], **kw)

    m = BlockManager(4, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, admission=rule), m)
    sch.add(Sequence("big", list(range(1, 30)), 29, _Params(), max_new=4))
    sch.add(Sequence("small", [1, 2, 3], 3, _Params(), max_new=2))
    out = sch.schedule(0.0)
    assert [w["id"] for w in seen[0]] == ["small"]
    assert seen[0][0] == {"id": "small", "priority": 0, "cached": 0, "arrival": 2, "tokens": 3, "blocks": 1}
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("small", 3)]


@pytest.mark.parametrize("bad", [42, lambda waiting: [], lambda a, b, c: []])
def test_the_config_refuses_what_cannot_be_a_rule(bad):
    with pytest.raises(ConfigError, match="SchedulerConfig.admission"):
        SchedulerConfig(admission=bad)


def test_a_rule_drives_a_live_engine(random_llm):
    """Through LLMEngine: the same greedy tokens as the package's rule, every block back."""
    from workbench.engine import LLMEngine

    calls = []

    def rule(**kw):
        calls.append(len(kw["waiting"]))
        return admit(**kw)

    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(10, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for name, adm in (("own", None), ("rule", rule)):
        eng = LLMEngine(random_llm, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                              admission=adm))
        outs[name] = [o.token_ids for o in eng.generate(prompts, params)]
        assert eng.pool.manager.num_used_blocks == 0
        assert all(s.status is SeqStatus.FINISHED for s in eng.seqs.values()) or not eng.seqs
    assert outs["rule"] == outs["own"] and calls

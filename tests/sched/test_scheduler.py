"""Scheduler invariants under random traces (hypothesis), with a fake model runner.

The fake runner keeps a fake KV memory: every slot remembers which token, at which position,
after which prefix, was written there.  Before computing a chunk it checks that every earlier
position of the sequence reads back exactly its own history through the block table, so a
scheduling bug (a freed block reused while still needed, a wrong prefix hit, a botched swap)
fails loudly.  Its "model" picks the next token as a function of the whole history, so a
request's output is fixed by its prompt: any schedule must reproduce it.

Invariants checked after every step: block-manager bookkeeping; every request is in exactly
one place; after the trace drains: every request ended (output, abort or rejection with a
reason), no block is used, no swap space is left, and completed outputs equal the
request-alone outputs.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import SamplingParams
from workbench.kv.paged import PagedKVConfig
from workbench.sched import SchedulerConfig, SeqStatus
from workbench.engine import LLMEngine

VOCAB = 11


def next_token(history: list[int]) -> int:
    h = hashlib.blake2b(bytes(t % 256 for t in history), digest_size=2).digest()
    return int.from_bytes(h, "little") % VOCAB


class FakeRunner:
    def __init__(self, manager) -> None:
        self.m = manager
        self.mem: dict[int, tuple] = {}
        self.swap_space: dict[str, list] = {}
        self.steps = 0

    def _slot(self, table, p):
        B = self.m.block_size
        return table[p // B] * B + p % B

    def _record(self, seq, p):
        return (seq.tokens[p], p, hash(tuple(seq.tokens[:p + 1])))

    def execute(self, scheduled):
        self.steps += 1
        rows = []
        for s in scheduled:
            seq, table = s.seq, self.m.block_table(s.seq.request_id)
            for p in range(s.start):   # the context must read back as this sequence's history
                got = self.mem.get(self._slot(table, p))
                assert got == self._record(seq, p), f"{seq.request_id} position {p}: {got} != {self._record(seq, p)}"
            for p in range(s.start, s.start + s.num_tokens):
                self.mem[self._slot(table, p)] = self._record(seq, p)
            if s.samples:
                row = torch.full((VOCAB,), -1.0)
                row[next_token(seq.tokens)] = 1.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)

    def swap_out(self, s):
        self.swap_space[s.seq.request_id] = [self.mem[self._slot(s.block_table, p)] for p in range(s.num_tokens)]

    def swap_in(self, s):
        saved = self.swap_space.pop(s.seq.request_id)
        table = self.m.block_table(s.seq.request_id)
        for p in range(s.num_cached, s.num_tokens):
            self.mem[self._slot(table, p)] = saved[p]

    def drop_swap(self, request_id):
        self.swap_space.pop(request_id, None)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_engine(random_llm, sched: SchedulerConfig, block_size: int, num_blocks: int, caching: bool):
    clock = FakeClock()
    eng = LLMEngine(random_llm, scheduler=sched, clock=clock,
                    kv=PagedKVConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
                    runner=lambda pool: FakeRunner(pool.manager))   # made for the engine's pool
    return eng, clock


def alone_output(prompt: list[int], max_new: int) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(max_new):
        t = next_token(toks)
        out.append(t)
        toks.append(t)
    return out


def check_places(eng) -> None:
    sch = eng.scheduler
    places = [s.request_id for s in sch.waiting + sch.running + sch.swapped]
    assert len(places) == len(set(places)), "a request is in two queues"
    for rid, seq in eng.seqs.items():
        assert (rid in places) != seq.finished, f"{rid}: status {seq.status} vs queues"
        if seq.status is SeqStatus.RUNNING:
            assert rid in eng.pool.manager
    eng.pool.manager.check_invariants()


request = st.tuples(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24),   # prompt
                    st.integers(1, 8),                                               # max_tokens
                    st.integers(0, 2),                                               # priority
                    st.integers(0, 3))                                               # arrival step
trace = st.fixed_dictionaries({
    "requests": st.lists(request, min_size=1, max_size=10),
    "aborts": st.lists(st.tuples(st.integers(0, 9), st.integers(0, 12)), max_size=3),   # (request idx, step)
    "block_size": st.integers(1, 4),
    "extra_blocks": st.integers(0, 12),
    "max_num_seqs": st.integers(1, 5),
    "budget": st.integers(1, 24),
    "chunked": st.booleans(),
    "mode": st.sampled_from(["recompute", "swap"]),
    "window": st.sampled_from([0.0, 1.5]),
    "caching": st.booleans(),
    "prefix_aware": st.booleans(),
    "queue": st.integers(2, 12),
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=trace)
def test_random_traces_keep_every_invariant(random_llm, t):
    B = t["block_size"]
    longest = max(len(p) + n for p, n, _, _ in t["requests"])
    num_blocks = -(-longest // B) + t["extra_blocks"]           # the longest request fits alone
    sched = SchedulerConfig(max_num_seqs=t["max_num_seqs"], max_num_batched_tokens=t["budget"],
                            chunked_prefill=t["chunked"], preemption_mode=t["mode"],
                            micro_batch_window_s=t["window"], prefix_aware=t["prefix_aware"],
                            max_queue_len=t["queue"], aging_s=4.0)
    eng, clock = make_engine(random_llm, sched, B, num_blocks, t["caching"])
    ids: dict[int, str] = {}
    ends: dict[str, object] = {}
    for step in range(400):
        for i, (prompt, n, prio, at) in enumerate(t["requests"]):
            if at == step:
                ids[i] = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                         priority=prio)
        for i, at in t["aborts"]:
            if at == step and i in ids:
                eng.abort(ids[i])
        for ev in eng.step():
            if ev.finished:
                assert ev.request_id not in ends, "a request finished twice"
                ends[ev.request_id] = ev
        check_places(eng)
        clock.t += 1.0
        if step > 3 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished(), f"not drained after 400 steps: {eng.stats()}"
    assert set(ends) == set(ids.values()), "a request never ended"
    assert eng.pool.manager.num_used_blocks == 0 and not eng.runner.swap_space
    for i, rid in ids.items():
        prompt, n = t["requests"][i][:2]
        ev, out = ends[rid], eng.get_output(rid)
        assert ev.finish_reason in ("length", "abort", "rejected"), ev
        if ev.finish_reason == "length":
            assert out.token_ids == alone_output(prompt, n), f"{rid}: schedule changed the output"
        else:
            assert ev.error, f"{rid} ended with {ev.finish_reason} but no reason"


def test_aging_bounds_starvation(random_llm):
    """The stated bound: with aging (+1 per whole aging_s waited), a request waiting since t
    is admitted before any request of base priority p' > p that arrives after
    t + (p' - p) x aging_s: from then on the newcomer's aged priority is at most the old
    request's, and a tie goes to the earlier arrival (with prefix-aware ordering a tie goes to
    the longer cached prefix first, which loosens the bound by one aging_s).  Requests that
    arrived before t + (p' - p - 1) x aging_s stay strictly above it and go first.  Under a
    stream of high-priority arrivals, one per step, the low-priority request is therefore
    admitted after (part of) the backlog of earlier high arrivals, never later: no starvation."""
    aging, gap = 10.0, 2
    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, aging_s=aging)
    eng, clock = make_engine(random_llm, sched, 4, 64, False)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    low = eng.add_request([1, 2, 3], p, priority=0)
    arrivals, admitted = {}, []
    for step in range(400):
        rid = eng.add_request([5, 6, step % 7 + 1], p, priority=gap)
        arrivals[rid] = clock.t
        running_before = {s.request_id for s in eng.scheduler.running}
        eng.step()
        admitted += [s.request_id for s in eng.scheduler.running if s.request_id not in running_before]
        clock.t += 1.0
        if eng.seqs[low].finished:
            break
    assert low in admitted, "the low-priority request starved"
    before_low = admitted[:admitted.index(low)]
    assert all(arrivals[r] <= gap * aging for r in before_low), \
        [arrivals[r] for r in before_low if arrivals[r] > gap * aging]
    assert len(before_low) >= (gap - 1) * aging      # the high-priority backlog did go first
    assert eng.seqs[low].output.finish_reason == "length"


def test_higher_priority_arrival_preempts_when_the_pool_is_full(random_llm):
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, aging_s=None)
    eng, clock = make_engine(random_llm, sched, 2, 6, False)     # 12 slots
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    low = eng.add_request(list(range(1, 8)), p, priority=0)      # 7 + 4 tokens: most of the pool
    eng.step()
    high = eng.add_request(list(range(1, 6)), p, priority=5)
    eng.step()
    assert eng.seqs[low].num_preemptions == 1 and eng.seqs[high].status is SeqStatus.RUNNING
    while eng.has_unfinished():
        eng.step()
        clock.t += 1
    for rid, prompt in ((low, list(range(1, 8))), (high, list(range(1, 6)))):
        assert eng.get_output(rid).token_ids == alone_output(prompt, 4)


def test_custom_runner_is_a_runner_or_a_callable_taking_the_pool(random_llm):
    from workbench.errors import ConfigError

    kv = PagedKVConfig(block_size=2, num_blocks=8)
    fake = FakeRunner(None)
    assert LLMEngine(random_llm, kv=kv, runner=fake).runner is fake
    eng = LLMEngine(random_llm, kv=kv, runner=lambda pool: FakeRunner(pool.manager))
    assert isinstance(eng.runner, FakeRunner) and eng.runner.m is eng.pool.manager
    for bad in (object(), lambda pool: None):
        with pytest.raises(ConfigError, match="runner= must be a runner"):
            LLMEngine(random_llm, kv=kv, runner=bad)


def test_queue_limit_and_never_fitting_prompts_are_rejected_with_reasons(random_llm):
    eng, _ = make_engine(random_llm, SchedulerConfig(max_queue_len=1), 2, 3, False)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    a = eng.add_request([1, 2], p)
    b = eng.add_request([3, 4], p)                              # queue full
    c_too_long = None
    evs = eng.step()
    rej = {e.request_id: e for e in evs if e.finish_reason == "rejected"}
    assert b in rej and "queue full" in rej[b].error
    c_too_long = eng.add_request(list(range(1, 9)), p)          # 8 tokens > 3 blocks x 2
    evs = [e for _ in range(10) for e in eng.step()]
    rej = {e.request_id: e for e in evs if e.finish_reason == "rejected"}
    assert c_too_long in rej and "KV blocks" in rej[c_too_long].error
    assert eng.get_output(a).finish_reason == "length"


@pytest.mark.parametrize("window", [0.0, 3.0])
def test_micro_batch_window_holds_admission(random_llm, window):
    eng, clock = make_engine(random_llm, SchedulerConfig(micro_batch_window_s=window), 4, 32, False)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request([1, 2, 3], p)
    first_step = eng.step()
    assert bool(eng.scheduler.running) == (window == 0.0)
    clock.t += window
    eng.step()
    assert eng.scheduler.running or first_step


# ---- regressions: pure scheduler over a BlockManager (the test plays the model) ----------------

from workbench.kv.block_manager import BlockManager  # noqa: E402
from workbench.sched.scheduler import Scheduler, SchedulerOutput  # noqa: E402
from workbench.sched.sequence import Sequence  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def seq(rid, tokens, priority=0, arrival=0.0, max_new=1):
    return Sequence(rid, list(tokens), len(tokens), GREEDY, priority=priority, arrival_time=arrival, max_new=max_new)


def computed(m, out):
    """Pretend the forward ran: the scheduled chunks' KV is written."""
    for s in out.scheduled:
        s.seq.num_computed = s.start + s.num_tokens
        m.commit(s.seq.request_id, s.seq.num_computed)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_request_that_can_never_fit_the_pool_ends_with_a_reason(random_llm, mode):
    """5 prompt + 10 new tokens need 4 blocks of 4; the pool has 2: rejected at admission
    (swap mode used to swap it out for good and block every later request)."""
    eng = LLMEngine(random_llm, kv=PagedKVConfig(block_size=4, num_blocks=2),
                    scheduler=SchedulerConfig(preemption_mode=mode))
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    big = eng.add_request([5, 6, 7, 8, 9], p)
    small = eng.add_request([5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(20):
        eng.step()
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    out = eng.get_output(big)
    assert out.finish_reason == "rejected" and "KV pool" in out.error and "4 KV blocks" in out.error
    assert eng.get_output(small).finish_reason == "length"
    assert eng.pool.manager.num_used_blocks == 0 and not eng.runner.swap_space


def test_swapped_sequence_that_outgrew_the_pool_is_ended_not_kept():
    m = BlockManager(2, 4)
    sch = Scheduler(SchedulerConfig(preemption_mode="swap", aging_s=None), m)
    a = seq("a", [5, 6, 7, 8, 9])
    sch.add(a)
    computed(m, sch.schedule(0.0))
    a.tokens += [1, 2, 3, 4]                  # grew past the 8 slots (more than its max_new said)
    out = sch.schedule(1.0)
    assert [s.seq for s in out.swapped_out] == [a] and a in sch.swapped
    b = seq("b", [1, 2])
    sch.add(b)
    out = sch.schedule(2.0)
    assert [(s.request_id, "KV pool" in r) for s, r in out.rejected] == [("a", True)]
    assert out.admitted == [b] and not sch.swapped and not sch.swap_sizes and a.finished


def test_prefix_aware_order_survives_aging():
    for aging in (5.0, None):
        m = BlockManager(64, 4)
        shared = list(range(100, 116))
        m.allocate("warm", shared + [1])
        m.commit("warm", 17)
        m.free("warm")
        sch = Scheduler(SchedulerConfig(max_num_seqs=1, aging_s=aging, prefix_aware=True), m)
        a = seq("no-cache", range(200, 217), arrival=0.000)
        b = seq("cached", shared + [7], arrival=0.001)
        sch.add(a)
        sch.add(b)
        assert sch.schedule(0.002).admitted == [b], aging


@pytest.mark.parametrize("high_at", [1.0, 6.0, 60.0])
def test_running_time_does_not_age(high_at):
    """A low-priority request admitted at once never waited: a higher-priority arrival preempts
    it however long it has been running."""
    m = BlockManager(64, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=1, aging_s=5.0), m)
    low = seq("low", [1, 2, 3], priority=0, arrival=0.0)
    sch.add(low)
    computed(m, sch.schedule(0.0))
    assert sch.effective_priority(low, high_at) == 0
    high = seq("high", [4, 5, 6], priority=1, arrival=high_at)
    sch.add(high)
    out = sch.schedule(high_at)
    assert out.preempted == [low] and out.admitted == [high]
    assert sch.effective_priority(low, high_at + 5.0) == 1     # waiting again: aging again


def test_aged_admission_is_not_undone_by_the_requests_it_overtook():
    """Waiting credit stays with a running request: one admitted on its aged priority is not
    preempted by a younger request of higher base priority (no admit/preempt churn)."""
    m = BlockManager(64, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=1, aging_s=5.0), m)
    blocker = seq("blocker", [9, 9], priority=5)
    sch.add(blocker)
    computed(m, sch.schedule(0.0))
    low = seq("low", [1, 2, 3], priority=0, arrival=0.0)
    sch.add(low)
    sch.schedule(1.0)
    sch.finish(blocker)
    out = sch.schedule(11.0)                                   # waited 11 s: aged priority 2
    assert out.admitted == [low] and sch.effective_priority(low, 30.0) == 2
    computed(m, out)
    for t in (11.0, 12.0, 14.0):                              # the newcomers waited < 5 s
        sch.add(seq(f"high-{t}", [4, 5, 6], priority=2, arrival=t))
        out = sch.schedule(t)
        assert not out.preempted and low in sch.running


def test_never_fitting_priority_request_preempts_nothing():
    m = BlockManager(4, 4)                                     # 16 slots
    sch = Scheduler(SchedulerConfig(max_num_seqs=1), m)
    low = seq("low", [1, 2, 3])
    sch.add(low)
    computed(m, sch.schedule(0.0))
    huge = seq("huge", range(40), priority=5, arrival=0.1)     # 10 blocks
    sch.add(huge)
    out = sch.schedule(0.1)
    assert [s.request_id for s, _ in out.rejected] == ["huge"] and not out.preempted
    assert sch.running == [low] and low.num_computed == 3 and low.num_preemptions == 0
    # prompt alone fits, prompt + max_new does not: rejected before preempting too
    longer = seq("longer", range(12), priority=5, arrival=0.2, max_new=8)
    sch.add(longer)
    out = sch.schedule(0.2)
    assert [s.request_id for s, _ in out.rejected] == ["longer"] and not out.preempted


def test_priority_admission_preempts_only_when_that_makes_room():
    m = BlockManager(4, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, aging_s=None), m)
    vip = seq("vip", range(100, 108), priority=9)                # 2 blocks, not preemptible by 5
    low = seq("low", [1, 2, 3], priority=0)                      # 1 block
    sch.add(vip)
    sch.add(low)
    computed(m, sch.schedule(0.0))
    high = seq("high", range(200, 216), priority=5, arrival=0.1)  # needs all 4 blocks
    sch.add(high)
    for t in (0.1, 0.2, 0.3):
        out = sch.schedule(t)
        assert not out.preempted and not out.admitted and low in sch.running
    # room that preempting low does make: mid takes 2 blocks
    sch.finish(high)
    mid = seq("mid", range(300, 306), priority=5, arrival=0.4)
    sch.add(mid)
    out = sch.schedule(0.4)
    assert out.preempted == [low] and out.admitted == [mid]


def test_swap_in_does_not_recompute_into_shared_prefix_blocks():
    m = BlockManager(16, 4)
    sch = Scheduler(SchedulerConfig(preemption_mode="swap", max_num_batched_tokens=16, aging_s=None), m)
    prompt = list(range(100, 112))
    b = seq("B", prompt + [7], arrival=0.0)
    a = seq("A", prompt, arrival=0.1)
    sch.add(b)
    sch.add(a)
    computed(m, sch.schedule(0.0))                             # B whole, A its first 3 tokens
    assert a.num_computed == 3
    sch._preempt(a, SchedulerOutput(0, 0.0))                   # swapped out mid-prefill
    out = sch.schedule(1.0)
    (si,) = out.swapped_in
    assert (si.num_cached, si.num_tokens) == (3, 3)            # nothing to restore
    (chunk,) = [s for s in out.scheduled if s.seq is a]
    assert chunk.start == 8                                    # the 8 cached prefix tokens are not recomputed
    written = {x // 4 for x in m.slot_mapping("A", chunk.start, chunk.start + chunk.num_tokens)}
    assert all(m.blocks[blk].ref_count == 1 for blk in written)

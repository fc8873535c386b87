"""BlockManager: unit tests, then a hypothesis state machine over random operation sequences.

The state machine keeps a fake KV memory (slot -> the token prefix whose key lives there) and
checks, after every step, that every committed position of every sequence reads back exactly
its own prefix: prefix hits, copy-on-write and eviction can never hand a sequence wrong KV.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workbench.errors import WorkbenchError
from workbench.model.config import ModelConfig
from workbench.errors import ConfigError
from workbench.kv import AllocStatus, BlockManager, KVLayout, MissReason


def snapshot(bm: BlockManager):
    return (bm.block_states(), [b.ref_count for b in bm.blocks], {s: bm.block_table(s) for s in bm._seqs},
            {s: bm.num_tokens(s) for s in bm._seqs}, bm.num_free_blocks, bm.num_cached_blocks)


# ---- unit tests ---------------------------------------------------------------------------------
def test_allocate_table_and_slot_mapping():
    bm = BlockManager(8, 4)
    a = bm.allocate("a", list(range(10)))
    assert len(a.block_table) == 3 and a.num_cached_tokens == 0 and a.prompt_tokens == 10
    assert a.miss_reason is MissReason.NO_SHARED_PREFIX and a.cacheable_tokens == 8
    t = bm.block_table("a")
    assert bm.slot_mapping("a", 0, 10) == [t[p // 4] * 4 + p % 4 for p in range(10)]
    assert bm.slot_mapping("a", 5, 7) == [t[1] * 4 + 1, t[1] * 4 + 2]
    assert bm.slot_mapping("a", 3, 3) == []
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.num_cached_blocks) == (5, 3, 0)
    assert bm.block_states().count("owned") == 3
    bm.check_invariants()


def test_append_across_block_boundary():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    bm.allocate("a", [1, 2, 3])               # blocks: [1 2] [3 _]
    t0 = bm.block_table("a")
    assert bm.append_slot("a", 4) == t0[1] * 2 + 1   # fills the second block, no new one
    assert bm.block_table("a") == t0 and bm.num_free_blocks == 2
    slot = bm.append_slot("a", 5)             # position 4: opens a third block
    t1 = bm.block_table("a")
    assert len(t1) == 3 and slot == t1[2] * 2 and bm.num_free_blocks == 1
    assert bm.slot_mapping("a", 0, 5)[-1] == slot and bm.num_tokens("a") == 5
    assert bm.take_copies() == []
    bm.check_invariants()


def test_fork_and_copy_on_write():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])      # [1 2 3 4] [5 6 _ _]
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p")
    assert bm.block_states().count("shared") == 2
    bm.check_invariants()
    last = bm.block_table("p")[1]
    slot = bm.append_slot("c", 7)             # shared partial block: the child copies it
    new = bm.block_table("c")[1]
    assert new != last and slot == new * 4 + 2
    assert bm.take_copies() == [(last, new)] and bm.take_copies() == []
    assert bm.block_table("c")[0] == bm.block_table("p")[0]   # the full block stays shared
    assert bm.blocks[last].ref_count == 1 and bm.stats.cow_copies == 1
    assert bm.append_slot("p", 9) == last * 4 + 2   # now the parent's own: written in place
    assert bm.take_copies() == []
    bm.check_invariants()
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_free_returns_blocks():
    for caching, cached in ((False, 0), (True, 2)):
        bm = BlockManager(8, 4, enable_prefix_caching=caching)
        bm.allocate("a", list(range(10)))
        bm.commit("a", 10)
        bm.free("a")
        assert bm.num_cached_blocks == cached and bm.num_free_blocks == 8 - cached and bm.num_used_blocks == 0
        bm.check_invariants()
        with pytest.raises(WorkbenchError, match="unknown sequence"):
            bm.free("a")


def test_uncommitted_blocks_are_not_cached():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(10)))
    bm.commit("a", 5)                         # only block 0 is written
    bm.free("a")
    assert bm.num_cached_blocks == 1
    bm.check_invariants()


def test_never_versus_later():
    bm = BlockManager(4, 4)
    assert bm.can_allocate(16) is AllocStatus.OK
    assert bm.can_allocate(17) is AllocStatus.NEVER
    assert bm.allocate("big", list(range(17))) is None and "big" not in bm
    bm.allocate("a", list(range(12)))
    assert bm.can_allocate(5) is AllocStatus.LATER and bm.can_allocate(4) is AllocStatus.OK
    assert bm.allocate("b", list(range(5))) is None
    bm.check_invariants()


def test_no_space_never_corrupts_state():
    bm = BlockManager(3, 2)
    bm.allocate("a", [1, 2, 3, 4])
    bm.allocate("b", [5, 6])
    before = snapshot(bm)
    assert bm.allocate("c", [7, 8, 9]) is None
    assert not bm.can_append("a") and bm.append_slot("a", 9) is None
    assert snapshot(bm) == before and "c" not in bm
    bm.check_invariants()
    bm.free("b")
    assert bm.append_slot("a", 9) is not None
    bm.check_invariants()


def test_misuse_raises():
    with pytest.raises(WorkbenchError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(WorkbenchError, match="block_size"):
        BlockManager(4, 0)
    with pytest.raises(WorkbenchError, match="eviction"):
        BlockManager(4, 4, eviction="random")
    bm = BlockManager(4, 4)
    bm.allocate("a", [1, 2])
    with pytest.raises(WorkbenchError, match="already allocated"):
        bm.allocate("a", [1, 2])
    with pytest.raises(WorkbenchError, match="empty prompt"):
        bm.allocate("b", [])
    with pytest.raises(WorkbenchError, match="cannot commit 3"):
        bm.commit("a", 3)
    with pytest.raises(WorkbenchError, match="outside"):
        bm.slot_mapping("a", 0, 3)
    with pytest.raises(WorkbenchError, match="already allocated"):
        bm.fork("a", "a")
    with pytest.raises(WorkbenchError, match="token ids must be integers"):
        bm.allocate("f", [1.5, 2])
    with pytest.raises(WorkbenchError, match="token ids must be integers"):
        bm.append_slot("a", "x")
    with pytest.raises(WorkbenchError, match="unknown sequence 'zz'"):
        bm.append_slot("zz", 1)
    bm.check_invariants()


def test_full_prompt_hit_still_computes_the_last_token():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(8)))
    bm.commit("a", 8)
    bm.free("a")
    b = bm.allocate("b", list(range(8)))     # both blocks cached, but the last holds the final token
    assert b.num_cached_tokens == 4 and b.miss_reason is None
    c = bm.allocate("c", list(range(9)))
    assert c.num_cached_tokens == 8 and c.miss_reason is None
    assert c.block_table[:2] == bm.block_table("b")[:1] + [c.block_table[1]]
    assert bm.block_states().count("shared") == 1
    bm.check_invariants()


def test_can_allocate_counts_hits():
    bm = BlockManager(3, 2)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", 5)
    bm.free("a")                               # 2 cached, 1 free
    bm.allocate("x", [9])                      # takes the free one
    prompt = [1, 2, 3, 4, 6]
    assert bm.can_allocate(5) is AllocStatus.LATER          # 3 blocks, 2 available
    assert bm.can_allocate(5, prompt) is AllocStatus.LATER  # 2 hits need 1 more: none left
    bm.free("x")
    assert bm.can_allocate(5, prompt) is AllocStatus.OK
    assert bm.allocate("b", prompt).num_cached_tokens == 4 and bm.stats.evictions == 0
    bm.check_invariants()


def test_commit_is_monotonic_and_registers_generated_blocks():
    bm = BlockManager(8, 2)
    bm.allocate("a", [1, 2, 3])
    bm.commit("a", 3)
    for t in (4, 5):
        bm.append_slot("a", t)
    bm.commit("a", 5)
    bm.commit("a", 2)                           # no-op: already further
    assert bm.num_committed("a") == 5
    bm.free("a")
    assert bm.num_cached_blocks == 2           # [1 2] [3 4]; [5] is partial
    b = bm.allocate("b", [1, 2, 3, 4, 9])       # a follow-up turn reuses the generated block too
    assert b.num_cached_tokens == 4
    bm.check_invariants()


def test_kv_layout_bytes():
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 -> 128 KiB per token, 2 MiB per 16-token block
    cfg = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)
    lay = KVLayout.from_model_config(cfg, 16, "bfloat16")
    assert lay == KVLayout(32, 8, 128, 16, 2)
    assert lay.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert lay.bytes_per_block_per_layer == 2 * 16 * 8 * 128 * 2 == 64 * 1024
    assert lay.bytes_per_block == 32 * lay.bytes_per_block_per_layer == 16 * lay.bytes_per_token
    assert lay.num_blocks_for_bytes(16 * 2**30) == 8192 and lay.num_blocks_for_bytes(2**21 - 1) == 0
    assert lay.bytes_for_tokens(17) == 2 * lay.bytes_per_block
    assert cfg.kv_bytes_per_token(2) == lay.bytes_per_token
    torch = pytest.importorskip("torch")
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2), ("fp8", 1), ("torch.float64", 8)):
        assert KVLayout.from_model_config(cfg, 16, dtype).dtype_bytes == size
    with pytest.raises(ConfigError, match="dtype 'complex7' is unknown"):
        KVLayout.from_model_config(cfg, 16, "complex7")
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        KVLayout(32, 8, 128, 0, 2)


# ---- property-based: random operation sequences -------------------------------------------------
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)   # small alphabet: prefixes collide


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 16), block_size=st.integers(1, 4),
                caching=st.sampled_from([True, True, True, False]),
                eviction=st.sampled_from(["lru", "fifo", "policy"]),
                constant_hash=st.sampled_from([False, False, False, True]))
    def setup(self, num_blocks, block_size, caching, eviction, constant_hash):
        if eviction == "policy":   # a function chooses (BlockManager(eviction=choose_victim)): a leaf, most hits
            eviction = self._leaf_most_hits
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, eviction=eviction)
        if constant_hash:  # every block collides: hits must still be verified, never wrong
            self.bm.prefix_cache.hash_fn = lambda parent, tokens: 0
        self.B = block_size
        self.memory: dict[int, tuple] = {}  # slot -> the prefix whose KV was written there
        self.tokens: dict[str, list[int]] = {}
        self.history: list[list[int]] = []   # every sequence's tokens when freed: re-requested for hits
        self.next_id = 0

    def _leaf_most_hits(self, candidates):
        """A policy unlike LRU and FIFO; checks that every candidate is a cached block first."""
        states = self.bm.block_states()
        assert candidates and all(states[c.block_id] == "cached" for c in candidates)
        ids = {c.block_id for c in candidates}
        assert all(c.children == sum(k.parent == c.block_id for k in candidates) for c in candidates)
        # a parent that is no candidate is held: by a sequence, or as a hit of the prompt being admitted
        assert all(c.parent is None or c.parent in ids or states[c.parent] != "free" for c in candidates)
        return max((c for c in candidates if c.children == 0), key=lambda c: (c.hits, c.block_id)).block_id

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _allocate(self, prompt, prefill):
        bm, sid = self.bm, self._new_id()
        status, before = bm.can_allocate(len(prompt), prompt), snapshot(bm)
        a = bm.allocate(sid, prompt)
        if a is None:
            assert status is not AllocStatus.OK, "can_allocate said OK but allocate failed"
            assert snapshot(bm) == before
            return
        assert status is AllocStatus.OK
        assert a.num_cached_tokens % self.B == 0 and a.num_cached_tokens < len(prompt)
        assert a.num_cached_tokens <= a.cacheable_tokens
        assert (a.miss_reason is MissReason.DISABLED) == (not bm.enable_prefix_caching)
        for j in range(a.num_cached_tokens // self.B):   # token equality of every hit block
            assert bm.blocks[a.block_table[j]].tokens == tuple(prompt[j * self.B:(j + 1) * self.B])
        self.tokens[sid] = list(prompt)
        if prefill:  # as an engine does: compute the uncached part of the prompt right away
            self._write_and_commit(sid, len(prompt))

    @rule(prompt=TOKENS, prefill=st.booleans())
    def allocate(self, prompt, prefill):
        self._allocate(prompt, prefill)

    @precondition(lambda self: self.tokens or self.history)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=6), prefill=st.booleans())
    def allocate_extending(self, data, suffix, prefill):
        """A prompt that starts like a live or freed sequence: the likeliest source of hits."""
        base = data.draw(st.sampled_from([t for _, t in sorted(self.tokens.items())] + self.history))
        cut = data.draw(st.integers(1, len(base)))
        self._allocate(base[:cut] + suffix, prefill)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        bm, sid = self.bm, data.draw(st.sampled_from(sorted(self.tokens)))
        before, could = snapshot(bm), bm.can_append(sid)
        slot = bm.append_slot(sid, token)
        if slot is None:
            assert not could and snapshot(bm) == before
            return
        pos = len(self.tokens[sid])
        self.tokens[sid].append(token)
        assert slot == bm.block_table(sid)[pos // self.B] * self.B + pos % self.B
        for src, dst in bm.take_copies():   # perform the copy-on-write as a caller would
            assert bm.blocks[dst].ref_count == 1 and dst in bm.block_table(sid)
            for o in range(self.B):
                if src * self.B + o in self.memory:
                    self.memory[dst * self.B + o] = self.memory[src * self.B + o]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.bm.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data):
        """Write the KV of positions [committed, n) into the fake memory, then commit."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._write_and_commit(sid, data.draw(st.integers(self.bm.num_committed(sid), len(self.tokens[sid]))))

    def _write_and_commit(self, sid, n):
        bm, toks, done = self.bm, self.tokens[sid], self.bm.num_committed(sid)
        for pos, slot in enumerate(bm.slot_mapping(sid, done, n), start=done):
            self.memory[slot] = tuple(toks[:pos + 1])
        bm.commit(sid, n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(sid)
        self.history = (self.history + [self.tokens.pop(sid)])[-8:]

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        assert bm.num_free_blocks + bm.num_used_blocks + bm.num_cached_blocks == bm.num_blocks
        assert all(b.ref_count >= 0 for b in bm.blocks)
        for sid, toks in self.tokens.items():   # every committed position holds its own prefix's KV
            assert bm.num_tokens(sid) == len(toks)
            for pos, slot in enumerate(bm.slot_mapping(sid, 0, bm.num_committed(sid))):
                assert self.memory.get(slot) == tuple(toks[:pos + 1]), f"{sid} reads wrong KV at {pos}"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for sid in list(self.tokens):
            self.bm.free(sid)
        self.bm.check_invariants()
        assert self.bm.num_used_blocks == 0
        assert set(self.bm.block_states()) <= {"free", "cached"}, "a block leaked"


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase

"""The offload tier over the prefetch layer: disk blocks really go through the disk transport,
staged (prefetched) reads are hits, unstaged ones are demand fetches, tokens are verified on
every read, and the staging buffers stay bounded."""

from __future__ import annotations

import os

import pytest
import torch

from workbench.kv.offload import DiskOffload, HostOffload

SHAPE = (2, 2, 4, 3, 5)            # [layers, K/V, block_size, kv heads, head dim]
CPU = torch.device("cpu")


def blocks(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(n)]


def landed(store, key):
    """Wait until the staged copy of ``key`` is in its buffer (without using it)."""
    store.prefetcher.pending[key].done_flag.wait(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_offload_round_trips_through_the_disk_transport(dtype, tmp_path, monkeypatch):
    store = DiskOffload(4, SHAPE, dtype, tmp_path / "kv.bin")
    tr = store.transport
    assert tr.kind == "disk" and tr.read_mode in ("O_DIRECT", "fadvise(DONTNEED)")
    reads = []
    real_copy = tr._copy
    monkeypatch.setattr(tr, "_copy", lambda key, out: (reads.append(key), real_copy(key, out)))
    kvs = blocks(3, dtype)
    for i, kv in enumerate(kvs):
        store.put(100 + i, (i, i), kv)
    assert os.path.getsize(tmp_path / "kv.bin") >= 3 * store.block_nbytes      # the bytes are in the file
    for i, kv in enumerate(kvs):
        got = store.get(100 + i, (i, i), CPU)
        assert got.dtype == dtype and torch.equal(got, kv)
    assert reads == [100, 101, 102]                                             # every read hit the transport
    st = store.prefetcher.stats()
    assert st["demand"] == st["uses"] == 3 and st["hits"] == 0 and st["bytes"] == 3 * store.block_nbytes
    assert store.stats.gets == 3 and store.stats.bytes_in == 3 * store.block_nbytes and store.stats.seconds_in > 0
    assert store.stats.puts == 3 and store.stats.bytes_out == 3 * store.block_nbytes
    store.close()


def test_disk_reads_come_from_the_file_not_a_copy_in_memory(tmp_path):
    store = DiskOffload(2, SHAPE, torch.float32, tmp_path / "kv.bin")
    kv = blocks(1)[0]
    store.put(7, (1, 2), kv)
    off, _ = store.transport._extents[7]
    fd = os.open(tmp_path / "kv.bin", os.O_WRONLY)      # change the bytes behind the store's back
    try:
        os.pwrite(fd, torch.full((4,), 123.0).numpy().tobytes(), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    got = store.get(7, (1, 2), CPU)
    assert got.reshape(-1)[:4].tolist() == [123.0] * 4 and torch.equal(got.reshape(-1)[4:], kv.reshape(-1)[4:])
    store.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_prefetched_get_is_a_hit_unprefetched_a_demand_fetch(kind, tmp_path):
    store = (HostOffload(4, pin=False, staging_blocks=2) if kind == "host"
             else DiskOffload(4, SHAPE, torch.float32, tmp_path / "kv.bin", staging_blocks=2))
    kvs = blocks(2)
    store.put(1, (1,), kvs[0])
    store.put(2, (2,), kvs[1])
    assert store.prefetch([(1, (1,))]) == 1 and store.staged_keys() == [1]
    landed(store, 1)
    assert torch.equal(store.get(1, (1,), CPU), kvs[0])          # staged and landed: a hit
    assert torch.equal(store.get(2, (2,), CPU), kvs[1])          # nobody staged it: fetched now
    st = store.prefetcher.stats()
    assert st["uses"] == 2 and st["hits"] == 1 and st["demand"] == 1 and st["predicted"] == 1
    assert store.stats.prefetch_hits == 1 and store.stats.gets == 2 and not store.staged_keys()
    store.close()


def test_token_mismatch_is_a_miss_even_when_staged(tmp_path):
    store = DiskOffload(4, SHAPE, torch.float32, tmp_path / "kv.bin", staging_blocks=2)
    store.put(5, (1, 2), blocks(1)[0])
    assert store.prefetch([(5, (9, 9))]) == 0                    # other tokens: nothing staged
    assert store.prefetch([(5, (1, 2))]) == 1
    assert store.get(5, (9, 9), CPU) is None and store.stats.misses == 1
    assert store.get(6, (1, 2), CPU) is None and store.stats.misses == 2
    assert store.stats.gets == 0 and store.prefetcher.stats()["uses"] == 0
    store.close()


def test_staging_is_bounded_and_buffers_come_back(tmp_path):
    store = DiskOffload(8, SHAPE, torch.float32, tmp_path / "kv.bin", staging_blocks=2)
    kvs = blocks(4)
    for i, kv in enumerate(kvs):
        store.put(i, (i,), kv)
    items = [(i, (i,)) for i in range(4)]
    assert store.prefetch(items) == 2 and sorted(store.staged_keys()) == [0, 1]   # two buffers, two staged
    st = store.staging

    def buffers():
        return len(st._free) + len(st._staged) + len(st._retiring)

    assert buffers() == 2
    assert torch.equal(store.get(0, (0,), CPU), kvs[0])           # uses one: a fresh buffer replaces it
    assert buffers() == 2 and store.prefetch(items[2:]) == 1
    job = store.prefetcher.pending[1]
    store.unstage(1)                                               # let one go (in flight or landed) ...
    job.done_flag.wait(5)
    assert st.num_free == 1 and buffers() == 2 and st.wasted == 1  # ... its buffer is free once it landed
    for i in (1, 2, 3):                                            # staged or not, every read is exact
        assert torch.equal(store.get(i, (i,), CPU), kvs[i])
    assert buffers() == 2
    store.close()


def test_a_block_replaced_or_evicted_while_staged_is_never_used(tmp_path):
    store = DiskOffload(2, SHAPE, torch.float32, tmp_path / "kv.bin", staging_blocks=2)
    old, new, other, third = blocks(4)
    store.put(1, (1,), old)
    store.prefetch([(1, (1,))])
    store.put(1, (1, 1), new)                 # same key, other content: the staged copy goes
    assert store.staged_keys() == []
    assert torch.equal(store.get(1, (1, 1), CPU), new)
    store.put(2, (2,), other)
    store.prefetch([(2, (2,))])
    store.put(3, (3,), third)                 # capacity 2: the least recently used (2) is dropped
    store.put(4, (4,), third)
    assert 2 not in store and store.staged_keys() == [] and store.get(2, (2,), CPU) is None
    assert store.stats.evictions == 2
    store.close()


def test_putting_a_held_block_again_writes_nothing(tmp_path):
    store = DiskOffload(2, SHAPE, torch.float32, tmp_path / "kv.bin")
    kv = blocks(1)[0]
    store.put(1, (1,), kv)
    store.put(1, (1,), torch.zeros(SHAPE))    # the same block (hash and tokens): the first copy stays
    assert store.stats.puts == 1 and store.stats.already_held == 1
    assert torch.equal(store.get(1, (1,), CPU), kv)
    store.close()


def test_swap_in_time_on_a_cuda_transport_is_device_time(monkeypatch):
    """SwapStore.take on CUDA only enqueues (copies, the compute stream's waits, the cat): its
    seconds_in come from CUDA events (here, fakes), not from the host's enqueue time."""
    from fake_cuda import FakeCudaTransport, FakeEvent, install
    from workbench.kv.kv_prefetch import SwapStore
    from workbench.prefetch.prefetcher import Prefetcher

    install(monkeypatch)
    monkeypatch.setattr(FakeEvent, "elapsed_time", lambda self, end: 40.0)
    store = SwapStore(Prefetcher(FakeCudaTransport()), SHAPE, torch.float32, staging_blocks=1)
    kv = torch.randn(SHAPE[0], SHAPE[1], 3, *SHAPE[2:])
    store.put("r", kv)
    out = store.take("r", 0, 3, CPU)
    assert torch.equal(out, kv.flatten(2, 3))
    assert store.stats["swap_ins"] == 1 and store.stats["seconds_in"] == pytest.approx(0.04)

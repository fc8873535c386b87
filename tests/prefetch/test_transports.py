"""The transports: bytes back exactly as stored, from disk (O_DIRECT and the fadvise fallback)
and RAM, into aligned and unaligned buffers; clear errors for small buffers, full disks and
unknown keys; the copy lane's worker finishes before close() returns."""

from __future__ import annotations

import threading
from collections import namedtuple

import pytest
import torch

from workbench.errors import ConfigError, WorkbenchError
from workbench.prefetch import transports as T
from workbench.prefetch.transports import ALIGN, DiskTransport, HostTransport, aligned_empty, make_transport


def _payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.fixture(params=[None, False], ids=["direct-if-possible", "fadvise"])
def disk(request, tmp_path):
    tr = DiskTransport(directory=tmp_path, direct=request.param)
    yield tr
    tr.close()


def test_aligned_empty_is_aligned_and_rounded():
    for n in (1, 4095, 4096, 10_000):
        t = aligned_empty(n)
        assert t.data_ptr() % ALIGN == 0 and t.numel() % ALIGN == 0 and t.numel() >= n


def test_disk_round_trip_odd_sizes_and_dtypes(disk):
    if disk.read_mode == "O_DIRECT":
        assert disk.describe()["read_mode"] == "O_DIRECT"
    data = {"a": _payload(5_000, 1), "b": torch.randn(33, 7), "c": torch.arange(3, dtype=torch.int64)}
    for k, v in data.items():
        disk.put(k, v)
    assert disk.bytes_stored == sum(v.numel() * v.element_size() for v in data.values())
    for k, v in data.items():
        out = torch.empty_like(v)
        job = disk.read(k, out)
        assert torch.equal(out, v) and job.seconds is not None and job.nbytes == v.numel() * v.element_size()


def test_disk_fadvise_mode_is_reported(tmp_path):
    tr = DiskTransport(directory=tmp_path, direct=False)
    try:
        assert tr.read_mode == "fadvise(DONTNEED)"
        tr.put(0, _payload(10_000))
        out = torch.empty(10_000, dtype=torch.uint8)
        tr.read(0, out)
        assert torch.equal(out, _payload(10_000))
    finally:
        tr.close()


def test_disk_unaligned_and_larger_buffers(disk):
    v = _payload(9_000, 2)
    disk.put("k", v)
    raw = aligned_empty(20_000)
    unaligned = raw[1:9_001]                         # address not a multiple of 4096
    assert unaligned.data_ptr() % ALIGN != 0
    disk.read("k", unaligned)
    assert torch.equal(unaligned, v)
    big = torch.zeros(12_000, dtype=torch.uint8)     # larger than needed: the first bytes are written
    disk.read("k", big)
    assert torch.equal(big[:9_000], v)


def test_async_fetches_run_in_order_and_overlap_the_caller(disk):
    vals = [_payload(64 << 10, s) for s in range(6)]
    for i, v in enumerate(vals):
        disk.put(i, v)
    outs = [torch.empty(64 << 10, dtype=torch.uint8) for _ in vals]
    jobs = [disk.start(i, outs[i]) for i in range(len(vals))]
    for j in jobs:
        disk.wait(j)
    assert all(torch.equal(o, v) for o, v in zip(outs, vals))
    assert all(a.finished <= b.started for a, b in zip(jobs, jobs[1:]))      # one lane, submission order


def test_replace_and_drop_reuse_the_space(disk):
    disk.put("x", _payload(8192, 1))
    end = disk._end
    disk.put("x", _payload(8192, 2))                 # replaced: the old extent is freed and reused
    disk.drop("x")
    disk.put("y", _payload(8192, 3))
    assert disk._end == end and "x" not in disk and disk.bytes_stored == 8192


def test_too_small_buffer_and_unknown_key_are_clear(disk):
    disk.put("k", _payload(1000))
    with pytest.raises(WorkbenchError, match="too small"):
        disk.start("k", torch.empty(999, dtype=torch.uint8))
    with pytest.raises(WorkbenchError, match="nothing stored under 'nope'"):
        disk.start("nope", torch.empty(10, dtype=torch.uint8))
    with pytest.raises(WorkbenchError, match="contiguous"):
        disk.start("k", torch.empty(40, 40, dtype=torch.uint8).t())


def test_full_disk_is_a_config_error_before_writing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(T.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 10 << 20))
    tr = DiskTransport(directory=tmp_path)
    try:
        with pytest.raises(ConfigError, match="WORKBENCH_PREFETCH_DIR"):
            tr.put("k", _payload(4096))
        assert "k" not in tr and tr.path.stat().st_size == 0
    finally:
        tr.close()


def test_close_removes_the_temporary_file_and_stops_the_worker(tmp_path):
    tr = DiskTransport(directory=tmp_path)
    tr.put(0, _payload(100))
    path, worker = tr.path, tr._worker._thread
    assert path.exists() and worker.is_alive()
    tr.close()
    assert not path.exists() and not worker.is_alive()


def test_given_path_is_kept(tmp_path):
    p = tmp_path / "slow.bin"
    tr = DiskTransport(path=p)
    tr.put(0, _payload(100))
    tr.close()
    assert p.exists()


def test_host_round_trip_and_errors():
    tr = HostTransport()
    try:
        v = torch.randn(1000)
        tr.put("w", v)
        v.zero_()                                     # the slow tier holds a copy
        out = torch.empty(1000)
        tr.read("w", out)
        assert out.abs().sum() > 0 and tr.describe() == {"transport": "host", "link": "RAM -> RAM"}
        with pytest.raises(WorkbenchError, match="too small"):
            tr.start("w", torch.empty(10))
    finally:
        tr.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_buffer_viewed_under_inference_mode_is_written_by_the_worker(kind, tmp_path):
    """Inference mode is thread-local: a view made under it may only be written in it (the
    streamer submits from inside the engine's inference-mode step)."""
    tr = make_transport(kind, **({"directory": tmp_path, "direct": False} if kind == "disk" else {}))
    try:
        tr.put(0, _payload(5000))
        buf = torch.empty(6000, dtype=torch.uint8)[1:]          # unaligned: the disk path copies too
        with torch.inference_mode():
            tr.wait(tr.start(0, buf[:5000]))
        assert torch.equal(buf[:5000], _payload(5000))
    finally:
        tr.close()


def test_a_failed_copy_raises_at_wait_with_the_cause():
    tr = HostTransport()
    tr.put(0, torch.zeros(10))
    tr._copy = lambda key, out: (_ for _ in ()).throw(OSError("boom"))
    try:
        with pytest.raises(WorkbenchError, match="fetching 0 failed: OSError: boom"):
            tr.read(0, torch.empty(10))
    finally:
        tr.close()


def test_make_transport_kinds():
    with pytest.raises(ConfigError, match="got 'ssd'"):
        make_transport("ssd")
    tr = make_transport("auto", "cpu")
    assert isinstance(tr, DiskTransport)
    tr.close()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            make_transport("cuda")
        # a disk path (WeightStreamConfig.path) is not an argument of the CUDA transport
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            make_transport("cuda", "cpu", path="x")


def test_make_transport_cuda_drops_the_disk_path(monkeypatch):
    import workbench.prefetch.cuda_transport as ct

    got = {}

    class Recorder:
        def __init__(self, device=None, timing=True):
            got.update(device=device, timing=timing)

    monkeypatch.setattr(ct, "CudaTransport", Recorder)
    assert isinstance(make_transport("auto", "cuda", path="/tmp/x", directory="/tmp"), Recorder)
    assert got == {"device": torch.device("cuda"), "timing": True}


def test_worker_threads_do_not_leak():
    before = threading.active_count()
    for _ in range(3):
        HostTransport().close()
    assert threading.active_count() == before


def test_cuda_transport_time_origin_is_taken_on_an_idle_device(monkeypatch):
    """The event that maps CUDA times to the host clock is recorded with nothing queued ahead
    and the host time read once the GPU passed it (stand-ins for torch.cuda)."""
    import time as _time

    from fake_cuda import FakeEvent, FakeStream, install
    from workbench.prefetch.cuda_transport import CudaTransport

    calls = install(monkeypatch)
    order = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("copy"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("sync"))
    monkeypatch.setattr(FakeEvent, "record", lambda self, stream=None: order.append("record"))
    t0 = _time.perf_counter()
    tr = CudaTransport("cuda")
    assert order == ["sync", "record", "sync"] and tr._base_host >= t0
    assert calls == []


def test_cuda_transport_stores_a_batch_in_one_pinned_buffer(monkeypatch):
    """put_many on CUDA: one pinned allocation and one device -> host copy for all the records,
    each key a view of it (stand-ins for torch.cuda; CPU tensors for the device ones)."""
    from fake_cuda import FakeStream, install
    from workbench.prefetch.cuda_transport import CudaTransport

    install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("copy"))
    tr = CudaTransport("cuda")
    allocs = []
    monkeypatch.setattr(tr, "_pinned", lambda n: allocs.append(n) or torch.empty(n, dtype=torch.uint8))
    recs = [torch.randn(4, 8) for _ in range(5)]
    tr.put_many([(("k", i), r) for i, r in enumerate(recs)])
    assert allocs == [5 * 4 * 8 * 4]
    assert tr.bytes_stored == 5 * 128 and all(("k", i) in tr for i in range(5))
    for i, r in enumerate(recs):
        assert torch.equal(tr._data[("k", i)].view(torch.float32).view(4, 8), r)
    tr.put_many([(("k", 0), torch.zeros(4, 8))])            # a key written again replaces its bytes
    assert tr.bytes_stored == 5 * 128 and torch.equal(tr._data[("k", 0)], torch.zeros(128, dtype=torch.uint8))
    tr.drop(("k", 1))
    assert tr.bytes_stored == 4 * 128 and ("k", 1) not in tr

"""measure_link: one point per block size with a median and spread, on the disk (both read
modes) and RAM links; the ceiling; clear errors before anything is written."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from workbench.errors import ConfigError
from workbench.prefetch import link as L
from workbench.prefetch.link import LinkPoint, ceiling, measure_link


def _check(points, kind, sizes, repeats):
    assert [p.block_bytes for p in points] == sorted(sizes)
    for p in points:
        assert isinstance(p, LinkPoint) and p.transport == kind and p.repeats == repeats
        assert 0 < p.gbps_min <= p.gbps_median <= p.gbps_max
        assert p.us_per_block > 0 and p.sync_gbps > 0 and p.blocks >= 4


def test_host_link_points():
    pts = measure_link("host", sizes=(64 << 10, 8 << 10), total_bytes=1 << 20, repeats=2, latency_blocks=4)
    _check(pts, "host", (8 << 10, 64 << 10), 2)
    assert pts[0].blocks == 128 and pts[0].read_mode is None and pts[0].link == "RAM -> RAM"


@pytest.mark.parametrize("direct", [None, False])
def test_disk_link_points_and_no_file_left(tmp_path, direct):
    pts = measure_link("disk", sizes=(8 << 10, 256 << 10), total_bytes=1 << 20, repeats=2, directory=tmp_path,
                       direct=direct, latency_blocks=4)
    _check(pts, "disk", (8 << 10, 256 << 10), 2)
    assert pts[0].read_mode in ("O_DIRECT", "fadvise(DONTNEED)")
    if direct is False:
        assert pts[0].read_mode == "fadvise(DONTNEED)"
    assert list(tmp_path.iterdir()) == []


def test_max_blocks_caps_the_small_sizes():
    (p,) = measure_link("host", sizes=(8 << 10,), total_bytes=64 << 20, repeats=1, max_blocks=16, latency_blocks=2)
    assert p.blocks == 16


def test_ceiling_is_the_best_median():
    mk = lambda g: LinkPoint("host", "RAM -> RAM", None, 4096, g, g, g, 1.0, 1)   # noqa: E731
    assert ceiling([mk(1.0), mk(3.0), mk(2.0)]) == 3.0
    assert ceiling([]) is None


@pytest.mark.parametrize("kw,match", [
    (dict(transport_kind="nvme"), "transport_kind must be"),
    (dict(sizes=(0,)), "sizes must be positive"),
    (dict(sizes=()), "sizes must be positive"),
    (dict(repeats=0), "repeats must be"),
    (dict(sizes=(4 << 20,), total_bytes=1 << 20), "smaller than the largest block"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ConfigError, match=match):
        measure_link(**{"transport_kind": "host", **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        measure_link("cuda")


def test_a_full_disk_fails_before_writing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(L.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 100 << 20))
    with pytest.raises(ConfigError, match="Lower total_bytes"):
        measure_link("disk", sizes=(1 << 20,), total_bytes=64 << 20, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_one_fetch_reports_the_host_time_on_every_link(monkeypatch):
    """CUDA: the link's figure is the copy's own events; the host's (enqueue + synchronize) is
    reported beside it, the same clock as the CPU links' (here on stand-ins for torch.cuda)."""
    from fake_cuda import FakeCudaTransport, FakeEvent, install
    from workbench.prefetch.transports import Job

    calls = install(monkeypatch)
    monkeypatch.setattr(FakeEvent, "elapsed_time", lambda self, end: 0.002)      # 2 us of copy

    class Tr(FakeCudaTransport):
        def start(self, key, dst, after=None):
            job = Job(key, 8, 0.0)
            job.events = (FakeEvent(True), FakeEvent(True))
            job.ready = FakeEvent()
            return job

    link_s, host_s = L._one_seconds(Tr(), 0, torch.empty(8, dtype=torch.uint8))
    assert link_s == pytest.approx(2e-6) and host_s > 0
    assert calls[0][0] == "synchronize" and calls[-1][0] == "event_sync"
    pts = measure_link("host", sizes=(8 << 10,), total_bytes=1 << 16, repeats=1, latency_blocks=2)
    assert pts[0].us_per_block_host == pts[0].us_per_block > 0

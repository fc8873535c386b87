"""Stand-ins that run the CUDA branches of the prefetch / KV-tier code on a CPU.

Those branches only ask ``transport.kind == "cuda"`` / ``transport.timing`` and call a handful of
``torch.cuda`` functions; :func:`install` replaces those functions with recording fakes (events
stamped with the host clock, streams that record waits) and :class:`FakeCudaTransport` is a
RAM -> RAM transport that says it is the CUDA one.  ``calls`` (what :func:`install` returns)
lists every synchronizing call made: ``("synchronize", device)``, ``("stream_sync", stream)``,
``("event_sync", event)``.
"""

from __future__ import annotations

import time

import torch

from workbench.prefetch.transports import HostTransport


class FakeEvent:
    calls: list = []

    def __init__(self, enable_timing: bool = False, **_kw) -> None:
        self.timing = enable_timing
        self.t: float | None = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        FakeEvent.calls.append(("event_sync", self))

    def elapsed_time(self, end: FakeEvent) -> float:
        return ((end.t or 0.0) - (self.t or 0.0)) * 1e3


class FakeStream:
    def __init__(self, name: str = "compute") -> None:
        self.name = name
        self.waits: list = []

    def wait_stream(self, other) -> None:
        self.waits.append(("stream", other))

    def wait_event(self, ev) -> None:
        self.waits.append(("event", ev))

    def synchronize(self) -> None:
        FakeEvent.calls.append(("stream_sync", self.name))


def install(monkeypatch) -> list:
    """Patch ``torch.cuda`` with the fakes; returns the list synchronizing calls are recorded in."""
    calls: list = []
    FakeEvent.calls = calls
    compute = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", str(device))))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return calls


class FakeCudaTransport(HostTransport):
    """RAM -> RAM copies, presented as the CUDA transport (``kind == "cuda"``)."""

    kind = "cuda"
    epoch = 0

    def __init__(self, timing: bool = False) -> None:
        super().__init__()
        self.timing = timing
        self.device = torch.device("cuda")
        self.stream = FakeStream("copy")
        self._base = FakeEvent(enable_timing=True)
        self._base.record()
        self._base_host = time.perf_counter()
        self.joins = 0

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def join(self) -> None:
        self.joins += 1

    def resolve(self, jobs) -> None:       # host jobs carry their own times
        pass


class CountSyncs:
    """A dispatch mode counting the ops that make a GPU host wait (on a CPU tensor too):
    ``aten._local_scalar_dense`` (``bool(t)``, ``float(t)``, ``.item()``), ``nonzero``,
    ``masked_select`` and indexing with a boolean mask.  ``.cpu()`` / ``.tolist()`` of a CPU
    tensor dispatch nothing: count those by patching ``torch.Tensor``.  ``with CountSyncs() as c:``
    then ``c.n`` and ``c.ops`` (their names)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.n, self.ops = 0, []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                idx = args[1] if len(args) > 1 and name in ("index", "index_put_", "index_put", "_index_put_impl_") \
                    else ()
                bool_idx = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (idx or ()))
                if name in ("_local_scalar_dense", "nonzero", "masked_select") or bool_idx:
                    self.n += 1
                    self.ops.append(name)
                return func(*args, **(kwargs or {}))

        return _Mode()

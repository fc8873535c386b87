"""Weight streaming: run a model with only some decoder layers resident; the rest are fetched,
layer by layer, while earlier layers compute (DeepSpeed ZeRO-Inference's layer-wise streaming,
FlexGen's overlap, here as a transformation of the plain model).

::

    streamer = stream_weights(model, WeightStreamConfig(resident_layers=2, distance=2))
    model(ids)                      # layers 2..L-1 come from the slow tier; 2 fetches in flight
    streamer.stats()                # prefetch_hit_rate, stall_s, GB/s, prefetch_efficiency, bytes resident
    streamer.remove()               # every layer resident again

What stays resident: the embedding, the LM head (tied to the embedding or not), the final norm,
the first ``resident_layers`` decoder layers, and the streaming buffers (``distance + 1`` layer-
sized buffers; one at distance 0).  Those buffers count against a ``resident_bytes`` budget.
The other layers live in the slow tier (a file on disk on a CPU, pinned host memory on CUDA).

The schedule.  Streamed layer of rank r (its place among the streamed layers) always lives in
buffer ``r % (d + 1)``: its parameters are fixed views into that buffer, so their addresses never
change (``torch.compile`` and CUDA graphs see the same tensors every step).  When rank r has
computed, its buffer is free and the next rank that uses it (r + d + 1, or, past the last layer,
the same rank in the next step) is fetched into it.  So while rank r computes, ranks r+1 .. r+d
are in flight or ready: layer i + d is fetched while layer i computes, across the step boundary
too (the first layers of step n+1 are fetched while the last of step n compute and while the
engine samples).  Distance 0 is the synchronous baseline: each layer is fetched when it is
needed, with one buffer.  The rule is :func:`stream_buffers` and :func:`next_fetch`.

What streams: every tensor a layer reads at forward time (:func:`forward_tensors`) - its
parameters, its module buffers, and the tensors its quantized layers' compute ops hold.  A
quantized layer (:class:`~workbench.quant.apply.QuantLinear`) keeps its weight in buffers
(int8 or packed int4 integers, scales, zero points), and a packed backend keeps more: torch's
int4 CPU op its scales-and-zeros (the weight is its buffer, in the op's layout), the int8 op a view of the
scales, W8A8 the transposed weight.  All of them become views into the layer's buffer, tensors
that share storage (a transpose, a slice) stay views of one another, so the bytes a fetch moves
are the layer's *stored* bytes: the quantized bytes (and an op's own tensors) for a quantized
model.  Something that cannot be a view into a byte buffer (an opaque packed object, a tensor
subclass, a non-strided layout) is refused by name at install.

Weights are the same bytes every step, so a prediction can be early but never wrong: greedy
tokens are identical to the all-resident model (tested, quantized models included).
"""

from __future__ import annotations

import numbers
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workbench.errors import ConfigError, WorkbenchError
from workbench.prefetch.prefetcher import Prefetcher
from workbench.prefetch.transports import make_transport
from workbench.prefetch.weight_layout import (
    _check_viewable,
    _extent_bytes,
    _extents,
    _layout,
    _place,
    _raw_bytes,
    _repoint,
    forward_tensors,
)


@dataclass
class WeightStreamConfig:
    """``resident_layers``: decoder layers kept resident (the first N); or ``resident_bytes``: a
    budget for everything resident (embedding, head, norms, resident layers and the streaming
    buffers), which picks the largest N that fits.  ``distance``: 0 = synchronous; d >= 1: layer
    i + d is fetched while layer i computes (d + 1 buffers).  ``transport``: "auto" (cuda on a
    CUDA device, else disk), "disk", "host" (RAM -> RAM) or "cuda".  ``path``: the disk
    transport's file (default: a temporary file, removed at the end)."""
    resident_layers: int | None = None
    resident_bytes: int | None = None
    distance: int = 1
    transport: str = "auto"
    path: str | None = None

    def __post_init__(self) -> None:
        if (self.resident_layers is None) == (self.resident_bytes is None):
            raise ConfigError("WeightStreamConfig: give resident_layers or resident_bytes (exactly one)")
        if self.resident_layers is not None and (not isinstance(self.resident_layers, int) or self.resident_layers < 0):
            raise ConfigError("WeightStreamConfig.resident_layers must be an integer >= 0, "
                              f"got {self.resident_layers!r}")
        if self.resident_bytes is not None and self.resident_bytes <= 0:
            raise ConfigError(f"WeightStreamConfig.resident_bytes must be > 0, got {self.resident_bytes!r}")
        if not isinstance(self.distance, int) or not 0 <= self.distance <= 16:
            raise ConfigError(f"WeightStreamConfig.distance must be an integer in 0..16, got {self.distance!r}")
        if self.transport not in ("auto", "disk", "host", "cuda"):
            raise ConfigError(f"WeightStreamConfig.transport must be auto, disk, host or cuda, got {self.transport!r}")

    def describe(self) -> str:
        what = (f"resident={self.resident_layers}" if self.resident_layers is not None
                else f"resident_bytes={self.resident_bytes}")
        return f"stream-weights {what} d={self.distance} {self.transport}"


def stream_buffers(streamed: int, distance: int) -> int:
    """The layer-sized streaming buffers: one at distance 0 (each layer fetched when needed), else
    ``distance + 1``, never more than the ``streamed`` layers (so the distance reached is at most
    ``streamed - 1``)."""
    return 1 if distance == 0 else min(distance + 1, streamed)


def next_fetch(rank: int, streamed: int, distance: int) -> int | None:
    """The schedule: when the streamed layer of rank ``rank`` (0 .. streamed - 1) has computed, its
    buffer ``rank % buffers`` is free, and the copy of the next rank that lives in that buffer
    starts: ``rank + buffers``, or, past the last streamed rank, ``rank % buffers`` - the same
    buffer's first rank in the next step.  None at distance 0 (nothing is fetched ahead)."""
    if distance == 0:
        return None
    buffers = stream_buffers(streamed, distance)
    nxt = rank + buffers
    return nxt if nxt < streamed else rank % buffers


#: ``schedule(rank=, streamed=, distance=) -> {"buffers": int, "fetch": rank | None}``: a stand-in for
#: :func:`stream_buffers` and :func:`next_fetch` together (notebook 03's exercise)
Schedule = Callable[..., dict]


def _fmt_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.3g}{unit}"
    return f"{int(n)}B"


class WeightStreamer:
    """The installed transformation (``model._wb_stream``): buffers, hooks, the prefetcher."""

    def __init__(self, model: nn.Module, config: WeightStreamConfig, schedule: Schedule | None = None) -> None:
        if getattr(model, "_wb_stream", None) is not None:
            raise ConfigError("stream_weights: this model already streams its weights; remove() that first")
        self.model, self.config = model, config
        layers = list(model.model.layers)
        L = len(layers)
        dev = model.lm_head.weight.device
        # what each layer reads at forward time; a storage two parts of the model share stays resident
        per_layer = [forward_tensors(layer, strict=False) for layer in layers]
        in_layers = {id(t) for named in per_layer for _, t in named}
        outside = [(n, t) for n, t in forward_tensors(model, strict=False) if id(t) not in in_layers]
        owners: dict[int, set] = {}
        for who, named in [*enumerate(per_layer), (-1, outside)]:
            for _, t in named:
                if t.numel():
                    owners.setdefault(t.untyped_storage().data_ptr(), set()).add(who)
        self._shared = frozenset(ptr for ptr, o in owners.items() if len(o) > 1)
        own = [[(n, t) for n, t in named if not t.numel() or t.untyped_storage().data_ptr() not in self._shared]
               for named in per_layer]
        self._measured_layer_bytes = [_extent_bytes(named) for named in own]
        layer_bytes = self._layer_bytes = [_place(_extents(named)) for named in own]
        self._memory: dict | None = None
        self.fixed_bytes = _extent_bytes(outside + [(n, t) for named in per_layer for n, t in named
                                                    if t.numel() and t.untyped_storage().data_ptr() in self._shared])
        n_res = self._resident_count(L, layer_bytes) if config.resident_layers is None else config.resident_layers
        if n_res >= L:
            raise ConfigError(f"stream_weights: resident_layers={n_res} keeps all {L} decoder layers resident; "
                              f"nothing to stream (use at most {L - 1}, or do not stream weights)")
        self.resident = list(range(n_res))
        self.streamed = list(range(n_res, L))
        n = len(self.streamed)
        d = config.distance
        self.num_buffers = stream_buffers(n, d)
        self.effective_distance = self.num_buffers - 1 if d else 0
        # after rank r computes: the rank fetched into its buffer (the schedule, checked once, here)
        self._next = (_checked_schedule(schedule, n, d) if schedule is not None else
                      [next_fetch(r, n, d) for r in range(n)])
        self.device = dev
        # the streamed layers' layouts, strictly: an op whose tensors cannot be seen or viewed is refused
        self._layouts = {i: _layout(layers[i], self._shared, prefix=f"model.layers.{i}") for i in self.streamed}
        for i in self.streamed:
            for e in self._layouts[i][0]:
                for name, t in e.tensors:
                    _check_viewable(name, t, dev)
        self.transport = make_transport(config.transport, dev, **({"path": config.path} if config.path else {}))
        self.prefetcher = Prefetcher(self.transport, name="weights")
        slot_bytes = max(self._layouts[i][1] for i in self.streamed)
        self.layer_bytes = slot_bytes
        self.buffers = [self.transport.buffer(slot_bytes) for _ in range(self.num_buffers)]
        # each streamed layer: its bytes into the slow tier, its tensors become views of its buffer
        with torch.no_grad():
            for rank, i in enumerate(self.streamed):
                extents, nbytes = self._layouts[i]
                blob = torch.zeros(nbytes, dtype=torch.uint8, device="cpu")
                for e in extents:
                    blob[e.offset:e.offset + e.nbytes].copy_(_raw_bytes(e))
                self.prefetcher.put(i, blob)
                buf = self.buffers[rank % self.num_buffers]
                for e in extents:
                    _repoint(e, buf, e.offset, e.lo)
        self._rank = {i: r for r, i in enumerate(self.streamed)}
        self._t0: dict[int, object] = {}
        self._captured_submit = False
        self._hooks = []
        for i, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(self._pre_hook(i)))
            self._hooks.append(layer.register_forward_hook(self._post_hook(i)))
        self._hooks.append(model.model.norm.register_forward_pre_hook(_no_compile(self._end_of_layers)))
        model._wb_stream = self
        _forget_compiled()
        if d:
            for rank in range(self.num_buffers):             # fill the buffers for the first step
                self._submit(rank)

    def _resident_count(self, L: int, layer_bytes: list[int]) -> int:
        budget = self.config.resident_bytes
        d = self.config.distance
        for n_res in range(L - 1, -1, -1):
            n_buf = stream_buffers(L - n_res, d)
            need = self.fixed_bytes + sum(layer_bytes[:n_res]) + n_buf * max(layer_bytes[n_res:])
            if need <= budget:
                return n_res
        need = self.fixed_bytes + stream_buffers(L, d) * max(layer_bytes)
        raise ConfigError(f"stream_weights: resident_bytes={budget} is too small: the embedding, head and norms "
                          f"({self.fixed_bytes} bytes) plus the streaming buffers need {need} bytes at distance {d}")

    # ---- the schedule ------------------------------------------------------------------------
    def _submit(self, rank: int, after=None) -> None:
        i = self.streamed[rank]
        self.prefetcher.submit(i, self.buffers[rank % self.num_buffers], after)
        if self.transport.kind == "cuda" and torch.cuda.is_current_stream_capturing():
            self._captured_submit = True

    def _mark(self):
        if self.transport.kind == "cuda":
            if torch.cuda.is_current_stream_capturing() or not self.transport.timing:
                return None
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _pre_hook(self, i: int):
        rank = self._rank.get(i)

        def pre(module, args):
            if i == 0:
                self.prefetcher.step += 1
                if self.transport.kind == "cuda" and torch.cuda.is_current_stream_capturing():
                    self.transport.epoch += 1
            if rank is not None:
                buf = self.buffers[rank % self.num_buffers]
                if self.config.distance == 0:
                    self.prefetcher.fetch_now(i, buf, label=f"L{i}")
                else:
                    self.prefetcher.wait(i, buf, label=f"L{i}")
            self._t0[i] = self._mark()
        return _no_compile(pre)

    def _post_hook(self, i: int):
        rank = self._rank.get(i)

        def post(module, args, output):
            t0, t1 = self._t0.pop(i, None), self._mark()
            if t0 is not None and t1 is not None:
                self.prefetcher.compute(f"L{i}", t0, t1)
            if rank is not None and self.config.distance:
                after = None
                if self.transport.kind == "cuda":
                    after = torch.cuda.Event()
                    after.record()
                self._submit(self._next[rank], after)          # past the last rank: the next step's
        return _no_compile(post)

    def _end_of_layers(self, module, args):
        """CUDA, while a graph is captured: the copy stream joins the compute stream (a capture's
        forked streams must join before it ends; the next step's first layers are then ready)."""
        if self.transport.kind == "cuda" and self._captured_submit and torch.cuda.is_current_stream_capturing():
            self.transport.join()
            self._captured_submit = False

    # ---- reading ---------------------------------------------------------------------------------
    def memory(self) -> dict:
        """Measured resident bytes: every tensor the model reads at forward time (parameters,
        module buffers such as a quantized layer's integers and scales, a compute op's repacked
        copy), each storage's bytes once, plus the streaming buffers; next to what keeping every
        layer resident takes.  ``streamed_layer_resident_bytes``: what the streamed layers still
        hold outside the streaming buffers (0: every tensor they read is a view into a buffer).
        Measured once, at first call: nothing is allocated or freed afterwards, and servers read
        stats() after every step."""
        if self._memory is None:
            layers = self.model.model.layers
            mine = lambda i: [(n, t) for n, t in forward_tensors(layers[i], strict=False)  # noqa: E731
                              if t.numel() and t.untyped_storage().data_ptr() not in self._shared]
            resident_layer_bytes = _extent_bytes([x for i in self.resident for x in mine(i)])
            bufs = {b.untyped_storage().data_ptr() for b in self.buffers}
            left = _extent_bytes([(n, t) for i in self.streamed for n, t in mine(i)
                                  if t.untyped_storage().data_ptr() not in bufs])
            buffers = sum(b.numel() for b in self.buffers)
            self._memory = {"embedding_head_norm_bytes": self.fixed_bytes, "resident_layer_bytes": resident_layer_bytes,
                            "buffer_bytes": buffers, "streamed_layer_resident_bytes": left,
                            "resident_bytes": self.fixed_bytes + resident_layer_bytes + buffers + left,
                            "all_resident_bytes": self.fixed_bytes + sum(self._measured_layer_bytes)}
        return {**self._memory, "slow_tier_bytes": self.transport.bytes_stored}

    def settings(self) -> dict:
        """``layer_bytes``: one streaming buffer (the largest streamed layer); ``streamed_layer_bytes``:
        the bytes one fetch of a streamed layer moves, on average over the streamed layers (as stored:
        quantized bytes for a quantized model); ``weights``: the recipe, or the float dtype."""
        recipe = getattr(self.model, "recipe", None)
        fmt = getattr(recipe, "name", None) or str(self.model.lm_head.weight.dtype).removeprefix("torch.")
        per_layer = sum(self._layouts[i][1] for i in self.streamed) // len(self.streamed)
        return {"resident_layers": len(self.resident), "streamed_layers": len(self.streamed),
                "distance": self.config.distance, "effective_distance": self.effective_distance,
                "buffers": self.num_buffers, "layer_bytes": self.layer_bytes, "streamed_layer_bytes": per_layer,
                "weights": fmt, **self.transport.describe()}

    def stats(self) -> dict:
        return {**self.settings(), **self.prefetcher.stats(), **self.memory()}

    def describe(self) -> str:
        s = self.settings()
        return (f"stream-weights resident={s['resident_layers']}/{s['resident_layers'] + s['streamed_layers']} "
                f"d={s['distance']} {s['transport']} {_fmt_bytes(s['streamed_layer_bytes'])}/layer")

    def remove(self) -> None:
        """Every layer resident again (read back from the slow tier, each extent into storage of
        its own, views still views of one another), hooks off, transport closed."""
        self.prefetcher.drain()
        if self.transport.kind == "cuda":
            torch.cuda.synchronize(self.device)
        with torch.no_grad():
            for rank, i in enumerate(self.streamed):
                extents, nbytes = self._layouts[i]
                own = self.transport.buffer(nbytes)
                self.transport.read(i, own)
                at = self.buffers[rank % self.num_buffers].storage_offset()    # the buffer's byte 0
                for e in extents:
                    store = torch.empty(-(-e.nbytes // 8) * 8, dtype=torch.uint8, device=own.device)
                    store[:e.nbytes].copy_(own[e.offset:e.offset + e.nbytes])
                    _repoint(e, store, 0, at + e.offset)
        for h in self._hooks:
            h.remove()
        self.prefetcher.close()
        self.model._wb_stream = None


def _checked_schedule(schedule: Schedule, streamed: int, distance: int) -> list[int | None]:
    """``schedule`` for every rank, each answer checked against the rule (:func:`stream_buffers`,
    :func:`next_fetch`) before anything runs: a copy into a buffer whose layer is still to compute
    would change its weights, so a wrong answer is a WorkbenchError naming the rule, never a wrong
    token.  Returns the rank fetched after each rank computes."""
    buffers = stream_buffers(streamed, distance)
    where = f"{streamed} streamed layers, distance {distance}"
    out = []
    for r in range(streamed):
        try:
            got = schedule(rank=r, streamed=streamed, distance=distance)
        except Exception as e:  # noqa: BLE001 - the caller's code: one line, not its traceback
            raise WorkbenchError(f"stream_weights: the schedule raised {type(e).__name__}: {e} (rank {r}, {where})") \
                from None
        if not isinstance(got, dict) or not {"buffers", "fetch"} <= set(got):
            raise WorkbenchError(f"stream_weights: the schedule returned {type(got).__name__} {got!r:.60} for rank "
                                 f"{r}: a dict with 'buffers' and 'fetch'")
        b, f, want = got["buffers"], got["fetch"], next_fetch(r, streamed, distance)
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or int(b) != buffers:
            raise WorkbenchError(f"stream_weights: the schedule keeps {b!r} buffers ({where}): one at distance 0, else "
                                 f"d + 1 but never more than the streamed layers, min(d + 1, streamed) = {buffers}")
        if f is None and want is None:
            out.append(None)
            continue
        if f is None or want is None or isinstance(f, bool) or not isinstance(f, numbers.Integral):
            rule = ("at distance 0 nothing is fetched ahead: None" if want is None else
                    "at distance >= 1 every computed layer's buffer takes the next copy: a rank (int)")
            raise WorkbenchError(f"stream_weights: the schedule fetches {f!r} after rank {r} ({where}): {rule}")
        if int(f) != want:
            raise WorkbenchError(
                f"stream_weights: the schedule fetches rank {int(f)} after rank {r} computes ({where}): buffer "
                f"{r % buffers} is the one free, and the next rank that lives in it is {want} (rank + buffers, or "
                "past the last rank, rank % buffers in the next step)")
        out.append(want)
    return out


def _forget_compiled() -> None:
    """Code ``torch.compile`` traced before the hooks existed runs without them: Dynamo does not
    guard on hooks being added (``torch._dynamo.config.skip_nnmodule_hook_guards``), so streamed
    layers would compute on buffers nobody filled - wrong tokens, silently.  So installing drops
    compiled code (process-wide: every compiled function retraces once, now with the hooks);
    removing needs nothing (the traced hook iteration is guarded and retraces)."""
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()


def _no_compile(fn):
    """Hooks run as plain Python under ``torch.compile`` (a graph break around each), so the
    waits and submissions really happen every step."""
    disable = getattr(torch.compiler, "disable", None)
    return disable(fn) if disable is not None else fn


def stream_weights(model: nn.Module, config: WeightStreamConfig | None = None, schedule: Schedule | None = None,
                   **kw) -> WeightStreamer:
    """Install weight streaming on ``model`` (in place); ``kw``: WeightStreamConfig fields.
    ``schedule``: a stand-in for :func:`stream_buffers` and :func:`next_fetch` (a learner's, notebook
    03: ``{"buffers": ..., "fetch": ...}``), called once per rank at install and checked against the
    rule there (a WorkbenchError when it differs; nothing is installed then)."""
    return WeightStreamer(model, config or WeightStreamConfig(**kw), schedule=schedule)


def weight_streamer(model: nn.Module) -> WeightStreamer | None:
    return getattr(model, "_wb_stream", None)

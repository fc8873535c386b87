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
needed, with one buffer.

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

import functools
import sys
import time
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.errors import ConfigError
from workbench.prefetch.prefetcher import Prefetcher
from workbench.prefetch.transports import make_transport

PARAM_ALIGN = 64        # byte offset of each parameter inside a layer's buffer


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
            raise ConfigError(f"WeightStreamConfig.resident_layers must be an integer >= 0, got {self.resident_layers!r}")
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


def forward_tensors(module: nn.Module, strict: bool = True, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor ``module`` reads at forward time: its parameters, its
    buffers, and the tensors held by the compute ops of its quantized layers (a module's ``_op``,
    set by :func:`workbench.quant.apply.set_quant_backend`: a closure whose cells hold, e.g., the
    int4 CPU op's repacked weight).  Each object once; views of one storage are all listed.
    ``strict``: an op whose tensors cannot be found is a ConfigError (False: it is skipped, for
    accounting only).  ``prefix``: put before every name (the module's own name in the model)."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def add(name: str, t: torch.Tensor) -> None:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))

    for name, t in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        add(name, t)
    for name, t in module.named_buffers(prefix=prefix.rstrip("."), remove_duplicate=False):
        add(name, t)
    for name, mod in module.named_modules(prefix=prefix.rstrip(".")):
        op = getattr(mod, "_op", None)
        if op is not None:
            where = f"{name}._op" if name else "_op"
            try:
                held = _held_tensors(op, where)
            except ConfigError:
                if strict:
                    raise
                held = []
            for cname, t in held:
                add(f"{where}.{cname}", t)
    return out


def _held_tensors(fn, where: str, depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The tensors a compute op holds: its closure cells (and those of functions it closes
    over), a ``functools.partial``'s arguments.  An op whose state cannot be seen this way is
    refused: its tensors would stay resident, or, worse, compute on stale bytes."""
    if isinstance(fn, functools.partial):
        pairs = [(f"arg{k}", v) for k, v in enumerate(fn.args)] + list(fn.keywords.items()) + [("func", fn.func)]
    elif isinstance(fn, types.FunctionType):
        pairs = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                pairs.append((name, cell.cell_contents))
            except ValueError:            # an empty cell
                continue
    else:
        raise ConfigError(f"stream_weights: {where} is a {type(fn).__name__}, whose tensors cannot be found to "
                          "stream them; use quant_backend='reference' (or a backend whose op is a plain function)")
    out = []
    for name, v in pairs:
        if isinstance(v, torch.Tensor):
            out.append((name, v))
        elif isinstance(v, torch.ScriptObject):
            raise ConfigError(f"stream_weights: {where}.{name} is a packed {v._type().name()} object, which cannot "
                              "be a view into a streaming buffer; use quant_backend='reference'")
        elif isinstance(v, (types.FunctionType, functools.partial)):
            if depth < 4:
                out += [(f"{name}.{n}", t) for n, t in _held_tensors(v, f"{where}.{name}", depth + 1)]
        elif isinstance(v, (list, tuple, dict)):
            items = v.items() if isinstance(v, dict) else enumerate(v)
            out += [(f"{name}[{k}]", t) for k, t in items if isinstance(t, torch.Tensor)]
        elif not isinstance(v, (nn.Module, types.ModuleType, type)) and hasattr(v, "__dict__"):
            # an object holding tensors (e.g. a QuantizedWeight); a module's own tensors are listed already
            out += [(f"{name}.{k}", t) for k, t in vars(v).items() if isinstance(t, torch.Tensor)]
    return out


def _check_viewable(name: str, t: torch.Tensor, device: torch.device) -> None:
    why = ("a tensor subclass" if type(t) not in (torch.Tensor, nn.Parameter)
           else f"layout {t.layout}" if t.layout != torch.strided
           else "a quantized tensor" if t.is_quantized
           else "an MKL-DNN tensor" if t.is_mkldnn
           else f"on {t.device}, the buffers on {device}" if t.device != device
           else None)
    if why is not None:
        raise ConfigError(f"stream_weights: {name} ({type(t).__name__}) is {why} and cannot be a view into a "
                          "streaming buffer; use quant_backend='reference' or keep its layer resident")


@dataclass
class _Extent:
    """Bytes ``[lo, lo + nbytes)`` of one storage that ``tensors`` read (views of one storage
    whose bytes overlap are one extent), and where they sit in the layer's buffer."""
    tensors: list = field(default_factory=list)      # [(name, tensor)]
    lo: int = 0
    hi: int = 0
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def _tensor_span(t: torch.Tensor) -> tuple[int, int]:
    es = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * es, (t.storage_offset() + last + 1) * es


def _extents(named: list[tuple[str, torch.Tensor]]) -> list[_Extent]:
    """Group tensors by storage; overlapping byte ranges of one storage merge into one extent
    (a weight and its transpose, scales and a slice of them), disjoint ones stay apart (tensors
    carved from one big loaded storage do not drag their neighbours along).  Empty tensors hold no
    bytes and are skipped."""
    by_storage: dict[int, list] = {}
    for name, t in named:
        if t.numel() == 0:
            continue
        lo, hi = _tensor_span(t)
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((lo, hi, name, t))
    out = []
    for items in by_storage.values():
        items.sort(key=lambda x: x[0])
        cur = None
        for lo, hi, name, t in items:
            if cur is not None and lo < cur.hi:
                cur.hi = max(cur.hi, hi)
            else:
                cur = _Extent(lo=lo // 8 * 8, hi=hi)        # 8-aligned: every dtype's offset stays whole
                out.append(cur)
            cur.tensors.append((name, t))
    return out


def _extent_bytes(named) -> int:
    """Measured bytes of ``named``'s tensors: each storage's bytes they read, once."""
    return sum(e.nbytes for e in _extents(named))


def _place(extents: list[_Extent]) -> int:
    """Give each extent its byte offset in a layer's buffer; returns the buffer's size."""
    off = 0
    for e in extents:
        e.offset = off
        off = -(-(off + e.nbytes) // PARAM_ALIGN) * PARAM_ALIGN
    return off


def _layout(layer: nn.Module, exclude: frozenset = frozenset(), prefix: str = "") -> tuple[list[_Extent], int]:
    """The extents of every tensor ``layer`` reads at forward time (storages in ``exclude`` left
    out: shared with another part of the model, they stay resident), placed in one buffer; the
    buffer's total bytes."""
    named = [(n, t) for n, t in forward_tensors(layer, prefix=prefix)
             if t.numel() == 0 or t.untyped_storage().data_ptr() not in exclude]
    ext = _extents(named)
    return ext, _place(ext)


def _raw_bytes(e: _Extent) -> torch.Tensor:
    """The extent's bytes, as uint8 on the host."""
    t = e.tensors[0][1]
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), e.lo, (e.nbytes,), (1,))
    return raw.cpu()


def _repoint(e: _Extent, store: torch.Tensor, base: int, src_lo: int) -> None:
    """Every tensor of ``e`` becomes a view of ``store`` (uint8), whose byte ``base`` holds what
    byte ``src_lo`` of the tensors' present storage holds, with its own shape, strides and
    offset: the same Python object (modules, op closures and views keep pointing at it), new
    bytes underneath."""
    views: dict = {}
    for _, t in e.tensors:
        es = t.element_size()
        v = views.get(t.dtype)
        if v is None:
            v = views[t.dtype] = store.view(t.dtype)
        rel = base + t.storage_offset() * es - src_lo
        t.data = v.as_strided(t.shape, t.stride(), v.storage_offset() + rel // es)


def _fmt_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.3g}{unit}"
    return f"{int(n)}B"


class WeightStreamer:
    """The installed transformation (``model._wb_stream``): buffers, hooks, the prefetcher."""

    def __init__(self, model: nn.Module, config: WeightStreamConfig) -> None:
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
        self.num_buffers = 1 if d == 0 else min(d + 1, n)
        self.effective_distance = self.num_buffers - 1 if d else 0
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
            n_buf = 1 if d == 0 else min(d + 1, L - n_res)
            need = self.fixed_bytes + sum(layer_bytes[:n_res]) + n_buf * max(layer_bytes[n_res:])
            if need <= budget:
                return n_res
        need = self.fixed_bytes + (1 if d == 0 else min(d + 1, L)) * max(layer_bytes)
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
        n = len(self.streamed)

        def post(module, args, output):
            t0, t1 = self._t0.pop(i, None), self._mark()
            if t0 is not None and t1 is not None:
                self.prefetcher.compute(f"L{i}", t0, t1)
            if rank is not None and self.config.distance:
                nxt = rank + self.num_buffers
                after = None
                if self.transport.kind == "cuda":
                    after = torch.cuda.Event()
                    after.record()
                self._submit(nxt if nxt < n else rank % self.num_buffers, after)   # past the last: next step
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


def stream_weights(model: nn.Module, config: WeightStreamConfig | None = None, **kw) -> WeightStreamer:
    """Install weight streaming on ``model`` (in place); ``kw``: WeightStreamConfig fields."""
    return WeightStreamer(model, config or WeightStreamConfig(**kw))


def weight_streamer(model: nn.Module) -> WeightStreamer | None:
    return getattr(model, "_wb_stream", None)

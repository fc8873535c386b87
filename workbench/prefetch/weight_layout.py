"""What a decoder layer reads at forward time, and where it sits in a streaming buffer: the
tensors (:func:`forward_tensors`: parameters, module buffers, the tensors a quantized layer's
compute op holds), grouped into byte extents of their storages, placed at aligned offsets in one
buffer per layer, and repointed as views into that buffer (or back into storage of their own).
Used by :mod:`workbench.prefetch.weights`, whose module docstring says what streams and why.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.errors import ConfigError

PARAM_ALIGN = 64        # byte offset of each parameter inside a layer's buffer


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

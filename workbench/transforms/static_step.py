"""What every static decode step shares, over contiguous rows or over the paged pool: batch-size
buckets, ``torch.compile`` of the step, CUDA-graph capture per bucket.

A subclass defines the step (``_forward``), the arguments it is called with for a bucket
(``_step_args``) and how to fill a bucket with padding only (``_warm_inputs``, what capture runs
on).  :class:`~workbench.transforms.cuda_graphs.GraphedDecoder` (contiguous rows) and
:class:`~workbench.transforms.paged_graphs.PagedDecoder` (the paged pool) are the two.
"""

from __future__ import annotations

import types

import torch

from workbench.errors import ConfigError, WorkbenchError

NO_CUDA = "CUDA graphs need a CUDA device; running eager"


class InputCopies:
    """The host -> device copies that fill a static step's inputs before each step.

    On a CPU a plain ``copy_``.  On CUDA each source goes through a pinned host buffer of its own
    (kept per shape) and is copied with ``non_blocking=True``: a copy from pageable memory is staged
    by the driver and makes the host wait, a pinned one is a DMA the host only enqueues.  The
    pinned buffers are rewritten only after the previous step's copies finished (an event; in
    practice the sampler's read of the logits has already waited for them).  Each input has one
    flat pinned buffer, grown when a larger source comes (the paged tables' width varies)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: dict[tuple, torch.Tensor] = {}       # (input index, dtype) -> flat pinned buffer
        self._done = None

    def _pinned(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def __call__(self, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """``(dst, src)`` pairs: ``dst`` a device tensor (or view), ``src`` a CPU tensor of its shape."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        if self._done is not None:
            self._done.synchronize()          # the pinned buffers' previous copies have landed
        for i, (dst, src) in enumerate(pairs):
            n = src.numel()
            flat = self._host.get((i, src.dtype))
            if flat is None or flat.numel() < n:          # one flat buffer per input, grown as needed
                flat = self._host[(i, src.dtype)] = self._pinned((max(n, 2 * flat.numel() if flat is not None else n),),
                                                                 src.dtype)
            host = flat[:n].view(src.shape)
            host.copy_(src)
            dst.copy_(host, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(self.device))


class StaticStep:
    """Buckets, compile and capture around a subclass's ``_forward``."""

    def __init__(self, model, buckets: tuple[int, ...]) -> None:
        if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
            raise ConfigError(f"{type(self).__name__}: buckets must be positive integers, got {buckets!r}")
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        w = model.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        self.graphs: dict[int, tuple] = {}                      # bucket -> (CUDAGraph, static logits)
        self.copy_inputs = InputCopies(self.device)
        self._step, self.compiled = self._forward, False

    @property
    def graphed(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise WorkbenchError(f"{type(self).__name__}: batch of {n} exceeds the largest bucket ({self.buckets[-1]}); "
                             "add a bucket")

    # subclasses: the step, its arguments for a bucket, padding-only inputs
    def _forward(self, *args) -> torch.Tensor:
        raise NotImplementedError

    def _step_args(self, bs: int) -> tuple:
        raise NotImplementedError

    def _warm_inputs(self, bs: int) -> None:
        raise NotImplementedError

    def _before_replay(self) -> None:
        """Before a graph replay: the compute stream waits for the weight copies an *eager* step
        submitted (every prefill chunk is eager; with ``stream_weights`` its last layers start the
        next step's first copies on the copy stream).  Hooks do not run on a replay and the graph
        has no dependency on those eager copies: without this wait the replay's first streamed
        layers read a buffer still being written, and its own copies into that buffer race it.
        A GPU-side wait; the host does not block."""
        st = getattr(self.model, "_wb_stream", None)
        if st is not None and st.transport.kind == "cuda":
            st.transport.join()

    def _own_code(self, step):
        """``step`` as a function with a code object of this decoder's own.  Dynamo caches
        compiled code per code object, up to ``recompile_limit`` (8) entries, and does not guard
        on module hooks (``skip_nnmodule_hook_guards``): with one code object for every decoder
        of a process, a step compiled for a model without hooks would be reused for one with them
        (weight streaming's fetches skipped), and the ninth decoder would fall back to eager."""
        fn = step.__func__
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{id(self):x}")
        return types.MethodType(types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                                                   fn.__closure__), self)

    def compile(self, **options) -> None:
        """``torch.compile`` the static step: on a CPU inductor generates C++ for the whole decode
        step; on CUDA, Triton kernels (capture graphs after this to launch them as one)."""
        options.setdefault("dynamic", False)
        if not options["dynamic"]:      # one compiled entry per bucket on this decoder's code object
            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"   # older torch
            setattr(cfg, name, max(getattr(cfg, name), len(self.buckets) + 2))
        self._step = torch.compile(self._own_code(self._forward), **options)
        self.compiled = True

    @torch.inference_mode()
    def capture(self, strict: bool = False) -> bool:
        """Capture one graph per bucket.  Without CUDA: prints (or with ``strict`` raises) the one
        line :data:`NO_CUDA` and the eager static path is used.  Returns whether graphs are on."""
        if self.device.type != "cuda":
            if strict:
                raise WorkbenchError(NO_CUDA)
            print(NO_CUDA)
            return False
        # CUDA only.  Warm up on a side stream first (Triton / torch.compile compile, cuBLAS makes
        # its handles), on padding rows only.
        for bs in self.buckets:
            self._warm_inputs(bs)
        side = torch.cuda.Stream()                                                   # CUDA only
        side.wait_stream(torch.cuda.current_stream())                                # CUDA only
        with torch.cuda.stream(side):                                                # CUDA only
            for bs in reversed(self.buckets):
                for _ in range(2):
                    self._step(*self._step_args(bs))
        torch.cuda.current_stream().wait_stream(side)                                # CUDA only
        pool = torch.cuda.graph_pool_handle()                                        # CUDA only
        for bs in reversed(self.buckets):            # largest first: the smaller reuse its pool
            graph = torch.cuda.CUDAGraph()                                           # CUDA only
            with torch.cuda.graph(graph, pool=pool):                                 # CUDA only
                out = self._step(*self._step_args(bs))
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()                                                     # CUDA only
        return True

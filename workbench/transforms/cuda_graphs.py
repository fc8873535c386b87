"""CUDA graphs for decode steps: capture once per batch-size bucket, replay every step.

Why.  A decode step of a 1B model at batch 1 launches hundreds of small kernels; each costs
the host several microseconds to launch, which at these sizes is comparable to the kernel
itself.  A CUDA graph records the whole step once; a replay is one launch.

What it takes.  A replay re-runs the recorded kernels on the recorded *addresses*, so
everything a step touches must be static: the input ids, the positions, the slot mapping, the
KV cache, the cos/sin tables, the logits.  Positions are tensors (not Python ints), RoPE reads
its row through them, the new K/V go to their slots by an index (``rope_kv_write``), and
attention runs over the whole static cache with a mask built from the positions - no shape
depends on the step.  That is :class:`StaticDecodeCache` + ``BackendAttention._static_decode``.

::

    LLM(cuda_graphs=True)                       # the engine's decode steps, graphed (LLM(compile=True) on a CPU)

    dec = GraphedDecoder(model, max_len=512, buckets=(1, 2, 4, 8))     # what the engine's StaticRunner holds
    dec.capture()                               # CUDA: one graph per bucket; CPU: one line, runs eager
    dec.prefill(0, prompt_ids)                  # eager, into cache row 0
    logits = dec.decode([t0, t1, t2], [p0, p1, p2])   # a batch of 3 runs in the bucket of 4

    launches_per_decode_step(model, {"rmsnorm": "triton"})          # what one step launches
    launches_per_decode_step(model, parse_backend_spec("triton"), graphed=True)

Buckets.  A batch of n sequences runs in the smallest captured bucket >= n; sequence i owns
cache row i, padding rows write their K/V to a scratch row.  The engine's
:class:`~workbench.engine.runners.StaticRunner` keeps its running sequences on rows 0..n-1.

Not run here: every line marked ``# CUDA only`` (capture, replay, the profiler's kernel count)
was written without a GPU in the development session and is untested; the static decode path
itself runs (eagerly) and is tested on the CPU against the reference engine's greedy tokens.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import workbench_kernels
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.transforms.backends import apply_backends, current_backends, format_backends, remove_backends
from workbench.errors import ConfigError, WorkbenchError
from workbench.model.kv_cache import KVCache
from workbench.model.decoder import CausalLM
from workbench.transforms.static_step import NO_CUDA, StaticStep  # noqa: F401 - NO_CUDA is part of this module's API


class StaticDecodeCache:
    """Fixed buffers of one bucket: ``positions``, ``slots`` (set by the host before a step),
    ``mask`` / ``seq_lens`` (derived on the device inside the step), and the whole cache."""

    static_decode = True

    def __init__(self, kv: KVCache, rows: int, window: int | None, inputs: torch.Tensor | None = None) -> None:
        dev = kv.k[0].device
        self.k, self.v, self.max_len, self.rows, self.window = kv.k, kv.v, kv.max_len, rows, window
        # inputs: [3, rows] long (ids, positions, slots), filled by one host -> device copy a step
        self.inputs = torch.zeros(3, rows, dtype=torch.long, device=dev) if inputs is None else inputs
        self.ids = self.inputs[0].view(rows, 1)
        self.positions = self.inputs[1]
        self.slots = self.inputs[2]
        self.block_tables = torch.arange(rows, dtype=torch.int32, device=dev)[:, None]   # row b = block b
        self._pos_grid = torch.arange(kv.max_len, device=dev)[None, :]
        self.derive()

    def derive(self) -> None:
        """Device-side: the attention mask and lengths from the positions (part of the graph)."""
        p = self.positions[:, None]
        mask = self._pos_grid <= p
        if self.window is not None:
            mask = mask & (self._pos_grid > p - self.window)
        self.mask = mask[:, None, None, :]                       # [rows, 1, 1, max_len]
        self.seq_lens = (self.positions + 1).to(torch.int32)


class GraphedDecoder(StaticStep):
    """Static-buffer decode steps of ``model`` for batch-size ``buckets``, graphed on CUDA.

    The model gets backend modules if it has none (all ``eager``: bitwise the reference, a few
    more ops per step), since the static path lives in ``BackendAttention``; whatever backends
    it has are kept.  This changes ``model`` in place, for every engine that shares it.
    """

    def __init__(self, model: CausalLM, max_len: int, buckets: tuple[int, ...] = (1,)) -> None:
        limit = model.config.max_position_embeddings
        if not isinstance(max_len, int) or not 1 <= max_len <= limit:
            raise ConfigError(f"GraphedDecoder: max_len must be in [1, {limit}] (the model's context), got {max_len}")
        super().__init__(model, buckets)
        self.max_len = max_len
        apply_backends(model, current_backends(model))
        self.scratch = self.buckets[-1]                          # rows 0..max-1 are sequences, then scratch
        self.kv = KVCache(model.config, self.scratch + 1, max_len, device=self.device, dtype=self.dtype)
        cos, sin = model.model.rotary_emb._table(max_len, self.device)     # fp32 [>= max_len, hd]
        self.cos, self.sin = cos[:max_len].to(self.dtype), sin[:max_len].to(self.dtype)
        self.static = {b: StaticDecodeCache(self.kv, b, model.config.sliding_window) for b in self.buckets}
        self.ids = {b: self.static[b].ids for b in self.buckets}
        self.backends = current_backends(model)

    def _forward(self, bs: int) -> torch.Tensor:
        """One decode step over the static buffers of bucket ``bs``: logits [bs, V]."""
        m, c = self.model, self.static[bs]
        c.derive()
        x = m.model.embed_tokens(self.ids[bs])                  # [bs, 1, H]
        for layer in m.model.layers:
            x = layer(x, self.cos, self.sin, None, c)
        return m.lm_head(m.model.norm(x))[:, -1]

    def _set_inputs(self, bs: int, tokens: list, positions: list) -> None:
        """Row i decodes ``tokens[i]`` at ``positions[i]``; a None token (or a row past the list)
        is padding: its K/V goes to the scratch row and its logits are ignored."""
        c, ml = self.static[bs], self.max_len
        toks = list(tokens) + [None] * (bs - len(tokens))
        pos = list(positions) + [0] * (bs - len(positions))
        slots = [self.scratch * ml if t is None else i * ml + p for i, (t, p) in enumerate(zip(toks, pos))]
        # ids, positions and slots are rows of one buffer: one copy (pinned, non-blocking on CUDA)
        self.copy_inputs((c.inputs, torch.tensor([[0 if t is None else t for t in toks], pos, slots])))

    def _step_args(self, bs: int) -> tuple:
        return (bs,)

    def _warm_inputs(self, bs: int) -> None:
        self._set_inputs(bs, [], [])             # every row padding: K/V to the scratch row

    @torch.inference_mode()
    def decode(self, tokens: list, positions: list[int]) -> torch.Tensor:
        """One step for rows 0..n-1 (row i: token ``tokens[i]`` at ``positions[i]``; a None token
        leaves row i alone): logits [n, V]."""
        n = len(tokens)
        if n != len(positions) or n == 0:
            raise ConfigError(f"decode: {n} tokens but {len(positions)} positions")
        if max(positions) >= self.max_len:
            raise WorkbenchError(f"decode: position {max(positions)} >= max_len {self.max_len}; "
                                 "make the GraphedDecoder longer")
        bs = self.bucket_for(n)
        self._set_inputs(bs, list(tokens), list(positions))
        if bs in self.graphs:
            graph, out = self.graphs[bs]
            self._before_replay()
            graph.replay()                                                           # CUDA only
            return out[:n]
        return self._step(bs)[:n]

    @torch.inference_mode()
    def prefill(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor:
        """Eager prefill of tokens ``ids`` at positions ``start..`` of sequence ``row`` (its
        cache row); logits of the last position [V]."""
        if start + len(ids) >= self.max_len:
            raise WorkbenchError(f"prefill: {start + len(ids)} tokens leave no room in max_len {self.max_len}")
        x = torch.tensor([ids], device=self.device)
        view = self.kv.row(row)
        view.length = start
        return self.model(x, start, view, logits_to_keep=1)[0, -1]

    def move_row(self, src: int, dst: int) -> None:
        """Copy sequence ``src``'s cache row to ``dst`` (rows stay packed when a sequence ends)."""
        for t in self.kv.k + self.kv.v:
            t[dst].copy_(t[src])


# ---- counting launches ----------------------------------------------------------------------
# aten ops that only change metadata (no kernel on a GPU)
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
              "squeeze", "t", "as_strided", "alias", "detach", "lift_fresh", "empty", "empty_strided", "empty_like",
              "split", "chunk", "unbind", "_reshape_alias", "split_with_sizes", "unflatten", "narrow", "view_as",
              "expand_as", "contiguous", "_to_copy_noop", "lift_fresh_copy", "zeros_like_meta", "set_"}


def _inside_triton_interpreter() -> bool:
    """Under TRITON_INTERPRET=1 a launch copies its arguments with torch ops of its own; those
    belong to the (one) Triton launch, not to the model."""
    f = sys._getframe(2)
    while f is not None:
        if "triton" in f.f_code.co_filename and "interpreter" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def count_launches(fn, *args, **kwargs) -> dict:
    """Run ``fn`` once and count what it launches: ``aten`` = dispatched torch ops that run a
    kernel (metadata-only ops excluded), ``triton`` = launches through the workbench_kernels host
    wrappers, ``total``.  Device-independent (works on a CPU); on a GPU cross-check with
    :func:`count_cuda_kernels`.  ops inside a torch.compile'd region are invisible here."""
    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in _NO_KERNEL and not _inside_triton_interpreter():
                _Count.n += 1
            return func(*args, **(kwargs or {}))

    before = sum(workbench_kernels.LAUNCHES.values())
    with _Count():
        fn(*args, **kwargs)
    triton_n = sum(workbench_kernels.LAUNCHES.values()) - before
    return {"aten": _Count.n, "triton": triton_n, "total": _Count.n + triton_n}


def count_cuda_kernels(fn, steps: int = 3) -> dict:
    """CUDA only (untested here): per step, device kernels executed and host launch calls
    (``cudaLaunchKernel`` / ``cuLaunchKernel*`` / ``cudaGraphLaunch``), from torch.profiler."""
    fn()
    torch.cuda.synchronize()                                                         # CUDA only
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # CUDA only
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = launches = graphs = 0
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA":
            kernels += 1
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += 1
        elif e.name == "cudaGraphLaunch":
            graphs += 1
    return {"device_kernels": kernels / steps, "host_launches": (launches + graphs) / steps,
            "graph_launches": graphs / steps}


@contextmanager
def _backends_as(model: CausalLM, backends: dict[str, str] | None):
    """``backends`` on ``model`` for the duration (None: as it is; all ``eager``: the plain
    reference modules, which launch a few ops fewer than the eager backend modules); the
    model's previous state comes back on exit."""
    before = None if model.ops is None else dict(model.ops.backends)
    try:
        if backends is not None:
            chosen = {**current_backends(model), **backends}
            if set(chosen.values()) == {"eager"}:
                remove_backends(model)
            else:
                apply_backends(model, chosen)
        yield
    finally:
        if before is None:
            remove_backends(model)
        else:
            apply_backends(model, before)


def launches_per_decode_step(model: CausalLM, backends: dict[str, str] | None = None, graphed: bool = False,
                             prompt_len: int = 8) -> dict:
    """Kernel launches of one decode step of ``model`` (batch 1, after a ``prompt_len`` prefill).

    ``backends``: the per-op choice to count under (None: the model's own; all ``eager``: the
    plain reference model); the model is restored afterwards.  ``graphed=False`` counts the
    reference engine's step (``model(token, pos, cache)``), ``graphed=True`` the static step of
    :class:`GraphedDecoder` (captured on CUDA; on a CPU the same step runs eager and is counted).

    Returns ``{"aten", "triton", "total"}`` from :func:`count_launches` (device-independent:
    torch ops that run a kernel + Triton wrapper launches), ``"backends"`` (one line),
    ``"graphed"`` (whether a CUDA graph ran) and, on CUDA only, the profiler's per-step
    ``"device_kernels"`` / ``"host_launches"`` (a graph replay is one host launch).
    """
    if prompt_len < 1:
        raise ConfigError(f"launches_per_decode_step: prompt_len must be >= 1, got {prompt_len}")
    vocab = model.config.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(prompt_len)]
    dev = model.device
    with _backends_as(model, backends), torch.inference_mode():
        if graphed:
            dec = GraphedDecoder(model, max_len=prompt_len + 2)
            on = dec.capture()
            dec.prefill(0, ids)
            step = lambda: dec.decode([ids[-1]], [prompt_len])                  # noqa: E731
        else:
            on = False
            cache = model.new_cache(1, prompt_len + 2)
            model(torch.tensor([ids], device=dev), 0, cache, logits_to_keep=1)
            token = torch.tensor([[ids[-1]]], device=dev)

            def step():
                cache.length = prompt_len                  # every call is the same step
                return model(token, prompt_len, cache, logits_to_keep=1)
        step()                                             # warm: first-use work is not a step's
        out = count_launches(step)
        out["backends"] = format_backends(current_backends(model))
        out["graphed"] = on
        if dev.type == "cuda":                             # CUDA only (untested here)
            out.update(count_cuda_kernels(step))
    return out

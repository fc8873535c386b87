"""The Triton low-bit kernels against dense ``F.linear`` on a GPU: one row per (layer shape, rows m).

::

    rows = quant_kernel_rows()            # m = 1..64 on Llama-7B-sized layers, bf16, CUDA only
    print(format_table(rows))

Each row times four providers on the same x [m, K] (random weights, quantized by
``workbench.quant.rtn.quantize_weight`` with ``group`` columns per scale, symmetric):

* ``dense``: ``F.linear`` with the weight in ``dtype`` (bf16: cuBLAS);
* ``w4a16`` / ``w8a16``: ``workbench_kernels.quant_matmul.w4a16_matmul`` / ``w8a16_matmul`` (the
  row's ``path`` column is what :func:`~workbench_kernels.quant_matmul.w4a16_plan` chose:
  gemv / gemm, split_k and tiles);
* ``w4a8``: ``w4a8_matmul``, the per-token int8 quantization of x included.

How it is timed (a decode step reads each layer's weights once, from HBM, back to back):

* **Device time, no host overhead.**  ``calls`` consecutive calls are captured in one CUDA graph
  and the graph replay is timed with CUDA events; per call = replay / calls.  A Triton launch
  costs tens of microseconds of Python on the host, more than a 4096 x 4096 int4 GEMV takes on
  the device, so eager timing would measure the host.  (Should a capture fail, the row times
  eager calls instead and its ``timing`` column says so.)
* **L2-cold weights.**  The captured calls cycle through copies of the weight whose total is at
  least 2 x the L2 cache (``copies`` column), so each call streams its weight from HBM as in a
  model; x stays hot (it would be).
* **Interleaved.**  Each of ``repeats`` rounds replays every provider's graph once, in an order
  rotated per round (no provider always first after the others); ``*_ms`` is the median over
  rounds, ``*_ms_min`` / ``*_ms_max`` the range, ``*_spread_pct`` = (max - min) / median.

Other columns: ``*_speedup`` = dense ms / provider ms; ``*_weight_bytes`` = bytes of the weight
one call must read (values, fp32 scales; dense: N K 2); ``*_gbps`` = weight bytes / time (x, y
and the split-K partials not counted: a lower bound on traffic); ``*_max_rel_err`` =
max |y - ref| / max |ref| against the float32 reference of the *same quantized* weight
(``F.linear(x.float(), q.dequantize(float32))``; W4A8: the float64 integer reference,
``w4a8_matmul_ref``) -- the kernel's error, not the quantization's; ``dense_max_rel_err``:
bf16 cuBLAS against the fp32 product of the same bf16 weight, for scale.

On a machine without CUDA :func:`quant_kernel_rows` raises :class:`~workbench.errors.ConfigError`:
there the kernels run only under the Triton interpreter, whose timings say nothing about a GPU
(``tests/kernels/test_kernels_quant.py`` checks their correctness there).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workbench.bench.kernel_timing import dtype_name, environment, error_text
from workbench.errors import ConfigError

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))      # (N = out, K = in): Llama-2-7B q/o, gate/up, down
MS = (1, 2, 4, 8, 16, 32, 64)
GROUP = 128                       # columns per scale
# the device check's dry run (no GPU): the same code path under the Triton interpreter, at a size it
# runs in seconds (host timer: the times are not kernel speeds)
DRY_RUN = dict(shapes=((256, 256),), ms=(1, 4), group=64, dtype=torch.float32, reps=2, repeats=2, warmup=1)
PROVIDERS = ("dense", "w4a16", "w8a16", "w4a8")
KERNEL_PROVIDERS = PROVIDERS[1:]
_L2_FALLBACK = 50 << 20           # H100 / H200 L2, when torch does not report it


def _require_cuda(device) -> torch.device:
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        where = "no CUDA device is available" if not torch.cuda.is_available() else f"device={str(dev)!r}"
        raise ConfigError(
            f"quant_kernel_rows: the W4A16 / W8A16 / W4A8 kernel table times CUDA kernels and needs a GPU "
            f"({where}).  On a CPU the Triton kernels run only under the interpreter, whose timings say "
            "nothing about a GPU; their correctness is checked by tests/kernels/test_kernels_quant.py")
    return dev


def quant_kernel_rows(ms=MS, shapes=SHAPES, group: int = GROUP, dtype: torch.dtype = torch.bfloat16,
                      device="cuda", reps: int = 32, repeats: int = 7, warmup: int = 2, seed: int = 0,
                      progress: Callable[[str], None] | None = None,
                      on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (shape, m): see the module docstring for the columns and how they are timed.
    ``reps``: calls per timed sample (at least the number of weight copies that keep the weights
    L2-cold); ``repeats``: interleaved rounds.  ``on_row(row)`` is called as each row is done (a
    caller that may be stopped keeps what was measured).  CUDA only (ConfigError otherwise)."""
    dev = _require_cuda(device)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"quant_kernel_rows: dtype must be bfloat16, float16 or float32, got {dtype}")
    if group < 1 or any(K % group for _, K in shapes):
        raise ConfigError(f"quant_kernel_rows: group {group} must divide every K of {list(shapes)}")
    env = environment(dev)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or _L2_FALLBACK
    timer = _graph_timer(dev)
    rows = []
    for N, K in shapes:
        rows.extend(shape_rows(N, K, ms, group, dtype, dev, timer, env, reps=reps, repeats=repeats,
                               warmup=warmup, seed=seed, l2_bytes=l2, progress=progress, on_row=on_row))
    return rows


def dry_run_rows(progress: Callable[[str], None] | None = None,
                 on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """The table's rows at :data:`DRY_RUN` sizes on the CPU, the Triton kernels under the
    interpreter and a host timer (the device check's dry run: the columns and the code path,
    not speeds).  Sets ``TRITON_INTERPRET=1`` before any kernel import (ConfigError when a kernel
    module was already imported compiled)."""
    from workbench.bench.kernel_timing import prepare_device

    dev = prepare_device("cpu")
    env = environment(dev)
    d = DRY_RUN
    rows = []
    for N, K in d["shapes"]:
        rows.extend(shape_rows(N, K, d["ms"], d["group"], d["dtype"], dev, host_timer, env, reps=d["reps"],
                               repeats=d["repeats"], warmup=d["warmup"], progress=progress, on_row=on_row))
    return rows


# ---- one shape ---------------------------------------------------------------------------------------

def weight_bytes(provider: str, N: int, K: int, group: int, dtype: torch.dtype) -> int:
    """Bytes of the weight one call reads at least (values + float32 scales)."""
    if provider == "dense":
        return N * K * torch.finfo(dtype).bits // 8
    bits = 4 if provider in ("w4a16", "w4a8") else 8
    return N * K * bits // 8 + 4 * N * (K // group)


def shape_rows(N: int, K: int, ms, group: int, dtype: torch.dtype, dev: torch.device, timer, env: dict,
               reps: int = 32, repeats: int = 7, warmup: int = 2, seed: int = 0, l2_bytes: int = _L2_FALLBACK,
               progress: Callable[[str], None] | None = None,
               on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """The rows of one layer shape [N, K], every m of ``ms``; ``timer(calls, warmup) -> (fn, label)``
    turns a list of zero-argument calls into a function timing one sample (seconds per call).
    :func:`quant_kernel_rows` passes the CUDA-graph timer; any other device is for tests only."""
    import workbench_kernels.quant_matmul as qm
    from workbench.quant.rtn import quantize_weight

    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dev)
    q4 = quantize_weight(w, bits=4, group=group)
    q8 = quantize_weight(w, bits=8, group=group)
    dense = w.to(dtype)
    w4_ref, w8_ref = q4.dequantize(torch.float32), q8.dequantize(torch.float32)
    # copies so that one sample's calls stream from HBM: >= 2 x L2 in total, per provider
    nbytes = {p: weight_bytes(p, N, K, group, dtype) for p in PROVIDERS}
    copies = {p: max(1, min(reps, math.ceil(2 * l2_bytes / nbytes[p]))) for p in PROVIDERS}
    stores = {
        "dense": [dense] + [dense.clone() for _ in range(copies["dense"] - 1)],
        "w4a16": [(q4.qweight, q4.scales)]
        + [(q4.qweight.clone(), q4.scales.clone()) for _ in range(copies["w4a16"] - 1)],
        "w8a16": [(q8.qweight, q8.scales)]
        + [(q8.qweight.clone(), q8.scales.clone()) for _ in range(copies["w8a16"] - 1)],
    }
    stores["w4a8"] = stores["w4a16"]
    ops = {
        "dense": lambda x, c: F.linear(x, c),
        "w4a16": lambda x, c: qm.w4a16_matmul(x, c[0], c[1], None, group),
        "w8a16": lambda x, c: qm.w8a16_matmul(x, c[0], c[1], None, group),
        "w4a8": lambda x, c: qm.w4a8_matmul(x, c[0], c[1], group),
    }
    rows = []
    for m in ms:
        x = (torch.randn(m, K, generator=g)).to(dev, dtype)
        row = {**{k: env[k] for k in ("device", "device_name", "torch", "triton", "interpreter")},
               "N": N, "K": K, "m": m, "group": group, "dtype": dtype_name(dtype),
               "path": qm.w4a16_plan(m, N, K, group, device=dev).describe(),
               "w8a16_path": qm.w8a16_plan(m, N, K, group, device=dev).describe(),
               "w4a8_path": qm.w4a8_plan(m, N, K, group, device=dev).describe(),
               "repeats": repeats, "calls": max(reps, *copies.values()),
               "copies": ",".join(f"{p}={copies[p]}" for p in PROVIDERS)}
        # errors (one call each, outside the timing)
        refs = {"dense": F.linear(x.float(), dense.float()), "w4a16": F.linear(x.float(), w4_ref),
                "w8a16": F.linear(x.float(), w8_ref),
                "w4a8": qm.w4a8_matmul_ref(x, q4.qweight, q4.scales, group).float()}
        samplers, labels = {}, set()
        for p in PROVIDERS:
            try:
                y = ops[p](x, stores[p][0])
                row[f"{p}_max_rel_err"] = float((y.float() - refs[p]).abs().max()
                                                / refs[p].abs().max().clamp_min(1e-30))
                n_copies = len(stores[p])
                calls = [(lambda c=stores[p][i % n_copies], op=ops[p]: op(x, c)) for i in range(row["calls"])]
                samplers[p], label = timer(calls, warmup)
                labels.add(label)
                row[f"{p}_weight_bytes"] = nbytes[p]
            except Exception as e:  # noqa: BLE001 - recorded in the row, the table goes on
                row[f"{p}_error"] = error_text(e)
        times: dict[str, list[float]] = {p: [] for p in samplers}
        order = list(samplers)
        for r in range(repeats):                         # interleaved, order rotated every round
            for p in order[r % len(order):] + order[:r % len(order)]:
                if p in samplers:
                    try:
                        times[p].append(samplers[p]())
                    except Exception as e:  # noqa: BLE001 - the provider's row cells say so
                        row[f"{p}_error"] = error_text(e)
                        del samplers[p]
                        times[p] = []
        row["timing"] = "; ".join(sorted(labels))
        rows.append(summarize(row, times))
        if on_row is not None:
            on_row(row)
        if progress:
            progress(f"{N}x{K} m={m}: "
                     + ", ".join(f"{p} {row.get(f'{p}_ms', float('nan')):.4f} ms" for p in PROVIDERS))
    return rows


def summarize(row: dict, times: dict[str, list[float]]) -> dict:
    """Fill a row's timing columns from per-call seconds of each provider (``dense`` first):
    median / min / max ms, spread, speedup vs dense and weight GB/s."""
    for p, t in times.items():
        if not t:
            continue
        med = statistics.median(t)
        row[f"{p}_ms"], row[f"{p}_ms_min"], row[f"{p}_ms_max"] = med * 1e3, min(t) * 1e3, max(t) * 1e3
        row[f"{p}_spread_pct"] = 100 * (max(t) - min(t)) / med if med > 0 else None
        if row.get(f"{p}_weight_bytes"):
            row[f"{p}_gbps"] = row[f"{p}_weight_bytes"] / med / 1e9 if med > 0 else None
    dense = row.get("dense_ms")
    for p in KERNEL_PROVIDERS:
        if dense and row.get(f"{p}_ms"):
            row[f"{p}_speedup"] = dense / row[f"{p}_ms"]
    return row


# ---- timers -----------------------------------------------------------------------------------------

def _graph_timer(dev: torch.device):
    """CUDA: ``calls`` captured in one CUDA graph (after ``warmup`` eager rounds, which also
    compile the kernels); a sample = one replay between CUDA events, per call.  Falls back to
    timing the eager calls between events when the capture fails."""
    def make(calls: list[Callable], warmup: int):
        for _ in range(max(1, warmup)):
            for c in calls:
                c()
        torch.cuda.synchronize(dev)
        graph, label = None, f"cuda-graph replay of {len(calls)} calls, cuda events"
        try:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                calls[0]()                                   # allocator warm on the side stream
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for c in calls:
                    c()
            graph.replay()
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - eager timing, and the row says so
            graph = None
            label = f"eager {len(calls)} calls, cuda events (graph capture failed: {type(e).__name__})"

        def sample() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if graph is not None:
                graph.replay()
            else:
                for c in calls:
                    c()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / len(calls)
        return sample, label
    return make


def host_timer(calls: list[Callable], warmup: int):
    """``time.perf_counter`` around the calls (a CPU; tests only: under the Triton interpreter
    these are Python timings, not kernel speeds)."""
    for _ in range(max(1, warmup)):
        calls[0]()

    def sample() -> float:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls)
    return sample, f"host perf_counter, {len(calls)} calls"


# ---- table --------------------------------------------------------------------------------------------

def _ms(row: dict, p: str) -> str:
    if row.get(f"{p}_error"):
        return "error"
    v = row.get(f"{p}_ms")
    if v is None:
        return "-"
    spread = row.get(f"{p}_spread_pct")
    return f"{v:.4f}" + (f" ±{spread / 2:.0f}%" if spread is not None else "")


def format_table(rows: list[dict]) -> str:
    """A plain-text table, one line per row: shape, m, the W4A16 plan, dense ms, and per kernel
    ms (± half the spread), speedup vs dense, weight GB/s and max relative error; then the
    timing method and any provider errors."""
    if not rows:
        return "(no rows)"
    head = ["N x K", "m", "w4a16 path", "dense ms"]
    for p in KERNEL_PROVIDERS:
        head += [f"{p} ms", "x dense", "GB/s"]
    head += ["max rel err w4a16/w8a16/w4a8"]
    table = [head]
    for r in rows:
        line = [f"{r['N']}x{r['K']}", str(r["m"]), str(r.get("path", "-")), _ms(r, "dense")]
        for p in KERNEL_PROVIDERS:
            sp, gb = r.get(f"{p}_speedup"), r.get(f"{p}_gbps")
            line += [_ms(r, p), "-" if sp is None else f"{sp:.2f}x",
                     "-" if gb is None else f"{gb:.0f}" if gb >= 10 else f"{gb:.2g}"]
        errs = [r.get(f"{p}_max_rel_err") for p in KERNEL_PROVIDERS]
        line.append("/".join("-" if e is None else f"{e:.1e}" for e in errs))
        table.append(line)
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    out.insert(1, "  ".join("-" * w for w in widths))
    first = rows[0]
    out.append("")
    out.append(f"{first.get('device_name')} ({first.get('dtype')}, group {first.get('group')}; torch "
               f"{first.get('torch')}, triton {first.get('triton')}): {first.get('timing')}; median of "
               f"{first.get('repeats')} interleaved rounds, weights L2-cold ({first.get('copies')} copies); GB/s = "
               "weight bytes / time")
    for r in rows:
        for p in PROVIDERS:
            if r.get(f"{p}_error"):
                out.append(f"error: {r['N']}x{r['K']} m={r['m']} {p}: {r[f'{p}_error']}")
    return "\n".join(out)

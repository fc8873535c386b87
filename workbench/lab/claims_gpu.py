"""Claims of the source articles (see workbench.lab.claims): the GPU claims, read from the committed
GPU results (``results/gpu/<device>-<date>/``, written by ``scripts/device_check.sh``).

No GPU is needed here: each claim reads the newest committed table it needs
(``ctx.gpu_table(name)`` -> :func:`workbench.measure.gpu_results.latest`) and decides from the figures
in it, naming the folder, device, date and commit they came from.  Without that table the verdict is
``not measured`` and the reason names the table and the device-check step that writes it (or says
that no step writes it yet).

A claimed level is *reproduced* when the measured range's low end reaches it (the ranges are the
device check's own min..max over interleaved runs); a range that straddles it is "within noise",
which counts as ``does not hold`` (:mod:`workbench.lab.claims`).  Each rule is a pure function of
the numbers (:func:`at_least`, :func:`full_stack_rule`, ...), unit-tested on synthetic tables.
"""

from __future__ import annotations

import math

from workbench.lab.claims import (
    FAILS,
    HOLDS,
    NOT_MEASURED,
    Claim,
    ClaimContext,
    Finding,
)

# step of scripts/device_check.sh that writes each table, and the command it runs
STEPS = {
    "engine_bench": "engine_bench (`workbench bench --configs reference,loop,cuda-graphs --json`)",
    "engine_fast_bench": "engine_fast (`workbench bench --configs reference,compile,compile+graphs --json`)",
    "kernel_bench": "decode_roofline + kernels_bench (`workbench kernels-bench --size full --sections "
                    "ceilings,decode`, then `--sections kernels`)",
    "prefetch_bench": "prefetch_link + prefetch_bench (`python -m workbench.cli.gpu_results prefetch-link`, "
                      "then `prefetch-stream`)",
    "quant_bench": "quant_bench (`python -m workbench.cli.gpu_results quant-kernels`)",
    "calibrate": "calibrate (`workbench calibrate-quant --objective latency --json`)",
    "e2e": "e2e (notebook 06's ablation at its tiny size, `workbench.bench.end_to_end.run_end_to_end`)",
    "decode_stack": "decode_stack (`workbench decode-stack --json`)",
}


def source(t) -> str:
    """Where a GPU table comes from: ``results/gpu/<folder>/<table>.csv (device, date, commit)``."""
    commit = (t.meta or {}).get("git_commit") or "commit unknown"
    return f"results/gpu/{t.folder.name}/{t.table}.csv ({t.label}, commit {str(commit)[:12]})"


def not_measured(tables: list[str], what: str, missing_step: str | None = None) -> Finding:
    """The ``not measured`` finding: which tables, which device-check steps would write them."""
    steps = "; ".join(f"{t}.csv from step {STEPS[t]}" for t in tables if t in STEPS)
    reason = (f"no committed GPU run has {' / '.join(t + '.csv' for t in tables)} under results/gpu/ (needed: {what}); "
              f"scripts/device_check.sh writes {steps} on a GPU machine")
    if missing_step:
        reason += f".  Not written by the device check today: {missing_step}"
    reason += "."
    return Finding(NOT_MEASURED, "-", reason)


def at_least(lo: float, hi: float, target: float) -> str:
    """``holds`` when the low end reaches ``target``, else ``does not hold`` (a range that straddles
    it is within noise, which does not hold either)."""
    return HOLDS if lo >= target else FAILS


def _range_word(lo: float, hi: float, target: float) -> str:
    if lo >= target:
        return "reaches it"
    return "falls short" if hi < target else "straddles it (within noise)"


def _float(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _long_value(frame, section: str, metric: str):
    """One value of a long-format table (section, config, metric, value)."""
    rows = frame[(frame["section"] == section) & (frame["metric"] == metric)]
    return None if rows.empty else rows["value"].iloc[0]


# =====================================================================================================
# 17. full_stack_4x -- A §1 / B §1: the full stack ~4x faster than eager
# =====================================================================================================

CLAIMED_SPEEDUP = 4.0
_NOT_SIDES = ("transformers.generate", "llama.cpp")
_CLAIMED_TEXT = "claimed ~4x (A §1: TTFT 320 -> 75 ms, E2E 2.1 s -> < 500 ms; B §1: TTFT 820 -> 190 ms, E2E 4.7 -> 1.1 s)"


def ratio_range(old: dict, new: dict, key: str, higher_is_better: bool = False) -> tuple:
    """(median ratio, low end, high end) of ``new``'s speed-up over ``old`` on ``key``: the low end is
    the least favourable pairing of the runs' extremes (``key_min`` / ``key_max``; for a time, old's
    fastest over new's slowest).  Low and high are None when the table has no ``_min`` / ``_max``."""
    med = new[key] / old[key] if higher_is_better else old[key] / new[key]
    o_min, o_max, n_min, n_max = (_float(d.get(f"{key}_{e}")) for d, e in ((old, "min"), (old, "max"),
                                                                          (new, "min"), (new, "max")))
    if None in (o_min, o_max, n_min, n_max) or 0 in (o_min, n_min):
        return med, None, None
    if higher_is_better:
        return med, n_min / o_max, n_max / o_min
    return med, o_min / n_max, o_max / n_min


def _part(label: str, med: float, lo, hi, target: float) -> tuple[str, str]:
    """One metric's verdict: holds when the low end reaches ``target``, does not hold when the range
    falls short or straddles it (within noise), not measured without a range."""
    if lo is None:
        return NOT_MEASURED, (f"{label} {med:.2f}x (median ratio; the table has no per-run min / max, so the ratio's "
                              f"low end is unknown and {target:g}x cannot be established)")
    return at_least(lo, hi, target), f"{label} {med:.2f}x (range {lo:.2f}..{hi:.2f}x) {_range_word(lo, hi, target)}"


def _combine(verdicts: list[str]) -> str:
    if FAILS in verdicts:
        return FAILS
    return HOLDS if all(v == HOLDS for v in verdicts) else NOT_MEASURED


def full_stack_rule(sides: list[dict], target: float = CLAIMED_SPEEDUP) -> dict:
    """``sides``: engine_bench rows (``side``, ``ttft_ms_p50`` and, when the table has them,
    ``ttft_ms_p50_min`` / ``_max``; ``decode_tokens_per_s_p50`` / ``_min`` / ``_max``), the reference among
    them.  The fastest engine side against ``reference``: the low end of each ratio's range must reach
    ``target`` (decode: min over max; TTFT: the reference's fastest over the side's slowest); a range
    below or straddling it does not hold; a metric without a range is not measured."""
    ref = next(s for s in sides if s["side"] == "reference")
    cands = [s for s in sides if s["side"] not in (*_NOT_SIDES, "reference")]
    if not cands:
        return {"verdict": FAILS, "why": "no engine configuration other than the reference was measured", "best": None}
    best = max(cands, key=lambda s: s["decode_tokens_per_s_p50"])
    d_med = best["decode_tokens_per_s_p50"] / ref["decode_tokens_per_s_p50"]
    d_lo = best["decode_tokens_per_s_min"] / ref["decode_tokens_per_s_max"]
    d_hi = best["decode_tokens_per_s_max"] / ref["decode_tokens_per_s_min"]
    t_med, t_lo, t_hi = ratio_range(ref, best, "ttft_ms_p50")
    v_d, w_d = _part("decode", d_med, d_lo, d_hi, target)
    v_t, w_t = _part("TTFT", t_med, t_lo, t_hi, target)
    return {"verdict": _combine([v_d, v_t]), "best": best["side"], "decode_speedup": d_med, "decode_range": [d_lo, d_hi],
            "ttft_ratio": t_med, "ttft_range": [t_lo, t_hi], "why": f"{w_d}; {w_t}"}


def stack_rule(base: dict, stack: dict, target: float = CLAIMED_SPEEDUP) -> dict:
    """``base`` / ``stack``: e2e rows (medians of ``ttft_ms_p95`` / ``e2e_ms_p95``, p50 when p95 is
    missing; their per-run ``_min`` / ``_max`` when the table has them; the ``vs baseline: TTFT p95`` /
    ``E2E p95`` verdicts).  For TTFT and E2E the low end of the ratio's range (the baseline's fastest
    run over the stack's slowest) must reach ``target``, beyond noise (the verdict is not "within
    noise"); a range below or straddling ``target`` does not hold; without ranges: not measured."""
    out, verdicts, parts = {}, [], []
    for label, keys, verdict_key in (("TTFT", ("ttft_ms_p95", "ttft_ms_p50"), "vs baseline: TTFT p95"),
                                     ("E2E", ("e2e_ms_p95", "e2e_ms_p50"), "vs baseline: E2E p95")):
        key = next((k for k in keys if _float(base.get(k)) and _float(stack.get(k))), None)
        if key is None:
            verdicts.append(NOT_MEASURED)
            parts.append(f"{label} not in the table")
            continue
        med, lo, hi = ratio_range({k: _float(v) for k, v in base.items()}, {k: _float(v) for k, v in stack.items()}, key)
        v, w = _part(f"{label} ({key}) {_float(base[key]):.1f} -> {_float(stack[key]):.1f} ms:", med, lo, hi, target)
        cmp = str(stack.get(verdict_key) or "")
        if v == HOLDS and (not cmp or cmp.startswith("within noise")):
            v = FAILS
            w += ", but not beyond noise against the baseline"
        verdicts.append(v)
        out[f"{label.lower()}_ratio"], out[f"{label.lower()}_range"], out[f"{label.lower()}_key"] = med, [lo, hi], key
        parts.append(w + (f" ({cmp})" if cmp else " (no verdict against the baseline)"))
    return {"verdict": _combine(verdicts), "why": "; ".join(parts), **out}


def _e2e_stack(t) -> tuple[dict, dict] | None:
    """(baseline row, last stacked row) of an e2e table, or None."""
    f = t.frame
    if not {"config", "stack_step"} <= set(f.columns):
        return None
    rows = f.to_dict("records")
    measured = [r for r in rows if str(r.get("status", "measured")) == "measured"]
    base = next((r for r in measured if r.get("config") == "baseline"), None)
    stacked = [r for r in measured if _float(r.get("stack_step")) is not None and r.get("config") != "baseline"]
    if base is None or not stacked:
        return None
    return base, max(stacked, key=lambda r: _float(r["stack_step"]))


def measure_full_stack(ctx: ClaimContext) -> Finding:
    e2e = ctx.gpu_table("e2e")
    pair = _e2e_stack(e2e) if e2e is not None else None
    if pair is not None:
        base, stack = pair
        rule = stack_rule(base, stack)
        fig = (f"stack ({stack.get('layers') or stack['config']}) vs baseline: "
               + ", ".join(f"{k.split('_')[0].upper()} {rule[k]:.2f}x" for k in ("ttft_ratio", "e2e_ratio") if k in rule)
               + f"; {_CLAIMED_TEXT}")
        reason = (f"From {source(e2e)}: notebook 06's workload replayed on the baseline (continuous batching, contiguous "
                  f"KV, eager, unquantized) and on the stack of every layer that combines, interleaved rounds; "
                  f"{rule['why']}: {rule['verdict']}.  Which part is checked: the stack's TTFT and E2E against the "
                  "eager baseline on this GPU, at the ablation's small size; a ratio counts from the low end of its "
                  "range (the baseline's fastest run over the stack's slowest, columns <metric>_min / _max), not "
                  "from its medians.")
        return Finding(rule["verdict"], fig, reason, values={k: v for k, v in rule.items() if k != "why"},
                       table=[{k: v for k, v in r.items() if _float(v) is not None or isinstance(v, str)}
                              for r in (base, stack)])
    tabs = [t for t in (ctx.gpu_table("engine_bench"), ctx.gpu_table("engine_fast_bench")) if t is not None]
    missing = ("an E2E column and a 'full stack' side -- e2e.csv (step e2e) has both; engine_bench reports TTFT "
               "and decode tokens/s per engine configuration")
    if not tabs:
        return not_measured(["e2e", "engine_bench", "engine_fast_bench"], "TTFT and E2E of the eager baseline and "
                            "of the full stack (or, without e2e.csv, TTFT and decode tokens/s of the reference and the "
                            "fastest engine configuration)")
    sides, src = [], []
    for t in tabs:
        for r in t.frame.to_dict("records"):
            s = {k: _float(r.get(k)) for k in ("ttft_ms_p50", "decode_tokens_per_s_p50", "decode_tokens_per_s_min",
                                                 "decode_tokens_per_s_max")}
            if r.get("side") == "reference" and any(x["side"] == "reference" for x in sides):
                continue                      # one reference: the first table's
            if None not in s.values():
                extra = {k: _float(r.get(k)) for k in ("ttft_ms_p50_min", "ttft_ms_p50_max")
                         if _float(r.get(k)) is not None}          # a TTFT range, where the table has one
                sides.append({"side": r.get("side"), **s, **extra, "table": t.table})
        src.append(source(t))
    if not any(s["side"] == "reference" for s in sides):
        return Finding(NOT_MEASURED, "-", f"{'; '.join(src)} has no complete 'reference' row")
    rule = full_stack_rule(sides)
    if rule["best"] is None:
        return Finding(NOT_MEASURED, "-", f"{'; '.join(src)}: {rule['why']}")
    ref = next(s for s in sides if s["side"] == "reference")
    best = next(s for s in sides if s["side"] == rule["best"])
    fig = (f"{rule['best']} vs reference: decode {rule['decode_speedup']:.2f}x ({ref['decode_tokens_per_s_p50']:.0f} -> "
           f"{best['decode_tokens_per_s_p50']:.0f} tok/s), TTFT {ref['ttft_ms_p50']:.1f} -> {best['ttft_ms_p50']:.1f} ms "
           f"({rule['ttft_ratio']:.2f}x); {_CLAIMED_TEXT}")
    reason = (f"From {'; '.join(src)} (no e2e.csv yet): the fastest engine configuration measured by the device check "
              f"against the reference configuration (the eager engine) on the same model and prompts; {rule['why']}: "
              f"{rule['verdict']}.  Which part is checked: the speed-up of the package's fastest configuration on this "
              f"GPU, each ratio from the low end of its range (the least favourable pairing of the runs' min / max); "
              f"engine_bench has no per-run TTFT min / max, so its TTFT ratio is a median ratio that cannot establish "
              f"4x.  Not in these tables: {missing}.")
    return Finding(rule["verdict"], fig, reason, values={k: v for k, v in rule.items() if k != "why"},
                   table=sides)


# =====================================================================================================
# 18. fused_launches -- A §2 layer 1: 12 launches fused into 1; one layer 18.7 -> 4.3 ms (-77 %)
# =====================================================================================================

CLAIMED_LAUNCH_RATIO = 12.0
CLAIMED_LAYER_SPEEDUP = 18.7 / 4.3


def fused_rule(rows: list[dict]) -> dict:
    """``rows``: kernel_bench decode rows (provider eager / fused / fused+graphs, ``launches_per_step``,
    ``ms_median`` / ``ms_min`` / ``ms_max``).  The launch ratio eager / fewest (exact counts) must
    reach 12 and the step-time ratio eager / fastest (range min/max over max/min) 18.7 / 4.3."""
    eager = next(r for r in rows if r["provider"] == "eager")
    fused = [r for r in rows if r["provider"] != "eager"]
    with_launches = [r for r in fused if r.get("launches_per_step")]
    fewest = min(with_launches, key=lambda r: r["launches_per_step"]) if with_launches else None
    fastest = min(fused, key=lambda r: r["ms_median"])
    launch_ratio = (eager["launches_per_step"] / fewest["launches_per_step"]
                    if fewest is not None and eager.get("launches_per_step") else None)
    t_med = eager["ms_median"] / fastest["ms_median"]
    t_lo, t_hi = eager["ms_min"] / fastest["ms_max"], eager["ms_max"] / fastest["ms_min"]
    launches_ok = launch_ratio is not None and launch_ratio >= CLAIMED_LAUNCH_RATIO
    time_ok = at_least(t_lo, t_hi, CLAIMED_LAYER_SPEEDUP) == HOLDS
    e_launch = eager.get("launches_per_step")
    if e_launch and fewest is not None:
        launch_txt = (f"launches per step {e_launch:.0f} -> {fewest['launches_per_step']:.0f} ({fewest['provider']}): "
                      f"{launch_ratio:.1f}x, {'reaching' if launches_ok else 'short of'} 12x")
    else:
        launch_txt = ("launches per step not counted for "
                      + ("eager" if not e_launch else "the fused variants") + " (no launch ratio: not 12x)")
    why = (launch_txt
           + f"; step time {t_med:.2f}x ({fastest['provider']}, range {t_lo:.2f}..{t_hi:.2f}x) "
           f"{_range_word(t_lo, t_hi, CLAIMED_LAYER_SPEEDUP)} the claimed {CLAIMED_LAYER_SPEEDUP:.2f}x (-77 %)")
    return {"verdict": HOLDS if launches_ok and time_ok else FAILS, "launch_ratio": launch_ratio,
            "time_ratio": t_med, "time_range": [t_lo, t_hi], "fastest": fastest["provider"],
            "time_reduction": 1 - 1 / t_med, "why": why}


def _decode_rows(frame) -> list[dict]:
    d = frame[(frame["section"] == "decode") & (frame["status"] == "ok")]
    rows = []
    for r in d.to_dict("records"):
        row = {"provider": r.get("provider"), "sizes": r.get("sizes"), "dtype": r.get("dtype")}
        for k in ("launches_per_step", "ms_median", "ms_min", "ms_max", "frac_of_ceiling", "achieved", "bytes",
                  "ceiling"):
            row[k] = _float(r.get(k))
        if row["ms_median"] is not None:
            rows.append(row)
    return rows


def _layers(sizes) -> int | None:
    import re

    m = re.search(r"layers=(\d+)", str(sizes or ""))
    return int(m.group(1)) if m else None


def measure_fused_launches(ctx: ClaimContext) -> Finding:
    t = ctx.gpu_table("kernel_bench")
    if t is None:
        return not_measured(["kernel_bench"], "the decode step eager vs fused vs fused + CUDA graphs: launches per "
                            "step and ms")
    rows = _decode_rows(t.frame)
    if not any(r["provider"] == "eager" for r in rows) or len(rows) < 2:
        return Finding(NOT_MEASURED, "-", f"{source(t)} has no measured eager and fused decode_step rows")
    rule = fused_rule(rows)
    layers = _layers(rows[0]["sizes"])
    eager = next(r for r in rows if r["provider"] == "eager")
    fast = next(r for r in rows if r["provider"] == rule["fastest"])
    per_layer = (f"; per layer {eager['ms_median'] / layers:.3f} -> {fast['ms_median'] / layers:.3f} ms"
                 if layers else "")
    fig = (f"decode step {eager['ms_median']:.3f} -> {fast['ms_median']:.3f} ms ({rule['fastest']}, "
           f"{-100 * rule['time_reduction']:+.0f} %){per_layer}; launches "
           + (f"{rule['launch_ratio']:.1f}x fewer" if rule["launch_ratio"] else "not counted")
           + "; claimed 12 -> 1, 18.7 -> 4.3 ms per layer (-77 %)")
    reason = (f"From {source(t)}, the decode step of `workbench kernels-bench` ({rows[0]['sizes']}): {rule['why']}: "
              f"{rule['verdict']}.  The article's 12 -> 1 is one fused group of ops; the table counts a whole step, so "
              "12x is what fusing every group 12 -> 1 would give.  Per-layer times are the step's over its layers.")
    return Finding(rule["verdict"], fig, reason, values={k: v for k, v in rule.items() if k != "why"}, table=rows)


# =====================================================================================================
# 19. prefetch_bandwidth -- A §2 layer 3: bandwidth use 61 -> 93 %, prefetch hit rate > 89 %
# =====================================================================================================

CLAIMED_HIT_RATE, CLAIMED_LINK_USE = 0.89, (0.61, 0.93)


def prefetch_rule(hit: tuple[float, float, float], link_sync: float | None, link_best: tuple[float, float, float] | None,
                  comparison: str | None) -> dict:
    """``hit`` / ``link_best``: (median, min, max) of the best prefetch configuration; both must reach
    the claimed levels over their range, and the best configuration's link use must beat the
    synchronous one beyond noise (``comparison`` is compare's verdict, not "within noise")."""
    hit_ok = at_least(hit[1], hit[2], CLAIMED_HIT_RATE) == HOLDS
    link_ok = (link_best is not None and at_least(link_best[1], link_best[2], CLAIMED_LINK_USE[1]) == HOLDS
               and comparison is not None and not str(comparison).startswith("within noise"))
    why = (f"hit rate {hit[0]:.1%} (range {hit[1]:.1%}..{hit[2]:.1%}) {_range_word(hit[1], hit[2], CLAIMED_HIT_RATE)} "
           f"({CLAIMED_HIT_RATE:.0%})")
    if link_best is not None:
        why += (f"; link use {'n/a' if link_sync is None else f'{link_sync:.1%}'} synchronous -> {link_best[0]:.1%} "
                f"(range {link_best[1]:.1%}..{link_best[2]:.1%}) with prefetch, {comparison}; "
                f"{_range_word(link_best[1], link_best[2], CLAIMED_LINK_USE[1])} ({CLAIMED_LINK_USE[1]:.0%})")
    else:
        why += "; link use not in the table"
    return {"verdict": HOLDS if hit_ok and link_ok else FAILS, "hit_ok": hit_ok, "link_ok": link_ok, "why": why}


def measure_prefetch_bandwidth(ctx: ClaimContext) -> Finding:
    t = ctx.gpu_table("prefetch_bench")
    if t is None:
        return not_measured(["prefetch_bench"], "prefetch hit rate and link bandwidth use, synchronous vs prefetched",
                            "the HBM bandwidth use of a decode step with and without prefetch (the prefetch bench "
                            "measures the pinned host -> HBM link of weight streaming)")
    f = t.frame
    trip = [_float(_long_value(f, "verdict", f"hit_rate.measured.{k}")) for k in ("median", "min", "max")]
    if None in trip:
        return Finding(NOT_MEASURED, "-", f"{source(t)} has no verdict.hit_rate.measured rows")
    best = [_float(_long_value(f, "verdict", f"link_use.measured_best.{k}")) for k in ("median", "min", "max")]
    sync = _float(_long_value(f, "verdict", "link_use.measured_sync.median"))
    cmp = _long_value(f, "verdict", "link_use.comparison")
    config = _long_value(f, "verdict", "hit_rate.config")
    rule = prefetch_rule(tuple(trip), sync, tuple(best) if None not in best else None, cmp)
    fig = (f"prefetch hit rate {trip[0]:.1%} ({config}); link use "
           + (f"{sync:.1%} -> {best[0]:.1%}" if sync is not None and None not in best else "not measured")
           + "; claimed > 89 %, 61 -> 93 %")
    reason = (f"From {source(t)} (weight streaming, half the layers offloaded, fetched d layers ahead over the pinned "
              f"host -> HBM link on a side stream): {rule['why']}: {rule['verdict']}.  Which part is checked: the hit "
              "rate and the link's use by the package's prefetcher; the article's 'effective bandwidth utilisation' of "
              "HBM during decode is not in the table.")
    return Finding(rule["verdict"], fig, reason, values={k: v for k, v in rule.items() if k != "why"})


# =====================================================================================================
# 20. w4a16_speed -- B §2.3: W4A16 2.1x faster (C-Eval 62.3 -> 68.7 with per-channel scales)
# =====================================================================================================

CLAIMED_W4A16_SPEEDUP = 2.1


def w4a16_rule(rows: list[dict]) -> dict:
    """``rows``: quant_bench rows (``m``, ``dense_ms`` / ``_min`` / ``_max``, ``w4a16_ms`` / ``_min`` / ``_max``).
    Per m (tokens per matmul), the geometric mean over the layer shapes of the int4-weight matmul's
    speed-up and its range.  A layer's matmul speed-up is an *upper bound* on the whole model's (the
    rest of the model -- attention, norms, sampling, the host -- does not speed up), so it can only
    refute: ``does not hold`` when even the bound's high end is below 2.1x at every m in the table;
    otherwise ``not measured`` (the article's 2.1x is whole-model inference, which no table has)."""
    def gmean(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    per_m = {}
    for m in sorted({r.get("m", 1) for r in rows}):
        rs = [r for r in rows if r.get("m", 1) == m]
        per_m[m] = {"speedup": gmean([r["dense_ms"] / r["w4a16_ms"] for r in rs]),
                    "range": [gmean([r["dense_ms_min"] / r["w4a16_ms_max"] for r in rs]),
                              gmean([r["dense_ms_max"] / r["w4a16_ms_min"] for r in rs])], "shapes": len(rs)}
    refuted = all(v["range"][1] < CLAIMED_W4A16_SPEEDUP for v in per_m.values())
    txt = "; ".join(f"m = {m:g}: {v['speedup']:.2f}x (range {v['range'][0]:.2f}..{v['range'][1]:.2f}x, {v['shapes']} "
                    f"shapes)" for m, v in per_m.items())
    why = (f"W4A16 matmul vs dense bf16, geometric mean over the layer shapes: {txt}; an upper bound on the whole model's "
           f"speed-up, " + (f"below {CLAIMED_W4A16_SPEEDUP}x at every m even at its high end, so the model's is too"
                            if refuted else f"not below {CLAIMED_W4A16_SPEEDUP}x at every m, so it cannot decide"))
    first = per_m[min(per_m)]
    return {"verdict": FAILS if refuted else NOT_MEASURED, "per_m": per_m, "speedup": first["speedup"],
            "range": first["range"], "bound_refutes": refuted, "why": why}


def measure_w4a16_speed(ctx: ClaimContext) -> Finding:
    t = ctx.gpu_table("quant_bench")
    missing = ("a whole quantized model's inference (W4A16 vs bf16 in the engine, the article's '1K tokens on an A100: "
               "320 ms FP16 -> 152 ms'); C-Eval is not available offline (calibrate.csv has the perplexity degradation "
               "of W4A16 mixes on the GPU's kernels)")
    if t is None:
        return not_measured(["quant_bench"], "the W4A16 Triton matmul vs dense bf16 F.linear per layer shape and m", missing)
    keys = ("dense_ms", "dense_ms_min", "dense_ms_max", "w4a16_ms", "w4a16_ms_min", "w4a16_ms_max")
    rows = []
    for r in t.frame.to_dict("records"):
        m = _float(r.get("m"))
        row = {"N": r.get("N"), "K": r.get("K"), "m": m, **{k: _float(r.get(k)) for k in keys}}
        if m is not None and None not in (row[k] for k in keys):
            rows.append(row)
    if not rows:
        return Finding(NOT_MEASURED, "-", f"{source(t)} has no complete rows for dense and w4a16")
    rule = w4a16_rule(rows)
    fig = ("W4A16 matmul vs dense bf16: " + ", ".join(f"{v['speedup']:.2f}x at m = {m:g} (range {v['range'][0]:.2f}.."
                                                      f"{v['range'][1]:.2f}x)" for m, v in rule["per_m"].items())
           + " -- per layer, an upper bound on the model's; claimed 2.1x (whole model)")
    reason = (f"From {source(t)}: {rule['why']}: {rule['verdict']}.  Which part is checked: only whether the per-layer "
              f"bound already rules the claim out.  Missing for a verdict either way: {missing}; no device-check step "
              "writes such a table today.")
    return Finding(rule["verdict"], fig, reason, values={k: v for k, v in rule.items() if k != "why"}, table=rows)


# =====================================================================================================
# 21. decode_bandwidth_bound -- B §1: decode tracks memory bandwidth (use 41 -> 89 %), not compute
# =====================================================================================================

CLAIMED_BW_USE = (0.41, 0.89)


def _batch_and_bytes(sizes, dtype) -> tuple[int | None, int | None]:
    """The batch of a decode row's ``sizes`` ("batch=1 context=512 ...") and the element bytes of its dtype."""
    import re

    m = re.search(r"batch=(\d+)", str(sizes or ""))
    e = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}.get(str(dtype or "").removeprefix("torch."))
    return (int(m.group(1)) if m else None), e


def bandwidth_rule(rows: list[dict], copy_gbps: float | None, matmul_tflops: float | None) -> dict:
    """``rows``: kernel_bench decode rows (``frac_of_ceiling`` of the copy bandwidth at ``ms_median``,
    ``ms_min`` / ``ms_max``, ``sizes`` with the batch, ``dtype``).  The fastest variant's share of the
    copy ceiling must reach 89 % over its range, and, where the table gives the batch and dtype, the
    decode step's arithmetic intensity must lie below the ridge point of the measured ceilings
    (``matmul / copy``).  The intensity is bounded from above from the table: each weight element read
    does 2 FLOPs per sequence of the batch, each KV element 2 FLOPs, so FLOP / byte <= 2 x batch /
    element bytes; a bound below the ridge point confirms bandwidth-bound, one above it refutes
    nothing but the claim's 'not compute' is then not shown.  Eager's share is reported against the
    article's 41 %, not checked (the article's old stack is not this eager one)."""
    ok_rows = [r for r in rows if r.get("frac_of_ceiling") is not None]
    best = min(ok_rows, key=lambda r: r["ms_median"])
    eager = next((r for r in ok_rows if r["provider"] == "eager"), None)
    f = best["frac_of_ceiling"]
    lo, hi = f * best["ms_median"] / best["ms_max"], f * best["ms_median"] / best["ms_min"]
    ridge = matmul_tflops * 1e12 / (copy_gbps * 1e9) if copy_gbps and matmul_tflops else None
    batch, elem = _batch_and_bytes(best.get("sizes"), best.get("dtype"))
    intensity = 2 * batch / elem if batch and elem else None
    bound = ridge is not None and intensity is not None and intensity < ridge
    if intensity is None or ridge is None:
        int_txt = ("; intensity not checked (" + ("no batch / dtype in the table" if intensity is None else
                                                 "no ceilings to place it") + "): the verdict rests on the bandwidth share")
    else:
        int_txt = (f"; intensity <= 2 x batch {batch} / {elem} B = {intensity:g} FLOP/B vs the ceilings' ridge point "
                   f"{ridge:.0f} FLOP/B: " + ("bandwidth-bound" if bound else "not shown to be below it"))
    why = (f"fastest decode step ({best['provider']}) uses {f:.1%} of the measured copy bandwidth (range {lo:.1%}..{hi:.1%}), "
           f"{_range_word(lo, hi, CLAIMED_BW_USE[1])} ({CLAIMED_BW_USE[1]:.0%})"
           + (f"; eager {eager['frac_of_ceiling']:.1%} (the article's 41 %: reported, not checked)" if eager is not None
              else "") + int_txt)
    bw_ok = at_least(lo, hi, CLAIMED_BW_USE[1]) == HOLDS
    int_ok = bound if intensity is not None and ridge is not None else True
    return {"verdict": HOLDS if bw_ok and int_ok else FAILS, "best": best["provider"], "frac": f, "range": [lo, hi],
            "eager_frac": eager and eager["frac_of_ceiling"], "ridge_flop_per_byte": ridge,
            "intensity_bound": intensity, "why": why}


def measure_decode_bandwidth(ctx: ClaimContext) -> Finding:
    t = ctx.gpu_table("kernel_bench")
    if t is None:
        return not_measured(["kernel_bench"], "the decode step's bytes per step, achieved GB/s and the measured copy "
                            "and matmul ceilings")
    f = t.frame
    rows = [r for r in _decode_rows(f) if r["frac_of_ceiling"] is not None]
    if not rows:
        return Finding(NOT_MEASURED, "-", f"{source(t)} has no measured decode_step rows with a bandwidth fraction")
    ceil = f[f["section"] == "ceilings"]
    copy = ceil[ceil["op"] == "copy"]["achieved"]
    mm = ceil[ceil["op"] == "matmul"]["achieved"]
    rule = bandwidth_rule(rows, _float(copy.iloc[0]) if len(copy) else None, _float(mm.iloc[0]) if len(mm) else None)
    fig = (f"decode step at {rule['frac']:.1%} of copy bandwidth ({rule['best']})"
           + (f", eager {rule['eager_frac']:.1%}" if rule["eager_frac"] is not None else "")
           + "; claimed 41 -> 89 %, bandwidth-bound")
    reason = (f"From {source(t)}, the decode step of `workbench kernels-bench` ({rows[0]['sizes']}; bytes = weights + "
              f"KV read per step): {rule['why']}: {rule['verdict']}.")
    return Finding(rule["verdict"], fig, reason, values={k: v for k, v in rule.items() if k != "why"}, table=rows)


CLAIMS = [
    Claim("full_stack_4x", "The full stack is ~4x faster than eager: TTFT 320 -> 75 ms, E2E 2.1 s -> < 500 ms (A §1); "
          "TTFT 820 -> 190 ms, E2E 4.7 -> 1.1 s (B §1)", "A §1 / B §1", "end to end", device="gpu",
          measure=measure_full_stack),
    Claim("fused_launches", "12 kernel launches fused into 1; one Transformer layer 18.7 -> 4.3 ms (-77 %)",
          "A §2 (layer 1)", "fused kernels", device="gpu", measure=measure_fused_launches),
    Claim("prefetch_bandwidth", "Asynchronous prefetch raises effective bandwidth use from 61 % to 93 %, hit rate > 89 %",
          "A §2 (layer 3)", "prefetch", device="gpu", measure=measure_prefetch_bandwidth),
    Claim("w4a16_speed", "W4A16 inference is 2.1x faster (C-Eval 62.3 -> 68.7 with per-channel scales; 1K tokens on an "
          "A100: FP16 320 ms -> 152 ms)", "B §2.3",
          "quantization", device="gpu", measure=measure_w4a16_speed),
    Claim("decode_bandwidth_bound", "Decode tracks memory bandwidth (use 41 % -> 89 %), not compute", "B §1",
          "fused kernels", device="gpu", measure=measure_decode_bandwidth),
]

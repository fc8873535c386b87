"""The front page of a batch run's report: each notebook's headline figures against their
targets, the claims lab's table, and the latest committed GPU results.

A headline is one metric a notebook writes to its results sidecar, with what it should be and
why (correctness against a reference, or a claim of the source articles: ``A §..`` / ``B §..``),
and, where the notebook made one, its noise-aware verdict (the string it wrote with
:mod:`workbench.measure.compare`: "... lower by 1.50x", "within noise (...)", "holds" ...)::

    rows = headline_rows(results["metrics"])      # DataFrame: notebook, headline, measured, target, meets, verdict
    html = front_page_html(results)               # the three sections, for write_report

"meets" is ``yes`` / ``no`` when the target is a threshold the measured value can be checked
against (``yes`` needs the notebook's verdict, where it has one, to be beyond the noise),
``within noise`` / ``unverified`` when it is not, ``-`` when the row only informs, ``not run`` when
the notebook did not write the metric (failed, or a mode that skips it) and ``not measured`` when
it wrote none (NaN). The verdict is the
notebook's own; this page never turns a within-noise difference into "better".
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

# GPU tables shown on the front page, in order (workbench.measure.gpu_results lists them all)
GPU_TABLES = ("summary", "warmup", "kernel_bench", "decode_stack", "quant_bench", "prefetch_bench", "e2e",
              "engine_bench", "engine_fast_bench", "sched_bench", "tier_bench", "prefix_bench", "calibrate")


@dataclass(frozen=True)
class Headline:
    notebook: str
    metric: str
    label: str
    target: str                                   # what it should be, and the source
    check: Callable[[object], bool] | None = None
    verdict: str | None = None                    # the metric holding the notebook's noise-aware verdict
    fmt: str = "{:.3g}"
    ref: str | None = None                        # a second metric the check compares with: check(value, ref)
    ref_label: str = ""
    se: str | None = None                         # a metric holding the measured value's standard error
    noise: bool = True                            # False: the verdict metric is a reason, not a noise verdict

    def measured_text(self, value) -> str:
        if value is None:
            return "-"
        if isinstance(value, (bool, str)):
            return str(value)
        try:
            v = float(value)
        except (TypeError, ValueError):
            return str(value)
        return "nan" if math.isnan(v) else self.fmt.format(v)


def _eq1(v) -> bool:
    return float(v) == 1.0


def _true(v) -> bool:
    return v is True or str(v).lower() == "true"


def _lt(x: float) -> Callable[[object], bool]:
    return lambda v: float(v) < x


def _gt(x: float) -> Callable[[object], bool]:
    return lambda v: float(v) > x


def _tolerance(v, dtype) -> bool:
    """The max-error bound the kernel notebook asserts: float32 1e-3, half precision 0.5."""
    return float(v) < (1e-3 if str(dtype or "float32").endswith("float32") else 0.5)


# a noise-aware verdict that found a difference: "on lower by 1.50x", "workbench faster by 1.28x"
_BEYOND_NOISE = re.compile(r"\bby [\d.]+x\b")


HEADLINES: tuple[Headline, ...] = (
    Headline("00_tour", "greedy_token_agreement", "greedy tokens vs transformers.generate", "= 1 (correctness)", _eq1,
             fmt="{:.3f}"),
    Headline("00_tour", "bench_decode_speedup", "decode tokens/s, engine / transformers.generate",
             "> 1 beyond noise", _gt(1.0), verdict="bench_decode_verdict", fmt="{:.2f}x"),
    Headline("00_tour", "ttft_ms_p50", "TTFT P50 (ms), one request at a time", "- (the baseline)", fmt="{:.1f}"),
    Headline("01_fused_kernels", "max_err_flash_prefill", "flash prefill vs torch SDPA, max |err|",
             "< 1e-3 in float32, < 0.5 in bf16 (the notebook's asserts)", _tolerance, fmt="{:.1e}", ref="dtype",
             ref_label="dtype"),
    Headline("01_fused_kernels", "max_err_paged_decode", "paged decode attention vs torch, max |err|",
             "< 1e-3 in float32, < 0.5 in bf16 (the notebook's asserts)", _tolerance, fmt="{:.1e}", ref="dtype",
             ref_label="dtype"),
    Headline("01_fused_kernels", "launches_per_step_fused", "launches per decode step, all ops fused",
             "fewer than eager (A §2, layer 1: 12 -> 1)", lambda v, eager: float(v) < float(eager), fmt="{:.0f}",
             ref="launches_per_step_eager", ref_label="eager"),
    Headline("01_fused_kernels", "greedy_token_agreement", "greedy tokens, fused vs eager", "= 1 (correctness)", _eq1,
             fmt="{:.3f}"),
    Headline("02_kv_tiers", "hit_rate", "prefix-cache hit rate, shared system prompt", "> 92 % (A §2, layer 2)",
             _gt(0.92), fmt="{:.1%}"),
    Headline("02_kv_tiers", "ttft_p50_reduction", "TTFT P50, prefix cache off / on", "> 1 beyond noise", _gt(1.0),
             verdict="prefix_ttft_verdict", fmt="{:.2f}x"),
    Headline("02_kv_tiers", "identical_greedy_tokens", "greedy tokens, prefix cache on vs off", "True (correctness)",
             _true),
    Headline("02_kv_tiers", "best_tier_rel_ppl", "perplexity change, best tiered configuration", "<= +2 %",
             _lt(0.02 + 1e-12), fmt="{:+.2%}"),
    Headline("02_kv_tiers", "physical_measured_vs_formula", "tiered cache bytes, measured / formula",
             "= 1 within 5 % (the notebook's assert)", lambda v: abs(float(v) - 1.0) <= 0.05, fmt="{:.3f}"),
    Headline("03_prefetch", "prefetch_hit_rate_best", "prefetch hit rate at the best distance",
             ">= 89 % (A §2, layer 3)", verdict="verdict: prefetch hit rate >= 89%", fmt="{:.0%}"),
    Headline("03_prefetch", "hidden_share", "copy time hidden under compute", ">= 80 %",
             verdict="verdict: hidden share >= 80%", fmt="{:.0%}"),
    Headline("03_prefetch", "identical_greedy_tokens", "greedy tokens, streamed vs resident weights",
             "True (correctness)", _true),
    Headline("04_scheduler", "static_vs_continuous_ttft_p95_ratio", "TTFT P95, static (B=4) / continuous batching",
             "> 1 beyond noise", _gt(1.0), verdict="verdict: static vs continuous: TTFT p95", fmt="{:.2f}x"),
    Headline("04_scheduler", "chunked_itl_max_ratio", "worst inter-token gap, whole / chunked prefill",
             "> 1 beyond noise", _gt(1.0), verdict="verdict: chunked prefill: ITL max", fmt="{:.2f}x"),
    Headline("04_scheduler", "throughput_speedup", "tokens/s, concurrent / sequential", "> 1 beyond noise", _gt(1.0),
             verdict="verdict: throughput: concurrent vs sequential", fmt="{:.2f}x"),
    Headline("04_scheduler", "slo_p95_ttft_ms_guard", "P95 TTFT (ms) of served requests under overload, SLO guard",
             "below the unguarded ramp's, beyond noise", lambda v, plain: float(v) < float(plain),
             verdict="verdict: SLO guard: P95 TTFT of served requests", fmt="{:.0f}", ref="slo_p95_ttft_ms_no_guard",
             ref_label="no guard"),
    Headline("04_scheduler", "identical_greedy_tokens", "greedy tokens, every scheduler setting", "True (correctness)",
             _true),
    Headline("05_quantization", "rel_ppl_w8a16", "perplexity change, W8A16", "<= +2 %", _lt(0.02 + 1e-12),
             fmt="{:+.2%}"),
    Headline("05_quantization", "rel_ppl_w4a16_g128", "perplexity change, W4A16 g128 (RTN)", "<= +2 %",
             _lt(0.02 + 1e-12), fmt="{:+.2%}", se="rel_ppl_se_w4a16_g128"),
    Headline("05_quantization", "rel_ppl_w4a16_g128_awq", "perplexity change, W4A16 g128 + AWQ",
             "below RTN's, beyond noise", lambda v, rtn: float(v) < float(rtn), verdict="awq_vs_rtn_verdict",
             fmt="{:+.2%}", ref="rel_ppl_w4a16_g128", ref_label="RTN"),
    Headline("05_quantization", "linear_bytes_w4a16_vs_bf16", "linear-layer bytes, W4A16 / bf16", "< 0.3", _lt(0.3),
             fmt="{:.3f}"),
    Headline("05_quantization", "calib_recipe_reproduced", "calibrator's recipe measured again = reported",
             "True", _true),
    Headline("06_end_to_end", "recommended_config", "configuration the SLO rule picks", "one that meets the SLO",
             lambda v: str(v) not in ("none", "None", ""), verdict="recommendation_reason", noise=False),
    Headline("06_end_to_end", "stack_vs_baseline_ttft_p95_ratio", "P95 TTFT, full stack / baseline",
             "< 1 beyond noise (A §1 / B §1: ~4x faster)", _lt(1.0), verdict="stack_vs_baseline_verdict",
             fmt="{:.2f}x"),
)


def _meets(h: Headline, value, ref=None, verdict: str = "", se=None) -> str:
    """``yes`` / ``no`` against the target. With a noise-aware verdict, ``yes`` needs the value
    on the target's side *and* the verdict to have found a difference beyond the noise (or to
    say the claim holds); ``within noise`` when it did not; ``unverified`` when the notebook
    could not compare (too few samples). A value that misses a threshold by less than two
    standard errors is ``within noise`` too. A verdict alone ("holds" / "does not hold")
    decides when there is no threshold; a missing value is ``not measured``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "not measured"
    v = (verdict or "").strip().lower() if h.noise else ""
    if h.check is None:
        if v.startswith("holds"):
            return "yes"
        if v.startswith("does not hold"):
            return "no"
        return "within noise" if "within noise" in v else "-"
    try:
        ok = h.check(value, ref) if h.ref else h.check(value)
        near = not ok and se is not None and not h.ref   # within two standard errors of the threshold
        if near and (h.check(float(value) - 2 * float(se)) or h.check(float(value) + 2 * float(se))):
            return "within noise"
    except (TypeError, ValueError):
        return "no"
    if not ok:
        return "no"
    if not v:
        return "yes"
    if "within noise" in v:
        return "within noise"
    return "yes" if (_BEYOND_NOISE.search(v) or v.startswith("holds")) else "unverified"


def headline_rows(metrics, headlines=HEADLINES):
    """One row per headline and run of a notebook in a run's metrics table
    (``collect_results(...)["metrics"]``: columns notebook, metric, value): a sweep's points
    (``<stem>__<point>``) each get their rows; notebooks with no row at all are left out."""
    import pandas as pd

    have = {}
    for nb, metric, value in metrics[["notebook", "metric", "value"]].itertuples(index=False):
        if isinstance(value, float) and math.isnan(value):
            value = None
        have[(nb, metric)] = value
    runs: dict[str, list[str]] = {}
    for nb in dict.fromkeys(nb for nb, _ in have):
        runs.setdefault(re.sub(r"-\d+$", "", str(nb).split("__")[0]), []).append(nb)
    rows = [_row(h, nb, have) for h in headlines for nb in runs.get(h.notebook, [])]
    return pd.DataFrame(rows, columns=["notebook", "headline", "measured", "target", "meets", "verdict"])


def _row(h: Headline, nb: str, have: dict) -> dict:
    if (nb, h.metric) not in have:
        return {"notebook": nb, "headline": h.label, "measured": "", "target": h.target, "meets": "not run",
                "verdict": ""}
    value = have[(nb, h.metric)]
    verdict = have.get((nb, h.verdict), "") if h.verdict else ""
    measured, ref, se = h.measured_text(value), None, None
    if h.se and have.get((nb, h.se)) is not None:
        se = have[(nb, h.se)]
        measured += f" ± {h.measured_text(se).lstrip('+')}"
    if h.ref:
        ref = have.get((nb, h.ref))
        measured += f" ({h.ref_label or h.ref} {h.measured_text(ref)})"
    return {"notebook": nb, "headline": h.label, "measured": measured, "target": h.target,
            "meets": _meets(h, value, ref, str(verdict or ""), se), "verdict": "" if verdict is None else str(verdict)}


def _esc(s) -> str:
    return html.escape("" if s is None else str(s))


def _verdict_class(text: str) -> str:
    t = text.lower()
    if "within noise" in t or "cannot" in t or "not measured" in t:
        return "neutral"
    if "does not hold" in t:
        return "no"
    return ""


def _rows_html(df) -> str:
    out = [("<table class='front'><tr><th>notebook</th><th>headline</th><th>measured</th><th>target</th>"
            "<th>meets</th><th>noise-aware verdict</th></tr>")]
    for r in df.itertuples(index=False):
        meets_cls = {"yes": "ok", "no": "failed", "not run": "failed", "within noise": "neutral",
                     "unverified": "neutral", "not measured": "neutral"}.get(r.meets, "")
        out.append(f"<tr><td>{_esc(r.notebook)}</td><td>{_esc(r.headline)}</td><td>{_esc(r.measured)}</td>"
                   f"<td>{_esc(r.target)}</td><td class='{meets_cls}'>{_esc(r.meets)}</td>"
                   f"<td class='{_verdict_class(r.verdict)}' style='text-align:left'>{_esc(r.verdict)}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _table(df, classes: str = "data") -> str:
    """A table with units and rounding (:func:`workbench.lab.formats.table_html`) in a scroll box."""
    from workbench.lab.formats import table_html

    return f"<div class='scroll'>{table_html(df, classes=f'data {classes}' if classes != 'data' else 'data')}</div>"


def claims_html(results: dict) -> str:
    """The claims lab's table from notebook 06's sidecar (its ``claims`` table), or a line saying
    where it comes from when no notebook of this run wrote one."""
    for name, res in results.get("notebooks", {}).items():
        table = res.get("tables", {}).get("claims")
        if table is None:
            continue
        cols = [c for c in ("claim", "source", "layer", "measured", "verdict", "why") if c in table.columns]
        view = table[cols] if cols else table
        from workbench.lab.results import html_id

        return (f"<p>From <a href='#{html_id('nb', name)}'>{_esc(name)}</a> (<code>workbench claims --json</code> "
                "measures the same set from the command line). Verdicts: holds / does not hold / cannot be "
                "tested here / not measured / error, each with the comparison and its noise.</p>"
                + _table(view, "claims"))
    return ("<p>No notebook of this run wrote a claims table (notebook 06_end_to_end does, with "
            "<code>claims=True</code>); <code>workbench claims</code> measures them from the command line.</p>")


def gpu_html(root=None, max_rows: int = 30) -> str:
    """The latest committed GPU result of each table (``results/gpu/``), with where and when it
    was measured; one line saying there is none yet otherwise."""
    from workbench.measure.gpu_results import latest

    parts, found = [], 0
    for table in GPU_TABLES:
        t = latest(table, root)
        if t is None:
            continue
        found += 1
        try:
            frame = t.frame
            body = _table(frame.head(max_rows))
            more = f" (first {max_rows} of {len(frame)} rows)" if len(frame) > max_rows else ""
        except Exception as e:  # noqa: BLE001 - an unreadable table is named, the page still renders
            body, more = f"<p class='failed'>unreadable: {_esc(e)}</p>", ""
        parts.append(f"<details{' open' if table == 'summary' else ''}><summary><b>{_esc(table)}</b>: "
                     f"{_esc(t.label)} (<code>results/gpu/{_esc(t.folder.name)}/{_esc(table)}.csv</code>){more}"
                     f"</summary>{body}</details>")
    if not found:
        return ("<p>No GPU results are committed yet (<code>results/gpu/</code> holds none): every figure on this "
                "page was measured on this run's device. <code>bash scripts/device_check.sh</code> on a GPU machine "
                "writes them.</p>")
    return "".join(parts)


def front_page_html(results: dict, gpu_root=None) -> str:
    """The report's first three sections: summary against targets, claims, GPU results."""
    parts = ["<h2 id='summary'>Summary: headline figures against their targets</h2>"]
    rows = headline_rows(results["metrics"]) if len(results.get("metrics", [])) else None
    if rows is None or not len(rows):
        parts.append("<p>No notebook of this run wrote a headline metric.</p>")
    else:
        count = rows["meets"].value_counts()
        parts.append(f"<p>{len(rows)} headlines from {rows['notebook'].nunique()} notebooks: {count.get('yes', 0)} "
                     f"meet their target, {count.get('no', 0)} do not, {count.get('within noise', 0)} within noise of "
                     f"it, {count.get('unverified', 0)} unverified (too few samples for a verdict), "
                     f"{count.get('not run', 0) + count.get('not measured', 0)} not run or not measured; the rest "
                     "inform. <i>meets</i> compares the measured value with the target; the verdict is the notebook's "
                     "own comparison against the noise it measured (a difference within the noise is never called "
                     "better or worse).</p>")
        parts.append(_rows_html(rows))
    parts.append("<h2 id='claims'>Claims of the source articles</h2>")
    parts.append(claims_html(results))
    parts.append("<h2 id='gpu'>Latest committed GPU results</h2>")
    parts.append(gpu_html(gpu_root))
    return "\n".join(parts)

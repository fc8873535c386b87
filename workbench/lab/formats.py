"""How the notebooks and the report show numbers and names: times in ms without exponents, errors
in scientific notation (never rounded to 0.0), the kernel-bench rows' formats and columns, a results
dict as a table; and (:func:`readable_table`) any table with its units and rounding, headings from
keys (:func:`title_of`, :data:`TITLES`, :func:`humanize`)."""

from __future__ import annotations

import math
import numbers
import re

# How the notebook formats kernel-bench rows, and the columns it shows.
FORMATS = {"ms_median": "{:.4f}", "ms_min": "{:.4f}", "ms_max": "{:.4f}", "achieved": "{:.3g}",
           "frac_of_ceiling": "{:.2%}", "vs_eager": "{:.3g}", "max_err": "{:.2e}"}
SHOW = ["timing", "ms_median", "ms_min", "ms_max", "achieved", "metric", "frac_of_ceiling", "vs_eager", "max_err",
        "status", "note"]


def fmt_ms(v: float) -> str:
    """A time in ms with three significant digits and no exponent: 3,570 / 16.2 / 0.123."""
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_err(v) -> str:
    """A max error in scientific notation (4.77e-07; "0" when exact): never rounded to 0.0."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, str):
        return v
    return "0" if v == 0 else FORMATS["max_err"].format(v)


def results_frame(results: dict) -> pandas.DataFrame:  # noqa: F821
    """The notebook's results as a one-column table for display, each value with its unit
    (:func:`format_value` of :func:`unit_kind` of its key: "10.1 ms", "28.8 %", "18.8 MiB"),
    errors (keys with ``err``) in scientific notation, "—" for a missing value; the keys stay
    the index (the names in the sidecar), the saved values are untouched."""
    import pandas as pd

    def cell(key, v):
        kind = unit_kind(key)
        if kind == "fraction" and isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > 5:
            kind = "number"
        return format_value(v, kind, unit=True)

    return pd.Series({k: cell(k, v) for k, v in results.items()}, name="value", dtype=object).to_frame()



# ---- names and tables a reader can read: headings, units, rounding ------------------------------
# A heading per results key (tables and figures the notebooks save, and the notebooks' metrics):
# "<notebook>/<key>" first, then "<key>", else :func:`humanize` of the key.
TITLES = {
    # 00_tour
    "latency_summary": "Latency over a few requests: TTFT, TPOT, inter-token gaps, E2E",
    "00_tour/decode_breakdown": "Where a decode step's time goes (hooked components)",
    "00_tour/bench": "Reference engine vs transformers.generate",
    "stream": "Per-token latency of one streamed request",
    "stream_replay": "Per-token latency of one streamed request (replay)",
    "itl_histogram": "Inter-token gaps and TTFT per request",
    # 01_fused_kernels
    "kernels": "Every kernel against eager torch and torch.compile",
    "ceilings": "The device's ceilings: copy bandwidth and matmul rate",
    "01_fused_kernels/decode": "The decode step: eager, fused, fused + CUDA graphs",
    "toggles": "Per-op toggles: one op on Triton at a time",
    "add_rmsnorm_traffic": "Bytes moved by eager add + RMSNorm, op by op",
    "aot_sm90": "Kernels compiled for Hopper (sm_90): registers, shared memory, loads, tensor cores",
    "roofline": "All kernels on one roofline",
    "launches_per_step": "Kernel launches per decode step",
    # 02_kv_tiers
    "kv_layouts": "KV cache size per token and per block",
    "prefix_ttft": "TTFT with and without the prefix cache",
    "requests": "Requests through the paged pool",
    "miss_reasons": "Why prefix-cache lookups missed",
    "offload": "Offloading evicted blocks to host and disk",
    "tier_sweep": "Hot / warm / cold tier configurations swept",
    "pareto_front": "Tier configurations on the Pareto front",
    "tier_controls": "Tier controls: dropping the cold zone vs mean-cold",
    "tier_zones": "Hot / warm / cold zones per layer",
    "physical_zones": "Physical bytes per zone: measured vs formula",
    "physical_eval": "Physical tiers: measured bytes per token and quality",
    "long_context_projection": "Long contexts: tiered KV bytes projected",
    "block_manager_by_hand": "The block manager, step by step",
    "pca_explained": "Variance of the keys explained by PCA rank",
    "tier_pareto": "Memory vs quality of tier configurations (Pareto front)",
    "tier_kl": "KL divergence per tier configuration",
    "live_block_map_mid_run": "KV block map in the middle of the run",
    "live_block_map": "KV block map: free / owned / shared / cached blocks",
    "tier_zone_map": "Hot / warm / cold zone map",
    # 03_prefetch
    "link": "Link bandwidth per block size",
    "copy_compute": "Copy time vs compute time per layer",
    "streaming": "Weight streaming: sync, async and prefetch distance",
    "resident_fraction": "Decode speed vs layers kept resident",
    "engine_options": "Prefetch with the engine's options",
    "kv_lookahead": "KV lookahead: restores hidden behind compute",
    "memory": "Memory",
    "03_prefetch/memory": "Memory while streaming weights",
    "tier_predictors": "Tier predictors: hit rate, stalls and bytes moved",
    "block_size": "Link bandwidth vs block size",
    "distance_sweep": "Decode speed vs prefetch distance",
    "timeline": "Copy / compute timeline",
    "timeline_two_steps": "Copy / compute timeline, two decode steps",
    "tier_timeline_two_steps": "Tier fetch timeline, two decode steps",
    "verdicts": "Verdicts on the articles' claims",
    # 04_scheduler
    "batching": "Static vs continuous batching",
    "chunked_prefill": "Chunked prefill",
    "preemption": "Priorities and preemption",
    "window_sweep": "Micro-batch window sweep",
    "load_table": "Load ramp: stages, goodput and TTFT percentiles",
    "timeline_continuous": "Scheduler timeline: continuous batching",
    "timeline_static": "Scheduler timeline: static batching",
    "load_dashboard": "Load dashboard: percentiles and SLO state",
    "load_timeline": "Load ramp timeline",
    # 05_quantization
    "ladder": "The quantization ladder: perplexity, KL, memory",
    "ladder_steps": "The ladder step by step",
    "range_setters": "Activation ranges: outlier channels per layer",
    "scheme_errors": "Quantization error per scheme",
    "smooth_awq_ranges": "Activation ranges before and after SmoothQuant / AWQ",
    "awq_choices": "AWQ's choices per layer",
    "gptq_layers": "GPTQ per layer: loss vs round-to-nearest",
    "activations_8bit": "8-bit activations",
    "cpu_ops_floor": "CPU ops against their memory floor",
    "cpu_ops": "CPU low-bit ops: speed-up over dense",
    "memory_decode": "Memory and decode speed at a preset's shape",
    "calib_memory_reference": "Calibrator (memory objective), reference text",
    "calib_memory_prose": "Calibrator (memory objective), prose",
    "calib_latency_reference": "Calibrator (latency objective), reference text",
    "calib_latency_prose": "Calibrator (latency objective), prose",
    "calib_domains": "Calibrator: do the two domains choose differently?",
    "calib_uniform_on_texts": "Uniform schemes on each text",
    "perplexity": "Perplexity per scheme",
    "act_q_proj": "Activation outliers: q_proj input",
    "weight_q_proj": "Weight outliers: q_proj",
    "act_down_proj": "Activation outliers: down_proj input",
    "weight_down_proj": "Weight outliers: down_proj",
    "kernel_speed": "Low-bit kernels: speed",
    "calib_sensitivity_reference": "Layer sensitivity, reference text",
    "calib_sensitivity_prose": "Layer sensitivity, prose",
    "calib_pareto_memory_reference": "Memory vs perplexity of the calibrator's mixes, reference text",
    "calib_pareto_memory_prose": "Memory vs perplexity of the calibrator's mixes, prose",
    "calib_pareto_latency_prose": "Latency vs perplexity of the calibrator's mixes, prose",
    # 06_end_to_end
    "workload": "The workload",
    "runs": "Every run of every configuration",
    "skipped": "Layers skipped, and why",
    "summary": "Summary per configuration",
    "stack": "The stack, layer by layer",
    "waterfall": "Which layer buys what (waterfall)",
    "breakdown": "Where the time goes",
    "recommendation": "The SLO's pick",
    "claims": "Claims of the source articles",
    "claims_counts": "Claims: verdicts counted",
    "alone_ttft_p95": "Each layer alone: TTFT P95",
    "alone_tpot_p50": "Each layer alone: TPOT P50",
    "06_end_to_end/memory": "Memory per configuration",
}

_WORDS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E", "kv": "KV", "kl": "KL", "ppl": "perplexity",
          "rel": "rel.", "p50": "P50", "p90": "P90", "p95": "P95", "p99": "P99", "slo": "SLO", "gpu": "GPU",
          "cpu": "CPU", "rss": "RSS", "qps": "req/s", "gbps": "GB/s", "tflops": "TFLOP/s", "mlp": "MLP", "pca": "PCA",
          "aot": "AOT", "sm90": "sm_90", "id": "ID", "lm": "LM", "se": "SE", "std": "SD", "top1": "top-1",
          "frac": "fraction", "err": "error", "pct": "%", "num": "number of", "awq": "AWQ", "gptq": "GPTQ",
          "rtn": "RTN", "smem": "shared memory", "regs": "registers", "ttl": "TTL", "sd": "SD", "io": "I/O",
          "ms": "ms", "us": "µs", "s": "s", "usd": "USD", "qa": "QA", "llm": "LLM", "hf": "HF"}
_TIME_UNITS = {"ms": "ms", "us": "µs", "s": "s", "seconds": "s"}


def humanize(key) -> str:
    """A snake_case key in words, its time unit in brackets at the end: ``ttft_ms_p50`` is
    "TTFT P50 (ms)", ``decode_tokens_per_s`` "decode tokens/s", ``max_err`` "max error",
    ``live_block_map_mid_run`` "live block map mid run".  A name with spaces (written for
    reading already) is returned as it is."""
    text = str(key)
    if " " in text.strip() or not text:
        return text
    text = re.sub(r"_per_s(?=_|$)", "/s", text)
    words = [w for w in re.split(r"_+", text) if w]
    unit = ""
    out = []
    for i, w in enumerate(words):
        low = w.lower()
        per_next = i + 1 < len(words) and words[i + 1].lower() == "per"
        if low in _TIME_UNITS and not (low == "s" and i == 0) and not unit and len(words) > 1 and not per_next:
            unit = _TIME_UNITS[low]
            continue
        if low == "per" and i + 1 < len(words) and words[i + 1].lower() in _TIME_UNITS:
            out.append("per")
            continue
        out.append(_WORDS.get(low, w))
    words_text = " ".join(out).replace(" /s", "/s") or text
    return f"{words_text} ({unit})" if unit else words_text


def title_of(key, notebook: str | None = None) -> str:
    """A heading for a results key: :data:`TITLES` (``"<notebook>/<key>"`` first, then ``key``),
    else :func:`humanize` with a capital first letter."""
    key = str(key)
    title = TITLES.get(f"{notebook}/{key}") if notebook else None
    title = title or TITLES.get(key) or humanize(key)
    return title[:1].upper() + title[1:]


# ---- units and rounding of one column -----------------------------------------------------------
_RATE = re.compile(r"(/\s*s\b|\bper[ _]s\b|_per_s(_|$)|tokens/s)", re.IGNORECASE)


def unit_kind(name) -> str:
    """How the values of a column (or a metric) named ``name`` are shown, from its name:
    "percent" (already in %), "bytes", "ms" / "s" / "us", "err" (scientific when small),
    "fraction" (a share in 0..1, shown in %), "ratio" (×), else "number"."""
    low = str(name).lower()
    tokens = [t for t in re.split(r"[^a-z0-9%]+", low) if t]
    if "%" in low or "pct" in tokens:
        return "percent"
    if "bytes" in tokens or low.endswith("_bytes"):
        return "bytes"
    if not _RATE.search(low):
        if "ms" in tokens or low.startswith("ms_") or "ms/" in low:
            return "ms"
        if "us" in tokens or "µs" in low:
            return "us"
        if "seconds" in tokens or (tokens and tokens[-1] == "s" and len(tokens) > 1) or low in ("s", "wall_s"):
            return "s"
    if any(t in ("err", "error", "errors") or t.endswith("_err") for t in tokens) or low.startswith("max_err"):
        return "err"
    if any(t in ("share", "frac", "fraction", "efficiency", "agreement", "top1", "busy", "reuse") for t in tokens) \
            or "hit rate" in low or "hit_rate" in low or "top-1" in low or low in ("rel", "rel_ppl") \
            or low.startswith("rel_ppl") or "link use" in low:
        return "fraction"
    if any(t in ("ratio", "speedup", "reduction", "vs") for t in tokens) or " / " in low or low.startswith("vs_"):
        return "ratio"
    return "number"


_BINARY = (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10))
DASH = "—"


def fmt_bytes(v) -> str:
    """A size in bytes as B / KiB / MiB / GiB / TiB with one decimal: 19709952 -> "18.8 MiB"."""
    v = float(v)
    for unit, size in _BINARY:
        if abs(v) >= size:
            return f"{v / size:,.1f} {unit}"
    return f"{v:,.0f} B"


def fmt_number(v, digits: int = 4) -> str:
    """``digits`` significant digits, no exponent between 0.001 and 10^15, thousands separated:
    4691.855592 -> "4,692", 0.0123456 -> "0.01235", 3.0 -> "3"."""
    v = float(v)
    if v == 0:
        return "0"
    a = abs(v)
    if a < 1e-3 or a >= 1e15:
        return f"{v:.{max(0, digits - 2)}e}"
    if float(v).is_integer() and a < 1e15:
        return f"{v:,.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(a)))
    text = f"{v:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_time(v, unit: str = "") -> str:
    """A time with one decimal (4,398.8), or two significant digits below 1 (0.031): never 0.0
    for a time that is not 0."""
    v = float(v)
    a = abs(v)
    if a == 0:
        text = "0"
    elif a >= 1:
        text = f"{v:,.1f}"
    elif a >= 1e-3:
        text = f"{v:.2g}"
    else:
        text = f"{v:.1e}"
    return f"{text} {unit}".strip()


def _missing(v) -> bool:
    if v is None:
        return True
    try:
        return isinstance(v, float) and math.isnan(v) or (hasattr(v, "dtype") and bool(v != v))
    except (TypeError, ValueError):
        return False


def format_value(v, kind: str = "number", unit: bool = False) -> str:
    """One value as text for a table: ``kind`` from :func:`unit_kind`; ``unit``: say the unit in
    the text ("10.1 ms", "28.9 %"), as a list of metrics needs; a table says it in the header.
    Missing values (None, NaN) are "—", booleans "yes" / "no", lists joined by commas."""
    if _missing(v):
        return DASH
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return "yes" if v else "no"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    if isinstance(v, str) or not isinstance(v, numbers.Real):
        return str(v)
    v = float(v)
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    if kind == "bytes":
        return fmt_bytes(v)
    if kind in ("ms", "s", "us"):
        return fmt_time(v, {"ms": "ms", "s": "s", "us": "µs"}[kind] if unit else "")
    if kind == "fraction":
        p = 100 * v
        text = f"{p:.1f}" if p == 0 or abs(p) >= 0.1 else f"{p:.2g}"
        return f"{text} %" if unit else text
    if kind == "percent":
        text = f"{v:.2f}" if abs(v) < 10 else f"{v:,.1f}"
        return f"{text} %" if unit else text
    if kind == "ratio":
        return fmt_number(v, 3) + "×"
    if kind == "err":
        return fmt_err(v) if abs(v) < 0.01 else fmt_number(v, 3)
    return fmt_number(v)


def _column_kind(name, values) -> str:
    kind = unit_kind(name)
    nums = [float(x) for x in values if isinstance(x, numbers.Real) and not isinstance(x, bool) and not _missing(x)]
    if kind == "fraction" and nums and max(abs(x) for x in nums) > 5:
        return "number"                    # not a share after all (a count named "...share...")
    if kind == "number" and nums and all(x.is_integer() for x in nums):
        return "number"
    return kind


def column_header(name, kind: str) -> str:
    """A column's header: :func:`humanize` (the time unit in brackets), and "(%)" for a share
    shown in % whose name does not say it."""
    text = humanize(name)
    if kind == "fraction" and "%" not in text:
        text += " (%)"
    return text


_SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)+")


def readable_table(df, max_rows: int | None = None):
    """``df`` as a table of text a reader can read: headers in words with their unit, times
    in ms with one decimal, bytes in KiB / MiB / GiB, shares in %, ratios with ×, small errors
    in scientific notation, integral floats as integers, "—" for a missing value (no NaN), a
    snake_case row label in words (``ttft_ms`` -> "TTFT (ms)"), and a range index left out.
    Returns a DataFrame of strings (the numbers in ``df`` are untouched); its ``attrs`` say which
    columns hold numbers (``numeric``) and whether the index is a plain range (``plain_index``)."""
    import pandas as pd

    if isinstance(df, pd.Series):
        df = df.to_frame()
    if max_rows is not None:
        df = df.head(max_rows)
    kinds = [_column_kind(col, df.iloc[:, i].tolist()) for i, col in enumerate(df.columns)]
    row_kinds = _row_kinds(df, kinds)
    out, headers, numeric = {}, [], []
    for i, col in enumerate(df.columns):
        values = df.iloc[:, i].tolist()
        kind = kinds[i]
        head = column_header(col, kind)
        while head in headers:
            head += " "
        headers.append(head)
        counts = all(isinstance(v, numbers.Integral) for v in values if not _missing(v))
        if row_kinds and not counts:            # one unit per row (a row per metric): its name says which
            out[head] = [format_value(v, rk) for v, rk in zip(values, row_kinds)]
        else:
            out[head] = [format_value(v, kind) for v in values]
        present = [v for v in values if not _missing(v)]
        numeric.append(bool(present) and all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                             and type(v).__name__ != "bool_" for v in present))
    frame = pd.DataFrame(out, columns=headers)
    idx = df.index
    plain = isinstance(idx, pd.RangeIndex) or (idx.name is None and list(idx) == list(range(len(idx))))
    if not plain:
        kind = _column_kind(idx.name or "", list(idx))
        # metric rows (ttft_ms, tokens_per_s): their names in words with the unit; other labels
        # (op and module names a reader types: attention_decode, lm_head) as they are
        labels = [(humanize(v) if row_kinds and _SNAKE.fullmatch(v) else v) if isinstance(v, str)
                  else format_value(v, kind) for v in idx]
        frame.index = pd.Index(labels, name=humanize(idx.name) if idx.name is not None else None)
    else:
        frame.index = pd.RangeIndex(len(frame))
    frame.attrs["plain_index"] = plain
    frame.attrs["numeric"] = numeric
    return frame


def _row_kinds(df, column_kinds) -> list[str] | None:
    """A unit per row when the rows are metrics (``ttft_ms``, ``tokens_per_s`` ...) and the
    columns are statistics (mean, p50 ...) with no unit of their own; else None."""
    labels = list(df.index)
    if not labels or any(k != "number" for k in column_kinds) or not all(isinstance(v, str) for v in labels):
        return None
    kinds = [unit_kind(v) for v in labels]
    if sum(k != "number" for k in kinds) * 2 < len(kinds):
        return None
    return kinds


LONG_TEXT = 48      # a text cell longer than this wraps (others stay on one line)
CLIP_TEXT = 240     # ... and one longer than this scrolls inside a few lines (class "clip")


def table_html(df, classes: str = "data") -> str:
    """:func:`readable_table` of ``df`` as escaped HTML: one header row (the index, when it is
    not a plain range, as the first column), numbers right-aligned on one line, short text on
    one line, long text wrapped (class ``long``)."""
    import html as _html

    t = readable_table(df)
    esc = _html.escape
    show_index = not t.attrs.get("plain_index")
    numeric = t.attrs.get("numeric") or [False] * len(t.columns)
    head = (f"<th>{esc(str(t.index.name or ''))}</th>" if show_index else "") + "".join(
        f"<th class='{'num' if n else 'txt'}'>{esc(str(c))}</th>" for c, n in zip(t.columns, numeric))
    rows = []
    for label, row in zip(t.index, t.itertuples(index=False)):
        cells = [f"<th class='txt'>{esc(str(label))}</th>"] if show_index else []
        for text, n in zip(row, numeric):
            text = str(text)
            cls = "num" if n else ("txt long" if len(text) > LONG_TEXT else "txt")
            body = esc(text) if len(text) <= CLIP_TEXT else f"<div class='clip'>{esc(text)}</div>"
            cells.append(f"<td class='{cls}'>{body}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f"<table class='{esc(classes)}'><thead><tr>{head}</tr></thead><tbody>" + "".join(rows)
            + "</tbody></table>")

"""How the notebooks show numbers: times in ms without exponents, errors in scientific notation
(never rounded to 0.0), the kernel-bench rows' formats and columns, a results dict as a table."""

from __future__ import annotations

import math

# How the notebook formats kernel-bench rows, and the columns it shows.
FORMATS = {"ms_median": "{:.4f}", "ms_min": "{:.4f}", "ms_max": "{:.4f}", "achieved": "{:.3g}", "frac_of_ceiling": "{:.2%}",
           "vs_eager": "{:.3g}", "max_err": "{:.2e}"}
SHOW = ["timing", "ms_median", "ms_min", "ms_max", "achieved", "metric", "frac_of_ceiling", "vs_eager", "max_err", "status", "note"]


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
    """The notebook's results as a one-column table for display: errors (keys with ``err``) in
    scientific notation, other floats with four significant digits (the saved values are untouched)."""
    import pandas as pd

    def cell(key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return v
        if "err" in key:
            return fmt_err(v)
        return v if isinstance(v, int) else ("-" if math.isnan(v) else f"{v:.4g}")

    return pd.Series({k: cell(k, v) for k, v in results.items()}, name="value", dtype=object).to_frame()


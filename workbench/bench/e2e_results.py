"""What an end-to-end ablation's runs say: tables, comparisons, the waterfall, the candidates for
the recommendation, the flat rows of the GPU table.

:class:`AblationResults` is the reading half of :class:`~workbench.bench.end_to_end.Ablation`
(which inherits it): everything here reads ``self.configs`` (each with its ``runs``, ``quality``,
``spec``), ``self.stack`` (the stack's steps), ``self.skipped`` (the layers not measured or not
stacked, with the reason), ``self.cfg`` and ``self.noise``, and changes nothing.
"""

from __future__ import annotations

import math

import numpy as np

from workbench.bench.e2e_configs import Config, layer_label
from workbench.measure.compare import compare_samples

METRICS = {   # metric -> (label, unit, lower is better): the comparisons every configuration gets
    "ttft_ms_p95": ("TTFT p95", "ms", True), "tpot_ms_p50": ("TPOT p50", "ms", True),
    "e2e_ms_p95": ("E2E p95", "ms", True), "tokens_per_s": ("throughput", "tokens/s", False)}


class AblationResults:
    """Tables, comparisons and the waterfall of an ablation's runs (see the module docstring)."""

    def config(self, name: str) -> Config:
        for c in self.configs:
            if c.name == name:
                return c
        raise KeyError(f"no configuration named {name!r}; have {[c.name for c in self.configs]}")

    def samples(self, name: str, metric: str) -> list[float]:
        return [r[metric] for r in self.config(name).runs if r.get(metric) is not None]

    def compare(self, name: str, against: str, metric: str):
        """:func:`compare_samples` of one metric's per-run values (interleaved rounds), or None
        when a side has no value."""
        a, b = self.samples(name, metric), self.samples(against, metric)
        if not a or not b:
            return None
        label, unit, lower = METRICS.get(metric, (metric, "", True))
        return compare_samples(a, b, names=(name, against), metric=label, unit=unit, lower_is_better=lower,
                               noise=self.noise, better_word=None if lower else "higher")

    def runs_frame(self):
        """One row per run: configuration, group, round, every metric."""
        import pandas as pd

        return pd.DataFrame([{"config": c.name, "group": c.group, **r} for c in self.configs for r in c.runs])

    def _medians(self, c: Config) -> dict:
        keys = [k for k in (c.runs[0] if c.runs else {}) if k not in ("round", "engine", "miss_reasons")]
        out = {}
        for k in keys:
            v = [r[k] for r in c.runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            out[k] = float(np.median(v)) if v else None
        return out

    def summary(self):
        """One row per configuration: medians over its runs, memory, quality, and its verdicts
        against the baseline (each with the runs' ranges and the noise floor)."""
        import pandas as pd

        rows = []
        for c in self.configs:
            if not c.runs:
                continue
            row = {"config": c.name, "group": c.group,
                   "layers": " + ".join(layer_label(x, self.cfg) for x in c.layers) or "-", "runs": len(c.runs),
                   **self._medians(c), **{k: v for k, v in c.quality.items() if k != "scored"}}
            for metric, (label, _, _) in METRICS.items():
                cmp = None if c.name == "baseline" else self.compare(c.name, "baseline", metric)
                row[f"vs baseline: {label}"] = cmp.verdict if cmp is not None else "-"
            row["engine"] = c.runs[-1]["engine"]
            rows.append(row)
        return pd.DataFrame(rows).set_index("config")

    def skipped_frame(self):
        import pandas as pd

        return pd.DataFrame(self.skipped, columns=["stage", "layer", "layers", "kind", "reason"])

    def waterfall(self, metric: str = "ttft_ms_p95") -> list[dict]:
        """The stack step by step for ``metric``: ``start`` (the baseline), one ``step`` per layer
        (its median, the change from the previous step, that comparison's verdict and noise floor;
        or ``skipped`` with the reason), then ``total`` (the last step against the baseline)."""
        out, prev = [], None
        for st in self.stack:
            label = layer_label(st["layer"], self.cfg) if st["layer"] != "baseline" else "baseline"
            c = self.config(st["config"]) if st["config"] is not None else None
            vals = self.samples(c.name, metric) if c is not None and not c.failed else []
            if not vals:
                out.append({"kind": "skipped", "layer": st["layer"], "label": label, "config": None,
                            "reason": st["reason"] or (c.error if c is not None else None)})
                continue
            row = {"kind": "start" if prev is None else "step", "layer": st["layer"], "label": label, "config": c.name,
                   "value": float(np.median(vals)), "lo": min(vals), "hi": max(vals)}
            if prev is not None:
                cmp = self.compare(c.name, prev["config"], metric)
                row.update(prev=prev["value"], delta=row["value"] - prev["value"],
                           rel=row["value"] / prev["value"] - 1 if prev["value"] else None, verdict=cmp.verdict,
                           winner=cmp.winner, within_noise=cmp.winner is None, noise=cmp.noise)
            out.append(row)
            prev = row
        first = next((r for r in out if r["kind"] == "start"), None)
        if first is not None and prev is not first:
            cmp = self.compare(prev["config"], first["config"], metric)
            out.append({"kind": "total", "layer": "stack", "label": "the stack", "config": prev["config"],
                        "value": prev["value"], "prev": first["value"], "delta": prev["value"] - first["value"],
                        "rel": prev["value"] / first["value"] - 1 if first["value"] else None, "verdict": cmp.verdict,
                        "winner": cmp.winner, "within_noise": cmp.winner is None, "noise": cmp.noise})
        return out

    def stack_frame(self, metrics=("ttft_ms_p95", "tpot_ms_p50", "tokens_per_s")):
        """The stack's steps (skipped ones with their reason), each step's medians and its verdicts
        against the step before."""
        import pandas as pd

        rows, prev = [], None
        for st in self.stack:
            row = {"step": st["step"], "layer": "baseline" if st["step"] == 0 else layer_label(st["layer"], self.cfg),
                   "config": st["config"] or "-", "status": "skipped" if st["config"] is None else "in the stack",
                   "reason": st["reason"] or ""}
            if st["config"] is not None:
                c = self.config(st["config"])
                med = self._medians(c)
                for m in metrics:
                    row[m] = med.get(m)
                if prev is not None:
                    for m in metrics:
                        cmp = self.compare(c.name, prev, m)
                        row[f"vs previous: {METRICS[m][0]}"] = cmp.verdict if cmp is not None else "-"
                row.update(kv_bytes=med.get("kv_bytes"), weights_bytes=med.get("weights_bytes"),
                           agreement=c.quality.get("agreement"), rel_ppl=c.quality.get("rel_ppl"))
                prev = c.name
            rows.append(row)
        return pd.DataFrame(rows)

    def candidates(self) -> list[dict]:
        """The measured configurations as :func:`recommend` reads them."""
        out = []
        for c in self.configs:
            if not c.runs or c.failed:
                continue
            med = self._medians(c)
            out.append({"name": c.name, "layers": list(c.layers), "ttft_ms_p95": self.samples(c.name, "ttft_ms_p95"),
                        "tokens_per_s": self.samples(c.name, "tokens_per_s"), "rel_ppl": c.quality.get("rel_ppl"),
                        "agreement": c.quality.get("agreement"),
                        "memory_bytes": (med.get("kv_bytes") or 0) + (med.get("weights_bytes") or 0)})
        return out


def report_rows(ab) -> list[dict]:
    """Flat rows (scalars only): one per measured configuration (its medians, memory, quality,
    verdicts against the baseline, its step in the stack), then one per layer that was not
    measured or not stacked (``status``: cannot combine / not here / failed, and the reason)."""
    summary = ab.summary().reset_index()
    steps = {st["config"]: st["step"] for st in ab.stack if st["config"] is not None}
    rows = []
    for rec in summary.to_dict("records"):
        row = {"config": rec.pop("config"), "status": "measured"}
        row["stack_step"] = steps.get(row["config"])
        row.update({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()
                    if v is None or isinstance(v, (str, int, float, bool))})
        rows.append(row)
    for s in ab.skipped:
        rows.append({"config": f"{s['stage']}: {s['layers']}", "status": s["kind"], "group": s["stage"],
                     "layers": s["layers"], "reason": s["reason"]})
    return rows

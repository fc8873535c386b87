"""Notebook 06 (end to end) runs top to bottom on a CPU in smoke mode, claims lab included, and
writes the sidecar keys the batch report reads.

It has a file of its own so that pytest-xdist's ``--dist loadfile`` runs it on the other worker
than ``tests/lab/test_notebooks.py`` (it takes a few minutes: the whole ablation, then the claims).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "06_end_to_end.ipynb"
BUNDLED_WEIGHTS = ROOT / "data" / "reference-model" / "model.safetensors"

EXPECTED_KEYS = {"baseline_ttft_ms_p95", "baseline_tpot_ms_p50", "baseline_tokens_per_s", "stack_ttft_ms_p95",
                 "stack_vs_baseline_ttft_p95_ratio", "stack_vs_baseline_verdict", "stack_layers", "layers_not_stacked",
                 "configs_measured", "combinations_refused", "slo", "recommended_config", "recommendation_reason",
                 "alone_prefix_cache_ttft_p95_ratio", "alone_prefix_cache_ttft_p95_verdict",
                 "alone_prefix_cache_agreement", "alone_quant_agreement", "alone_tiers_ttft_p95_verdict",
                 "claims_total", "threads", "noise_threshold"}
EXPECTED_TABLES = {"workload", "runs", "skipped", "summary", "stack", "waterfall", "recommendation", "claims",
                   "claims_counts"}
EXPECTED_FIGURES = {"workload", "alone_ttft_p95", "alone_tpot_p50", "memory", "waterfall"}


@pytest.mark.notebook
@pytest.mark.slow
def test_end_to_end_notebook_runs_in_smoke_mode(tmp_path):
    pytest.importorskip("papermill")
    from workbench.lab.results import load_results
    from workbench.lab.runner import execute_one, resolve_kernel

    if not BUNDLED_WEIGHTS.is_file():
        pytest.fail(f"{BUNDLED_WEIGHTS} is missing: the bundled model is part of the repository")
    sidecar = tmp_path / "06_end_to_end.results.json"
    rec = execute_one(NOTEBOOK, tmp_path / NOTEBOOK.name, {"device": "cpu", "results_path": str(sidecar)}, 900,
                      resolve_kernel())
    assert rec["status"] == "ok", f"{NOTEBOOK.name} failed after {rec['seconds']:.0f} s: {rec['error']} " \
                                  f"(executed copy: {rec['output']})"
    res = load_results(sidecar)
    metrics = res["metrics"]
    missing = EXPECTED_KEYS - set(metrics)
    assert not missing, f"results lack {sorted(missing)}"
    assert EXPECTED_TABLES <= set(res["tables"]), sorted(set(res["tables"]))
    assert EXPECTED_FIGURES <= set(res["figures"]), sorted(set(res["figures"]))
    assert metrics["combinations_refused"] >= 3 and metrics["configs_measured"] >= 10
    assert metrics["alone_prefix_cache_agreement"] >= 0.9
    summary = res["tables"]["summary"]
    assert "baseline" in set(summary["config"]) and summary["ttft_ms_p95"].notna().all()

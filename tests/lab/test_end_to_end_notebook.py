"""Notebook 06 (end to end) runs top to bottom on a CPU and writes the sidecar keys the batch
report reads (through papermill: see the test).

It runs in ``mode="tiny"``, the device check's size (7 requests, one evaluation document of 192
tokens): every configuration, refusal, table and figure of smoke mode, with the ablation in 37 s
instead of 56 s (papermill alone on a 2-core machine; 54 vs 73 s for the notebook). The Quick
start's batch run (and CI's) runs it in smoke mode, its default. Its claims lab section runs on
three claims, one of each kind (a serving claim, with its HTTP server; a model claim; a GPU claim
read from the committed results): every claim is measured in smoke mode by
``tests/bench/test_claims_*.py``, and the Quick start's batch run measures all of them in this notebook.

It has a file of its own so that pytest-xdist's ``--dist loadfile`` runs it on the other worker
than ``tests/lab/test_notebooks.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("nbformat")

from lab_browser import lab_session, plotly_outputs, run_and_check  # noqa: E402,F401 - lab_session: a fixture

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "06_end_to_end.ipynb"
BUNDLED_WEIGHTS = ROOT / "data" / "reference-model" / "model.safetensors"

EXPECTED_KEYS = {"baseline_ttft_ms_p95", "baseline_tpot_ms_p50", "baseline_tokens_per_s", "stack_ttft_ms_p95",
                 "stack_tokens_per_s", "stack_vs_baseline_tokens_per_s_ratio", "stack_vs_baseline_tokens_per_s_verdict",
                 "stack_vs_baseline_ttft_p95_ratio", "stack_vs_baseline_verdict", "stack_layers", "layers_not_stacked",
                 "configs_measured", "combinations_refused", "slo", "recommended_config", "recommendation_reason",
                 "alone_prefix_cache_ttft_p95_ratio", "alone_prefix_cache_ttft_p95_verdict",
                 "alone_prefix_cache_agreement", "alone_quant_agreement", "alone_tiers_ttft_p95_verdict",
                 "claims_total", "threads", "noise_threshold"}
EXPECTED_TABLES = {"workload", "runs", "skipped", "summary", "stack", "waterfall", "recommendation", "claims",
                   "claims_counts", "breakdown"}
EXPECTED_FIGURES = {"workload", "alone_ttft_p95", "alone_tpot_p50", "memory", "waterfall", "breakdown"}
CLAIMS = ["first_sse_chunk_64b", "kv_size_llama2_7b_32k", "full_stack_4x"]


@pytest.mark.notebook
@pytest.mark.slow
def test_end_to_end_notebook_runs_in_tiny_mode(tmp_path):
    if not BUNDLED_WEIGHTS.is_file():
        pytest.fail(f"{BUNDLED_WEIGHTS} is missing: the bundled model is part of the repository")
    # Through papermill, not the browser: 06 has no live view, and this file runs on the worker
    # that does not carry the browser runs of 00-05 (~500 s). (Its claims section once stalled in
    # JupyterLab and in a batch run: the load generator's closed loop kept sending after its time
    # was up, tests/load/test_loadgen.py::test_run_ends_when_its_time_is_up_while_requests_close_their_streams.)
    res = run_and_check(NOTEBOOK, tmp_path, None, EXPECTED_KEYS, parameters={"mode": "tiny", "claims": CLAIMS})
    metrics = res["metrics"]
    assert metrics["claims_total"] == len(CLAIMS)
    assert list(res["tables"]["claims"]["id"]) == CLAIMS
    missing = EXPECTED_KEYS - set(metrics)
    assert not missing, f"results lack {sorted(missing)}"
    assert EXPECTED_TABLES <= set(res["tables"]), sorted(set(res["tables"]))
    assert EXPECTED_FIGURES <= set(res["figures"]), sorted(set(res["figures"]))
    # refused on a CPU: CUDA graphs (the one combination the engine cannot build here); the static decode
    # step joins the stack over the paged pool, and the memory layers are measured alone
    assert metrics["combinations_refused"] >= 1 and metrics["configs_measured"] >= 10
    assert "compile" in metrics["stack_layers"] or "static decode" in metrics["stack_layers"]
    breakdown = res["tables"]["breakdown"]
    assert list(breakdown["config"])[0] == "baseline" and breakdown["model_ms"].gt(0).all()
    assert metrics["alone_prefix_cache_agreement"] >= 0.9
    summary = res["tables"]["summary"]
    assert "baseline" in set(summary["config"]) and summary["ttft_ms_p95"].notna().all()
    # the executed notebook holds the replay of the rounds (frames and a slider) and the SLO explorer,
    # whose slider, moved to its first step (a bound nothing meets), changes the recommendation offline
    figures = list(plotly_outputs(tmp_path / NOTEBOOK.name))
    assert any(f.get("frames") and f["layout"].get("sliders") for f in figures), "no replay in the executed 06"
    explorer = [f for f in figures if f["layout"].get("meta") == "wb-slo-explorer"]
    assert explorer and explorer[0]["layout"].get("sliders"), "no SLO explorer with a slider in the executed 06"
    from workbench.lab.browser import Browser, chromium_available

    if chromium_available() is None:
        import re

        with Browser() as browser:
            before, after = (re.sub(r"<[^>]+>", "", t) for t in slider_text_of(browser, explorer[0]))
        assert before.startswith("recommendation:") and after.startswith("recommendation:"), (before, after)
        assert after != before, f"moving the SLO slider did not change the recommendation: {before!r}"


def slider_text_of(browser, fig: dict) -> tuple[str, str]:
    from workbench.lab.browser import slider_text

    return slider_text(browser, fig, at=0.0)


PROGRESS_CELLS = ["ab = Ablation(llm, wl, E2E", "live = AblationLive(ab"]   # the build and the rounds


@pytest.mark.notebook
@pytest.mark.slow
def test_the_long_cells_show_progress_within_10_s_in_jupyterlab(lab_session):  # noqa: F811 - the imported fixture
    """In JupyterLab: 06's long cells (the build, the rounds: 84 s and 234 s of [*] alone before)
    show a progress bar within 10 s of their start; the run stops once both have."""
    if lab_session is None:
        pytest.skip("no browser here")
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from workbench.lab.browser import progress_delays

    nb = parameterize_notebook(load_notebook_node(str(NOTEBOOK)), {"device": "cpu", "mode": "tiny", "claims": False,
                                                                   "results_path": None})
    nbformat.write(nb, str(lab_session.root / NOTEBOOK.name))
    delays = progress_delays(lab_session.browser, lab_session.lab, NOTEBOOK.name, PROGRESS_CELLS, timeout=420)
    assert set(delays) == set(PROGRESS_CELLS), f"not every long cell started within 420 s: {delays}"
    slow = {cell: d for cell, d in delays.items() if d is None or d > 10}
    assert not slow, f"cells without progress within 10 s of their start (None: none at all): {slow}"


"""Every notebook runs top to bottom on a CPU, once, as a learner runs it: opened in JupyterLab in
headless Chromium, Run All (tests/lab/lab_browser.py), with
no error output, no "Error displaying widget", each live view updating while its cell runs,
and the file not marked modified by opening it; screenshots and a report (front page first)
go to runs/browser/<run id>/. Without chromium + Playwright the same notebooks run through
papermill as the batch runner runs them (``WORKBENCH_BROWSER_TESTS=1`` makes that a failure).
Every committed notebook is stripped of outputs and has a cell tagged ``parameters``.

The notebooks with a ``tiny`` mode (``TINY``) run in it: every cell, view and assert of smoke mode, with
fewer repeats and less text (the Quick start's batch run, command 1, runs every notebook at its
default smoke size, whose measurements the report shows); the others with their default parameters.

The notebooks turn their checks into asserts, so running them is a test.  Each writes a
results sidecar (workbench.lab.results) to the injected ``results_path``; the keys checked below
are the ones the batch report relies on, and every headline of the report's front page
(workbench.lab.front_page) must be among them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

from lab_browser import LIVE_VIEWS, lab_session, run_and_check, write_browser_report  # noqa: E402,F401

# the kernelspec the Quick start registers: a notebook naming another is marked modified on open
KERNELSPEC = {"display_name": "Python 3 (workbench)", "language": "python", "name": "python3"}

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# run in tests/lab/test_end_to_end_notebook.py instead, so that xdist (--dist loadfile) puts it on the other worker
RUN_ELSEWHERE = {"06_end_to_end"}
RUN_HERE = [p for p in NOTEBOOKS if p.stem not in RUN_ELSEWHERE]
# smoke mode's path on smaller sizes: papermill alone on a 2-core machine, smoke -> tiny:
# 03 72 -> 31 s, 04 91 -> 60 s, 05 76 -> 58 s
TINY = {"03_prefetch", "04_scheduler", "05_quantization"}
BUNDLED_WEIGHTS = ROOT / "data" / "reference-model" / "model.safetensors"

# Metrics a notebook's sidecar must hold (notebooks not listed must write at least one metric).
EXPECTED_KEYS = {
    "00_tour": {"ttft_ms_p50", "tpot_ms_p50", "itl_ms_p99", "decode_tokens_per_s_p50", "step_ms_plain",
                "hook_overhead_pct", "greedy_token_agreement", "bench_decode_speedup", "bench_decode_verdict",
                "threads", "noise_threshold"},
    "01_fused_kernels": {"max_err_add_rmsnorm", "max_err_swiglu", "max_err_rope", "max_err_flash_prefill",
                         "max_err_paged_decode", "launches_per_step_eager", "launches_per_step_fused",
                         "greedy_token_agreement"},
    "04_scheduler": {"static_vs_continuous_ttft_p95_ratio", "chunked_itl_max_ratio", "preemptions_recompute",
                     "preemptions_swap", "throughput_speedup", "scheduler_share_batch32", "identical_greedy_tokens",
                     "slo_p95_ttft_ms_no_guard", "slo_p95_ttft_ms_guard", "slo_trips",
                     "verdict: static vs continuous: TTFT p95", "verdict: chunked prefill: ITL max",
                     "verdict: throughput: concurrent vs sequential", "threads", "noise_threshold"},
    "03_prefetch": {"copy_compute_ratio", "hidden_share", "best_distance", "prefetch_hit_rate_best",
                    "prefetch_efficiency_best", "link_ceiling_disk_gbps", "link_ceiling_host_gbps",
                    "identical_greedy_tokens", "kv_lookahead_hidden_share", "kv_lookahead_ttft_p95_ratio",
                    "tiers_hit_rate_none", "tiers_hit_rate_step", "tiers_stall_ms_per_step_none",
                    "tiers_stall_ms_per_step_step", "tiers_bytes_moved_per_step_step", "tiers_timeline_hit_rate",
                    "threads", "noise_threshold"},
    "02_kv_tiers": {"ttft_p50_reduction", "hit_rate", "bookkeeping_cost", "identical_greedy_tokens",
                    "best_tier_reduction", "best_tier_rel_ppl", "prefix_ttft_verdict", "offload_host_verdict",
                    "physical_reduction_measured", "physical_measured_vs_formula", "physical_identical_to_accounted",
                    "claim_8k_64k_verdict", "threads", "noise_threshold", "eviction_reuse_lru", "eviction_reuse_fifo",
                    "eviction_reuse_yours", "hash_chain_predicts_hits", "slot_mapping_key_error"},
    "05_quantization": {"rel_ppl_bf16", "rel_ppl_w8a16", "rel_ppl_w4a16_pt", "rel_ppl_w4a16_pc", "rel_ppl_w4a16_g128",
                        "rel_ppl_se_w4a16_g128", "rel_ppl_w4a16_g128_awq", "rel_ppl_w4a16_g128_gptq", "rel_ppl_w4a8",
                        "rel_ppl_w8a8", "rel_ppl_w8a8_smooth_0_5", "linear_bytes_w4a16_vs_bf16",
                        "identical_greedy_tokens", "awq_vs_rtn_verdict", "gptq_vs_rtn_verdict",
                        "per_channel_claim_verdict", "int4_decode_cpu_verdict", "outlier_max_median_down_proj",
                        "max_err_w4a16_kernel", "cpu_int4pack_speedup_m1", "threads", "noise_threshold",
                        "calib_memory_reference", "calib_memory_prose", "calib_memory_prose_ppl_pct",
                        "calib_latency_reference", "calib_domains_differ_memory", "calib_recipe_reproduced",
                        "exercise_w4a16_asym_identical", "exercise_dequantize_error_gap"},
}


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", RUN_HERE, ids=[p.stem for p in RUN_HERE])
def test_notebook_runs(path, tmp_path, lab_session):  # noqa: F811 - the imported fixture
    if not BUNDLED_WEIGHTS.is_file():
        pytest.fail(f"{BUNDLED_WEIGHTS} is missing: the bundled model is part of the repository")
    run_and_check(path, tmp_path, lab_session, EXPECTED_KEYS.get(path.stem, set()),
                  parameters={"mode": "tiny"} if path.stem in TINY else None)


@pytest.mark.notebook
@pytest.mark.slow
def test_browser_report(lab_session):  # noqa: F811 - the imported fixture
    """After this file's notebooks (pytest keeps a file's order): the run folder's report, front
    page first, renders in Chromium with every figure drawn and every screenshot loaded."""
    if lab_session is None:
        pytest.skip("no browser: the notebooks ran through papermill")
    report = write_browser_report(lab_session)
    print(f"browser run report: {report}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_clean(path):
    nb = nbformat.read(str(path), as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs or execution counts; strip them before committing"
    assert "widgets" not in nb.metadata, f"{path.name}: saved widget state in metadata; strip it"
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1 and tagged[0].cell_type == "code", \
        f"{path.name}: needs exactly one code cell tagged 'parameters' (papermill injects after it)"
    assert nb.metadata.get("kernelspec") == KERNELSPEC, \
        f"{path.name}: kernelspec {nb.metadata.get('kernelspec')}; use {KERNELSPEC} (what the Quick start registers)"
    info = nb.metadata.get("language_info", {})
    assert {"codemirror_mode", "file_extension", "mimetype", "name", "nbconvert_exporter", "pygments_lexer",
            "version"} <= set(info), f"{path.name}: language_info {info}: keep the whole block the kernel reports " \
                                     "(JupyterLab marks a notebook modified on open when it differs)"
    src = tagged[0].source
    if LIVE_VIEWS.get(path.stem):        # the batch runner sets live=False: each figure shown once
        assert "live =" in src, f"{path.name}: has live views, so its parameters cell should define live"
    for name in ("device", "model", "results_path"):   # the runner and the test inject these
        assert f"{name} =" in src, f"{path.name}: the parameters cell should define {name!r}"
    assert "smoke" in src, f"{path.name}: the parameters cell should have a smoke/full switch"
    if path.stem in TINY:                # the browser test runs it so
        assert '"tiny"' in src, f"{path.name}: the parameters cell should describe its tiny mode"
    first = nb.cells[0].source.lower() if nb.cells and nb.cells[0].cell_type == "markdown" else ""
    assert any(w in first for w in ("tutorial", "how-to", "explanation", "purpose")), \
        f"{path.name}: the first cell should be markdown stating the notebook's purpose " \
        "(tutorial / how-to / explanation)"


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no *.ipynb"

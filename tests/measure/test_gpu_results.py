"""workbench.measure.gpu_results: the latest committed GPU table, and the JSON -> CSV
conversions scripts/device_check.sh uses (on sample outputs of `workbench bench --json`,
`workbench sched-bench --json` and `workbench prefix-bench --json`, run at small sizes on a CPU)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from datetime import datetime, UTC
from pathlib import Path

import pytest

from workbench.measure import gpu_results as gr

ROOT = Path(__file__).resolve().parents[2]

ENGINE_JSON = json.loads(
    '{"model": "bundled", "device": "cpu", "device_name": "AMD EPYC, 2 cores", "dtype": "float32", '
    '"threads": 1, "threads_policy": {"threads": 1, "policy": "measured", "step_ms": {"1": 12.054, "2": '
    '65.954}, "spread_ms": {"1": [10.167, 13.94], "2": [60.029, 71.879]}, "seconds": 2.919, "note": ""}, '
    '"torch": "2.13.0+cpu", "transformers": "5.24.0", "config": {"model": null, "device": "cpu", "dtype":'
    ' null, "prompt_tokens": 64, "max_tokens": 8, "num_prompts": 2, "repeats": 2, "warmup": 1, "seed": 0,'
    ' "backend": null, "threads": null}, "workbench": {"ttft_ms_p50": 30.288, "decode_tokens_per_s_p50": '
    '91.437, "ttft_ms_jitter": 1.623, "decode_tokens_per_s_min": 75.994, "decode_tokens_per_s_max": '
    '95.128}, "transformers_generate": {"ttft_ms_p50": 34.769, "decode_tokens_per_s_p50": 77.94, '
    '"ttft_ms_jitter": 1.711, "decode_tokens_per_s_min": 77.173, "decode_tokens_per_s_max": 78.583}, '
    '"decode_speedup": 1.173, "ttft_ratio": 0.871, "decode_verdict": "within noise (1.17x, ranges '
    'overlap)", "ttft_verdict": "workbench lower by 1.15x", "decode_winner": null, "ttft_winner": '
    '"workbench", "greedy_token_agreement": 1.0, "backends": {"backend": "eager", "backends": '
    '"rmsnorm=eager rope=eager swiglu=eager attention_prefill=eager attention_decode=eager", "ops": '
    '{"rmsnorm": "eager", "rope": "eager", "swiglu": "eager", "attention_prefill": "eager", '
    '"attention_decode": "eager"}, "triton_interpreter": false}}')

SCHED_JSON = json.loads(
    '{"config": {"streams": 4, "prompt_tokens": 48, "max_tokens": 8, "rounds": 3, "rate": 8.0, '
    '"trace_requests": 8, "long_prompt_tokens": 128, "long_every": 4, "token_budget": 64, "windows_ms": '
    '[0.0, 5.0], "overhead_batch": 8, "overhead_tokens": 4, "seed": 0, "batch_invariant": null}, '
    '"device": "cpu", "device_name": "AMD EPYC, 2 cores", "dtype": "float32", "torch": "2.13.0+cpu", '
    '"threads": 1, "throughput": {"streams": 4, "batch_invariant": true, "sequential_tokens_per_s": '
    '42.166, "concurrent_tokens_per_s": 142.426, "speedup": 3.378, "runs": {"sequential": [40.602, '
    '42.637, 42.166], "concurrent": [142.426, 142.929, 125.417]}, "verdict": "concurrent faster by '
    '3.38x", "winner": "concurrent", "identical_tokens": true, "max_batch": 4}, "chunked": '
    '[{"chunked_prefill": false, "requests": 8, "finished": 8, "ttft_ms_p50": 58.245, "ttft_ms_p95": '
    '119.015, "short_ttft_ms_p95": 106.955, "itl_ms_p95": 45.803, "itl_ms_max": 112.24, "queue_ms_p50": '
    '17.111, "queue_ms_p95": 67.919, "steps": 38, "mean_batch": 1.684, "tokens_per_s": 56.922, "wall_s": '
    '1.124}, {"chunked_prefill": true, "requests": 8, "finished": 8, "ttft_ms_p50": 57.787, '
    '"ttft_ms_p95": 145.318, "short_ttft_ms_p95": 104.178, "itl_ms_p95": 46.393, "itl_ms_max": 49.533, '
    '"queue_ms_p50": 12.783, "queue_ms_p95": 53.259, "steps": 40, "mean_batch": 1.7, "tokens_per_s": '
    '55.684, "wall_s": 1.149}], "window": [{"window_ms": 0.0, "requests": 8, "finished": 8, '
    '"ttft_ms_p50": 86.998, "ttft_ms_p95": 165.439, "short_ttft_ms_p95": 127.828, "itl_ms_p95": 57.34, '
    '"itl_ms_max": 57.34, "queue_ms_p50": 14.767, "queue_ms_p95": 74.218, "steps": 36, "mean_batch": '
    '1.889, "tokens_per_s": 54.095, "wall_s": 1.183}, {"window_ms": 5.0, "requests": 8, "finished": 8, '
    '"ttft_ms_p50": 114.605, "ttft_ms_p95": 193.562, "short_ttft_ms_p95": 159.487, "itl_ms_p95": 54.159, '
    '"itl_ms_max": 69.151, "queue_ms_p50": 13.093, "queue_ms_p95": 76.748, "steps": 37, "mean_batch": '
    '1.892, "tokens_per_s": 52.426, "wall_s": 1.221}], "overhead": {"batch": 8, "steps": 3, '
    '"schedule_us_p50": 55.623, "post_us_p50": 118.126, "step_ms_p50": 25.008, "schedule_share": 0.002, '
    '"post_share": 0.005}, "chunked_identical_tokens": true, "window_identical_tokens": true}')

PREFIX_JSON = json.loads(
    '{"config": {"num_requests": 8, "system_tokens": 900, "max_tokens": 4, "block_size": 16, '
    '"unique_prompt_tokens": 256, "rounds": 1, "seed": 0}, "system_prompt_tokens": 901, "device": "cpu", '
    '"pool_blocks": 240, "shared_prefix": {"off": {"ttft_ms_p50": 375.606, "ttft_ms_std": 27.258, '
    '"ttft_ms_p95": 401.027, "ttft_ms_std_after_first": 27.369}, "on": {"ttft_ms_p50": 32.531, '
    '"ttft_ms_std": 105.433, "ttft_ms_p95": 40.292, "ttft_ms_std_after_first": 6.793}, '
    '"ttft_p50_reduction": 11.546, "ttft_verdict": "prefix cache on lower by 12.83x", "ttft_winner": '
    '"prefix cache on", "ttft_comparison": {"metric": "TTFT of requests after the first", "unit": "ms", '
    '"lower_is_better": true, "noise": 0.0, "samples": {"prefix cache off": [374.016, 377.195, 345.335, '
    '381.976, 401.027, 425.174, 340.739], "prefix cache on": [28.165, 39.477, 29.401, 23.133, 40.292, '
    '35.661, 22.574]}, "median": {"prefix cache off": 377.195, "prefix cache on": 29.401}, "min": '
    '{"prefix cache off": 340.739, "prefix cache on": 22.574}, "max": {"prefix cache off": 425.174, '
    '"prefix cache on": 40.292}, "ratio": 12.829, "round_ratio_min": 9.555, "round_ratio_max": 16.512, '
    '"separated": true, "paired": true, "winner": "prefix cache on", "verdict": "prefix cache on lower by'
    ' 12.83x"}, "jitter_off_ms": 27.258, "jitter_on_ms": 105.433, "hit_tokens": 6272, "prompt_tokens": '
    '7355, "hit_rate": 0.853, "miss_reasons": {"no_shared_prefix": 1, "shorter_than_block": 7}, '
    '"identical_greedy_tokens": true}, "no_sharing": {"tokens_per_s_off": 32.265, "tokens_per_s_on": '
    '32.293, "relative_cost": -0.001, "tokens_per_s_runs_off": [32.265], "tokens_per_s_runs_on": '
    '[32.293], "manager_share_off": 0.005, "manager_share_on": 0.003, "bookkeeping_cost": -0.002, '
    '"identical_greedy_tokens": true, "tokens_per_s_verdict": "within noise (1.00x, ranges overlap)"}, '
    '"block_manager_stats_shared": {"requests": 8, "prompt_tokens": 7355, "hit_tokens": 6272, "hit_rate":'
    ' 0.853, "full_hits": 0, "partial_hits": 7, "misses": {"no_shared_prefix": 1, "shorter_than_block": '
    '7}, "evictions": 0, "cow_copies": 0, "restored_blocks": 0}}')


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _folder(root: Path, name: str, tables: dict[str, str], meta: dict | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for table, text in tables.items():
        (d / f"{table}.csv").write_text(text)
    if meta is not None:
        (d / "meta.json").write_text(json.dumps(meta))
    return d


# ---- latest / describe ------------------------------------------------------------------------------

def test_newest_folder_wins_by_date_then_name(tmp_path):
    _folder(tmp_path, "nvidia-h200-2026-11-03", {"sched_bench": "a,b\n1,2\n"}, {"device_name": "NVIDIA H200"})
    _folder(tmp_path, "nvidia-a100-2026-12-01", {"sched_bench": "a,b\n3,4\n"}, {"device_name": "NVIDIA A100"})
    _folder(tmp_path, "nvidia-h200-2026-12-01", {"sched_bench": "a,b\n5,6\n"}, {"device_name": "NVIDIA H200"})
    _folder(tmp_path, "nvidia-h100-2026-10-30", {"sched_bench": "a,b\n7,8\n"})
    t = gr.latest("sched_bench", root=tmp_path)
    assert t is not None and t.folder.name == "nvidia-h200-2026-12-01"
    assert (t.device, t.date, t.table) == ("NVIDIA H200", "2026-12-01", "sched_bench")
    assert t.meta == {"device_name": "NVIDIA H200"}
    assert t.label == str(t) == "NVIDIA H200, 2026-12-01"
    assert t.frame.to_dict("records") == [{"a": 5, "b": 6}]
    assert gr.latest("sched_bench.csv", root=tmp_path).folder == t.folder      # the suffix is optional


def test_a_second_run_of_the_day_wins_and_a_missing_table_falls_back(tmp_path):
    _folder(tmp_path, "nvidia-h200-2026-12-01", {"sched_bench": "x\n1\n", "prefix_bench": "x\n1\n"})
    _folder(tmp_path, "nvidia-h200-2026-12-01-2", {"sched_bench": "x\n2\n"})
    _folder(tmp_path, "nvidia-h200-2026-12-01-10", {"sched_bench": "x\n10\n"})
    assert gr.latest("sched_bench", root=tmp_path).folder.name == "nvidia-h200-2026-12-01-10"
    # the newest run has no prefix_bench.csv (its step failed): the previous one is still the latest
    older = gr.latest("prefix_bench", root=tmp_path)
    assert older.folder.name == "nvidia-h200-2026-12-01"
    assert older.device == "nvidia-h200" and older.meta == {}       # no meta.json: the folder's slug


def test_a_dry_run_folder_is_never_shown_as_a_gpu_figure(tmp_path):
    _folder(tmp_path, "nvidia-h200-2026-12-01", {"sched_bench": "x\n1\n"}, {"device_name": "NVIDIA H200"})
    _folder(tmp_path, "cpu-2026-12-02", {"sched_bench": "x\n2\n"}, {"device_name": "AMD EPYC", "dry_run": True})
    assert gr.latest("sched_bench", root=tmp_path).folder.name == "nvidia-h200-2026-12-01"


def test_device_check_script_parses_and_its_caps_fit_the_budget():
    import re
    import subprocess

    script = ROOT / "scripts" / "device_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    caps = [int(c) for c in re.findall(r"^\s*step \w+ (\d+) \d+ ", text, re.M)]
    budget = int(re.search(r"DEVICE_CHECK_BUDGET_S:-(\d+)", text).group(1))
    reserve = int(re.search(r"^RESERVE=(\d+)", text, re.M).group(1))
    assert len(caps) >= 5 and budget <= 480
    # the start-up (the probe's torch import, nvidia-smi, the output folder) is charged to the budget too
    assert sum(caps) <= budget - reserve - 15, (caps, budget, reserve)


def test_missing_table_or_root_is_none_and_describe_says_so(tmp_path):
    assert gr.latest("engine_bench", root=tmp_path / "nowhere") is None
    _folder(tmp_path, "nvidia-h200-2026-12-01", {"sched_bench": "x\n1\n"}, {"device_name": "NVIDIA H200"})
    (tmp_path / "README.md").write_text("not a folder")
    (tmp_path / "scratch").mkdir()                  # no date in the name: not a result folder
    assert gr.latest("engine_bench", root=tmp_path) is None
    assert gr.describe("engine_bench", root=tmp_path) == \
        "on a GPU: not measured yet (no results/gpu/*/engine_bench.csv)"
    assert gr.describe("sched_bench", root=tmp_path) == \
        "on a GPU: NVIDIA H200, 2026-12-01 (nvidia-h200-2026-12-01/sched_bench.csv)"


def test_default_root_is_the_repositorys_results_gpu():
    assert gr.RESULTS_ROOT == ROOT / "results" / "gpu"
    assert gr.DRY_RUN_DIR == ROOT / "runs" / "device_check"
    found = gr.latest("engine_bench")            # whatever is committed: a table or None
    assert found is None or found.folder.parent == gr.RESULTS_ROOT


def test_results_folder_is_not_git_ignored():
    for name in ("summary.csv", "meta.json", "device_check.log"):
        r = subprocess.run(["git", "check-ignore", "-q", f"results/gpu/nvidia-h200-2026-12-01/{name}"],
                           cwd=ROOT, capture_output=True)
        if r.returncode == 128:
            pytest.skip("not a git checkout")
        assert r.returncode == 1, f"results/gpu/*/{name} must not be git-ignored"
    assert subprocess.run(["git", "check-ignore", "-q", "runs/device_check/summary.csv"], cwd=ROOT).returncode == 0


# ---- the conversions ------------------------------------------------------------------------------

def test_engine_bench_is_one_row_per_side(tmp_path):
    rows = gr.engine_rows(ENGINE_JSON)
    assert [r["side"] for r in rows] == ["workbench", "transformers.generate"]
    wb, hf = rows
    assert wb["ttft_ms_p50"] == 30.288 and hf["decode_tokens_per_s_p50"] == 77.94
    for r in rows:
        for col in ("decode_tokens_per_s_min", "decode_tokens_per_s_max", "decode_speedup", "ttft_ratio",
                    "greedy_token_agreement", "threads", "dtype", "device", "prompt_tokens", "max_tokens"):
            assert col in r, col
    assert wb["decode_speedup"] == hf["decode_speedup"] == 1.173
    assert wb["threads"] == 1 and wb["dtype"] == "float32" and wb["threads_policy"] == "measured"
    assert "config" not in wb and "workbench" not in wb          # nested objects are flattened or left out
    path = gr.write_csv(rows, tmp_path / "engine_bench.csv")
    back = _read(path)
    assert [r["side"] for r in back] == ["workbench", "transformers.generate"]
    assert float(back[1]["ttft_ms_p50"]) == 34.769


def test_sched_bench_long_format():
    rows = gr.long_rows(SCHED_JSON)
    assert all(set(r) == set(gr.LONG_COLUMNS) for r in rows)
    by = {(r["section"], r["config"], r["metric"]): r["value"] for r in rows}
    assert by[("throughput", "", "speedup")] == 3.378
    assert by[("throughput", "", "verdict")] == "concurrent faster by 3.38x"
    assert by[("chunked", "chunked_prefill=True", "ttft_ms_p95")] == 145.318
    assert by[("window", "window_ms=5.0", "tokens_per_s")] == 52.426
    assert by[("overhead", "", "schedule_us_p50")] == 55.623
    assert by[("config", "", "windows_ms")] == "0.0 5.0"          # a setting that is a list
    assert by[("run", "", "device")] == "cpu" and by[("run", "", "chunked_identical_tokens")] is True
    assert not any(r["metric"].startswith("runs") for r in rows)   # raw samples stay in the JSON


def test_prefix_bench_long_format():
    rows = gr.long_rows(PREFIX_JSON)
    by = {(r["section"], r["config"], r["metric"]): r["value"] for r in rows}
    assert by[("shared_prefix", "", "on.ttft_ms_p50")] == 32.531
    assert by[("shared_prefix", "", "hit_rate")] == 0.853
    assert by[("shared_prefix", "", "miss_reasons.shorter_than_block")] == 7
    assert by[("shared_prefix", "", "ttft_comparison.median.prefix cache off")] == 377.195
    assert by[("no_sharing", "", "relative_cost")] == -0.001
    assert by[("config", "", "num_requests")] == 8 and by[("run", "", "pool_blocks")] == 240
    assert not any("samples" in r["metric"] for r in rows)


def test_quant_bench_is_one_row_per_kernel_measurement(tmp_path):
    work = _work(tmp_path, [("quant_bench", "ok")])
    rows = [{"m": 1, "N": 4096, "K": 4096, "path": "gemv split_k=4", "dense_ms": 0.05, "w4a16_ms": 0.02,
             "w4a16_speedup": 2.5, "nested": {"dropped": 1}},
            {"m": 64, "N": 4096, "K": 4096, "path": "gemm", "dense_ms": 0.06, "w4a16_ms": 0.05, "w4a16_speedup": 1.2}]
    (work / "quant_bench.out").write_text(json.dumps({"kernels": rows, "kernels_table": "..."}))
    out = tmp_path / "out"
    assert gr.write_tables(out, work)["quant_bench"] == "ok"
    got = _read(out / "quant_bench.csv")
    assert [r["m"] for r in got] == ["1", "64"] and "nested" not in got[0] and got[0]["w4a16_speedup"] == "2.5"


def test_calibrate_is_one_row_per_measured_mix(tmp_path):
    work = _work(tmp_path, [("calibrate", "ok")])
    cands = [{"key": "unquantized", "label": "42 dense", "degradation": 0.0, "cost": 3.1, "ms": 3.1,
              "samples": [3, 3.2]},
             {"key": "uniform w4a16:g128", "label": "42 w4a16:g128", "degradation": 0.012, "cost": 1.9, "ms": 1.9,
              "assignment": {"a": "w4a16:g128"}}]
    res = {"candidates": cands, "recommendation": {"key": "uniform w4a16:g128"}}
    (work / "calibrate.out").write_text(json.dumps({"result": res, "files": {}}))
    out = tmp_path / "out"
    assert gr.write_tables(out, work)["calibrate"] == "ok"
    got = _read(out / "calibrate.csv")
    assert [r["key"] for r in got] == ["unquantized", "uniform w4a16:g128"]
    assert [r["recommended"] for r in got] == ["False", "True"]
    assert "samples" not in got[0] and "assignment" not in got[1]


def test_read_json_output_skips_a_line_before_the_object(tmp_path):
    p = tmp_path / "x.out"
    p.write_text("some warning\n" + json.dumps({"a": {"b": 1}}) + "\n")
    assert gr.read_json_output(p) == {"a": {"b": 1}}
    p.write_text("no json here\n")
    with pytest.raises(ValueError):
        gr.read_json_output(p)


def test_slug():
    assert gr.slug("NVIDIA H200") == "nvidia-h200"
    assert gr.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gr.slug("  ") == "unknown-device"


# ---- one device check's folder, end to end --------------------------------------------------------

def _work(tmp_path: Path, steps: list[tuple[str, str]]) -> Path:
    work = tmp_path / "raw"
    work.mkdir()
    lines = [f"{name}\t{status}\t{i + 3}\t60" for i, (name, status) in enumerate(steps)]
    (work / "steps.tsv").write_text("\n".join(lines) + "\n")
    (work / "engine_bench.out").write_text(json.dumps(ENGINE_JSON))
    (work / "sched_bench.out").write_text(json.dumps(SCHED_JSON))
    (work / "prefix_bench.out").write_text("x" * 10 + "\n" + json.dumps(PREFIX_JSON))
    (work / "kernel_bench.csv").write_text("time,section,op\n1,kernels,rmsnorm\n")
    for name, _ in steps:
        (work / f"{name}.log").write_text("".join(f"line {i}\n" for i in range(100)))
    return work


def test_start_and_write_tables_on_a_gpu(tmp_path):
    probe = {"cuda_available": True, "device_name": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0",
             "cuda": "13.0", "python": "3.12.3"}
    now = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    root = tmp_path / "results" / "gpu"
    cuda, out = gr.start(probe, root=root, now=now)
    assert cuda and out == root / "nvidia-h200-2026-12-01"
    assert gr.start(probe, root=root, now=now)[1] == root / "nvidia-h200-2026-12-01-2"   # same day again
    meta = json.loads((out / "meta.json").read_text())
    for key in ("device_name", "date", "utc_time", "torch", "triton", "cuda", "git_commit", "python"):
        assert key in meta, key
    assert (meta["device_name"], meta["date"], meta["utc_time"]) == ("NVIDIA H200", "2026-12-01",
                                                                     "2026-12-01T09:30:00Z")
    assert meta["triton"] == "3.6.0" and meta["dry_run"] is False

    work = _work(tmp_path, [("tests", "ok"), ("kernels_bench", "ok"), ("sched_bench", "timeout"),
                            ("engine_bench", "ok"), ("prefix_bench", "ok")])
    done = gr.write_tables(out, work)
    assert done == {"engine_bench": "ok", "kernel_bench": "ok", "sched_bench": "step timeout", "prefix_bench": "ok",
                    "engine_fast_bench": "not run", "prefetch_bench": "not run", "tier_bench": "not run",
                    "quant_bench": "not run", "calibrate": "not run", "decode_stack": "not run", "e2e": "not run",
                    "warmup": "not run"}
    names = sorted(p.name for p in out.iterdir())
    assert names == ["device_check.log", "engine_bench.csv", "kernel_bench.csv", "meta.json", "prefix_bench.csv",
                     "summary.csv"]
    assert len(names) <= 8          # what one call of the device tool brings back
    summary = _read(out / "summary.csv")
    assert [r["step"] for r in summary] == ["tests", "kernels_bench", "sched_bench", "engine_bench", "prefix_bench"]
    assert list(summary[0]) == gr.SUMMARY_COLUMNS and list(summary[0])[:4] == ["step", "status", "seconds", "limit_s"]
    assert summary[2]["status"] == "timeout"
    assert _read(out / "prefix_bench.csv")[0] == {"section": "config", "config": "", "metric": "num_requests",
                                                  "value": "8"}
    log = (out / "device_check.log").read_text().splitlines()
    assert len(log) < 5 * 2 * (gr.LOG_TAIL_LINES + 1)      # tails only
    assert "line 99" in log and "line 0" not in log
    assert json.loads((out / "meta.json").read_text())["tables"]["sched_bench"] == "step timeout"
    t = gr.latest("engine_bench", root=root)
    assert t.label == "NVIDIA H200, 2026-12-01" and list(t.frame["side"]) == ["workbench", "transformers.generate"]


def test_without_cuda_it_writes_the_dry_run_folder_never_results(tmp_path):
    probe = {"cuda_available": False, "torch": "2.13.0+cpu", "triton": "3.9.0", "cuda": None}
    root, dry = tmp_path / "results" / "gpu", tmp_path / "runs" / "device_check"
    dry.mkdir(parents=True)
    (dry / "sched_bench.csv").write_text("stale\n")
    cuda, out = gr.start(probe, root=root, dry_run_dir=dry)
    assert not cuda and out == dry and not root.exists()
    assert not (dry / "sched_bench.csv").exists()         # the previous dry run's tables are gone
    assert json.loads((dry / "meta.json").read_text())["dry_run"] is True


def test_command_line(tmp_path):
    work = _work(tmp_path, [("engine_bench", "ok"), ("prefix_bench", "failed rc=1")])
    out = tmp_path / "out"
    env_cmd = [sys.executable, "-m", "workbench.cli.gpu_results"]
    probe = json.dumps({"cuda_available": False, "torch": "x"})
    r = subprocess.run(env_cmd + ["start", "--probe", probe, "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"0\t{out}\n"
    r = subprocess.run(env_cmd + ["write-tables", str(out), "--work", str(work)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "engine_bench.csv   ok" in r.stdout and "prefix_bench.csv   step failed rc=1" in r.stdout
    assert (out / "engine_bench.csv").is_file() and not (out / "prefix_bench.csv").exists()


def test_module_imports_only_the_standard_library():
    # the module and the four it re-exports from, alone (workbench/__init__ and workbench/measure/__init__
    # are stand-ins here: the package itself imports torch)
    code = ("import sys, types; "
            f"[setattr(sys.modules.setdefault(n, types.ModuleType(n)), '__path__', [p]) for n, p in "
            f"(('workbench', {str(ROOT / 'workbench')!r}), "
            f"('workbench.measure', {str(ROOT / 'workbench/measure')!r}))]; "
            "import workbench.measure.gpu_results as m; "
            "assert m.latest and m.write_tables and m.CompileLog and m.start; "
            "print(sorted(n for n in ('pandas', 'torch', 'numpy') if n in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

"""The GPU claims (workbench.bench.claims.gpu_*): "not measured" without committed GPU results, naming the
table and the device-check step; a verdict from a temporary results folder written by
workbench.measure.gpu_results' own writers (start + write_tables, as scripts/device_check.sh does)."""

from __future__ import annotations

import json

import pytest

from workbench.bench import claims as lab
from workbench.bench.claims import gpu_bandwidth, gpu_stack, gpu_tables
from workbench.bench.claims.catalogue import GPU
from workbench.measure import gpu_results

IDS = ["full_stack_4x", "fused_launches", "prefetch_bandwidth", "w4a16_speed", "decode_bandwidth_bound"]


def test_the_five_claims_are_registered_for_the_gpu():
    assert [c.id for c in GPU] == IDS
    assert all(c.device == "gpu" for c in GPU)


def test_not_measured_without_results(tmp_path):
    res = lab.run_claims(IDS, ctx=lab.ClaimContext(gpu_root=tmp_path / "none"))
    assert [r.verdict for r in res] == [lab.NOT_MEASURED] * 5
    by = {r.id: r for r in res}
    assert "engine_bench.csv" in by["full_stack_4x"].reason and "step engine_bench" in by["full_stack_4x"].reason
    assert "kernel_bench.csv" in by["fused_launches"].reason and "kernels_bench" in by["fused_launches"].reason
    assert "prefetch_bench.csv" in by["prefetch_bandwidth"].reason
    assert "quant_bench.csv" in by["w4a16_speed"].reason
    assert "Not written by the device check" in by["w4a16_speed"].reason
    assert lab.problems(res) == []                    # a GPU claim may be "not measured"


def _kernel_rows():
    from workbench.bench.kernel_timing import ROW_FIELDS

    base = {"device": "cuda", "device_name": "NVIDIA H200", "dtype": "bfloat16", "status": "ok"}
    rows = [{**base, "section": "ceilings", "op": "copy", "provider": "torch", "metric": "GB/s", "achieved": 4000.0},
            {**base, "section": "ceilings", "op": "matmul", "provider": "torch", "metric": "TFLOP/s",
             "achieved": 800.0}]
    sizes = "batch=1 context=512 layers=16 hidden=2048"
    for prov, ms, lo, hi, launches, frac in (("eager", 10.0, 9.8, 10.2, 600, 0.30), ("fused", 4.0, 3.9, 4.1, 120, 0.75),
                                             ("fused+graphs", 2.0, 1.98, 2.02, 40, 0.95)):
        rows.append({**base, "section": "decode", "op": "decode_step", "provider": prov, "sizes": sizes,
                     "ms_median": ms, "ms_min": lo, "ms_max": hi, "launches_per_step": launches, "metric": "GB/s",
                     "frac_of_ceiling": frac, "ceiling_name": "copy bandwidth", "ceiling": 4000.0})
    return rows, ROW_FIELDS


@pytest.fixture()
def results_root(tmp_path):
    """A results root with one GPU run, written through gpu_results (start, then write_tables)."""
    root, work = tmp_path / "gpu", tmp_path / "work"
    work.mkdir()
    cuda, folder = gpu_results.start({"cuda_available": True, "device_name": "NVIDIA H200", "torch": "2.11.0",
                                      "triton": "3.6.0", "cuda": "12.8"}, root=root)
    assert cuda and folder.parent == root

    def side(ttft, p50, lo, hi):
        return {"ttft_ms_p50": ttft, "decode_tokens_per_s_p50": p50, "decode_tokens_per_s_min": lo,
                "decode_tokens_per_s_max": hi, "ttft_ms_jitter": 0.1}

    engine = {"model": "bundled", "device": "cuda", "device_name": "NVIDIA H200",
              "configs": {"reference": side(20.0, 100.0, 95.0, 105.0), "cuda-graphs": side(4.5, 450.0, 440.0, 460.0)},
              "transformers_generate": side(25.0, 80.0, 78.0, 82.0), "config": {"prompt_tokens": 64, "max_tokens": 64}}
    prefetch = {"verdict": {"hit_rate": {"claim": "prefetch hit rate >= 89%", "config": "d=2",
                                         "measured": {"median": 0.80, "min": 0.75, "max": 0.85}},
                            "link_use": {"measured_sync": {"median": 0.60, "min": 0.58, "max": 0.62},
                                         "measured_best": {"median": 0.95, "min": 0.94, "max": 0.96},
                                         "comparison": "d=2 higher by 1.58x"}}}
    quant = {"kernels": [{"N": n, "K": k, "m": m, "dense_ms": 0.020, "dense_ms_min": 0.019, "dense_ms_max": 0.021,
                          "w4a16_ms": 0.008 if m == 1 else 0.03, "w4a16_ms_min": 0.0078 if m == 1 else 0.029,
                          "w4a16_ms_max": 0.0082 if m == 1 else 0.031}
                         for n, k in ((4096, 4096), (11008, 4096)) for m in (1, 16)]}
    for step, data in (("engine_bench", engine), ("prefetch_bench", prefetch), ("quant_bench", quant)):
        (work / f"{step}.out").write_text("a line of text first\n" + json.dumps(data))
    rows, fields = _kernel_rows()
    gpu_results.write_csv(rows, work / "kernel_bench.csv", fields)
    (work / "steps.tsv").write_text("".join(f"{s}\tok\t10\t40\n" for s in ("kernels_bench", "engine_bench",
                                                                             "prefetch_bench", "quant_bench")))
    done = gpu_results.write_tables(folder, work)
    assert all(done[t] == "ok" for t in ("engine_bench", "kernel_bench", "prefetch_bench", "quant_bench")), done
    return root, folder


def test_verdicts_from_a_results_folder(results_root):
    root, folder = results_root
    res = {r.id: r for r in lab.run_claims(IDS, ctx=lab.ClaimContext(gpu_root=root))}
    expect = {"full_stack_4x": lab.NOT_MEASURED,     # decode 4.19..4.84x; TTFT 4.4x of medians only (no range)
              "fused_launches": lab.HOLDS,           # 600 -> 40 launches (15x), 10 -> 2 ms (4.85..5.15x)
              "prefetch_bandwidth": lab.FAILS,       # hit rate 75..85 % < 89 %
              "w4a16_speed": lab.NOT_MEASURED,       # per-layer bound 2.32..2.69x at m = 1: cannot confirm the model's
              "decode_bandwidth_bound": lab.HOLDS}   # 93..96 % of copy bandwidth; intensity <= 1 < ridge 200 FLOP/B
    assert {k: r.verdict for k, r in res.items()} == expect
    for r in res.values():
        assert f"results/gpu/{folder.name}/" in r.reason and "NVIDIA H200" in r.reason and r.figure.strip("- ")
    assert "cuda-graphs" in res["full_stack_4x"].figure
    assert res["prefetch_bandwidth"].values["hit_ok"] is False and res["prefetch_bandwidth"].values["link_ok"] is True
    assert res["w4a16_speed"].values["speedup"] == pytest.approx(2.5)
    assert res["w4a16_speed"].values["per_m"][16.0]["speedup"] == pytest.approx(2 / 3)   # the larger-m rows count
    assert "whole quantized model" in res["w4a16_speed"].reason
    assert "low end is unknown" in res["full_stack_4x"].reason and "320 -> 75 ms" in res["full_stack_4x"].figure
    assert res["decode_bandwidth_bound"].values["intensity_bound"] == pytest.approx(1.0)
    assert "not checked" in res["decode_bandwidth_bound"].reason                   # eager vs the article's 41 %
    assert lab.problems(list(res.values())) == []


def test_a_dry_run_folder_is_not_a_gpu_result(results_root):
    root, folder = results_root
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps(meta | {"dry_run": True}))
    res = lab.run_claims(["fused_launches"], ctx=lab.ClaimContext(gpu_root=root))
    assert res[0].verdict == lab.NOT_MEASURED


def test_rules_on_synthetic_numbers():
    ref = {"side": "reference", "ttft_ms_p50": 20.0, "decode_tokens_per_s_p50": 100.0, "decode_tokens_per_s_min": 90.0,
           "decode_tokens_per_s_max": 110.0}
    fast = {"side": "compile", "ttft_ms_p50": 19.0, "decode_tokens_per_s_p50": 420.0, "decode_tokens_per_s_min": 400.0,
            "decode_tokens_per_s_max": 430.0}
    r = gpu_stack.full_stack_rule([ref, fast])
    assert r["verdict"] == lab.FAILS and "straddles it" in r["why"]          # decode 3.6..4.8x straddles 4x
    # the low end decides, not the medians: 4.4x medians, TTFT range 3.6..5.5x -> within noise
    ref_t = {**ref, "ttft_ms_p50_min": 18.0, "ttft_ms_p50_max": 22.0}
    fast_t = {**fast, "ttft_ms_p50": 4.5, "ttft_ms_p50_min": 4.0, "ttft_ms_p50_max": 5.0,
              "decode_tokens_per_s_p50": 500.0, "decode_tokens_per_s_min": 480.0, "decode_tokens_per_s_max": 520.0}
    r = gpu_stack.full_stack_rule([ref_t, fast_t])
    assert r["ttft_ratio"] == pytest.approx(20 / 4.5) and r["ttft_range"] == pytest.approx([3.6, 5.5])
    assert r["verdict"] == lab.FAILS and "TTFT 4.44x (range 3.60..5.50x) straddles" in r["why"]
    fast_t.update(ttft_ms_p50_min=4.2, ttft_ms_p50_max=4.4)                  # 18 / 4.4 = 4.09x at the low end
    assert gpu_stack.full_stack_rule([ref_t, fast_t])["verdict"] == lab.HOLDS
    assert gpu_stack.full_stack_rule([ref, {**fast_t, "ttft_ms_p50_min": None}])["verdict"] == lab.NOT_MEASURED
    assert gpu_tables.at_least(4.1, 4.5, 4.0) == lab.HOLDS and gpu_tables.at_least(3.9, 4.5, 4.0) == lab.FAILS
    rows = [{"N": 4096, "K": 4096, "dense_ms": 0.02, "dense_ms_min": 0.019, "dense_ms_max": 0.021,
             "w4a16_ms": 0.012, "w4a16_ms_min": 0.011, "w4a16_ms_max": 0.013}]
    assert gpu_bandwidth.w4a16_rule(rows)["verdict"] == lab.FAILS                # even the bound: 1.46..1.91x < 2.1x
    fast_rows = [{**rows[0], "w4a16_ms": 0.008, "w4a16_ms_min": 0.0078, "w4a16_ms_max": 0.0082}]
    assert gpu_bandwidth.w4a16_rule(fast_rows)["verdict"] == lab.NOT_MEASURED    # a bound above 2.1x confirms nothing
    # one m whose bound reaches 2.1x: the rule cannot refute the claim
    assert gpu_bandwidth.w4a16_rule(rows + [{**fast_rows[0], "m": 16}])["verdict"] == lab.NOT_MEASURED
    krows, _ = _kernel_rows()
    dec = [{"provider": r["provider"], "sizes": r["sizes"], "dtype": r["dtype"], "ms_median": r["ms_median"],
            "ms_min": r["ms_min"], "ms_max": r["ms_max"], "frac_of_ceiling": r["frac_of_ceiling"]}
           for r in krows if r["section"] == "decode"]
    assert gpu_bandwidth.bandwidth_rule(dec, 4000.0, 800.0)["verdict"] == lab.HOLDS
    big = [{**d, "sizes": d["sizes"].replace("batch=1", "batch=256")} for d in dec]   # intensity <= 256 > ridge 200
    b = gpu_bandwidth.bandwidth_rule(big, 4000.0, 800.0)
    assert b["verdict"] == lab.FAILS and b["intensity_bound"] == 256 and "not shown" in b["why"]


def test_fused_rule_without_eager_launches():
    rows = [{"provider": "eager", "launches_per_step": None, "ms_median": 10.0, "ms_min": 9.8, "ms_max": 10.2},
            {"provider": "fused", "launches_per_step": 120.0, "ms_median": 2.0, "ms_min": 1.9, "ms_max": 2.1}]
    r = gpu_stack.fused_rule(rows)                                 # no TypeError on the missing count
    assert r["verdict"] == lab.FAILS and r["launch_ratio"] is None and "not counted for eager" in r["why"]
    p = gpu_bandwidth.prefetch_rule((0.95, 0.93, 0.97), 0.6, (0.95, 0.94, 0.96), "within noise (1.02x, ranges overlap)")
    assert p["hit_ok"] and not p["link_ok"] and p["verdict"] == lab.FAILS


def test_full_stack_prefers_the_end_to_end_table(results_root):
    root, folder = results_root
    base = {"config": "baseline", "status": "measured", "stack_step": 0, "ttft_ms_p50": 400.0, "ttft_ms_p95": 820.0,
            "e2e_ms_p50": 4000.0, "e2e_ms_p95": 4700.0}
    stack = {"config": "stack 4", "status": "measured", "stack_step": 4, "layers": "paged + prefix + graphs",
             "ttft_ms_p50": 95.0, "ttft_ms_p95": 190.0, "e2e_ms_p50": 900.0, "e2e_ms_p95": 1100.0,
             "vs baseline: TTFT p95": "stack 4 lower by 4.32x", "vs baseline: E2E p95": "stack 4 lower by 4.27x"}
    skipped = {"config": "stack: tiers", "status": "cannot combine", "reason": "tiers need per-sequence caches"}
    gpu_results.write_csv([base, stack, skipped], folder / "e2e.csv")
    r = lab.run_claims(["full_stack_4x"], ctx=lab.ClaimContext(gpu_root=root))[0]
    # medians only (what report_rows writes today): 4.3x of medians cannot establish 4x
    assert r.verdict == lab.NOT_MEASURED and "e2e.csv" in r.reason and "low end is unknown" in r.reason
    assert r.values["e2e_ratio"] == pytest.approx(4700 / 1100)
    base.update(ttft_ms_p95_min=800.0, ttft_ms_p95_max=840.0, e2e_ms_p95_min=4600.0, e2e_ms_p95_max=4800.0)
    stack.update(ttft_ms_p95_min=185.0, ttft_ms_p95_max=195.0, e2e_ms_p95_min=1080.0, e2e_ms_p95_max=1120.0)
    gpu_results.write_csv([base, stack, skipped], folder / "e2e.csv")
    r = lab.run_claims(["full_stack_4x"], ctx=lab.ClaimContext(gpu_root=root))[0]
    assert r.verdict == lab.HOLDS and r.values["e2e_range"][0] == pytest.approx(4600 / 1120)   # 4.11x at the low end
    stack.update(e2e_ms_p95_max=1250.0)                                           # low end 3.68x: straddles 4x
    gpu_results.write_csv([base, stack, skipped], folder / "e2e.csv")
    r = lab.run_claims(["full_stack_4x"], ctx=lab.ClaimContext(gpu_root=root))[0]
    assert r.verdict == lab.FAILS and "straddles" in r.reason
    stack.update(e2e_ms_p95_max=1120.0)
    stack["vs baseline: E2E p95"] = "within noise (4.27x, ranges overlap)"       # not beyond noise: no verdict
    gpu_results.write_csv([base, stack, skipped], folder / "e2e.csv")
    r = lab.run_claims(["full_stack_4x"], ctx=lab.ClaimContext(gpu_root=root))[0]
    assert r.verdict == lab.FAILS and "within noise" in r.reason

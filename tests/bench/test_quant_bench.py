"""The quantization benchmark: quality rows (fp32 reference, paired standard error, a failed
recipe recorded), memory / decode rows at a preset's shape, and the CLI's tables."""

from __future__ import annotations

import json
import math

import pytest

from workbench.bench.quant import paired_stats, preset_rows, quality_rows


def test_paired_stats_of_identical_nll_is_zero():
    import torch

    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    st = paired_stats(a, a)
    assert st["rel_ppl"] == 0 and st["rel_ppl_se"] == 0 and st["tokens"] == 3
    st = paired_stats(a + 0.01, a)
    assert st["rel_ppl"] == pytest.approx(math.exp(0.01) - 1)


def test_quality_rows_record_failures_and_keep_going(bundled_llm):
    r = quality_rows(["fp32", "w3a16", "w8a16"], docs=1, calibration_docs=1, context=64)
    rows = {row["recipe"]: row for row in r["rows"]}
    assert rows["fp32"]["rel_ppl"] == 0 and rows["fp32"]["top1"] == 1 and rows["fp32"]["error"] is None
    assert "w3a16" in rows["w3a16"]["error"] and "expected one of" in rows["w3a16"]["error"]
    w8 = rows["w8a16"]
    assert w8["error"] is None and w8["name"] == "w8a16-per-channel-sym-rtn"
    assert abs(w8["rel_ppl"]) < 0.05 and w8["tokens"] == 63
    assert 0.45 < w8["linear_vs_bf16"] < 0.55                 # int8 + one fp32 scale per row


def test_preset_rows_bytes_and_decode():
    r = preset_rows("tiny", variants=("fp32", "bf16", "w4a16:pc", "w8a8"), decode_steps=2, prompt_len=4)
    rows = {row["variant"]: row for row in r["rows"]}
    assert all(row["error"] is None for row in rows.values()), rows
    assert rows["bf16"]["linear_bytes"] * 2 == rows["fp32"]["linear_bytes"]
    assert rows["w4a16:pc"]["linear_vs_bf16"] < 0.3            # 4 bits + one fp32 scale per row of 64 / 160
    assert rows["w8a8"]["placement"]["layers"] == {"cpu": 14}      # 2 layers x 7 linears, torch._int_mm
    assert all(row["ms_min"] <= row["ms_per_token"] <= row["ms_max"] for row in rows.values())


def test_cli_quant_bench(capsys, bundled_llm):
    from workbench.cli.main import main

    assert main(["quant-bench", "--recipes", "fp32,w4a16:g32", "--docs", "1", "--context", "64", "--preset", "tiny",
                 "--decode-steps", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["recipe"] for r in res["quality"]["rows"]] == ["fp32", "w4a16:g32"]
    assert [r["variant"] for r in res["preset"]["rows"]][:2] == ["fp32", "bf16"]
    assert main(["quant-bench", "--recipes", "fp32", "--docs", "1", "--context", "64", "--preset", "none"]) == 0
    out = capsys.readouterr().out
    assert "rel ppl +- se" in out and "MEASURED" in out
    assert main(["quant-bench", "--docs", "0", "--preset", "none"]) == 2

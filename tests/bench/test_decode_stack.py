"""``workbench decode-stack`` at a tiny CPU size: the plumbing, not the speed.

Timings are this machine's and are not asserted.  What is asserted: every row has the table's
columns; a configuration the engine refuses (CUDA graphs on a CPU) is a row with status ``refused``
and the engine's reason, and the others still run; the paged configuration reports greedy token
agreement with the contiguous baseline over the same prompts; on a CPU the batch-1 bandwidth
fraction is computed from the CPU copy bandwidth measured in the same run (and labelled so), and
with no measured ceiling no fraction is claimed; the command's JSON becomes
``decode_stack.csv`` through the device check's writer, with the table printed last.
"""

from __future__ import annotations

import csv

import pytest

from workbench.bench.decode_stack import (ROW_FIELDS, DecodeStackConfig, _compare, format_decode_stack,
                                          run_decode_stack, write_rows_csv)
from workbench.errors import ConfigError

SMALL = dict(model="preset:tiny", device="cpu", batches=(1, 2), prompt_tokens=12, max_tokens=6, repeats=2,
             warmup_tokens=2, copy_mib=8, backend="eager")


@pytest.fixture(scope="module")
def res():
    return run_decode_stack(DecodeStackConfig(configs=("paged+graphs", "paged+static", "contiguous+static"), **SMALL))


def _rows(res, config):
    return {r["batch"]: r for r in res["rows"] if r["config"] == config}


def test_every_row_has_the_tables_columns(res, tmp_path):
    assert len(res["rows"]) == 3 * 2
    for r in res["rows"]:
        assert list(r) == ROW_FIELDS
    # batch by batch, the configurations side by side in the order given
    assert [(r["batch"], r["config"]) for r in res["rows"]][:3] == [
        (1, "paged+graphs"), (1, "paged+static"), (1, "contiguous+static")]
    path = write_rows_csv(res, str(tmp_path / "ds.csv"))
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 6 and list(got[0]) == ROW_FIELDS


def test_a_refused_configuration_is_a_row_with_the_engines_reason(res):
    for _, r in _rows(res, "paged+graphs").items():
        assert r["status"] == "refused" and "cuda_graphs=True needs a CUDA device" in r["reason"]
        assert r["decode_tok_s_p50"] is None and r["vs_baseline"] is None
    assert "REFUSED: LLMEngine: cuda_graphs=True" in format_decode_stack(res)


def test_measured_rows_report_speed_ratio_and_agreement(res):
    paged, contig = _rows(res, "paged+static"), _rows(res, "contiguous+static")
    for b in (1, 2):
        p, c = paged[b], contig[b]
        for r in (p, c):
            assert r["status"] == "ok" and r["repeats"] == 2
            assert r["decode_tok_s_min"] <= r["decode_tok_s_p50"] <= r["decode_tok_s_max"]
            assert r["ms_per_step_p50"] == pytest.approx(1e3 * b / r["decode_tok_s_p50"])
            assert r["first_token_spread_ms"] == 0.0          # submitted together: prefilled in one step
            assert r["kv"] in ("paged", "contiguous") and r["fast_path"] == "static_decode"
        assert c["baseline"] == p["baseline"] == "contiguous+static" and c["vs_baseline"] == 1.0
        assert p["vs_baseline"] == pytest.approx(p["decode_tok_s_p50"] / c["decode_tok_s_p50"])
        assert p["vs_baseline_round_min"] <= p["vs_baseline_round_max"] and p["verdict"]
        # greedy agreement over the same prompts: every request of both repeats
        # (float32, both static steps eager: the same greedy tokens, as measured)
        assert p["sequences"] == 2 * b and p["agreement_vs_baseline"] == 1.0
        assert p["identical_sequences"] == p["sequences"]
        assert "paged bs=16" in p["description"] and "prefix-cache" in p["description"]
        assert "contiguous" in c["description"]


def test_cpu_fraction_is_of_the_cpu_copy_measured_in_the_run(res):
    ceil = res["ceiling"]
    assert ceil["status"] == "ok" and ceil["gb_s"] > 0 and "CPU memory copy bandwidth measured" in ceil["label"]
    for config in ("paged+static", "contiguous+static"):
        rows = _rows(res, config)
        one = rows[1]
        assert one["ceiling_gb_s"] == ceil["gb_s"] and one["ceiling"] == ceil["label"]
        assert one["step_bytes"] > 0 and "weights" in one["bytes_formula"]
        assert one["achieved_gb_s"] == pytest.approx(one["step_bytes"] * one["decode_tok_s_p50"] / 1e9)
        assert one["frac_of_ceiling"] == pytest.approx(one["achieved_gb_s"] / ceil["gb_s"])
        assert rows[2]["frac_of_ceiling"] is None           # stated at batch 1 only


def test_without_a_measured_ceiling_no_fraction_is_claimed():
    res = run_decode_stack(DecodeStackConfig(**{**SMALL, "batches": (1,), "repeats": 1},
                                             configs=("contiguous+static",), measure_ceiling=False))
    (row,) = res["rows"]
    assert row["status"] == "ok" and row["step_bytes"] > 0
    assert row["frac_of_ceiling"] is None and row["ceiling_gb_s"] is None
    assert row["ceiling"].startswith("no fraction")
    assert res["ceiling"]["gb_s"] is None


def test_first_divergence_is_reported_with_its_margin():
    from workbench.model.loader import load_model

    model = load_model("preset:tiny", device="cpu")
    s = {"configs": ("paged+static", "contiguous+static"), "batches": (1,)}
    rows = {(n, 1): {"status": "ok", "config": n} for n in s["configs"]}
    samples = {k: [(100.0, 0.01, 0.0), (110.0, 0.01, 0.0)] for k in rows}
    prompt = [5, 6, 7, 8]
    tokens = {("contiguous+static", 1): [[1, 2, 3], [4, 4, 4]], ("paged+static", 1): [[1, 2, 3], [4, 9, 4]]}
    notes: list[str] = []
    _compare(rows, samples, tokens, {1: [prompt, prompt]}, model, s, notes)
    p = rows["paged+static", 1]
    assert p["agreement_vs_baseline"] == pytest.approx(5 / 6) and p["identical_sequences"] == 1
    assert isinstance(p["first_divergence_margin"], float)
    assert any("sequence 1 leaves at token 1" in n for n in notes)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="unknown configuration"):
        DecodeStackConfig(configs=("paged+magic",))
    with pytest.raises(ConfigError, match="max_tokens"):
        DecodeStackConfig(max_tokens=1)
    with pytest.raises(ConfigError, match="batches"):
        DecodeStackConfig(batches=(0,))


def test_cli_json_then_table_becomes_decode_stack_csv(tmp_path, capsys):
    from workbench.cli.main import main
    from workbench.measure import gpu_results as gr

    csv_path = tmp_path / "rows.csv"
    rc = main(["decode-stack", "--device", "cpu", "--model", "preset:tiny", "--configs",
               "paged+static,contiguous+static", "--backend", "eager", "--batches", "1,2", "--prompt-tokens", "8",
               "--max-tokens", "4", "--repeats", "1", "--warmup-tokens", "2", "--copy-mib", "4", "--budget-s", "20",
               "--csv", str(csv_path), "--json", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and csv_path.is_file()
    assert out.rstrip().splitlines()[-1].startswith("contiguous+static")   # the table is printed last
    work = tmp_path / "raw"
    work.mkdir()
    (work / "decode_stack.out").write_text(out)
    (work / "steps.tsv").write_text("decode_stack\tok\t3\t40\n")
    done = gr.write_tables(tmp_path / "tables", work)
    assert done["decode_stack"] == "ok"
    with open(tmp_path / "tables" / "decode_stack.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert [(r["config"], r["batch"]) for r in got] == [("paged+static", "1"), ("contiguous+static", "1"),
                                                        ("paged+static", "2"), ("contiguous+static", "2")]
    assert got[0]["agreement_vs_baseline"] != "" and got[0]["frac_of_ceiling"] != ""
    assert gr.read_json_output(work / "decode_stack.out")["config"]["repeats_done"] == 1

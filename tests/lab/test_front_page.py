"""The report's front page: headline figures against their targets, the claims table, the latest
GPU results; and write_report putting them first."""

from __future__ import annotations

import json

import pytest

pd = pytest.importorskip("pandas")

from workbench.lab.front_page import (  # noqa: E402 - after the importorskip
    Headline,
    claims_html,
    front_page_html,
    gpu_html,
    headline_rows,
)
from workbench.lab.results import collect_results, save_results, write_report  # noqa: E402


def _metrics(rows):
    return pd.DataFrame(rows, columns=["notebook", "metric", "value"])


def _row(df, metric_label):
    return df.set_index("headline").loc[metric_label]


def test_threshold_verdict_and_noise_give_yes_no_within_noise():
    hs = (Headline("nb", "ratio", "ratio", "> 1 beyond noise", lambda v: float(v) > 1, verdict="ratio_verdict"),)
    def meets(value, verdict):
        m = _metrics([("nb", "ratio", value), ("nb", "ratio_verdict", verdict)])
        return headline_rows(m, hs).iloc[0]["meets"]
    assert meets(1.5, "on lower by 1.50x") == "yes"
    assert meets(1.05, "within noise (1.05x, ranges overlap)") == "within noise"   # right side, not beyond noise
    assert meets(0.7, "off lower by 1.43x") == "no"
    assert meets(0.9, "within noise (0.9x)") == "no"                               # wrong side stays "no"
    assert meets(1.3, "needs 2+ requests") == "unverified"                         # no comparison was made
    assert meets(float("nan"), "") == "not measured"


def test_verdict_alone_decides_without_a_threshold_and_missing_metric_is_not_run():
    hs = (Headline("nb", "hit", "hit", ">= 89 %", verdict="v"),
          Headline("nb", "absent", "absent", "= 1", lambda v: v == 1))
    m = _metrics([("nb", "hit", 0.95), ("nb", "v", "holds")])
    df = headline_rows(m, hs)
    assert _row(df, "hit")["meets"] == "yes"
    assert _row(df, "absent")["meets"] == "not run" and _row(df, "absent")["measured"] == ""
    m = _metrics([("nb", "hit", 0.5), ("nb", "v", "does not hold")])
    assert headline_rows(m, hs[:1]).iloc[0]["meets"] == "no"
    # a notebook that wrote nothing at all has no rows (it is listed as failed in the report's table instead)
    assert headline_rows(_metrics([("other", "x", 1)]), hs).empty


def test_reference_metric_and_standard_error_are_shown_and_checked():
    h = (Headline("nb", "fused", "launches", "fewer than eager", lambda v, e: float(v) < float(e), fmt="{:.0f}",
                  ref="eager", ref_label="eager"),
         Headline("nb", "ppl", "ppl", "<= +2 %", lambda v: float(v) <= 0.02, fmt="{:+.2%}", se="ppl_se"))
    df = headline_rows(_metrics([("nb", "fused", 120), ("nb", "eager", 252), ("nb", "ppl", 0.024),
                                 ("nb", "ppl_se", 0.0127)]), h)
    assert _row(df, "launches")["measured"] == "120 (eager 252)" and _row(df, "launches")["meets"] == "yes"
    # +2.40 % misses +2 % by less than two standard errors: not a miss the run can tell
    assert _row(df, "ppl")["measured"] == "+2.40% ± 1.27%" and _row(df, "ppl")["meets"] == "within noise"
    df = headline_rows(_metrics([("nb", "ppl", 0.05), ("nb", "ppl_se", 0.01)]), h[1:])
    assert df.iloc[0]["meets"] == "no"


def test_a_sweeps_points_each_get_their_rows():
    hs = (Headline("04_scheduler", "x", "x", "> 1", lambda v: float(v) > 1),)
    m = _metrics([("04_scheduler__rate=4", "x", 2.0), ("04_scheduler__rate=8", "x", 0.5)])
    df = headline_rows(m, hs)
    assert df["notebook"].tolist() == ["04_scheduler__rate=4", "04_scheduler__rate=8"]
    assert df["meets"].tolist() == ["yes", "no"]


def test_claims_and_gpu_sections(tmp_path):
    claims = pd.DataFrame([{"id": "x", "layer": "kv", "source": "A §2", "claim": "c", "measured": "m",
                            "verdict": "holds", "why": "w"}])
    html = claims_html({"notebooks": {"06_end_to_end": {"tables": {"claims": claims}}}})
    assert "'>holds</td>" in html and "06_end_to_end" in html
    assert "'>m</td>" in html and "'>w</td>" in html              # the measured figure and the reason
    assert "No notebook of this run wrote a claims table" in claims_html({"notebooks": {}})
    assert "No GPU results are committed yet" in gpu_html(tmp_path)
    folder = tmp_path / "nvidia-h200-2026-12-01"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H200"}))
    (folder / "summary.csv").write_text("step,status,seconds\nkernels,ok,12.5\n")
    html = gpu_html(tmp_path)
    assert "NVIDIA H200, 2026-12-01" in html and "kernels" in html and "nvidia-h200-2026-12-01/summary.csv" in html


def test_write_report_puts_the_front_page_first_and_links_screenshots(tmp_path):
    side = tmp_path / "00_tour.results.json"
    save_results(side, {"greedy_token_agreement": 1.0, "bench_decode_speedup": 1.2,
                        "bench_decode_verdict": "workbench faster by 1.20x"})
    shot = tmp_path / "shots" / "00_tour-top.png"
    shot.parent.mkdir()
    shot.write_bytes(b"\x89PNG\r\n\x1a\n")
    recs = [{"name": "00_tour", "status": "ok", "seconds": 1.0, "output": str(tmp_path / "00_tour.ipynb"),
             "results": str(side)}]
    res = collect_results(recs)
    page = write_report(tmp_path / "report.html", recs, res, screenshots={"00_tour": [("top", str(shot))]},
                        gpu_root=tmp_path / "none").read_text()
    assert page.index("headline figures against their targets") < page.index("<h2>Environment</h2>")
    assert "workbench faster by 1.20x" in page and "src='shots/00_tour-top.png'" in page
    assert "No GPU results are committed yet" in page
    assert front_page_html(res, gpu_root=tmp_path / "none").count("<h2") == 3

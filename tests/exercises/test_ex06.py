"""Notebook 06's exercise: the solution and the reference pass, planted mistakes are caught with the
case and the rule named, and the SLO explorer's hook (slo_choices(pick=...)) runs the learner's pick
at every bound and turns a wrong answer into one WorkbenchError."""

from __future__ import annotations

import statistics

import pytest

from workbench.bench.e2e_recommend import SLO, recommend
from workbench.errors import WorkbenchError
from workbench.exercises import check_fn, get, load_solution
from workbench.lab.e2e_view import slo_choices
from workbench.measure.compare import compare_samples


def test_the_solution_and_the_reference_pass():
    ex = get("06.pick")
    assert check_fn(ex, load_solution("06.pick")).passed
    assert check_fn(ex, ex.reference).passed


def _planted(meets=None, tie=True, key=None, none_when_empty=True, name=True):
    """The rule with one piece changed: ``meets(row, bound, quality)``, whether within-noise ties count,
    the tie-break ``key``, what an empty list gives, and whether the name (or the row) is returned."""
    meets = meets or (lambda r, b, q: max(r["ttft_ms_p95"]) <= b and (r["rel_ppl"] is None or r["rel_ppl"] <= q))
    key = key or (lambda r: (len(r["layers"]), r["memory_bytes"] or 0, -statistics.median(r["tokens_per_s"])))

    def pick(rows, ttft_p95_ms, max_rel_ppl, noise):
        ok = [r for r in rows if meets(r, ttft_p95_ms, max_rel_ppl)]
        if not ok:
            return None if none_when_empty or not rows else min(rows, key=lambda r: max(r["ttft_ms_p95"]))["name"]
        lead = max(ok, key=lambda r: statistics.median(r["tokens_per_s"]))
        tied = [lead] + [r for r in ok if tie and r is not lead and compare_samples(
            r["tokens_per_s"], lead["tokens_per_s"], names=(r["name"], lead["name"]), noise=noise,
            lower_is_better=False).winner is None]
        best = min(tied, key=key)
        return best["name"] if name else best
    return pick


def test_meeting_the_bound_at_the_median_is_not_meeting_it():
    r = check_fn(get("06.pick"), _planted(meets=lambda r, b, q: statistics.median(r["ttft_ms_p95"]) <= b))
    assert "not in every run" in r.case
    assert "window does not meet the SLO" in r.rule and "slowest run > 450 ms" in r.rule


def test_a_strict_bound_is_an_off_by_one():
    r = check_fn(get("06.pick"), _planted(meets=lambda r, b, q: max(r["ttft_ms_p95"]) < b and
                                          (r["rel_ppl"] is None or r["rel_ppl"] <= q)))
    assert "equal to the slowest run" in r.case and "paged+prefix meets the SLO" in r.rule and "<= 210 ms" in r.rule


def test_the_quality_bound_is_part_of_the_slo():
    r = check_fn(get("06.pick"), _planted(meets=lambda r, b, q: max(r["ttft_ms_p95"]) <= b))
    assert "the quality is not" in r.case and "int4 does not meet the SLO: perplexity +5.00 % > +2 %" in r.rule


def test_nothing_meeting_the_slo_is_none_not_the_closest():
    r = check_fn(get("06.pick"), _planted(none_when_empty=False))
    assert "nothing meets the SLO" in r.case and "expected None" in r.rule and "does not meet the SLO" in r.rule


def test_faster_within_noise_is_a_tie_that_the_fewest_layers_win():
    r = check_fn(get("06.pick"), _planted(tie=False))
    assert "a tie within noise" in r.case
    assert "stack and w8a8 tie within noise" in r.rule and "the fewest layers win (stack: 4, w8a8: 1)" in r.rule


def test_a_tie_on_layers_goes_to_the_least_memory():
    r = check_fn(get("06.pick"), _planted(key=lambda r: (len(r["layers"]), -statistics.median(r["tokens_per_s"]))))
    assert "the least memory wins" in r.case and "(paged+prefix: 1000, tiers: 500" in r.rule


def test_the_row_is_not_its_name():
    r = check_fn(get("06.pick"), _planted(name=False))
    assert "edge case" in r.case and "return a configuration's name (a str) or None, got dict" in r.rule


# ---- the hook: slo_choices(pick=...) --------------------------------------------------------------
CANDIDATES = [
    {"name": "baseline", "layers": [], "ttft_ms_p95": [900.0, 1000.0, 950.0], "tokens_per_s": [100.0, 101.0, 99.0],
     "rel_ppl": None, "agreement": 1.0, "memory_bytes": 40},
    {"name": "paged", "layers": ["paged", "prefix_cache"], "ttft_ms_p95": [400.0, 420.0, 410.0],
     "tokens_per_s": [150.0, 152.0, 149.0], "rel_ppl": None, "agreement": 1.0, "memory_bytes": 60},
    {"name": "stack", "layers": ["paged", "prefix_cache", "quant"], "ttft_ms_p95": [300.0, 310.0, 305.0],
     "tokens_per_s": [200.0, 205.0, 198.0], "rel_ppl": 0.05, "agreement": 0.9, "memory_bytes": 30},
]


def test_slo_choices_run_the_learners_pick_at_every_bound():
    seen = []
    sol = load_solution("06.pick")

    def spy(**kw):
        seen.append(kw["ttft_p95_ms"])
        return sol(**kw)
    mine = slo_choices(CANDIDATES, 0.02, noise=0.05, default=1000.0, pick=spy)
    assert seen == [c["bound"] for c in mine] == [279.0, 310.0, 420.0, 1000.0]
    assert mine == slo_choices(CANDIDATES, 0.02, noise=0.05, default=1000.0)       # the rule's answers, unchanged
    # a pick that meets the SLO but is not the rule's drives the choice; the reason names the rule's
    other = slo_choices(CANDIDATES, 0.02, noise=0.05, default=1000.0,
                        pick=lambda rows, ttft_p95_ms, **kw: "baseline" if ttft_p95_ms >= 1000 else sol(
                            rows=rows, ttft_p95_ms=ttft_p95_ms, **kw))
    assert other[-1]["pick"] == "baseline" and "the rule picks paged" in other[-1]["reason"]
    assert recommend(CANDIDATES, SLO(1000.0, 0.02), noise=0.05)["pick"] == "paged"


@pytest.mark.parametrize("pick,words", [
    (lambda **kw: "stack", "'stack' at P95 TTFT <= 279 ms, which does not meet the SLO: P95 TTFT 310 ms"),
    (lambda **kw: "w4a16", "the name of a measured configuration (baseline, paged, stack) or None"),
    (lambda **kw: 2, "returned 2"),
    (lambda **kw: kw["missing"], "pick raised KeyError"),
])
def test_a_wrong_pick_is_one_error(pick, words):
    with pytest.raises(WorkbenchError) as e:
        slo_choices(CANDIDATES, 0.02, noise=0.05, pick=pick)
    assert words in str(e.value) and "\n" not in str(e.value)

"""Notebook 00's exercises: the solutions and references pass; planted mistakes fail naming the case and
the rule."""

from __future__ import annotations

import pytest

from workbench.exercises import check_fn, get, load_solution


@pytest.mark.parametrize("eid", ["00.latencies", "00.percentile"])
def test_solution_and_reference_pass(eid):
    ex = get(eid)
    assert check_fn(ex, load_solution(eid)).passed
    assert check_fn(ex, ex.reference).passed


# ---- 00.latencies ----------------------------------------------------------------------------------------
def test_tpot_over_n_instead_of_n_minus_1_is_named():
    def latencies(arrival, token_times, finished):
        n = len(token_times)
        return {"ttft": token_times[0] - arrival if n else None, "tpot": (token_times[-1] - token_times[0]) / n
                if n > 1 else None, "e2e": finished - arrival}

    r = check_fn(get("00.latencies"), latencies)
    assert r.case == 'edge case "three tokens"'
    assert "'tpot': expected 0.15, got 0.1" in r.rule and "(n - 1)" in r.rule


def test_a_single_token_request_without_a_tpot_guard_is_named():
    def latencies(arrival, token_times, finished):
        return {"ttft": token_times[0] - arrival,
                "tpot": (token_times[-1] - token_times[0]) / (len(token_times) - 1), "e2e": finished - arrival}

    r = check_fn(get("00.latencies"), latencies)
    assert r.case == 'edge case "one token: no time per output token"'
    assert r.rule.startswith("your function raised ZeroDivisionError")


def test_a_request_with_no_token_is_named():
    def latencies(arrival, token_times, finished):
        n = len(token_times)
        return {"ttft": token_times[0] - arrival,
                "tpot": (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None, "e2e": finished - arrival}

    r = check_fn(get("00.latencies"), latencies)
    assert "no token at all" in r.case and "IndexError" in r.rule


def test_e2e_at_the_last_token_instead_of_the_finish_is_named():
    def latencies(arrival, token_times, finished):
        n = len(token_times)
        return {"ttft": token_times[0] - arrival if n else None,
                "tpot": (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
                "e2e": (token_times[-1] if n else finished) - arrival}

    r = check_fn(get("00.latencies"), latencies)
    assert "finished after the last token" in r.case
    assert "'e2e': expected 0.45, got 0.3" in r.rule and "finish time minus the arrival" in r.rule


def test_a_list_instead_of_a_dict_is_a_type_message():
    r = check_fn(get("00.latencies"), lambda arrival, token_times, finished: [0.5, 0.15, 0.8])
    assert r.case == 'edge case "three tokens"'
    assert r.rule == "expected a dict with keys 'ttft', 'tpot', 'e2e', got list"


# ---- 00.percentile ---------------------------------------------------------------------------------------
def test_nearest_rank_instead_of_interpolation_is_named():
    def percentile(values, q):
        s = sorted(values)
        return s[min(len(s) - 1, round((len(s) - 1) * q / 100))] if s else None

    r = check_fn(get("00.percentile"), percentile)
    assert r.case == 'edge case "two values: P95 lies between them"'
    assert "expected 1.95, got 2" in r.rule and "linearly" in r.rule


def test_n_instead_of_n_minus_1_is_named():
    def percentile(values, q):
        s = sorted(values)
        if not s:
            return None
        pos = min(len(s) * q / 100, len(s) - 1)
        lo = int(pos)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)

    r = check_fn(get("00.percentile"), percentile)
    assert r.status == "failed" and "(n - 1) * q / 100" in r.rule


def test_unsorted_input_is_named():
    def percentile(values, q):
        s = list(values)
        if not s:
            return None
        pos = (len(s) - 1) * q / 100
        lo = int(pos)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)

    r = check_fn(get("00.percentile"), percentile)
    assert r.case == 'edge case "unsorted input"' and "expected 25.0" in r.rule


def test_no_values_is_named():
    def percentile(values, q):
        s = sorted(values)
        pos = (len(s) - 1) * q / 100
        lo = int(pos)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)

    r = check_fn(get("00.percentile"), percentile)
    assert r.case == 'edge case "no values"' and "IndexError" in r.rule


def test_a_string_result_is_a_type_message():
    r = check_fn(get("00.percentile"), lambda values, q: "7.0")
    assert r.case == 'edge case "one value"' and r.rule.startswith("the result: expected a number (float), got str")

"""tokens_match: identity where a path is exact, a stated agreement elsewhere, and a message that says which."""

from __future__ import annotations

import pytest

from workbench.measure.agreement import MIN_AGREEMENT, tokens_match

REF = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 6, 7, 8]]


def test_identical_runs_pass_both_ways():
    for exact in (True, False):
        ok, why = tokens_match(REF, [REF, [list(t) for t in REF]], exact)
        assert ok and why == "identical (2 runs x 2 sequences)"


def test_an_exact_path_fails_on_one_flipped_token():
    other = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 99], [5, 6, 7, 8]]
    ok, why = tokens_match(REF, [other], exact=True)
    assert not ok
    assert why.startswith("identical required (an exact path") and "1 of 2 sequences differ, first at token 9" in why


def test_a_non_exact_path_passes_above_the_agreement_and_fails_below():
    one_flip = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 99], [5, 6, 7, 8]]          # 13 of 14 tokens: 0.93
    ok, why = tokens_match(REF, [one_flip], exact=False)
    assert ok and f"agreement >= {MIN_AGREEMENT} required" in why and "0.929 worst run" in why
    early = [[1, 2, 0, 0, 0, 0, 0, 0, 0, 0], [5, 6, 7, 8]]              # 6 of 14: 0.43
    ok, why = tokens_match(REF, [one_flip, early], exact=False)
    assert not ok and "0.429 worst run" in why and "first at token 2" in why


def test_a_run_with_other_sequences_fails_and_bad_exact_is_refused():
    ok, why = tokens_match(REF, [REF[:1]], exact=False)
    assert not ok and "run 1 has 1 sequences, the reference 2" in why
    with pytest.raises(TypeError, match="exact must be a bool"):
        tokens_match(REF, [REF], exact="yes")

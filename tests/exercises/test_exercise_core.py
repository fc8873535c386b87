"""The exercises' checker: signatures, edge cases, shrunk property-based failures, messages that name
the case and the rule, the modes a notebook runs in, and the registry's shape."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import workbench.exercises as wx
from workbench.errors import WorkbenchError
from workbench.exercises import Case, Exercise, check_fn
from workbench.exercises.cells import cell_tag, sources, statement_source

ROOT = Path(__file__).resolve().parents[2]


def _total(values: list[int]) -> int:
    return sum(values)


def _toy(**kw) -> Exercise:
    from hypothesis import strategies as st

    base = dict(id="99.total", notebook="99_toy", title="a total", teaches="nothing", statement="Sum.",
                hints=["one", "two"], stub="def total(values):\n    raise NotImplementedError",
                reference=_total, cases=lambda: [Case("empty", {"values": []}), Case("one", {"values": [3]})],
                strategy=lambda: st.fixed_dictionaries({"values": st.lists(st.integers(0, 100), max_size=20)}))
    base.update(kw)
    return Exercise(**base)


def test_the_reference_passes_and_the_counts_are_reported():
    r = check_fn(_toy(), _total)
    assert r.passed and r.cases_run == 2 and r.examples_run > 0
    assert "passed (2 edge cases" in r.summary()


def test_a_stub_that_still_raises_is_not_written_not_failed():
    def total(values):
        raise NotImplementedError

    r = check_fn(_toy(), total)
    assert r.status == "not written" and not r.passed


def test_a_library_that_raises_not_implemented_is_a_failure_not_an_unwritten_stub():
    def total(values):
        return int(torch.tensor(values, dtype=torch.float32).__lshift__(1).sum())   # torch: not for floats

    r = check_fn(_toy(), total)
    assert r.status == "failed" and r.rule.startswith("your function raised NotImplementedError")


def test_an_edge_case_failure_names_the_case_the_call_and_both_values():
    def total(values):
        return sum(values) if values else None

    r = check_fn(_toy(), total)
    assert r.status == "failed" and r.case == 'edge case "empty"'
    assert r.call == "total(values=[])" and r.expected == "0" and r.got == "None"
    assert "expected" in r.rule and "None" in r.rule


def test_a_property_failure_is_shrunk_to_the_smallest_input():
    def total(values):  # wrong only for values above 50, and only from the third item on
        return sum(values) + sum(1 for v in values[2:] if v > 50)

    r = check_fn(_toy(), total)
    assert r.status == "failed" and "smallest hypothesis found" in r.case
    assert r.call == "total(values=[0, 0, 51])", r.call   # shrunk: three items, the smallest value that fails


def test_a_signature_that_renamed_a_parameter_is_said_before_any_call():
    def total(xs):
        return sum(xs)

    r = check_fn(_toy(), total)
    assert r.case == "the signature" and "(xs)" in r.rule and "(values)" in r.rule and "keep the stub" in r.rule
    r = check_fn(_toy(), 42)
    assert "expected a function named total" in r.rule


def test_an_exception_in_the_learners_code_names_their_line_not_the_checkers():
    def total(values):
        acc = 0
        for i in range(len(values) + 1):
            acc += values[i]
        return acc

    r = check_fn(_toy(), total)
    assert r.rule.startswith("your function raised IndexError: list index out of range at line ")
    assert "acc += values[i]" in r.rule and "workbench" not in r.rule


def test_tensor_results_say_type_dtype_shape_then_the_first_element_that_differs():
    from workbench.exercises import compare_tensors

    e = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert compare_tensors([0, 1], e) == "the result: expected a torch.Tensor, got list"
    assert compare_tensors(e.double(), e) == "the result: expected dtype torch.float32, got torch.float64"
    assert compare_tensors(e.T.contiguous(), e) == "the result: expected shape (2, 3), got (3, 2)"
    g = e.clone()
    g[1, 2] += 0.5
    msg = compare_tensors(g, e, rtol=1e-5, atol=1e-6)
    assert msg.startswith("the result: element [1, 2] expected 5.0, got 5.5 (1 of 6 elements differ")
    assert compare_tensors(e.clone(), e) is None


def test_values_compare_ints_exactly_floats_within_tolerance_and_say_where():
    from workbench.exercises import compare_values

    assert compare_values([1, 2, 3], [1, 2, 4]) == "item 2: expected 4, got 3"
    assert compare_values(1.0 + 1e-12, 1.0) is None
    assert compare_values(2.5, 2) == "the result: expected the integer 2, got 2.5"
    assert compare_values({"a": 1}, {"a": 1, "b": 2}) == "the result: keys differ (missing ['b'], unexpected [])"
    assert compare_values("3", 3).startswith("the result: expected a number (int), got str")


def test_a_rules_exercise_checks_every_answer_against_its_rules_not_the_reference():
    def rules(kw, got):
        return None if got in kw["values"] else f"{got} is not one of the candidates {kw['values']}"

    ex = _toy(rules=rules, cases=lambda: [Case("two", {"values": [4, 9]})],
              strategy=None, reference=lambda values: values[0])
    assert check_fn(ex, lambda values: values[-1]).passed      # not the reference's answer, but allowed
    r = check_fn(ex, lambda values: 7)
    assert r.status == "failed" and r.rule == "7 is not one of the candidates [4, 9]"


# ---- modes ---------------------------------------------------------------------------------------------
def test_yours_mode_returns_a_passing_function_and_the_reference_otherwise():
    def percentile(values, q):
        s = sorted(values)
        if not s:
            return None
        pos = (len(s) - 1) * q / 100
        lo = int(pos)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)

    fn, res, note = wx.resolve("00.percentile", percentile, "yours")
    assert fn is percentile and res.passed and "your percentile drives" in note

    def wrong(values, q):
        return max(values)

    fn, res, note = wx.resolve("00.percentile", wrong, "yours")
    assert fn is wx.get("00.percentile").reference and res.status == "failed" and "until yours passes" in note

    def stub(values, q):
        raise NotImplementedError

    fn, res, note = wx.resolve("00.percentile", stub, "yours")
    assert res.status == "not written" and "not written yet" in note


def test_solutions_mode_uses_the_solution_and_a_wrong_solution_stops_the_run(tmp_path, monkeypatch):
    fn, res, _ = wx.resolve("00.percentile", None, "solutions")
    assert res.passed and fn.__module__.startswith("workbench_solutions_")
    (tmp_path / "00_tour.py").write_text("def percentile(values, q):\n    return 0.0\n")
    monkeypatch.setattr(wx, "SOLUTIONS", tmp_path)
    with pytest.raises(WorkbenchError, match=r"the solution of exercise 00.percentile .* fails its check"):
        wx.resolve("00.percentile", None, "solutions")
    with pytest.raises(WorkbenchError, match="exercises must be one of 'yours', 'solutions', got 'mine'"):
        wx.resolve("00.percentile", None, "mine")


def test_an_unknown_exercise_lists_the_ones_there_are():
    with pytest.raises(WorkbenchError, match=r"no exercise '00.nope' \(there are: 00.latencies, 00.percentile"):
        wx.get("00.nope")


# ---- the registry --------------------------------------------------------------------------------------
def test_every_exercise_is_complete_and_its_stub_is_a_runnable_cell():
    exs = wx.all_exercises()
    assert len({e.id for e in exs}) == len(exs), "exercise ids repeat"
    for e in exs:
        assert e.id.startswith(e.notebook[:2] + "."), e.id
        assert (ROOT / "notebooks" / f"{e.notebook}.ipynb").is_file(), e.notebook
        assert 2 <= len(e.hints) <= 3, f"{e.id}: a hint ladder has 2-3 hints"
        assert e.statement and e.teaches and e.title, e.id
        ns: dict = {}
        exec(compile(e.stub, e.id, "exec"), ns)   # self-contained: its imports at its top
        stub = ns[e.function]
        params = list(inspect.signature(stub).parameters)
        assert params == list(e.cases()[0].kwargs), f"{e.id}: the stub's parameters differ from the cases'"
        assert list(inspect.signature(e.reference).parameters) == params, f"{e.id}: the reference's parameters"
        assert check_fn(e, stub, examples=0).status == "not written", e.id
        assert ast.parse(e.stub)                   # a stub is valid Python


def test_the_statement_holds_the_hint_ladder_nested():
    ex = wx.get("00.percentile")
    md = statement_source(ex, 2)
    assert md.startswith("### Exercise 00.2 · P95 of a latency")
    assert md.count("<details>") == len(ex.hints) == md.count("</details>")
    # each hint opens inside the one before: all the openings come before the first closing
    assert md.rindex("<details>") < md.index("</details>")
    parts = sources(ex, 2)
    assert parts["check"][1].endswith("percentile = check('00.percentile', percentile, mode=exercises)")


def test_the_notebooks_exercise_cells_match_the_registry():
    import importlib.util

    spec = importlib.util.spec_from_file_location("exercise_cells", ROOT / "scripts" / "exercise_cells.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    found = [p for nb in sorted((ROOT / "notebooks").glob("*.ipynb")) for p in mod.problems(nb)]
    assert not found, "\n".join(found) + "\n(run: .venv/bin/python scripts/exercise_cells.py --write)"


def test_every_notebook_with_exercises_declares_the_exercises_parameter():
    import nbformat

    for stem in sorted({e.notebook for e in wx.all_exercises()}):
        nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert params and 'exercises = "yours"' in params[0].source, stem
        assert sum(1 for c in nb.cells if cell_tag(c) and cell_tag(c)[1] == "stub") == len(wx.for_notebook(stem))


def test_the_check_view_escapes_and_marks_its_status():
    from workbench.lab.exercise_view import CheckView, check

    shown = []
    fn = check("00.percentile", lambda values, q: "<script>", display=shown.append)
    view = shown[0]
    assert isinstance(view, CheckView) and fn is wx.get("00.percentile").reference
    html = view._repr_html_()
    assert "data-status='failed'" in html and "<script>" not in html and "&lt;script&gt;" in html
    assert "00.percentile: failed on edge case" in repr(view)


def test_who_names_whose_function_drives_the_cells_after_a_check():
    from workbench.lab.exercise_view import check, who

    quiet = lambda view: None                                              # noqa: E731
    assert who("00.latencies").startswith("the package's latencies (yours is not checked yet")

    def latencies(arrival, token_times, finished):
        raise NotImplementedError

    check("00.latencies", latencies, display=quiet)
    assert who("00.latencies") == "the package's latencies (yours is not written yet)"
    check("00.latencies", lambda arrival, token_times, finished: {}, display=quiet)
    assert who("00.latencies") == "the package's latencies (yours does not pass yet)"
    check("00.latencies", wx.load_solution("00.latencies"), display=quiet)
    assert who("00.latencies") == "your latencies"
    check("00.latencies", None, mode="solutions", display=quiet)
    assert who("00.latencies") == "the solution's latencies"

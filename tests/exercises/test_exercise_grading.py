"""``workbench exercises check`` grades filled notebooks in a separate process; ``list`` and ``hint``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import workbench.exercises as wx
from workbench.exercises.cells import sources
from workbench.exercises.grade import grade_notebook

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = (ROOT / "notebooks" / "solutions" / "00_tour.py").read_text()

RIGHT_PERCENTILE = SOLUTION[SOLUTION.index("def percentile"):]
WRONG_LATENCIES = '''def latencies(arrival, token_times, finished):
    n = len(token_times)
    return {"ttft": token_times[0] - arrival, "tpot": (token_times[-1] - token_times[0]) / n,
            "e2e": finished - arrival}
'''


def filled(path: Path, answers: dict[str, str | None], stem: str = "00_tour") -> Path:
    """A notebook with the exercises' cells, each stub replaced by ``answers[id]`` (None: the stub)."""
    nb = nbformat.v4.new_notebook()
    for k, ex in enumerate(wx.for_notebook(stem), 1):
        for part, (ctype, src) in sources(ex, k).items():
            if part == "stub" and answers.get(ex.id) is not None:
                src = answers[ex.id]
            cell = nbformat.v4.new_markdown_cell(src) if ctype == "markdown" else nbformat.v4.new_code_cell(src)
            cell.metadata["workbench"] = {"exercise": ex.id, "part": part}
            nb.cells.append(cell)
    out = path / f"{stem}.ipynb"
    nbformat.write(nb, out)
    return out


def test_a_notebook_with_one_wrong_answer_is_graded_case_by_case(tmp_path):
    nb = filled(tmp_path, {"00.latencies": WRONG_LATENCIES, "00.percentile": RIGHT_PERCENTILE})
    lat, pct = grade_notebook(nb)
    assert pct.passed
    assert lat.status == "failed" and lat.case == 'edge case "three tokens"' and "TPOT is the mean gap" in lat.rule


def test_the_cli_prints_the_table_and_exits_1_when_anything_is_not_passed(tmp_path):
    nb = filled(tmp_path, {"00.latencies": WRONG_LATENCIES, "00.percentile": None})
    p = subprocess.run([sys.executable, "-m", "workbench.cli.main", "exercises", "check", str(nb), "--details"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["notebook", "exercise", "status", "failing", "case"]
    assert "00.latencies" in lines[1] and "failed" in lines[1] and 'edge case "three tokens"' in lines[1]
    assert "00.percentile" in lines[2] and "not written" in lines[2]
    assert "0 of 2 passed" in p.stdout and "expected: {'ttft': 0.5, 'tpot': 0.15, 'e2e': 0.8}" in p.stdout
    (tmp_path / "ok").mkdir()
    ok = filled(tmp_path / "ok", {"00.latencies": SOLUTION, "00.percentile": SOLUTION})
    p = subprocess.run([sys.executable, "-m", "workbench.cli.main", "exercises", "check", str(ok), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(p.stdout)
    assert [r["status"] for r in rows] == ["passed", "passed"] and rows[0]["notebook"] == "00_tour.ipynb"


def test_a_cell_that_does_not_run_or_never_returns_ends_only_its_own_grading(tmp_path):
    nb = filled(tmp_path, {"00.latencies": "def latencies(arrival, token_times, finished)\n    return 1\n",
                           "00.percentile": "import nothing_of_that_name\n"})
    lat, pct = grade_notebook(nb)
    assert lat.case == "the answer cell" and "SyntaxError" in lat.rule and "line 1" in lat.rule
    assert "ModuleNotFoundError" in pct.rule
    (tmp_path / "loop").mkdir()
    nb = filled(tmp_path / "loop", {"00.latencies": "while True:\n    pass\n"})
    results = grade_notebook(nb, timeout=8)
    assert all(r.status == "failed" and "longer than 8 s" in r.rule for r in results)


def test_a_missing_answer_cell_and_a_file_that_is_not_a_notebook_are_named(tmp_path):
    nb = filled(tmp_path, {})
    raw = nbformat.read(nb, as_version=4)
    raw.cells = [c for c in raw.cells if c.metadata["workbench"] != {"exercise": "00.percentile", "part": "stub"}]
    nbformat.write(raw, nb)
    lat, pct = grade_notebook(nb)
    assert lat.status == "not written" and pct.status == "failed" and "answer cell is missing" in pct.rule
    bad = tmp_path / "x.ipynb"
    bad.write_text("not json")
    with pytest.raises(wx.WorkbenchError, match=r"x.ipynb: not a notebook"):
        grade_notebook(bad)


def test_list_and_hint():
    p = subprocess.run([sys.executable, "-m", "workbench.cli.main", "exercises", "list", "00"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "00.1  00.latencies" in p.stdout and "teaches:" in p.stdout
    assert "2 exercises in 1 notebooks" in p.stdout
    p = subprocess.run([sys.executable, "-m", "workbench.cli.main", "exercises", "hint", "00.percentile", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "hint 2 of 3" in p.stdout and "interpolate" in p.stdout
    p = subprocess.run([sys.executable, "-m", "workbench.cli.main", "exercises", "hint", "00.percentile", "9"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "has hints 1 to 3, not 9" in p.stderr and p.stdout == ""

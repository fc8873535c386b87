"""A batch run's inputs and folder: parameter and sweep names are identifiers (papermill writes
them into the notebook as code), sweep values split only at top-level commas, and a run folder
keeps its data: a fresh folder, a refused non-empty one unless --resume / --overwrite, never the
notebooks' folder, every file landing whole, and summary.json naming only what is on disk, also
after SIGTERM and after SIGKILL at any moment (the last, repeated at random moments, is slow)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")
pd = pytest.importorskip("pandas")

from workbench.cli.main import main  # noqa: E402 - after the importorskip
from workbench.errors import ConfigError  # noqa: E402
from workbench.lab import run_folder, runner  # noqa: E402
from workbench.lab.executors import Executor  # noqa: E402
from workbench.lab.results import save_results  # noqa: E402

from test_runner import write_notebook  # noqa: E402 - the runner tests' tiny notebooks

CLI = [sys.executable, "-m", "workbench.cli.main"]


class FakeExecutor(Executor):
    """Runs no kernel: writes each point's executed copy and sidecar as papermill and a notebook
    would, failing the points whose ``x`` is in ``fail``; ``ran`` lists what it ran."""

    name = "fake"

    def __init__(self, fail=(), check=None):
        self.fail, self.check, self.ran = set(fail), check, []

    def kernel(self, kernel_name):
        return "python3"

    def run(self, tasks, done):
        for task in tasks:
            if self.check:
                self.check(task)
            self.ran.append(task.name)
            nbformat.write(nbformat.v4.new_notebook(), str(task.output))
            x = task.point.get("x")
            if x in self.fail:
                done(task, {"status": "failed", "seconds": 0.1, "error": f"x={x} fails", "worker": None})
                continue
            save_results(task.results, {"x": x, "twice": 2 * x})
            done(task, {"status": "ok", "seconds": 0.1, "error": None, "worker": {"executor": "fake", "pid": 1}})


@pytest.fixture
def nb(tmp_path):
    (tmp_path / "nbs").mkdir()
    return write_notebook(tmp_path / "nbs" / "n.ipynb", "1", parameters="results_path = None\nx = 0")


def run(nb, out, ex=None, **kw):
    return runner.run_notebooks([nb], out_dir=out, progress=False, executor=ex or FakeExecutor(),
                                sweep=kw.pop("sweep", {"x": [1, 2, 3]}), **kw)


def folder_state(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


# ---- names: code must not ride in on a parameter's name ---------------------------------------------
def test_a_parameter_name_that_is_code_is_refused_before_anything_runs(nb, tmp_path, capsys, monkeypatch):
    """Finding 2: -p 'import os;os.system("touch INJECTED");x=1' created the file (papermill writes
    NAME = VALUE into the notebook, the kernel's working directory is the notebook's folder)."""
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, ["run-notebooks", str(nb), "-p", 'import os;os.system("touch INJECTED");x=1',
                                  "--out", str(tmp_path / "out"), "--quiet"])
    assert "is not a Python identifier" in err and "--param" in err
    assert not (nb.parent / "INJECTED").exists() and not (tmp_path / "INJECTED").exists()
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="not a Python identifier"):
        runner.run_notebooks([nb], parameters={"x;import os": 1}, out_dir=tmp_path / "o", progress=False)
    for name in ("class", "1x", "a b", "", "x\n"):
        with pytest.raises(ConfigError, match="not a Python identifier"):
            runner.check_name(name)
    assert runner.check_name("window_ms") == "window_ms"


def test_a_sweep_key_that_is_markup_is_refused(nb, tmp_path, capsys):
    """Finding 1's way in: a sweep key became a file name, a column, an HTML id and plotly's div_id."""
    err = one_line_error(capsys, ["run-notebooks", str(nb), "--sweep", 'mode#"><script>alert(document.title)<!---->=1',
                                  "--out", str(tmp_path / "out"), "--quiet"])
    assert "--sweep" in err and "is not a Python identifier" in err
    with pytest.raises(ConfigError, match="sweep parameter name 'a-b'"):
        runner.sweep_points({"a-b": [1]})


# ---- sweep values --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, values", [
    ("sizes=[1,2],[3,4]", [[1, 2], [3, 4]]),            # was split into "[1", "2]", "[3", "4]"
    ("sizes=[1,2]", [[1, 2]]),
    ('x="a,b",c', ["a,b", "c"]),
    ('cfg={"a":[1,2]},{"a":[3]}', [{"a": [1, 2]}, {"a": [3]}]),
    ("rate=4,8,16", [4, 8, 16]),
    ("mode=smoke,full", ["smoke", "full"]),
])
def test_sweep_values_split_only_at_top_level_commas(text, values, monkeypatch):
    seen = {}
    monkeypatch.setattr(runner, "run_notebooks", lambda *a, **kw: seen.update(kw) or {"notebooks": [], "report": "-"})
    assert main(["run-notebooks", "n", "--sweep", text, "--quiet"]) == 0
    assert seen["sweep"] == {text.split("=", 1)[0]: values}


@pytest.mark.parametrize("argv, needle", [
    (["--sweep", "sizes=[1,2"], "ends inside a JSON list"),
    (["--sweep", "sizes=1]"], "unbalanced ']'"),
    (["--sweep", "sizes=[1,,2]"], "starts like JSON but is not JSON"),
    (["--sweep", "x=1", "--sweep", "x=2"], "given twice"),
    (["-p", "x=[1,2"], "starts like JSON but is not JSON"),
])
def test_a_value_that_is_not_quite_json_is_an_error_not_a_string(argv, needle, capsys):
    assert needle in one_line_error(capsys, ["run-notebooks", "n", *argv, "--quiet"])


# ---- where a run writes --------------------------------------------------------------------------
def test_out_that_cannot_be_a_run_folder_is_one_line(nb, tmp_path, capsys, monkeypatch):
    """Finding 3 (low): --out '' wrote into the current folder; a file, /dev/null or /proc/x gave a
    traceback; the notebooks' own folder had a source notebook overwritten."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("mine")
    cases = [("", "is empty"), (str(tmp_path / "file.txt"), "exists and is not a folder"),
             ("/dev/null", "exists and is not a folder"), (str(nb.parent), "source notebooks' folder"),
             (str(runner.NOTEBOOKS), "source notebooks' folder"), (str(runner.NOTEBOOKS / "sub"), "source notebooks'")]
    if Path("/proc/self").is_dir():
        cases.append(("/proc/x", "cannot create the folder"))
    before = folder_state(nb.parent)
    for out, needle in cases:
        assert needle in one_line_error(capsys, ["run-notebooks", str(nb), "--out", out, "--quiet"]), out
    assert folder_state(nb.parent) == before and sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "nbs"]
    assert (tmp_path / "file.txt").read_text() == "mine" and not (runner.NOTEBOOKS / "sub").exists()


def test_a_second_run_into_a_folder_is_refused_and_the_first_kept(nb, tmp_path, capsys):
    """Finding 3: a second run into the same --out replaced the first one's sidecars."""
    out = tmp_path / "run"
    res = run(nb, out)
    assert json.loads((out / "summary.json").read_text())["status"] == "complete"
    before = folder_state(out)
    with pytest.raises(ConfigError, match=r"not empty .*--resume .*--overwrite"):
        run(nb, out)
    assert folder_state(out) == before
    assert "not empty" in one_line_error(capsys, ["run-notebooks", str(nb), "--out", str(out), "--quiet"])
    assert folder_state(out) == before and res["run_dir"] == str(out.resolve())
    with pytest.raises(ConfigError, match="give one"):
        run(nb, out, resume=True, overwrite=True)
    with pytest.raises(ConfigError, match="--resume needs --out"):
        runner.run_notebooks([nb], progress=False, executor=FakeExecutor(), resume=True)


def test_resume_keeps_what_finished_and_runs_the_rest(nb, tmp_path):
    out = tmp_path / "run"
    run(nb, out, FakeExecutor(fail={2}))
    kept_sidecar = (out / "n__x-1.results.json").read_bytes()
    again = FakeExecutor()
    res = run(nb, out, again, resume=True)
    assert again.ran == ["n__x-2"]                                          # only the failed point ran again
    recs = res["notebooks"]
    assert [r["status"] for r in recs] == ["ok"] * 3 and [r.get("resumed", False) for r in recs] == [True, False, True]
    assert (out / "n__x-1.results.json").read_bytes() == kept_sidecar
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["ok"] == 3 and summary["mode"] == "resume"
    assert sorted(pd.read_csv(out / "results.csv").query("metric == 'x'")["value"].astype(int)) == [1, 2, 3]
    nothing = FakeExecutor()
    run(nb, out, nothing, resume=True)                                      # all finished: nothing runs, files rebuilt
    assert nothing.ran == [] and (out / "report.html").is_file()
    with pytest.raises(ConfigError, match=r"--resume .*other notebooks or sweep points"):
        run(nb, out, sweep={"x": [1, 2]}, resume=True)
    with pytest.raises(ConfigError, match=r"--resume .*n__x-1 ran with parameters"):
        run(nb, out, resume=True, parameters={"mode": "full"})
    (out / "n__x-3.results.json").write_text('{"format": "workbench-res')     # a damaged sidecar is run again
    again = FakeExecutor()
    run(nb, out, again, resume=True)
    assert again.ran == ["n__x-3"]


def test_overwrite_deletes_only_what_the_run_before_wrote(nb, tmp_path):
    out = tmp_path / "run"
    run(nb, out)
    (out / "notes.txt").write_text("mine")
    (tmp_path / "outside.txt").write_text("keep")
    summary = json.loads((out / "summary.json").read_text())
    summary["leftover"] = ["..", "../outside.txt", "/etc/hostname", "."]   # never followed out of the folder
    (out / "summary.json").write_text(json.dumps(summary))
    res = run(nb, out, sweep={"x": [5]}, overwrite=True)
    assert [r["name"] for r in res["notebooks"]] == ["n__x-5"]
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted([".workbench-run.lock", "n__x-5.ipynb", "n__x-5.results.json", "notes.txt", "report.html",
                           "results.csv", "summary.json", "sweep.csv"])
    assert (tmp_path / "outside.txt").read_text() == "keep" and (out / "notes.txt").read_text() == "mine"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.csv").write_text("1")
    for flag in ("overwrite", "resume"):
        with pytest.raises(ConfigError, match="no summary.json: not a run folder"):
            run(nb, plain, **{flag: True})
    assert [p.name for p in plain.iterdir()] == ["data.csv"]


def test_the_summary_is_written_first_updated_per_notebook_and_last(nb, tmp_path, monkeypatch):
    out, order, seen = tmp_path / "run", [], []
    write = run_folder.atomic_write
    monkeypatch.setattr(run_folder, "atomic_write",
                        lambda path, data: order.append(Path(path).name) or write(path, data))

    def check(task):                       # before each point: the summary names only what is there
        doc = json.loads((out / "summary.json").read_text())
        seen.append((doc["status"], doc["finished"]))
        for rec in doc["notebooks"]:
            assert Path(rec["output"]).is_file() and Path(rec["results"]).is_file()

    run(nb, out, FakeExecutor(check=check))
    assert seen == [("running", 0), ("running", 1), ("running", 2)]
    assert order[0] == "summary.json" and order[-1] == "summary.json"
    assert order.index("report.html") < len(order) - 1 and order.count("summary.json") == 5   # start, 3 points, end
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_papermill_writes_beside_the_output_and_it_lands_whole(tmp_path, monkeypatch):
    import papermill

    written = []

    def fake(inp, out, **kw):
        written.append(out)
        nb = nbformat.read(inp, as_version=4)
        nb.metadata["papermill"] = {"output_path": out}
        nb.metadata["widgets"] = {"state": 1}
        nbformat.write(nb, out)

    monkeypatch.setattr(papermill, "execute_notebook", fake)
    src = write_notebook(tmp_path / "n.ipynb", "1")
    out = tmp_path / "run" / "n.ipynb"
    out.parent.mkdir()
    rec = runner.execute_one(src, out, {}, 10, "python3")
    assert rec["status"] == "ok" and written == [str(out.parent / ".n.partial.ipynb")]
    saved = nbformat.read(str(out), as_version=4)
    assert saved.metadata.papermill.output_path == str(out) and "widgets" not in saved.metadata
    assert sorted(p.name for p in out.parent.iterdir()) == ["n.ipynb"]


# ---- stopped from outside ---------------------------------------------------------------------------
TINY = """
import time
from workbench.lab.results import save_results
time.sleep(sleep)
if results_path:
    save_results(results_path, {"x": x})
"""


def check_consistent(d: Path) -> dict | None:
    """What a run folder's files name is there and whole: every executed notebook and sidecar
    its summary names, every notebook results.csv names, every file the report links."""
    if not (d / "summary.json").exists():
        assert not d.exists() or all(p.name == run_folder.LOCK or run_folder.is_temporary(p.name)
                                     for p in d.iterdir()), sorted(p.name for p in d.iterdir())
        return None
    doc = json.loads((d / "summary.json").read_text())
    assert doc["format"] == "workbench-run/1" and doc["status"] in ("running", "complete", "interrupted")
    assert doc["finished"] == len(doc["notebooks"]) <= doc["planned"]
    for rec in doc["notebooks"]:
        for key in ("output", "results"):
            if rec.get(key):
                json.loads(Path(rec[key]).read_text())          # there, and whole JSON
        if rec["status"] == "ok":
            assert rec["output"] and rec["results"], rec
    if (d / "results.csv").exists():
        for name in set(pd.read_csv(d / "results.csv")["notebook"]):
            json.loads((d / f"{name}.results.json").read_text())
    if (d / "report.html").exists():
        for href in re.findall(r"href='([^'#][^']*)'", (d / "report.html").read_text()):
            assert (d / urllib.parse.unquote(href)).is_file(), href
    if doc["status"] == "complete":
        assert doc["finished"] == doc["planned"] and (d / "results.csv").is_file() and (d / "report.html").is_file()
    return doc


def _processes(marker: str) -> dict[int, str]:
    """The processes of this test's runs (the runner, its workers and fork server, kernels): each
    inherits WORKBENCH_TEST_RUN=marker."""
    found, needle = {}, f"WORKBENCH_TEST_RUN={marker}".encode()
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and needle in (p / "environ").read_bytes().split(b"\0"):
                found[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
    return found


def _gone_after(marker: str, seconds: float) -> dict[int, str]:
    """What of the killed run is still running after ``seconds`` (its workers and kernels end with it)."""
    deadline = time.monotonic() + seconds
    while (left := _processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill_leftovers(marker: str) -> None:
    for pid in _processes(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _start(nb, out, marker, *extra):
    env = {**os.environ, "WORKBENCH_TEST_RUN": marker}
    return subprocess.Popen(CLI + ["run-notebooks", str(nb), "--out", str(out), "--quiet", "--timeout", "60",
                                   "--sweep", "x=1,2,3", *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "nbs").mkdir()
    return write_notebook(tmp_path / "nbs" / "tiny.ipynb", TINY, parameters="results_path = None\nx = 0\nsleep = 0.0")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds leftover processes through /proc")
def test_sigterm_with_jobs_2_writes_the_summary_of_what_finished(tiny, tmp_path):
    """Finding 3 (low): a run with --jobs 2 stopped from outside left no summary or report."""
    out, marker = tmp_path / "run", f"sigterm-{os.getpid()}-{time.monotonic_ns()}"
    proc = _start(tiny, out, marker, "--jobs", "2", "--sweep", "sleep=0,60")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:            # x=1..3 with sleep=0 end; those with sleep=60 do not
            doc = check_consistent(out) if out.exists() else None
            if doc and doc["ok"] >= 1:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no point finished: {proc.stderr.read() if proc.poll() is not None else ''}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert _gone_after(marker, 20) == {}, "a worker or kernel outlived its stopped run"
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_leftovers(marker)
    doc = check_consistent(out)
    assert doc["status"] == "interrupted" and doc["finished"] == doc["planned"] == 6, doc
    stopped = [r for r in doc["notebooks"] if r["status"] != "ok"]
    assert stopped and all("stopped (SIGTERM)" in r["error"] for r in stopped if r["point"]["sleep"] == 60)
    assert (out / "report.html").is_file() and (out / "sweep.csv").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds leftover processes through /proc")
def test_kill_9_at_random_moments_never_leaves_a_summary_naming_missing_files(tiny, tmp_path):
    """SIGKILL to run-notebooks at random moments between its first write and its last (--jobs 1
    and 2 in turn): the folder is complete or visibly incomplete, never one whose summary,
    results.csv or report names a file that is not there or not whole; --resume then finishes a
    killed run, keeping what had finished.  WORKBENCH_KILL_SEED=N repeats one set of moments."""
    seed = int(os.environ.get("WORKBENCH_KILL_SEED", "0")) or time.time_ns() % 10**6
    rng = random.Random(seed)
    marker = f"kill9-{os.getpid()}-{time.monotonic_ns()}"
    try:
        t0, first, full = time.monotonic(), None, tmp_path / "full"        # when a run writes, unharmed
        proc = _start(tiny, full, marker)
        while proc.poll() is None:
            if first is None and (full / "summary.json").exists():
                first = time.monotonic() - t0
            time.sleep(0.02)
        whole = time.monotonic() - t0
        assert proc.returncode == 0 and first is not None, proc.stderr.read()
        assert check_consistent(full)["status"] == "complete"
        outcomes, resumed = [], False
        for i in range(4):
            out, jobs = tmp_path / f"kill{i}", ["--jobs", "2"] if i % 2 else []
            delay = rng.uniform(first, whole)
            proc = _start(tiny, out, marker, *jobs)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)                       # the parent only, as kill -9 PID does
            proc.wait(30)
            doc = check_consistent(out)
            outcomes.append(f"{delay:.1f}s:" + ("no summary" if doc is None else f"{doc['status']}:{doc['finished']}"))
            assert _gone_after(marker, 20) == {}, "a worker or kernel outlived its killed run"
            if resumed or doc is None or doc["status"] == "complete":
                continue
            resumed, ok_before = True, {r["name"] for r in doc["notebooks"] if r["status"] == "ok"}
            again = _start(tiny, out, marker, *jobs, "--resume")
            assert again.wait(120) == 0, (seed, delay, again.stderr.read())
            done = check_consistent(out)
            assert done["status"] == "complete" and done["ok"] == 3, (seed, delay, done)
            assert {r["name"] for r in done["notebooks"] if r.get("resumed")} == ok_before
        print(f"kill -9 (seed {seed}, first write {first:.1f} s, whole run {whole:.1f} s):", outcomes)
    finally:
        _kill_leftovers(marker)

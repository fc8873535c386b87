"""The papermill batch runner and the results sidecar: a failing notebook is recorded and the
run goes on; sidecars become results.csv and an offline report.html."""

from __future__ import annotations

import json

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")
pd = pytest.importorskip("pandas")

from workbench.errors import ConfigError, WorkbenchError  # noqa: E402 - after the importorskip
from workbench.lab import runner  # noqa: E402
from workbench.lab import stacks as kernel_stacks  # noqa: E402
from workbench.lab.executors import Executor  # noqa: E402
from workbench.lab.results import load_results, save_results  # noqa: E402


def write_notebook(path, *sources, parameters="results_path = None"):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(parameters)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell] + [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


GOOD = """
import pandas as pd
import plotly.graph_objects as go
from workbench.lab.results import save_results
if results_path:
    save_results(results_path, {"x": x, "double": 2 * x, "label": "hello"},
                 tables={"squares": pd.DataFrame({"n": [1, 2, 3], "n2": [1, 4, 9]})},
                 figures={"bars": go.Figure(go.Bar(y=[1, 2, 3])), "line": go.Figure(go.Scatter(y=[3, 1]))})
"""


@pytest.mark.slow
def test_run_records_failure_and_goes_on(tmp_path):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    boom = write_notebook(nbs / "a_boom.ipynb", "raise ValueError('boom at cell 2')")
    good = write_notebook(nbs / "b_good.ipynb", GOOD, parameters="results_path = None\nx = 1")
    out = tmp_path / "run"
    res = runner.run_notebooks([boom, good], parameters={"x": 21}, out_dir=out, timeout=120, progress=False)

    assert res["run_dir"] == str(out.resolve())
    by_name = {r["name"]: r for r in res["notebooks"]}
    assert [r["name"] for r in res["notebooks"]] == ["a_boom", "b_good"]
    assert by_name["a_boom"]["status"] == "failed"
    assert "ValueError" in by_name["a_boom"]["error"] and "boom at cell 2" in by_name["a_boom"]["error"]
    assert by_name["a_boom"]["attempts"] == 1          # a cell error is not retried
    assert by_name["b_good"]["status"] == "ok", by_name["b_good"]["error"]
    for r in res["notebooks"]:
        assert r["seconds"] > 0
        executed = nbformat.read(r["output"], as_version=4)
        assert "widgets" not in executed.metadata

    metrics = pd.read_csv(res["results_csv"])
    got = {(r.notebook, r.metric): r.value for r in metrics.itertuples()}
    assert got[("b_good", "x")] == "21" or float(got[("b_good", "x")]) == 21      # the injected value
    assert float(got[("b_good", "double")]) == 42
    assert not any(nb == "a_boom" for nb, _ in got)

    with open(res["report"], encoding="utf-8") as f:
        report = f.read()
    # plotly.js once (compressed, with the figures' JSON) for two figures, each a placeholder the loader draws
    assert report.count("id='wb-plotly-js'") == 1 and report.count("id='wb-figures'") == 1
    assert report.count("class='plotly-graph-div wb-figure'") == 2
    for text in ("a_boom", "boom at cell 2", "b_good.ipynb", "squares", "torch", "python"):
        assert text in report


@pytest.mark.slow
def test_sweep_runs_every_point_and_records_a_failed_one(tmp_path):
    """A (window, rate)-style grid: one record and one sweep.csv row per point; the point that
    raises keeps its row with its error and the others still run."""
    src = """
from workbench.lab.results import save_results
if rate == 3:
    raise RuntimeError(f"point rate={rate} failed")
if results_path:
    save_results(results_path, {"product": a * rate, "a_seen": a})
"""
    nb = write_notebook(tmp_path / "grid.ipynb", src, parameters="results_path = None\na = 0\nrate = 0")
    res = runner.run_notebooks([nb], out_dir=tmp_path / "run", timeout=120, progress=False,
                               sweep={"a": [1, 2], "rate": [3, 5]})
    recs = res["notebooks"]
    assert [r["point"] for r in recs] == [{"a": 1, "rate": 3}, {"a": 1, "rate": 5}, {"a": 2, "rate": 3},
                                          {"a": 2, "rate": 5}]
    assert [r["status"] for r in recs] == ["failed", "ok", "failed", "ok"]
    assert len({r["name"] for r in recs}) == 4 and all(r["name"].startswith("grid__a-") for r in recs)
    table = pd.read_csv(res["sweep_csv"])
    assert list(table["rate"]) == [3, 5, 3, 5] and list(table["status"]) == ["failed", "ok", "failed", "ok"]
    ok = table[table["status"] == "ok"]
    assert list(ok["product"]) == [5, 10] and list(ok["a_seen"]) == [1, 2]
    assert table.loc[0, "error"].count("rate=3 failed") == 1
    html = (tmp_path / "run" / "report.html").read_text()
    assert "<h2>Sweep</h2>" in html and "rate=3 failed" in html and "fig-sweep" in html


def test_sweep_figure_draws_metric_vs_last_parameter_per_group():
    from workbench.lab.results import sweep_figure

    table = pd.DataFrame({"notebook": "n", "window_ms": [0, 0, 5, 5, 5], "rate": [4, 8, 4, 8, 16],
                          "status": ["ok", "ok", "ok", "ok", "failed"], "seconds": 1.0, "error": "",
                          "ttft_p95_ms": [10.0, 30.0, 12.0, 25.0, None], "tokens_per_s": [1.0, 2, 3, 4, None]})
    fig = sweep_figure(table, ["window_ms", "rate"])
    assert [t.name for t in fig.data] == ["window_ms=0", "window_ms=5"]         # only the p95 metric: one panel
    assert list(fig.data[1].x) == [4, 8] and list(fig.data[1].y) == [12.0, 25.0]   # the failed point is left out
    assert sweep_figure(table, ["window_ms", "rate"], metrics=["tokens_per_s"]).data[0].y.tolist() == [1.0, 2.0]
    assert sweep_figure(table.assign(status="failed"), ["window_ms", "rate"]) is None


def test_sweep_grid_and_labels():
    assert runner.sweep_points(None) == [{}]
    assert runner.sweep_points({"w": [0, 5], "q": ["a"]}) == [{"w": 0, "q": "a"}, {"w": 5, "q": "a"}]
    assert runner.point_label({"window_ms": 2.5, "name": "a/b c"}) == "window_ms-2.5_name-abc"
    with pytest.raises(ConfigError, match="'w'"):
        runner.sweep_points({"w": []})


def test_retry_once_on_kernel_start_error(tmp_path, monkeypatch):
    import papermill

    calls = []

    def flaky(inp, out, **kw):
        calls.append(kw)
        if len(calls) == 1:
            raise RuntimeError("Kernel died before replying to kinfo")
        nbformat.write(nbformat.read(inp, as_version=4), out)

    monkeypatch.setattr(papermill, "execute_notebook", flaky)
    nb = write_notebook(tmp_path / "n.ipynb", "1")
    rec = runner.execute_one(nb, tmp_path / "out.ipynb", {"results_path": "r.json"}, 10, "python3")
    assert rec["status"] == "ok" and rec["attempts"] == 2 and rec["error"] is None
    assert calls[0]["store_widget_state"] is False and calls[0]["progress_bar"] is False
    assert calls[0]["cwd"] == str(tmp_path)


def test_other_errors_are_not_retried(tmp_path, monkeypatch):
    import papermill

    def broken(inp, out, **kw):
        raise FileNotFoundError("no such thing")

    monkeypatch.setattr(papermill, "execute_notebook", broken)
    nb = write_notebook(tmp_path / "n.ipynb", "1")
    rec = runner.execute_one(nb, tmp_path / "out.ipynb", {}, 10, "python3")
    assert rec["status"] == "failed" and rec["attempts"] == 1 and "no such thing" in rec["error"]


def test_resolve_notebooks_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        runner.resolve_notebooks(["does-not-exist"])
    with pytest.raises(ConfigError, match="results_path"):
        runner.run_notebooks([write_notebook(tmp_path / "n.ipynb")], parameters={"results_path": "x"},
                             out_dir=tmp_path / "o", progress=False)


def test_kernel_runs_this_interpreter():
    from jupyter_client.kernelspec import KernelSpecManager

    name = runner.resolve_kernel()
    argv0 = KernelSpecManager().get_kernel_spec(name).argv[0]
    import sys
    assert argv0 in ("python", "python3", "python{}.{}".format(*sys.version_info[:2]), sys.executable)


def test_results_roundtrip_and_validation(tmp_path):
    np = pytest.importorskip("numpy")
    df = pd.DataFrame({"ms": [1.5, 2.0]}, index=pd.Index(["a", "b"], name="component"))
    p = save_results(tmp_path / "r.json", {"n": np.int64(3), "f": np.float32(0.5), "nan": float("nan"),
                                           "ok": True, "s": "x"}, tables={"t": df})
    res = load_results(p)
    assert res["metrics"] == {"n": 3, "f": 0.5, "nan": None, "ok": True, "s": "x"}
    pd.testing.assert_frame_equal(res["tables"]["t"], df)
    with pytest.raises(WorkbenchError, match="'bad'.*scalars"):
        save_results(tmp_path / "x.json", {"bad": [1, 2]})
    with pytest.raises(WorkbenchError, match="results_path"):
        save_results(None, {})
    (tmp_path / "junk.json").write_text(json.dumps({"metrics": {}}))
    with pytest.raises(WorkbenchError, match="not a workbench results file"):
        load_results(tmp_path / "junk.json")


class _StopsAfterOne(Executor):
    """An executor that finishes the first point, then has something escape it."""

    name = "stops"

    def __init__(self, error):
        self.error, self.closed = error, False

    def prepare(self):
        pass

    def kernel(self, kernel_name):
        return "python3"

    def run(self, tasks, done):
        save_results(tasks[0].results, {"x": 1})
        done(tasks[0], {"status": "ok", "seconds": 0.5, "error": None, "worker": {"executor": "stops"}})
        raise self.error

    def close(self):
        self.closed = True

    def describe(self):
        return "stops"


@pytest.mark.parametrize("error, raised", [(KeyboardInterrupt(), KeyboardInterrupt),
                                           (OSError(28, "No space left on device"), None)])
def test_a_run_that_stops_early_still_writes_every_row(tmp_path, error, raised):
    nb = write_notebook(tmp_path / "n.ipynb", "1", parameters="results_path = None\nx = 0")
    ex, out = _StopsAfterOne(error), tmp_path / "run"
    kw = {"out_dir": out, "progress": False, "sweep": {"x": [1, 2, 3]}, "executor": ex}
    if raised:
        with pytest.raises(raised):
            runner.run_notebooks([nb], **kw)
    else:
        runner.run_notebooks([nb], **kw)
    assert ex.closed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["planned"] == summary["finished"] == 3
    summary = summary["notebooks"]
    assert [r["status"] for r in summary] == ["ok", "failed", "failed"]
    why = "interrupted (KeyboardInterrupt)" if raised else "the stops executor stopped: OSError"
    assert all(why in r["error"] and r["error"].startswith("not run") for r in summary[1:])
    assert [r["output"] for r in summary] == [None, None, None]        # no executed copy was written: none named
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["status"]) == ["ok", "failed", "failed"] and table.loc[0, "x"] == 1
    assert list(pd.read_csv(out / "results.csv")["metric"]) == ["x"] and (out / "report.html").is_file()


def test_sweep_columns_of_the_runner_and_worker_are_never_overwritten():
    from workbench.lab.results import sweep_frame

    recs = [{"name": "p", "notebook": "n", "point": {"seconds": 9, "rate": 4}, "status": "ok", "seconds": 1.5,
             "error": None, "worker": {"executor": "local", "pid": 7}}]
    loaded = {"p": {"metrics": {"status": "warm", "error": 0.1, "worker_pid": 3, "executor": "x", "rate": 4,
                                "tps": 2.0}}}
    t = sweep_frame(recs, loaded)
    row = t.iloc[0]
    assert ((row["status"], row["seconds"], row["error"], row["executor"], row["worker_pid"])
            == ("ok", 1.5, "", "local", 7))
    assert ((row["param:seconds"], row["metric:status"], row["metric:error"], row["metric:worker_pid"])
            == (9, "warm", 0.1, 3))
    assert list(t.columns[:6]) == ["notebook", "param:seconds", "rate", "status", "seconds", "error"]


def test_batch_runs_set_live_false_where_a_notebook_declares_it(tmp_path):
    from workbench.lab.runner import batch_parameters

    live = write_notebook(tmp_path / "live.ipynb", "x = 1", parameters="live = True\nresults_path = None")
    plain = write_notebook(tmp_path / "plain.ipynb", "x = 1")
    assert batch_parameters(live, {"device": "cpu"}) == {"device": "cpu", "live": False}
    assert batch_parameters(live, {"live": True}) == {"live": True}          # given: kept
    assert batch_parameters(plain, {"device": "cpu"}) == {"device": "cpu"}   # not declared: not injected


def test_batch_runs_fill_the_exercises_with_their_solutions_where_a_notebook_declares_them(tmp_path):
    from workbench.lab.runner import batch_parameters

    ex = write_notebook(tmp_path / "ex.ipynb", "x = 1", parameters='exercises = "yours"\nlive = True')
    assert batch_parameters(ex, {}) == {"exercises": "solutions", "live": False}
    assert batch_parameters(ex, {"exercises": "yours"}) == {"exercises": "yours", "live": False}   # given: kept


@pytest.mark.slow
def test_a_batch_run_shows_the_static_figure_not_the_live_widget(tmp_path):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    write_notebook(nbs / "v.ipynb", "print('LIVE' if live else 'STATIC')",
                   parameters="live = True\nresults_path = None")
    res = runner.run_notebooks([nbs / "v.ipynb"], out_dir=tmp_path / "out", progress=False)
    out = nbformat.read(res["notebooks"][0]["output"], as_version=4)
    text = "".join(o.get("text", "") for c in out.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "STATIC" in text and "LIVE" not in text


STUCK = """
import threading, time
import workbench  # arms the stack dump (WORKBENCH_STACK_DUMP, set by the runner for this kernel)

def wait_for_ever(event):
    event.wait()

threading.Thread(target=wait_for_ever, args=(threading.Event(),), name="stuck-helper", daemon=True).start()

def stuck_cell():
    time.sleep(60)

stuck_cell()
"""


@pytest.mark.slow
def test_a_notebook_past_its_timeout_says_where_its_threads_were(tmp_path):
    nb = write_notebook(tmp_path / "stuck.ipynb", STUCK)
    out = tmp_path / "out" / "stuck.ipynb"
    out.parent.mkdir()
    rec = runner.execute_one(nb, out, {"results_path": None}, 8, runner.resolve_kernel())
    assert rec["status"] == "failed" and "timed out" in rec["error"]
    assert "stuck_cell" in rec["error"] and "wait_for_ever" in rec["error"], rec["error"]
    stacks = (tmp_path / "out" / "stuck.stacks.txt").read_text()
    assert rec["stacks"] == str(tmp_path / "out" / "stuck.stacks.txt")
    assert stacks.startswith("Timeout (") and "stuck_cell" in stacks
    assert not (tmp_path / "out" / ".stuck.stacks").exists(), "the kernel's dump folder is removed afterwards"


def test_stack_summary_names_the_threads_running_project_code():
    dump = """Timeout (0:09:45)!
Thread 0x00007f1 (most recent call first):
  File "/x/lib/python3.11/selectors.py", line 468 in select
  File "/x/lib/python3.11/asyncio/base_events.py", line 1884 in _run_once

Thread 0x00007f2 (most recent call first):
  File "/work/main/workbench/kv/batch.py", line 168 in attention_fp64
  File "/x/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789 in _call_impl
  File "/work/main/workbench/engine/core.py", line 303 in _step

Current thread 0x00007f3 (most recent call first):
  File "/tmp/ipykernel_1/123.py", line 4 in <module>
"""
    summary = kernel_stacks.stack_summary(dump)
    assert summary == "[thread 0] batch.py:168 attention_fp64 <- core.py:303 _step; [thread 1] 123.py:4 <module>"
    assert kernel_stacks.stack_dump_spec(None, "/t") is None
    assert kernel_stacks.stack_dump_spec(600, "/t") == "585:/t" and kernel_stacks.stack_dump_spec(8, "/t") == "6:/t"

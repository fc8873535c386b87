"""workbench.lab.browser without a browser: what a run's record calls a problem."""

from __future__ import annotations

from workbench.lab.browser import LabRun, chromium_available


def test_a_clean_run_has_no_problems_and_each_failure_is_named():
    ok = LabRun("n.ipynb", completed=True, all_ran=True, dirty_on_open=False, live={"block-map#0": 5})
    assert ok.problems(["block-map"]) == []
    bad = LabRun("n.ipynb", completed=True, all_ran=False, dirty_on_open=True, errors=["cell 3: ValueError: x"],
                 widget_errors=["Error displaying widget: model not found"], live={"block-map#0": 2})
    got = " | ".join(bad.problems(["block-map", "load-dashboard"]))
    for part in ("cell 3: ValueError", "Error displaying widget", "did not run", "marked it modified",
                 "'block-map': 2 distinct states", "'load-dashboard': 0 distinct states"):
        assert part in got, (part, got)
    assert "did not finish" in " ".join(LabRun("n.ipynb", note="timeout after 9 s").problems())


def test_missing_chromium_is_named(monkeypatch, tmp_path):
    import workbench.lab.browser_session as b

    monkeypatch.setattr(b, "CHROMIUM", str(tmp_path / "no-chromium"))
    assert "no-chromium not found" in chromium_available()


def test_problems_name_a_reopened_widget_error_and_a_replay_that_does_not_change():
    base = dict(notebook="n.ipynb", completed=True, all_ran=True, dirty_on_open=False)
    ok = LabRun(**base, replays=[{"changed": True}, {"changed": True}], reopened={"widget_errors": []})
    assert ok.problems(replays=True) == []
    one = LabRun(**base, replays=[{"index": 0, "changed": True}, {"index": 1, "title": "ramp", "changed": False}])
    assert one.problems(replays=True) == ["replay 1 ('ramp') did not change when scrubbed from its first frame "
                                          "to its last"]
    assert LabRun(**base).problems(replays=True) == ["no replay found (a plotly figure with frames and a slider)"]
    bad = LabRun(**base, replays=[{"index": 0, "changed": False}],
                 reopened={"widget_errors": ["Error displaying widget: model not found"]})
    got = " | ".join(bad.problems(replays=True))
    assert "reopened: Error displaying widget" in got and "replay 0 ('') did not change" in got
    assert bad.problems(replays=False) == ["reopened: Error displaying widget: model not found"]

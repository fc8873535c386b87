"""Running the notebooks as a learner does, for the notebook tests: JupyterLab + headless Chromium
(workbench.lab.browser), one smoke execution per notebook, with screenshots and a report.

Every notebook test file of one pytest run writes into one folder, ``runs/browser/<run id>/``
(the run id is pytest-xdist's, shared by its workers): the executed notebooks, their results
sidecars, ``<notebook>.browser.json`` (what the browser saw), ``screenshots/`` and ``report.html``,
which is written again from the whole folder each time a notebook file finishes, so the last
one holds every notebook. The folder's path is in ``runs/browser/LATEST``.

Without Debian's chromium or Playwright the tests fall back to papermill (as the batch runner
runs them), unless ``WORKBENCH_BROWSER_TESTS=1`` (CI), where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from datetime import datetime, UTC
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "runs" / "browser"
REQUIRED = os.environ.get("WORKBENCH_BROWSER_TESTS", "") == "1"
DISABLED = os.environ.get("WORKBENCH_BROWSER_TESTS", "") == "0"
# One smoke execution of a notebook takes 30-120 s on 2 cores (each is meant to stay within 3 min);
# past 600 s it has failed, and its kernel's stacks say where it was (pyproject's pytest timeout
# of 900 s is the net above this).
NOTEBOOK_TIMEOUT = 600

# The live views each notebook shows while it runs (class wb-live-<name> on the view's widget);
# each must be seen in at least 3 distinct states. 01's widget changes when its button is pressed.
LIVE_VIEWS = {
    "00_tour": ["latency-stream"],
    "01_fused_kernels": ["kernel-toggle"],
    "02_kv_tiers": ["block-map"],
    "03_prefetch": ["prefetch-timeline"],
    "04_scheduler": ["load-dashboard"],
    "05_quantization": [],
    "06_end_to_end": [],
}


def browser_unavailable() -> str | None:
    """Why the notebooks run through papermill instead of the browser; None: the browser."""
    if DISABLED:
        return "WORKBENCH_BROWSER_TESTS=0"
    from workbench.lab.browser import chromium_available

    return chromium_available()


def _run_id() -> str:
    """xdist's run id (the same in every worker of one run), else this process's start time."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return f"xdist-{uid[:12]}" if uid else datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


RUN_ID = _run_id()          # once per process: every test file of a run writes into one folder


class BrowserSession:
    def __init__(self, lab, browser, root: Path, out: Path) -> None:
        self.lab, self.browser, self.root, self.out = lab, browser, root, out


@pytest.fixture(scope="module")
def lab_session(tmp_path_factory):
    """A JupyterLab + Chromium for this test file, or None (papermill) with the reason printed."""
    why = browser_unavailable()
    if why:
        if REQUIRED:
            pytest.fail(f"WORKBENCH_BROWSER_TESTS=1 but no browser here: {why}")
        print(f"notebooks run with papermill, not in a browser: {why}")
        yield None
        return
    from workbench.lab.browser import Browser, JupyterLab

    out = RUNS / RUN_ID
    out.mkdir(parents=True, exist_ok=True)
    RUNS.joinpath("LATEST").write_text(str(out) + "\n")
    root = tmp_path_factory.mktemp("lab-root")
    with JupyterLab(root, notebook_timeout=NOTEBOOK_TIMEOUT) as lab, Browser() as browser:
        yield BrowserSession(lab, browser, root, out)


def press_kernel_toggle(page, res, seen) -> None:
    """01's per-op toggle: press "measure"; the button must show it is busy (disabled), then come
    back; the widget's table and figure change."""
    from workbench.lab.browser import _SAMPLE_JS

    sel = ".wb-live-kernel-toggle-button"
    page.locator(sel).first.scroll_into_view_if_needed()
    for key, sig in page.evaluate(_SAMPLE_JS).items():
        seen.setdefault(key, set()).add(sig)
    checkboxes = page.locator(".wb-live-kernel-toggle input[type=checkbox]")
    for i in range(min(checkboxes.count(), 3)):          # a choice other than the notebook's own
        checkboxes.nth(i).click()
    page.locator(sel).first.click()
    page.wait_for_function(f"() => document.querySelector('{sel}')?.disabled === true", timeout=10_000)
    res.note = (res.note + "; " if res.note else "") + "toggle busy state seen"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for key, sig in page.evaluate(_SAMPLE_JS).items():
            seen.setdefault(key, set()).add(sig)
        if page.evaluate(f"() => document.querySelector('{sel}')?.disabled === false"):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the toggle widget's button stayed disabled for 300 s")
    time.sleep(0.5)


AFTER_RUN = {"01_fused_kernels": press_kernel_toggle}

# notebooks whose live views replay afterwards: scrubbing a replay from its first frame to its last must
# change what it draws (workbench.lab.browser.scrub_replays)
REPLAYS = {"00_tour", "02_kv_tiers", "03_prefetch", "04_scheduler"}


def run_in_browser(session: BrowserSession, path: Path, parameters: dict, timeout: float = NOTEBOOK_TIMEOUT):
    """Parameterize ``path`` (papermill's injected cell) into the lab's root, run it in the browser;
    returns (LabRun, sidecar path). Files land in the session's run folder."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from workbench.lab.browser import reopen, run_in_lab

    name = path.stem
    sidecar = session.out / f"{name}.results.json"
    nb = parameterize_notebook(load_notebook_node(str(path)), {**parameters, "results_path": str(sidecar)})
    info = nb.metadata.get("language_info", {})
    if info.get("version") and info["version"] != platform.python_version():
        # committed with the project's Python (CI's); the kernel here reports another version, and
        # JupyterLab would mark the copy modified for that alone
        info["version"] = platform.python_version()
    nbformat.write(nb, str(session.root / path.name))
    res = run_in_lab(session.browser, session.lab, path.name, session.out / "screenshots",
                     live_views=LIVE_VIEWS.get(name, []), timeout=timeout, after_run=AFTER_RUN.get(name))
    executed = session.root / path.name
    if executed.is_file():
        (session.out / path.name).write_bytes(executed.read_bytes())
        if res.completed:       # saved: open it again, as a learner does the next day (no "model not found")
            res.reopened = reopen(session.browser, session.lab, path.name)
    if res.stacks:
        (session.out / f"{name}.stacks.txt").write_text(res.stacks)
    tmp = session.out / f".{name}.browser.json.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(res), indent=1, default=str))
    os.replace(tmp, session.out / f"{name}.browser.json")     # the other worker may be reading the folder
    return res, sidecar


def write_browser_report(session: BrowserSession) -> Path:
    """report.html of everything in the run folder so far (front page, screenshots), checked in
    Chromium: no page errors, every figure drawn, every screenshot loads."""
    import fcntl

    with open(session.out / ".report.lock", "w") as lock:     # one worker at a time: glob, write, check, rename
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _write_browser_report(session)


def _write_browser_report(session: BrowserSession) -> Path:
    from workbench.lab.browser import LabRun, check_report
    from workbench.lab.results import collect_results, write_report

    if not any(session.out.glob("*.browser.json")):
        pytest.skip("no notebook ran in the browser in this run (e.g. -m 'not slow')")
    records, shots = [], {}
    for info_path in sorted(session.out.glob("*.browser.json")):
        info = json.loads(info_path.read_text())
        name = info_path.name.removesuffix(".browser.json")
        problems = LabRun(**info).problems(LIVE_VIEWS.get(name, []), replays=name in REPLAYS)
        records.append({"name": name, "status": "ok" if not problems else "failed",
                        "seconds": float(info.get("seconds") or 0), "output": str(session.out / f"{name}.ipynb"),
                        "error": "; ".join(problems) or None, "results": str(session.out / f"{name}.results.json"),
                        "worker": {"executor": "browser (JupyterLab + Chromium)", "host": "localhost"}})
        shots[name] = [(c, p) for c, p in info.get("screenshots", [])]
    results = collect_results(records)
    # written under a name of this process, checked, then renamed: two workers may both write it
    report = write_report(session.out / f".report.{os.getpid()}.html", records, results,
                          parameters={"device": "cpu", "live": True}, kernel="python3 (JupyterLab)",
                          executor="browser", screenshots=shots)
    info = check_report(session.browser, report, session.out / "screenshots" / f"report-front-{os.getpid()}.png")
    assert not info["page_errors"], info["page_errors"]
    assert info["divs"] == info["drawn"], f"{info['divs'] - info['drawn']} figures of {info['divs']} not drawn"
    assert {"Summary: headline figures against their targets", "Claims of the source articles",
            "Latest committed GPU results", "In the browser"} <= set(info["sections"]), info["sections"]
    broken = [i["src"] for i in info["images"] if not i["ok"]]
    assert not broken, f"screenshots that do not load in the report: {broken}"
    final = session.out / "report.html"
    os.replace(report, final)
    return final


def run_and_check(path: Path, tmp_path: Path, lab_session, expected_keys=frozenset(),
                  timeout: int = NOTEBOOK_TIMEOUT, parameters: dict | None = None) -> dict:
    """One smoke execution of ``path``: in the browser when there is one, else papermill (the
    batch runner's call: cwd = notebooks/, live=False, no widget state), with ``parameters``
    beside ``device="cpu"``. Returns the sidecar."""
    pytest.importorskip("papermill")
    from workbench.lab.front_page import headline_rows
    from workbench.lab.results import collect_results, load_results
    from workbench.lab.runner import batch_parameters, execute_one, resolve_kernel

    params = {"device": "cpu", **(parameters or {})}
    if lab_session is None:
        sidecar = tmp_path / f"{path.stem}.results.json"
        rec = execute_one(path, tmp_path / path.name, {**batch_parameters(path, params), "results_path": str(sidecar)},
                          timeout, resolve_kernel())
        assert rec["status"] == "ok", f"{path.name} failed after {rec['seconds']:.0f} s: {rec['error']} " \
                                      f"(executed copy: {rec['output']})"
    else:
        res, sidecar = run_in_browser(lab_session, path, params, timeout=timeout)
        problems = res.problems(LIVE_VIEWS.get(path.stem, []), replays=path.stem in REPLAYS)
        assert {"open", "run", "read", "save", "shutdown"} <= set(res.phases), res.phases   # where its time went
        assert not problems, f"{path.name} in JupyterLab ({res.seconds:.0f} s): {problems} " \
                             f"(executed copy and screenshots: {lab_session.out})"
    if path.stem in REPLAYS:            # the executed copy (what a saved notebook and the report hold)
        executed = (tmp_path if lab_session is None else lab_session.out) / path.name
        assert any(fig.get("frames") and fig["layout"].get("sliders") for fig in plotly_outputs(executed)), \
            f"{executed}: no plotly figure with frames and a slider (a replay) among its outputs"
    executed = (tmp_path if lab_session is None else lab_session.out) / path.name
    verdicts = exercise_verdicts(executed)
    from workbench.exercises import for_notebook
    assert sorted(verdicts) == sorted(e.id for e in for_notebook(path.stem)), \
        f"{path.name}: exercise checks shown {sorted(verdicts)}"
    # papermill runs as a batch run does (the solutions: every check passes); JupyterLab as a learner
    # opens it (the stubs not written: the notebook runs on the package's own functions)
    mode = params.get("exercises", "solutions" if lab_session is None else "yours")
    want = "passed" if mode == "solutions" else "not written"
    assert all(v == want for v in verdicts.values()), f"{path.name} ({mode}): exercise checks {verdicts}, want {want}"
    assert sidecar.is_file(), f"{path.name} did not write its results to results_path"
    loaded = load_results(sidecar)
    metrics = loaded["metrics"]
    assert metrics, f"{path.name} wrote no metrics"
    missing = set(expected_keys) - set(metrics)
    assert not missing, f"{path.name}: results lack {sorted(missing)}"
    rows = headline_rows(collect_results([{"name": path.stem, "results": str(sidecar)}])["metrics"])
    not_run = rows.loc[rows["meets"] == "not run", "headline"].tolist()
    assert not not_run, f"{path.name}: the report's front page lacks these headlines: {not_run}"
    return loaded


def exercise_verdicts(path: Path) -> dict[str, str]:
    """exercise id -> the status its check cell showed (passed / failed / not written), read from
    the executed copy's outputs (the verdict box's ``data-status``)."""
    import re

    import nbformat

    from workbench.exercises.cells import cell_tag

    out = {}
    for cell in nbformat.read(str(path), as_version=4).cells:
        tag = cell_tag(cell)
        if not tag or tag[1] != "check":
            continue
        for o in cell.get("outputs", []):
            m = re.search(r"data-status='([a-z ]+)'", o.get("data", {}).get("text/html", ""))
            if m:
                out[tag[0]] = m.group(1)
    return out


def plotly_outputs(path: Path):
    """The plotly figures (as JSON) among a notebook's outputs."""
    import nbformat

    for cell in nbformat.read(str(path), as_version=4).cells:
        for out in cell.get("outputs", []):
            fig = out.get("data", {}).get("application/vnd.plotly.v1+json")
            if fig:
                yield fig



@pytest.fixture(scope="module")
def chromium():
    """A headless Chromium (Playwright) for the module (import this fixture from a test module):
    skipped where there is none, a failure under ``WORKBENCH_BROWSER_TESTS=1`` (CI)."""
    from workbench.lab.browser_session import chromium_available

    why = chromium_available()
    if why:
        if REQUIRED:
            pytest.fail(f"WORKBENCH_BROWSER_TESTS=1 but no browser here: {why}")
        pytest.skip(f"no browser: {why}")
    from workbench.lab.browser_session import Browser

    with Browser() as browser:
        yield browser

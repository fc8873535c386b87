"""Notebooks run as a learner runs them: JupyterLab in headless Chromium, "Run All", then read back.

::

    with JupyterLab(root_dir) as lab, Browser() as browser:
        res = run_in_lab(browser, lab, "00_tour.ipynb", shots_dir, live_views=["latency-stream"])
        res.errors, res.widget_errors, res.live["latency-stream#0"], res.screenshots

:class:`JupyterLab` starts ``jupyter lab`` (this interpreter's) on a free loopback port with a
token, its own settings and workspaces folders (no windowing, so every cell stays in the DOM;
no news or update checks) and ``expose_app_in_browser``, so the page's ``window.jupyterapp``
runs JupyterLab's own commands. :class:`Browser` is Playwright driving Debian's ``chromium``
(Playwright's own browser download cannot run on a closed network).

:func:`run_in_lab` opens a notebook, waits for its kernel to be connected and idle, records
whether opening marked it modified, runs ``notebook:run-all-cells`` and, while it runs, samples
every live view's data from the DOM (each live view's outermost widget has the classes
``wb-live`` and ``wb-live-<name>``; a sample is a hash of its plotly traces' ``x / y / z / text``
and its text, taken by a poll loop and by a MutationObserver at every DOM change inside a live
view), so "the view updated while its cell ran" is a count of distinct samples, not a judgement
from a picture. Then it reads the outputs from the notebook model (error outputs,
"Error displaying widget"), saves the notebook and takes screenshots of each live view and each
figure.

The processes (:class:`JupyterLab`, :class:`Browser`) are in :mod:`workbench.lab.browser_session`
and importable from here.  Playwright is imported inside the functions: ``import workbench`` does
not need it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbench.lab.browser_session import (  # noqa: F401
    CHROMIUM,
    Browser,
    JupyterLab,
    chromium_available,
)

# JS: one sample per live view, keyed "<name>#<index among views of that name>"
_SAMPLE_JS = """() => {
  const hash = (s) => {
    let h = 5381; for (let i = 0; i < s.length; i++) h = ((h << 5) + h + s.charCodeAt(i)) | 0; return h;
  };
  const out = {}; const seen = {};
  document.querySelectorAll('.wb-live').forEach((el) => {
    const cls = [...el.classList].find((c) => c.startsWith('wb-live-')) || 'wb-live-unnamed';
    const name = cls.slice(8); const k = seen[name] = (seen[name] ?? -1) + 1;
    let sig = el.innerText || '';
    el.querySelectorAll('.js-plotly-plot').forEach((gd) => {
      (gd.data || []).forEach((t) => { sig += '|' + JSON.stringify([t.x, t.y, t.z, t.text, t.base]); });
    });
    out[name + '#' + k] = hash(sig) + ':' + sig.length;
  });
  return out;
}"""

# JS: record a sample of a live view at every DOM change inside it (a MutationObserver runs after
# each task, so an update is seen even when the page is too busy for the poll loop to catch it)
_OBSERVE_JS = """() => {
  if (window.__wb_observer) return;
  window.__wb_sigs = {};
  const sample = """ + _SAMPLE_JS + """;
  let pending = false;
  const record = () => { pending = false; const now = sample();
    for (const [k, sig] of Object.entries(now)) { (window.__wb_sigs[k] = window.__wb_sigs[k] || {})[sig] = 1; } };
  // one sample per task that changed a live view (a redraw is many mutations, one task); on a
  // loaded machine the browser applies a view's updates in bursts, so every one of them counts
  window.__wb_observer = new MutationObserver((muts) => {
    if (pending) return;
    for (const m of muts) { const t = m.target.nodeType === 1 ? m.target : m.target.parentElement;
      if (t && t.closest && t.closest('.wb-live')) { pending = true; queueMicrotask(record); return; } }
  });
  window.__wb_observer.observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
}"""

_OBSERVED_JS = "() => Object.fromEntries(Object.entries(window.__wb_sigs || {}).map(([k, v]) => [k, Object.keys(v)]))"

_STATE_JS = """() => {
  const app = window.jupyterapp; if (!app) return {ready: false, why: 'no window.jupyterapp'};
  const w = app.shell.currentWidget;
  if (!w || !w.sessionContext || !w.content || !w.content.model) return {ready: false, why: 'no notebook panel'};
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  return {ready: !!k && k.connectionStatus === 'connected' && k.status === 'idle',
          why: k ? k.connectionStatus + '/' + k.status : 'no kernel', dirty: w.context.model.dirty,
          path: w.context.path, kernel: k ? k.name : null};
}"""

_PROGRESS_JS = """() => { const w = window.jupyterapp.shell.currentWidget; let ran = 0, n = 0;
  for (const c of w.content.model.cells) { if (c.type !== 'code') continue; n++; if (c.executionCount !== null) ran++; }
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  return ran + '/' + n + ' cells ran, kernel ' + (k ? k.status : 'none'); }"""

_OUTPUTS_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget; const cells = [];
  for (const c of w.content.model.cells) {
    if (c.type !== 'code') continue;
    const outs = c.outputs.toJSON();
    cells.push({count: c.executionCount, errors: outs.filter((o) => o.output_type === 'error')
                 .map((o) => o.ename + ': ' + o.evalue)});
  }
  return {cells, widgetErrors: (document.body.innerText.match(/Error displaying widget[^\\n]*/g) || [])};
}"""


@dataclass
class LabRun:
    """What one notebook's browser run saw."""

    notebook: str
    seconds: float = 0.0
    completed: bool = False            # run-all finished (its promise resolved) before the timeout
    all_ran: bool = False              # every code cell has an execution count
    dirty_on_open: bool | None = None  # opening (kernel start included) marked the notebook modified
    kernel: str | None = None
    errors: list = field(default_factory=list)          # "cell N: Ename: value"
    widget_errors: list = field(default_factory=list)   # "Error displaying widget..." texts
    page_errors: list = field(default_factory=list)     # uncaught JS errors on the page
    live: dict = field(default_factory=dict)            # "<name>#<i>" -> number of distinct samples seen
    samples: int = 0
    screenshots: list = field(default_factory=list)     # (caption, path)
    note: str = ""
    # after a timeout: the kernel's last stack dump (JupyterLab(notebook_timeout=))
    stacks: str = ""
    # seconds per step: open, run, after_run, read, save, screenshots, shutdown
    phases: dict = field(default_factory=dict)
    # per replay figure: its first and last frame drawn, whether they differ
    replays: list = field(default_factory=list)
    reopened: dict = field(default_factory=dict)  # the saved notebook opened again: widget errors, outputs shown

    def problems(self, live_views=(), replays: bool = False) -> list[str]:
        """What went wrong; ``replays``: the notebook must hold replays, and every one must draw
        something else at its last frame than at its first when its slider is clicked."""
        out = [f"error output {e}" for e in self.errors] + [f"widget: {w}" for w in self.widget_errors]
        out += [f"page error: {e}" for e in self.page_errors]
        out += [f"reopened: {e}" for e in self.reopened.get("widget_errors", [])]
        if replays and not self.replays:
            out.append("no replay found (a plotly figure with frames and a slider)")
        for r in self.replays if replays else ():
            if not r.get("changed"):
                out.append(f"replay {r.get('index')} ({str(r.get('title', ''))[:60]!r}) did not change when scrubbed "
                           f"from its first frame to its last" + (f": {r['error']}" if r.get("error") else ""))
        if not self.completed:
            out.append(f"run-all did not finish ({self.note})")
        elif not self.all_ran:
            out.append("some code cells did not run")
        if self.dirty_on_open:
            out.append("opening the notebook marked it modified (kernelspec or metadata differs from the kernel's)")
        for name in live_views:
            seen = max((n for k, n in self.live.items() if k.split("#")[0] == name), default=0)
            if seen < 3:
                out.append(f"live view {name!r}: {seen} distinct states seen while the notebook ran (want >= 3)")
        return out


def _wait_ready(page, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    state = {}
    while time.monotonic() < deadline:
        state = page.evaluate(_STATE_JS)
        if state.get("ready"):
            return state
        time.sleep(0.25)
    raise RuntimeError(f"the notebook's kernel was not connected and idle within {timeout:.0f} s: {state}")


def run_in_lab(browser: Browser, lab: JupyterLab, rel_path: str, shots_dir=None, live_views=(),
               timeout: float = 900.0, sample_every: float = 0.25, max_figure_shots: int = 12, after_run=None,
               log=None) -> LabRun:
    """Open ``rel_path`` (relative to the lab's root), Run All, read back; see the module docstring.
    ``after_run(page, res, seen)`` runs before the screenshots (e.g. press a widget's button);
    ``log(text)`` gets a progress line every 30 s while the notebook runs."""
    res = LabRun(notebook=rel_path)
    page = browser.new_page()
    page.on("pageerror", lambda e: res.page_errors.append(str(e)[:300]))
    t0 = lap = time.monotonic()

    def phase(name: str) -> None:          # where a run's time goes (a browser run is slower than papermill's)
        nonlocal lap
        now = time.monotonic()
        res.phases[name] = round(now - lap, 2)
        lap = now

    try:
        page.goto(lab.notebook_url(rel_path))
        state = _wait_ready(page, 120)
        time.sleep(1.0)                      # metadata updates land after the kernel's info reply
        state = page.evaluate(_STATE_JS)
        res.dirty_on_open, res.kernel = bool(state.get("dirty")), state.get("kernel")
        page.evaluate(_OBSERVE_JS)
        phase("open")
        page.evaluate("() => { window.__wb_done = null; window.jupyterapp.commands.execute('notebook:run-all-cells')"
                      ".then((r) => { window.__wb_done = {ok: r}; }, "
                      "(e) => { window.__wb_done = {err: String(e)}; }); }")
        seen: dict[str, set] = {}
        run_t0 = time.monotonic()
        deadline = time.monotonic() + timeout
        done = None
        last_log = time.monotonic()
        while time.monotonic() < deadline:
            for key, sig in page.evaluate(_SAMPLE_JS).items():
                seen.setdefault(key, set()).add(sig)
            res.samples += 1
            done = page.evaluate("() => window.__wb_done")
            if done is not None:
                break
            if log is not None and time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                log(f"{rel_path}: {time.monotonic() - run_t0:.0f} s, {res.samples} samples, "
                    f"{page.evaluate(_PROGRESS_JS)}, live {({k: len(v) for k, v in seen.items()})}")
            time.sleep(sample_every)
        res.seconds = time.monotonic() - run_t0
        phase("run")
        res.completed = done is not None and "err" not in done
        res.note = "" if done is not None else f"timeout after {timeout:.0f} s"
        if done is None and lab.stacks_dir is not None:
            from workbench.lab.stacks import last_stack_dump, stack_summary

            res.stacks = last_stack_dump(lab.stacks_dir) or ""
            if res.stacks:
                res.note += f"; where the kernel's threads were: {stack_summary(res.stacks)}"
        if done is not None and "err" in done:
            res.note = done["err"]
        if after_run is not None:
            after_run(page, res, seen)
            phase("after_run")
        res.replays = scrub_replays(page)
        phase("replays")
        for key, sig in page.evaluate(_SAMPLE_JS).items():
            seen.setdefault(key, set()).add(sig)
        for key, sigs in page.evaluate(_OBSERVED_JS).items():
            seen.setdefault(key, set()).update(sigs)
        res.live = {k: len(v) for k, v in sorted(seen.items())}
        outs = page.evaluate(_OUTPUTS_JS)
        res.errors = [f"cell {c['count']}: {e}" for c in outs["cells"] for e in c["errors"]]
        res.widget_errors = outs["widgetErrors"]
        res.all_ran = all(c["count"] is not None for c in outs["cells"])
        phase("read")
        saved = _bounded_command(page, "docmanager:save", 60)
        phase("save")
        if saved != "ok":
            res.errors.append(f"saving the notebook did not finish ({saved})")
        if shots_dir is not None:
            res.screenshots = _screenshots(page, Path(shots_dir), Path(rel_path).stem, max_figure_shots)
            phase("screenshots")
    finally:
        res.seconds = res.seconds or time.monotonic() - t0
        try:                    # the kernel ends with its page: a model and its threads are not left running
            _bounded_js(page, "window.jupyterapp?.shell.currentWidget?.sessionContext?.shutdown()", 30)
        except Exception:  # noqa: BLE001 - a page that is gone has no kernel to stop
            pass
        page.close()
        phase("shutdown")
    return res


# JS: a figure's drawing without its controls (slider, buttons), as a hash: what a frame shows
_FIGURE_SIG_JS = """(gd) => {
  const hash = (s) => {
    let h = 5381; for (let i = 0; i < s.length; i++) h = ((h << 5) + h + s.charCodeAt(i)) | 0; return h;
  };
  const parts = [...gd.querySelectorAll('.main-svg')].map((svg) => { const c = svg.cloneNode(true);
    c.querySelectorAll('.slider-container, .menulayer, .updatemenu-container').forEach((e) => e.remove());
    return c.innerHTML; });
  const label = gd.querySelector('.slider-currentvalue');
  return {sig: hash(parts.join('|')) + ':' + parts.join('|').length, label: label ? label.textContent : ''};
}"""


def scrub_replays(page, max_figures: int = 8) -> list[dict]:
    """Every replay in the page (a plotly figure with frames and a slider): click its slider's first
    step, then its last, as a learner drags it, and read what the figure draws each time (its SVG
    without the controls, hashed) and the slider's readout.  ``changed``: the two frames differ."""
    n = page.evaluate("""() => { let n = 0; document.querySelectorAll('.js-plotly-plot').forEach((gd) => {
        const sl = gd.layout && gd.layout.sliders; const fr = gd._transitionData && gd._transitionData._frames;
        if (sl && sl.length && fr && fr.length > 1 && !gd.hasAttribute('data-wb-replay'))
          gd.setAttribute('data-wb-replay', String(n++)); }); return n; }""")
    out = []
    for i in range(min(n, max_figures)):
        gd = page.locator(f'[data-wb-replay="{i}"]')
        rec: dict = {"index": i}
        try:
            gd.scroll_into_view_if_needed(timeout=5000)
            rail = gd.locator("rect.slider-rail-touch-rect").first
            # a replay taller than the window (04's four-panel ramps) has its slider below the fold:
            # scroll the rail itself into view, or the clicks land outside the page
            rail.scroll_into_view_if_needed(timeout=5000)
            box = rail.bounding_box(timeout=5000)
            if box is None:
                raise RuntimeError("no slider rail drawn")
            y = box["y"] + box["height"] / 2
            for end, x in (("first", box["x"] + 2), ("last", box["x"] + box["width"] - 2)):
                page.mouse.click(x, y)
                page.wait_for_timeout(400)
                rec[end] = gd.evaluate(_FIGURE_SIG_JS)
            rec["title"] = gd.evaluate("(gd) => (gd.layout.title && (gd.layout.title.text || gd.layout.title)) || ''")
            rec["changed"] = rec["first"]["sig"] != rec["last"]["sig"]
        except Exception as e:  # noqa: BLE001 - one figure that cannot be scrubbed is noted, the run goes on
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rec["changed"] = False
        out.append(rec)
    return out


def reopen(browser: Browser, lab: JupyterLab, rel_path: str, settle_s: float = 6.0) -> dict:
    """Open a saved notebook again, as a learner does the next day: the widget errors the page
    shows ("Error displaying widget", "model not found", in the page or its console) and how many
    outputs and figures it draws.  Its kernel is shut down after."""
    page = browser.new_page()
    console: list = []
    page.on("console", lambda m: console.append(m.text[:300]))
    info: dict = {}
    try:
        page.goto(lab.notebook_url(rel_path))
        _wait_ready(page, 120)
        page.wait_for_timeout(int(settle_s * 1000))
        info = page.evaluate("""() => ({
          shown: document.querySelectorAll('.jp-OutputArea-output').length,
          figures: document.querySelectorAll('.jp-RenderedPlotly, .js-plotly-plot').length,
          page: document.body.innerText.match(/(Error displaying widget|model not found)[^\\n]*/g) || []})""")
        info["widget_errors"] = info.pop("page") + [m for m in console if "model not found" in m
                                                    or "Error displaying widget" in m]
    finally:
        try:
            _bounded_js(page, "window.jupyterapp?.shell.currentWidget?.sessionContext?.shutdown()", 30)
        except Exception:  # noqa: BLE001
            pass
        page.close()
    return info


_CELLS_JS = """(markers) => { const w = window.jupyterapp.shell.currentWidget; const out = [];
  for (const c of w.content.model.cells) { if (c.type !== 'code') continue;
    const src = c.sharedModel.getSource(); const outs = JSON.stringify(c.outputs.toJSON());
    out.push({count: c.executionCount, marker: markers.findIndex((m) => src.includes(m)),
              progress: outs.includes('wb-progress')}); }
  return out; }"""


def progress_delays(browser: Browser, lab: JupyterLab, rel_path: str, markers: list[str],
                    timeout: float = 600.0) -> dict:
    """Run All in ``rel_path`` and, for each code cell whose source contains one of ``markers``,
    the seconds from the cell's start (the code cell before it has finished) to the first progress
    bar (``wb-progress``) in its output; None when it ended without one.  Stops (kernel shut down)
    once every marked cell has shown one, ended, or ``timeout`` passes: the cells after are not
    waited for.  Polled every 0.1 s from the notebook's model, which takes each display update
    as it arrives."""
    page = browser.new_page()
    found: dict = {}
    try:
        page.goto(lab.notebook_url(rel_path))
        _wait_ready(page, 120)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        started: dict = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(found) < len(markers):
            cells = page.evaluate(_CELLS_JS, markers)
            now = time.monotonic()
            for i, c in enumerate(cells):
                m = c["marker"]
                if m < 0 or markers[m] in found:
                    continue
                if m not in started and (i == 0 or cells[i - 1]["count"] is not None):
                    started[m] = now
                if m in started and c["progress"]:
                    found[markers[m]] = round(now - started[m], 2)
                elif m in started and c["count"] is not None:
                    found[markers[m]] = None          # it ended without showing progress
            time.sleep(0.1)
    finally:
        try:
            _bounded_js(page, "window.jupyterapp?.shell.currentWidget?.sessionContext?.shutdown()", 30)
        except Exception:  # noqa: BLE001
            pass
        page.close()
    return found


def slider_text(browser: Browser, fig_json: dict, at: float = 0.0, read: str = "annotations") -> tuple[str, str]:
    """A plotly figure with a slider, drawn alone in a page from disk (offline, as in the report):
    the text it shows (``read``: its first annotation, or its ``title``) before and after a click on
    the slider's rail at ``at`` (0: the first step, 1: the last)."""
    import tempfile

    import plotly.io as pio

    html = pio.to_html(fig_json, include_plotlyjs=True, full_html=True, auto_play=False, div_id="fig")
    page = browser.new_page()
    errors: list = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    js = ("(gd) => gd.layout.annotations && gd.layout.annotations.length ? gd.layout.annotations[0].text : ''"
          if read == "annotations" else "(gd) => (gd.layout.title && (gd.layout.title.text || gd.layout.title)) || ''")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figure.html"
        path.write_text(html)
        try:
            page.goto(path.as_uri())
            gd = page.locator("#fig")
            gd.locator("rect.slider-rail-touch-rect").first.wait_for(timeout=10_000)
            before = gd.evaluate(js)
            box = gd.locator("rect.slider-rail-touch-rect").first.bounding_box()
            page.mouse.click(box["x"] + 2 + (box["width"] - 4) * at, box["y"] + box["height"] / 2)
            page.wait_for_timeout(500)
            after = gd.evaluate(js)
        finally:
            page.close()
    if errors:
        raise RuntimeError(f"the figure's page raised: {errors[:3]}")
    return before, after


def _bounded_js(page, expr: str, timeout_s: float) -> str:
    """Start the promise ``expr`` in the page and wait at most ``timeout_s`` for it to settle:
    "ok", "error: ..." or "no answer in N s".  ``page.evaluate`` of a promise has no timeout of
    its own: a JupyterLab command that never settles (seen once: a save in CI) would hold the run
    for ever."""
    key = f"__wb_p{time.monotonic_ns()}"
    page.evaluate(f"() => {{ window.{key} = null; Promise.resolve().then(() => {expr}).then("
                  f"() => {{ window.{key} = 'ok'; }}, (e) => {{ window.{key} = 'error: ' + String(e); }}); }}")
    try:
        page.wait_for_function(f"() => window.{key} !== null", timeout=timeout_s * 1e3)
    except Exception:  # noqa: BLE001 - playwright's TimeoutError: said in the result
        return f"no answer in {timeout_s:g} s"
    return page.evaluate(f"() => window.{key}")


def _bounded_command(page, command: str, timeout_s: float) -> str:
    """A JupyterLab command (``app.commands.execute``), bounded as :func:`_bounded_js`."""
    return _bounded_js(page, f"window.jupyterapp.commands.execute({json.dumps(command)})", timeout_s)


def _screenshots(page, out: Path, stem: str, max_figures: int) -> list:
    out.mkdir(parents=True, exist_ok=True)
    shots = []
    page.evaluate("() => document.querySelectorAll('.jp-NotebookPanel .jp-WindowedPanel-outer, "
                  ".jp-NotebookPanel .jp-Notebook').forEach((e) => e.scrollTo(0, 0))")
    page.wait_for_timeout(200)
    p = out / f"{stem}-top.png"
    page.screenshot(path=str(p))
    shots.append(("top of the notebook after Run All", str(p)))
    for i, el in enumerate(page.locator(".wb-live").all()):
        p = out / f"{stem}-live-{i}.png"
        try:
            el.scroll_into_view_if_needed()
            el.screenshot(path=str(p))
            shots.append((f"live view {i}", str(p)))
        except Exception as e:  # noqa: BLE001 - a screenshot that fails is noted, the run is not lost
            shots.append((f"live view {i}: no screenshot ({type(e).__name__})", ""))
    # static figures: the output holding each plotly graph that is not part of a live view
    n = page.evaluate("""() => { let n = 0; document.querySelectorAll('.js-plotly-plot').forEach((gd) => {
        if (gd.closest('.wb-live')) return; const box = gd.closest('.jp-OutputArea-child') || gd;
        if (!box.hasAttribute('data-wb-shot')) box.setAttribute('data-wb-shot', String(n++)); }); return n; }""")
    for i in range(min(n, max_figures)):
        el = page.locator(f'[data-wb-shot="{i}"]')
        p = out / f"{stem}-figure-{i}.png"
        try:
            el.scroll_into_view_if_needed()
            el.screenshot(path=str(p))
            shots.append((f"figure {i}", str(p)))
        except Exception as e:  # noqa: BLE001
            shots.append((f"figure {i}: no screenshot ({type(e).__name__})", ""))
    return shots


def check_report(browser: Browser, report: Path, shot: Path | None = None) -> dict:
    """Open an HTML report from disk: page errors, plotly figures drawn vs figure divs, the
    front page's sections; a screenshot of the first screen."""
    page = browser.new_page()
    errors: list = []
    page.on("pageerror", lambda e: errors.append(str(e)[:300]))
    try:
        page.goto(Path(report).resolve().as_uri())
        page.wait_for_timeout(500)
        info = page.evaluate("""() => ({
          divs: document.querySelectorAll('div.plotly-graph-div').length,
          drawn: document.querySelectorAll('div.plotly-graph-div.js-plotly-plot .main-svg').length > 0
                 ? [...document.querySelectorAll('div.plotly-graph-div')]
                     .filter((d) => d.querySelector('.main-svg')).length
                 : 0,
          sections: [...document.querySelectorAll('h2')].map((h) => h.innerText),
          images: [...document.images].map((i) => ({src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0})),
        })""")
        if shot is not None:
            Path(shot).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot))
        info["page_errors"] = errors
        return info
    finally:
        page.close()

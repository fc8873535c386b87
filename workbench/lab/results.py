"""The results sidecar a notebook writes for the batch runner (scrapbook is unmaintained).

The runner injects ``results_path`` into each notebook; the notebook ends with::

    if results_path:
        save_results(results_path, {"ttft_ms_p50": 12.3, "model": "bundled"},
                     tables={"summary": df}, figures={"itl": fig})

The file is JSON, one object::

    {"format": "workbench-results/1",
     "metrics": {name: number | str | bool | null, ...},           # scalars only
     "tables":  {name: {"columns": [...], "index": [...], "data": [[...]], "index_name": ...}},
     "figures": {name: <plotly figure JSON>}}

:func:`load_results` reads it back with tables as DataFrames and figures as plotly dicts
(``plotly.io.from_json(json.dumps(d))`` or :func:`figure_html` turns one into a figure).
:func:`collect_results` and :func:`write_report` turn a batch run's sidecars into one table
and one offline HTML page (used by :mod:`workbench.lab.runner`; every string escaped, its own
scripts the only ones its Content-Security-Policy lets run); a sweep's table
(:func:`sweep_frame`, ``sweep.csv``) has one row per point and ends with the worker that ran it
(:data:`WORKER_COLUMNS`: executor, host, IP, pid, Ray node and worker id, GPUs).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import numbers
import re
import sys
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    import pandas

FORMAT = "workbench-results/1"


def _scalar(name: str, value):
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else None       # JSON has no NaN / inf
    if hasattr(value, "item") and tuple(getattr(value, "shape", (0,))) == ():
        return _scalar(name, value.item())            # numpy / torch 0-d values
    raise WorkbenchError(f"save_results: metric {name!r} is a {type(value).__name__}; metrics must be scalars "
                         "(number, str, bool, None); put tables in tables= and figures in figures=")


def _table_json(name: str, df) -> dict:
    import pandas as pd

    if isinstance(df, pd.Series):
        df = df.to_frame()
    if not isinstance(df, pd.DataFrame):
        raise WorkbenchError(f"save_results: table {name!r} is a {type(df).__name__}, expected a pandas DataFrame")
    d = json.loads(df.to_json(orient="split", default_handler=str))
    d["index_name"] = df.index.name
    return d


def _figure_json(name: str, fig) -> dict:
    if isinstance(fig, dict):
        return fig
    if hasattr(fig, "to_json"):                        # plotly Figure / FigureWidget
        return json.loads(fig.to_json())
    raise WorkbenchError(f"save_results: figure {name!r} is a {type(fig).__name__}, expected a plotly figure")


def save_results(path: str | Path, metrics: dict, tables: dict | None = None, figures: dict | None = None) -> Path:
    """Write a notebook's results sidecar (see the module docstring for the format)."""
    if path is None:
        raise WorkbenchError("save_results: path is None (the runner injects results_path; "
                             "guard the call with `if results_path:` when running by hand)")
    if not isinstance(metrics, dict):
        raise WorkbenchError(f"save_results: metrics must be a dict of scalars, got {type(metrics).__name__}")
    doc = {"format": FORMAT,
           "metrics": {str(k): _scalar(str(k), v) for k, v in metrics.items()},
           "tables": {str(k): _table_json(str(k), v) for k, v in (tables or {}).items()},
           "figures": {str(k): _figure_json(str(k), v) for k, v in (figures or {}).items()}}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(p)                                     # a reader never sees half a file
    return p


def load_results(path: str | Path) -> dict:
    """Read a sidecar: {"metrics": dict, "tables": {name: DataFrame}, "figures": {name: dict}}."""
    import pandas as pd

    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise WorkbenchError(f"{p}: results sidecar not found (did the notebook call save_results?)") from None
    except json.JSONDecodeError as e:
        raise WorkbenchError(f"{p}: results sidecar is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise WorkbenchError(f"{p}: not a workbench results file (expected \"format\": \"{FORMAT}\")")
    tables = {}
    for name, t in doc.get("tables", {}).items():
        df = pd.DataFrame(t["data"], columns=t["columns"], index=t["index"])
        df.index.name = t.get("index_name")
        tables[name] = df
    return {"metrics": doc.get("metrics", {}), "tables": tables, "figures": doc.get("figures", {})}


_SAFE_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def html_id(prefix: str, name) -> str:
    """An HTML id for ``name`` that is safe anywhere it goes (an attribute, a JS string, a CSS
    selector): ``prefix-`` then letters, digits, ``_`` and ``-``; a name with other characters gets
    a short hash of itself, so two names never share an id.  ``html_id("nb", "grid__a-1")`` is
    ``nb-grid__a-1``."""
    text = str(name)
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")[:60]
    if slug != text or not slug:
        slug = "-".join(x for x in (slug, hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:10]) if x)
    return f"{prefix}-{slug}"


def figure_html(fig_json: dict, div_id: str | None = None) -> str:
    """A ``<div>`` for one figure, without plotly.js (the page includes it once).  plotly writes
    ``div_id`` unescaped into an attribute and a script, so one that is not a plain id
    (letters, digits, ``_``, ``-``) is replaced by :func:`html_id` of it."""
    import plotly.io as pio

    fig = pio.from_json(json.dumps(fig_json), skip_invalid=True)
    return _figure_fragment(fig, div_id)


def _figure_fragment(fig, div_id: str | None) -> str:
    if div_id is not None and not _SAFE_ID.fullmatch(str(div_id)):
        div_id = html_id("fig", div_id)
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)


# ---- a run's results: one table and one HTML page ---------------------------------------------
def collect_results(records: list[dict]) -> dict:
    """Read the sidecars of a run's notebooks (``records`` as made by the runner).

    Returns {"metrics": DataFrame[notebook, metric, value], "notebooks": {name: loaded sidecar}};
    an unreadable sidecar is noted in its record's ``error`` rather than stopping the report.
    """
    import pandas as pd

    rows, loaded = [], {}
    for rec in records:
        path = rec.get("results")
        if not path:
            continue
        try:
            res = load_results(path)
        except WorkbenchError as e:
            rec["error"] = f"{rec.get('error') or ''} {e}".strip()
            continue
        loaded[rec["name"]] = res
        rows += [{"notebook": rec["name"], "metric": k, "value": v} for k, v in res["metrics"].items()]
    out = {"metrics": pd.DataFrame(rows, columns=["notebook", "metric", "value"]), "notebooks": loaded}
    if any(rec.get("point") for rec in records):
        out["sweep"] = sweep_frame(records, loaded)
    return out


WORKER_COLUMNS = ("executor", "worker_host", "worker_ip", "worker_pid", "worker_node_id", "worker_id", "worker_gpus")


def worker_columns(rec: dict) -> dict:
    """The record's worker as sweep-table columns (the same columns for every executor; empty
    where an executor has nothing to say, e.g. no Ray node id for a local process)."""
    w = rec.get("worker") or {}
    return {"executor": w.get("executor"), "worker_host": w.get("host"), "worker_ip": w.get("ip"),
            "worker_pid": w.get("pid"), "worker_node_id": w.get("node_id"), "worker_id": w.get("worker_id"),
            "worker_gpus": w.get("gpus")}


RUNNER_COLUMNS = ("notebook", "status", "seconds", "error")


def sweep_frame(records: list[dict], loaded: dict) -> pandas.DataFrame:
    """One row per sweep point, in the records' (grid) order: notebook, the point's parameters,
    status, seconds, error, every metric its sidecar holds (empty for a failed point, which
    keeps its row), then the worker that ran it (:data:`WORKER_COLUMNS`).

    The runner's columns (:data:`RUNNER_COLUMNS`) and the worker columns are never overwritten:
    a parameter of the same name is ``param:NAME`` and a metric ``metric:NAME`` (a metric named
    like a swept parameter keeps replacing it, as it reports the value the notebook used)."""
    import pandas as pd

    reserved = set(RUNNER_COLUMNS) | set(WORKER_COLUMNS)
    rows, front, metric_cols = [], ["notebook"], []
    for rec in records:
        point = {(f"param:{k}" if k in reserved else k): v for k, v in (rec.get("point") or {}).items()}
        metrics = {(f"metric:{k}" if k in reserved else k): v
                   for k, v in loaded.get(rec["name"], {}).get("metrics", {}).items()
                   if isinstance(v, (int, float, bool, str)) or v is None}
        front += [k for k in point if k not in front]
        metric_cols += [k for k in metrics if k not in metric_cols]
        rows.append({"notebook": rec.get("notebook", rec["name"]), **point, **metrics, "status": rec["status"],
                     "seconds": rec["seconds"], "error": rec.get("error") or "", **worker_columns(rec)})
    fixed = front + ["status", "seconds", "error"]
    cols = fixed + [c for c in metric_cols if c not in fixed and c not in WORKER_COLUMNS] + list(WORKER_COLUMNS)
    return pd.DataFrame(rows, columns=cols)


def environment(parameters: dict | None = None) -> dict:
    """What a report states about the machine: date, python, torch, device."""
    import os
    import platform
    from datetime import datetime, timezone

    env = {"date (UTC)": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
           "python": f"{platform.python_version()} ({sys.executable})", "platform": platform.platform(),
           "processor": platform.processor() or platform.machine(), "cpu cores": os.cpu_count()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch threads"] = torch.get_num_threads()
        env["cuda"] = (f"{torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"
                       if torch.cuda.is_available() else "not available")
    except ImportError:
        env["torch"] = "not installed"
    env["device (notebook parameter)"] = (parameters or {}).get("device", "notebook default")
    return env


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.ok{color:#186a1e}.failed{color:#b00020}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}pre{white-space:pre-wrap}
.neutral{color:#555}.no{color:#b00020}table.front td,table.front th,table.claims th{text-align:left}table.claims td{text-align:left;vertical-align:top}
details{margin:.3em 0}figure{display:inline-block;margin:.5em;vertical-align:top}
figure img{max-width:520px;border:1px solid #ccc}figcaption{font-size:90%;color:#555}.toc{color:#555}"""


def _relative(p: Path, base: Path) -> str:
    """A link from the report to file ``p``: relative and percent-encoded (``:`` too, so a file
    named ``javascript:...`` is a path, not a scheme), or a file: URI."""
    import os

    try:
        rel = os.path.relpath(p.resolve(), base.resolve()).replace(os.sep, "/")
    except ValueError:                 # another drive
        return p.resolve().as_uri()
    return _file_link(rel)


def _file_link(rel: str) -> str:
    return urllib.parse.quote(rel, safe="/")


def _esc(s) -> str:
    return html.escape("" if s is None else str(s))


# ---- what may run in the page -------------------------------------------------------------------
_SCRIPT = re.compile(r"<script\b[^>]*>(.*?)</script>", re.DOTALL | re.IGNORECASE)


class _Scripts:
    """The page's own scripts (plotly.js and plotly's figure calls), each allowed by its sha256 in
    the page's Content-Security-Policy: no other inline script, event handler or ``javascript:``
    link runs, even if some text reached the page unescaped."""

    def __init__(self):
        self.bodies: list[str] = []

    def add(self, body: str) -> str:
        body = body.replace("\r\n", "\n").replace("\r", "\n")   # as the HTML parser hands it to the hash
        if re.search(r"</script", body, re.IGNORECASE):
            raise ValueError("a script of the report holds '</script': it would end early")
        self.bodies.append(body)
        return f"<script>{body}</script>"

    def take(self, fragment: str) -> str:
        """A fragment plotly wrote (its JSON has ``<`` escaped), its script blocks noted."""
        return _SCRIPT.sub(lambda m: self.add(m.group(1)), fragment)

    def policy(self) -> str:
        hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode('utf-8')).digest()).decode()}'"
                          for b in dict.fromkeys(self.bodies))
        return ("default-src 'none'; "
                f"script-src {hashes or chr(39) + 'none' + chr(39)}; "
                "style-src 'unsafe-inline'; img-src 'self' data: blob: file:; font-src data:; "
                "connect-src 'none'; object-src 'none'; base-uri 'none'; form-action 'none'")


def _kv_table(d: dict) -> str:
    return "<table>" + "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in d.items()) + "</table>"


def _worker_text(w: dict | None) -> str:
    if not w or not w.get("executor"):
        return ""
    where = w.get("host") or "?"
    if w.get("ip"):
        where += f" ({w['ip']})"
    text = f"{w['executor']}: {where}" + (f" pid {w['pid']}" if w.get("pid") else "")
    return text + (f" GPU {w['gpus']}" if w.get("gpus") else "")


def sweep_figure(table, params: list[str], metrics: list[str] | None = None):
    """Latency vs load for a sweep: x = the last swept parameter (e.g. the request rate), one
    line per combination of the others (e.g. the window), one panel per metric (default: every
    metric whose name has ``p95``).  Failed points are left out of the lines (they keep their
    table row).  None when nothing numeric can be drawn."""
    import pandas as pd
    from plotly.subplots import make_subplots

    if not params:
        return None
    x, groups = params[-1], params[:-1]
    ok = table[table["status"] == "ok"] if "status" in table else table
    known = set(params) | {"notebook", "status", "seconds", "error"} | set(WORKER_COLUMNS)
    numeric = [c for c in ok.columns if c not in known and pd.api.types.is_numeric_dtype(ok[c])]
    metrics = [m for m in (metrics or [c for c in numeric if "p95" in c.lower()] or numeric[:1]) if m in numeric]
    if ok.empty or not metrics or not pd.api.types.is_numeric_dtype(ok[x]):
        return None
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics)
    keyed = ok.groupby(groups) if groups else [((), ok)]
    for key, part in keyed:
        key = key if isinstance(key, tuple) else (key,)
        name = ", ".join(f"{g}={v}" for g, v in zip(groups, key)) or "all"
        part = part.sort_values(x)
        for i, m in enumerate(metrics):
            fig.add_scatter(x=part[x], y=part[m], mode="lines+markers", name=name, legendgroup=name,
                            showlegend=i == 0, row=1, col=i + 1)
    fig.update_xaxes(title_text=x)
    fig.update_layout(title=f"sweep: {', '.join(metrics)} vs {x}", height=380)
    return fig


def write_report(path: str | Path, records: list[dict], results: dict, parameters: dict | None = None,
                 started=None, kernel: str | None = None, sweep: dict | None = None,
                 executor: str | None = None, screenshots: dict | None = None, front_page: bool = True,
                 gpu_root=None) -> Path:
    """One self-contained HTML page. The front page first (:mod:`workbench.lab.front_page`: every
    notebook's headline figures against their targets with its noise-aware verdicts, the claims
    table when a notebook wrote one, the latest committed GPU results), then the environment,
    notebook summary (status, seconds, worker, links), metrics table, and each notebook's tables
    and figures (plotly.js inlined once). ``screenshots``: {notebook: [(caption, path), ...]}
    from a browser run (:mod:`workbench.lab.browser`), shown as images linked relative to the page.

    Every string from a run (names, parameters, sweep keys and values, errors, table cells,
    headings) is escaped; ids are :func:`html_id`, links percent-encoded; and the page's
    Content-Security-Policy allows no script but its own (plotly.js and each figure's call, by
    sha256): no inline script, event handler or ``javascript:`` link that reached it otherwise
    runs.  The page lands whole (a temporary file, then a rename)."""
    path = Path(path)
    scripts = _Scripts()
    title = f"Workbench notebook run {path.parent.name}"
    parts = [f"<h1>{_esc(title)}</h1>"]
    if front_page:
        from workbench.lab.front_page import front_page_html

        parts.append("<p class='toc'><a href='#summary'>summary</a> · <a href='#claims'>claims</a> · "
                     "<a href='#gpu'>GPU results</a> · <a href='#notebooks'>notebooks</a> · "
                     "<a href='#metrics'>all metrics</a>" + (" · <a href='#browser'>browser</a>" if screenshots else "")
                     + "</p>")
        parts.append(front_page_html(results, gpu_root=gpu_root))
    parts += ["<h2>Environment</h2>", _kv_table(environment(parameters))]
    parts.append("<p>Parameters given to every notebook: "
                 f"<code>{_esc(json.dumps(parameters or {}, default=str))}</code>; kernel <code>{_esc(kernel)}</code>"
                 + (f"; started {started:%Y-%m-%d %H:%M:%S} UTC" if started else "")
                 + (f"; executor: {_esc(executor)}" if executor else "") + ".</p>")

    parts.append("<h2 id='notebooks'>Notebooks</h2><table><tr><th>notebook</th><th>status</th><th>seconds</th>"
                 "<th>worker</th><th>results</th><th>error</th></tr>")
    for rec in records:
        name = _esc(rec["name"])
        cell = (f"<a href='{_esc(_file_link(Path(rec['output']).name))}'>{name}</a>" if rec.get("output") else name)
        has = (f"<a href='#{html_id('nb', rec['name'])}'>yes</a>" if rec["name"] in results["notebooks"] else "no")
        status = str(rec.get("status"))
        parts.append(f"<tr><td>{cell}</td>"
                     f"<td class='{'ok' if status == 'ok' else 'failed'}'>{_esc(status)}</td>"
                     f"<td>{_seconds(rec.get('seconds'))}</td>"
                     f"<td>{_esc(_worker_text(rec.get('worker')))}</td><td>{has}</td>"
                     f"<td style='text-align:left'><pre>{_esc(rec.get('error') or '')}</pre></td></tr>")
    parts.append("</table>")

    n_figures = 0
    if "sweep" in results:
        parts.append(f"<h2>Sweep</h2><p>Grid <code>{_esc(json.dumps(sweep or {}, default=str))}</code>: one row per "
                     "point (a failed point keeps its row and its error).</p>")
        parts.append(results["sweep"].to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep=""))
        try:
            fig = sweep_figure(results["sweep"], list(sweep or {}))
        except ImportError:
            fig = None
        if fig is not None:
            parts.append(scripts.take(_figure_fragment(fig, "fig-sweep")))
            n_figures += 1
    metrics = results["metrics"]
    parts.append("<h2 id='metrics'>Metrics</h2>")
    parts.append(metrics.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")
                 if len(metrics) else "<p>No notebook wrote metrics.</p>")

    if screenshots:
        parts.append("<h2 id='browser'>In the browser</h2><p>Each notebook opened in JupyterLab in headless Chromium "
                     "and run with Run All, as a learner runs it (live widgets on); screenshots taken after the run.</p>")
        for name, shots in screenshots.items():
            parts.append(f"<h3>{_esc(name)}</h3>")
            for caption, shot in shots:
                if not shot:
                    parts.append(f"<p>{_esc(caption)}</p>")
                    continue
                rel = _relative(Path(shot), path.parent)
                parts.append(f"<figure><a href='{_esc(rel)}'><img src='{_esc(rel)}' alt='{_esc(caption)}'></a>"
                             f"<figcaption>{_esc(caption)}</figcaption></figure>")
    for name, res in results["notebooks"].items():
        parts.append(f"<h2 id='{html_id('nb', name)}'>{_esc(name)}</h2>")
        for tname, df in res["tables"].items():
            parts.append(f"<h3>{_esc(tname)}</h3>" + df.to_html(float_format=lambda v: f"{v:.4g}", na_rep=""))
        for fname, fig in res["figures"].items():
            parts.append(f"<h3>{_esc(fname)}</h3>")
            try:
                parts.append(scripts.take(figure_html(fig, div_id=f"fig-{n_figures + 1}")))
                n_figures += 1
            except ImportError:
                parts.append("<p>(plotly is not installed: figure not rendered)</p>")

    plotly_js = ""
    if n_figures:
        from plotly.offline import get_plotlyjs
        plotly_js = scripts.add(get_plotlyjs())
    head = (f"<meta charset='utf-8'><meta http-equiv='Content-Security-Policy' content=\"{_esc(scripts.policy())}\">"
            f"<title>{_esc(title)}</title><style>{_CSS}</style>{plotly_js}")
    from workbench.lab.run_folder import atomic_write

    atomic_write(path, f"<!DOCTYPE html>\n<html><head>{head}</head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
    return path


def _seconds(v) -> str:
    try:
        return f"{float(v):.1f}"
    except (TypeError, ValueError):
        return _esc(v)

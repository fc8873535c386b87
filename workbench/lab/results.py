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
and one offline HTML page (used by :mod:`workbench.lab.runner`): headings in words, a contents
list per notebook, tables with units (:mod:`workbench.lab.formats`), plotly.js once and every
figure's JSON compressed (replays keep their frames and controls), every string escaped, its own
scripts the only ones its Content-Security-Policy lets run; a sweep's table
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
    """A ``<div>`` and plotly's script for one figure, without plotly.js, a replay's frames kept
    but not played until ▶ (the report itself draws its figures with its own loader).  plotly writes
    ``div_id`` unescaped into an attribute and a script, so one that is not a plain id
    (letters, digits, ``_``, ``-``) is replaced by :func:`html_id` of it."""
    import plotly.io as pio

    fig = pio.from_json(json.dumps(fig_json), skip_invalid=True)
    return _figure_fragment(fig, div_id)


def _figure_fragment(fig, div_id: str | None) -> str:
    if div_id is not None and not _SAFE_ID.fullmatch(str(div_id)):
        div_id = html_id("fig", div_id)
    # auto_play=False: a replay waits for its ▶
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, auto_play=False)


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
    from datetime import UTC, datetime

    env = {"date (UTC)": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
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


_CSS = """body{font-family:system-ui,sans-serif;margin:0 auto 4em;max-width:1100px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.ok{color:#186a1e}.failed{color:#b00020}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em;scroll-margin-top:3em}
pre{white-space:pre-wrap;margin:0}
h3{margin:1.6em 0 .3em;scroll-margin-top:3em}h3 .key{font-weight:normal;font-size:70%;color:#777;margin-left:.6em}
.neutral{color:#555}.no{color:#b00020}table.front td,table.front th,table.claims th{text-align:left}
table.claims td{text-align:left;vertical-align:top}
details{margin:.3em 0}figure{display:inline-block;margin:.5em;vertical-align:top}
figure img{max-width:520px;border:1px solid #ccc}figcaption{font-size:90%;color:#555}.toc{color:#555}
nav.bar{position:sticky;top:0;z-index:10;background:#fff;border-bottom:1px solid #ddd;padding:.4em 0;font-size:90%;
  line-height:1.7}
nav.bar a{margin-right:.2em}nav.bar b{margin-right:.4em}
.items{display:flex;flex-wrap:wrap;column-gap:2.5em;align-items:flex-start}.item{min-width:0;max-width:100%}
.item.f{flex:1 1 100%}.item.t{flex:0 1 auto}.item h3{margin-top:1.2em}
.scroll{max-height:24em;overflow:auto;margin:.4em 0 1em;display:inline-block;max-width:100%;
  border-bottom:1px solid #eee}
.scroll table{margin:0}.scroll thead th{position:sticky;top:0;z-index:1}
table.data td,table.data th{white-space:nowrap}
table.data td.num{font-variant-numeric:tabular-nums;text-align:right}
table.data td.txt,table.data th.txt{text-align:left}table.data td.long{white-space:normal;min-width:18em;max-width:36em}
table.data thead th{white-space:normal;vertical-align:bottom;min-width:3em}table.data tbody th{background:#fafafa}
table.data div.clip{max-height:7.5em;overflow:auto}
.contents{background:#f7f7f9;border:1px solid #e3e3e8;padding:.5em 1em;margin:.6em 0 1em;columns:2;column-gap:2em;
  font-size:92%}
.contents p{margin:.1em 0;break-inside:avoid}.contents b{display:block;column-span:all;margin-bottom:.2em}
p.meta{color:#555;margin:.2em 0}p.up{text-align:right;font-size:85%;margin:.2em 0 0}p.up a{color:#666}
a.totop{position:fixed;right:1em;bottom:1em;background:#fff;border:1px solid #bbb;border-radius:4px;padding:.2em .6em;
font-size:90%;text-decoration:none;color:#333;z-index:11}
div.wb-figure{width:100%;margin:.3em 0 1em}.wb-fig-error{color:#b00020;border:1px dashed #b00020;padding:.5em}"""


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

    def allow(self, body: str) -> str:
        """Allow a script that the page's own loader inserts (plotly.js, shipped compressed):
        its text as the browser will hash it.  Returns that text."""
        body = body.replace("\r\n", "\n").replace("\r", "\n")
        self.bodies.append(body)
        return body

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


# ---- figures: plotly.js and every figure's JSON shipped compressed, drawn by one small loader ----
def _json_text(obj) -> str:
    """JSON for the browser's JSON.parse: no NaN / Infinity (null instead)."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False, default=str)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _deflate_b64(text: str) -> str:
    """``text`` as UTF-8, raw DEFLATE (level 9), base64: what the page's loader inflates."""
    import zlib

    z = zlib.compressobj(9, zlib.DEFLATED, -15, 9)
    return base64.b64encode(z.compress(text.encode("utf-8")) + z.flush()).decode("ascii")


_INFLATE_JS = r"""function wbInflate(src) {
  var out = new Uint8Array(Math.max(1024, src.length * 4)), op = 0, pos = 0, bb = 0, bc = 0;
  function bits(n) {
    while (bc < n) {
      if (pos >= src.length) throw new Error("inflate: input ends early");
      bb |= src[pos++] << bc; bc += 8;
    }
    var v = bb & ((1 << n) - 1); bb >>>= n; bc -= n; return v;
  }
  function room(n) {
    if (op + n > out.length) {
      var o = new Uint8Array(Math.max(out.length * 2, op + n)); o.set(out.subarray(0, op)); out = o;
    }
  }
  function table(lengths, n) {            /* canonical Huffman code: counts per length, symbols in code order */
    var count = new Uint16Array(16), offs = new Uint16Array(16), sym = new Uint16Array(n), i;
    for (i = 0; i < n; i++) count[lengths[i]]++;
    count[0] = 0;
    for (i = 1; i < 16; i++) offs[i] = offs[i - 1] + count[i - 1];
    for (i = 0; i < n; i++) if (lengths[i]) sym[offs[lengths[i]]++] = i;
    var fast = new Int32Array(512).fill(-1), next = new Uint16Array(16), code = 0, L, c, r, j;
    for (L = 1; L < 16; L++) { code = (code + count[L - 1]) << 1; next[L] = code; }
    for (i = 0; i < n; i++) {             /* codes of up to 9 bits: one lookup of the next 9 bits (reversed) */
      L = lengths[i];
      if (!L || L > 9) continue;
      c = next[L]++; r = 0;
      for (j = 0; j < L; j++) { r = (r << 1) | (c & 1); c >>= 1; }
      for (j = r; j < 512; j += 1 << L) fast[j] = (i << 4) | L;
    }
    return {count: count, sym: sym, fast: fast};
  }
  function decode(h) {
    while (bc < 9 && pos < src.length) { bb |= src[pos++] << bc; bc += 8; }
    var e = h.fast[bb & 511];
    if (e >= 0 && (e & 15) <= bc) { bb >>>= e & 15; bc -= e & 15; return e >> 4; }
    var code = 0, first = 0, index = 0, len, c;
    for (len = 1; len < 16; len++) {
      while (bc < 1) { if (pos >= src.length) throw new Error("inflate: input ends early"); bb |= src[pos++]; bc = 8; }
      code |= bb & 1; bb >>>= 1; bc--;
      c = h.count[len];
      if (code - c < first) return h.sym[index + (code - first)];
      index += c; first = (first + c) << 1; code <<= 1;
    }
    throw new Error("inflate: bad code");
  }
  var LB = [3,4,5,6,7,8,9,10,11,13,15,17,19,23,27,31,35,43,51,59,67,83,99,115,131,163,195,227,258],
      LX = [0,0,0,0,0,0,0,0,1,1,1,1,2,2,2,2,3,3,3,3,4,4,4,4,5,5,5,5,0],
      DB = [1,2,3,4,5,7,9,13,17,25,33,49,65,97,129,193,257,385,513,769,1025,1537,2049,3073,4097,6145,8193,12289,
            16385,24577],
      DX = [0,0,0,0,1,1,2,2,3,3,4,4,5,5,6,6,7,7,8,8,9,9,10,10,11,11,12,12,13,13],
      ORDER = [16,17,18,0,8,7,9,6,10,5,11,4,12,3,13,2,14,1,15], fixed = null, last, type, i;
  do {
    last = bits(1); type = bits(2);
    if (type === 0) {
      pos -= bc >> 3; bb = 0; bc = 0;    /* to the byte boundary: whole bytes read ahead go back */
      var len = src[pos] | (src[pos + 1] << 8); pos += 4;
      room(len); out.set(src.subarray(pos, pos + len), op); op += len; pos += len;
      continue;
    }
    var lit, dist;
    if (type === 1) {
      if (!fixed) {
        var l = new Uint8Array(288);
        for (i = 0; i < 144; i++) l[i] = 8; for (; i < 256; i++) l[i] = 9;
        for (; i < 280; i++) l[i] = 7; for (; i < 288; i++) l[i] = 8;
        var d = new Uint8Array(30).fill(5);
        fixed = [table(l, 288), table(d, 30)];
      }
      lit = fixed[0]; dist = fixed[1];
    } else if (type === 2) {
      var nlen = bits(5) + 257, ndist = bits(5) + 1, ncode = bits(4) + 4, lens = new Uint8Array(320);
      for (i = 0; i < ncode; i++) lens[ORDER[i]] = bits(3);
      var lencode = table(lens, 19), n = 0;
      lens = new Uint8Array(320);
      while (n < nlen + ndist) {
        var s = decode(lencode), rep = 0, val = 0;
        if (s < 16) { lens[n++] = s; continue; }
        if (s === 16) {
          if (!n) throw new Error("inflate: repeat with no length");
          val = lens[n - 1]; rep = 3 + bits(2);
        }
        else if (s === 17) rep = 3 + bits(3); else rep = 11 + bits(7);
        while (rep--) lens[n++] = val;
      }
      lit = table(lens.subarray(0, nlen), nlen); dist = table(lens.subarray(nlen, nlen + ndist), ndist);
    } else throw new Error("inflate: bad block type");
    for (;;) {
      var sym = decode(lit);
      if (sym < 256) { if (op >= out.length) room(1); out[op++] = sym; continue; }
      if (sym === 256) break;
      sym -= 257;
      var length = LB[sym] + bits(LX[sym]), ds = decode(dist), back = DB[ds] + bits(DX[ds]);
      if (back > op) throw new Error("inflate: distance too far back");
      room(length);
      for (i = 0; i < length; i++, op++) out[op] = out[op - back];
    }
  } while (!last);
  return out.subarray(0, op);
}"""

_LOADER_JS = _INFLATE_JS + "\n" + r"""(function () {
  "use strict";
  function raw(id) {
    var el = document.getElementById(id);
    if (!el) return null;
    var b = atob(el.textContent.replace(/\s+/g, "")), a = new Uint8Array(b.length);
    for (var i = 0; i < b.length; i++) a[i] = b.charCodeAt(i);
    return new TextDecoder("utf-8").decode(wbInflate(a));
  }
  function fail(div, text) { div.textContent = text; div.style.height = "auto"; div.classList.add("wb-fig-error"); }
  var divs = document.querySelectorAll("div.wb-figure"), why = "";
  try {
    if (!window.Plotly) {
      window.PlotlyConfig = {MathJaxConfig: "local"};
      var s = document.createElement("script");
      s.textContent = raw("wb-plotly-js");
      document.head.appendChild(s);          /* allowed by its sha256 in the page's policy */
    }
    if (!window.Plotly) why = "plotly.js did not load (blocked by the page's policy, or the page is damaged)";
  } catch (e) { why = "plotly.js could not be unpacked: " + e; }
  var doc = null;
  if (!why) {
    try { doc = JSON.parse(raw("wb-figures")); } catch (e) { why = "the figures could not be unpacked: " + e; }
  }
  for (var i = 0; i < divs.length; i++) {
    var div = divs[i];
    if (why) { fail(div, why); continue; }
    var f = doc.figures[div.id];
    if (!f) { fail(div, "no data for this figure"); continue; }
    var layout = f.layout || {};
    if (f.template !== undefined && f.template !== null) layout.template = doc.templates[f.template];
    try {
      Plotly.newPlot(div, {data: f.data || [], layout: layout, frames: f.frames || [],
                           config: {responsive: true, displaylogo: false}});
    } catch (e) { fail(div, "figure not drawn: " + e); }
  }
})();"""


class _Figures:
    """The page's figures: a ``<div>`` each where it is shown; their JSON (templates shared: every
    figure of plotly's default look carries the same ~8 KB one) and plotly.js go at the end of the
    page, compressed, drawn by :data:`_LOADER_JS` without autoplay (a replay waits for its ▶).
    plotly.js once for the page: 4.8 MB as text, ~2 MB shipped."""

    def __init__(self):
        self.figures: dict[str, dict] = {}
        self.templates: list = []
        self._template_ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.figures)

    def div(self, fig, div_id: str | None = None) -> str:
        """A placeholder ``<div>`` for ``fig`` (a plotly figure or its JSON dict), sized as it will be."""
        if not isinstance(fig, dict):
            fig = json.loads(fig.to_json())
        div_id = div_id if div_id and _SAFE_ID.fullmatch(div_id) else html_id("fig", div_id or len(self.figures) + 1)
        while div_id in self.figures:
            div_id += "-x"
        fig = dict(fig)
        layout = dict(fig.get("layout") or {})
        entry = {"data": fig.get("data") or [], "layout": layout}
        if fig.get("frames"):
            entry["frames"] = fig["frames"]
        template = layout.pop("template", None)
        if template is not None:
            key = _json_text(template)
            if key not in self._template_ids:
                self._template_ids[key] = len(self.templates)
                self.templates.append(template)
            entry["template"] = self._template_ids[key]
        self.figures[div_id] = entry
        try:
            height = int(float(layout.get("height") or 450))
        except (TypeError, ValueError):
            height = 450
        return f"<div id='{div_id}' class='plotly-graph-div wb-figure' style='height:{height}px'></div>"

    def scripts(self, scripts: _Scripts) -> str:
        """The data blocks and the loader (nothing without figures)."""
        if not self.figures:
            return ""
        from plotly.offline import get_plotlyjs

        plotly_js = scripts.allow(get_plotlyjs())
        packed_js = _deflate_b64(plotly_js)
        packed_figs = _deflate_b64(_json_text({"templates": self.templates, "figures": self.figures}))
        out = [scripts.add(packed_js).replace("<script>",
                                              "<script type='application/octet-stream' id='wb-plotly-js'>", 1),
               scripts.add(packed_figs).replace("<script>",
                                                "<script type='application/octet-stream' id='wb-figures'>", 1),
               scripts.add(_LOADER_JS)]
        return "\n".join(out)


# ---- the page -------------------------------------------------------------------------------------
def _notebook_title(rec: dict) -> str:
    """The first ``# `` heading of the notebook (its executed copy, else its source), else its name."""
    for key in ("output", "source"):
        path = rec.get(key)
        if not path:
            continue
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            for cell in doc.get("cells", [])[:3]:
                if cell.get("cell_type") != "markdown":
                    continue
                src = cell.get("source", "")
                src = "".join(src) if isinstance(src, list) else str(src)
                for line in src.splitlines():
                    if line.startswith("# "):
                        return line[2:].strip()[:200]
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return str(rec.get("notebook") or rec.get("name"))


def _table_block(df) -> str:
    from workbench.lab.formats import table_html

    try:
        body = table_html(df)
    except Exception:  # noqa: BLE001 - a table that does not format is shown as it is
        body = df.to_html(na_rep="—", escape=True)
    rows = len(df)
    return f"<div class='scroll'>{body}</div>" + (f"<p class='meta'>{rows} rows</p>" if rows > 15 else "")


def _metrics_table(metrics: dict) -> str:
    """A notebook's metrics: name in words, key, value with its unit."""
    from workbench.lab.formats import format_value, humanize, unit_kind

    rows = []
    for k, v in metrics.items():
        kind = unit_kind(k)
        if kind == "fraction" and isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > 5:
            kind = "number"
        rows.append(f"<tr><td>{_esc(humanize(k))}</td><td><code>{_esc(k)}</code></td>"
                    f"<td>{_esc(format_value(v, kind, unit=True))}</td></tr>")
    return ("<div class='scroll'><table class='data'><thead><tr><th>metric</th><th>key</th><th>value</th></tr></thead>"
            + "".join(rows) + "</table></div>")


def _up(*links) -> str:
    return "<p class='up'>" + " · ".join(f"<a href='#{i}'>↑ {_esc(t)}</a>" for i, t in links) + "</p>"


def _report_nav(run_name: str, results: dict, nb_titles: dict, front_page: bool, screenshots) -> list[str]:
    """The links of the report's top bar: the sections, then every notebook (by its number when
    there are more than four)."""
    shown = list(nb_titles)
    nav = ["<b>Run " + _esc(run_name) + "</b>"]
    if front_page:
        nav += ["<a href='#summary'>summary</a>", "<a href='#claims'>claims</a>", "<a href='#gpu'>GPU results</a>"]
    nav.append("<a href='#notebooks'>notebooks</a>")
    if "sweep" in results:
        nav.append("<a href='#sweep'>sweep</a>")
    if screenshots:
        nav.append("<a href='#browser'>browser</a>")
    nav += [f"<a href='#{html_id('nb', name)}' title='{_esc(nb_titles[name])}'>"
            f"{_esc(name.split('_')[0] if len(shown) > 4 else name)}</a>"
            for name in shown]
    nav.append("<a href='#metrics'>all metrics</a>")
    return nav


def _environment_section(parameters: dict | None, started, kernel: str | None, executor: str | None) -> list[str]:
    """The report's environment table and the parameters, kernel, start time and executor of the run."""
    return ["<h2>Environment</h2>", _kv_table(environment(parameters)),
            "<p>Parameters given to every notebook: "
            f"<code>{_esc(json.dumps(parameters or {}, default=str))}</code>; kernel <code>{_esc(kernel)}</code>"
            + (f"; started {started:%Y-%m-%d %H:%M:%S} UTC" if started else "")
            + (f"; executor: {_esc(executor)}" if executor else "") + ".</p>"]


def _summary_table(records: list[dict], results: dict, nb_titles: dict) -> list[str]:
    """The notebook summary: one row per record (status, seconds, worker, a link to its results, its error)."""
    parts = ["<h2 id='notebooks'>Notebooks</h2><table><tr><th>notebook</th><th>status</th><th>seconds</th>"
             "<th>worker</th><th>results</th><th>error</th></tr>"]
    for rec in records:
        name = _esc(rec["name"])
        cell = (f"<a href='{_esc(_file_link(Path(rec['output']).name))}'>{name}</a>" if rec.get("output") else name)
        has = (f"<a href='#{html_id('nb', rec['name'])}'>{_esc(nb_titles.get(rec['name'], 'yes'))}</a>"
               if rec["name"] in results["notebooks"] else "no")
        status = str(rec.get("status"))
        parts.append(f"<tr><td>{cell}</td>"
                     f"<td class='{'ok' if status == 'ok' else 'failed'}'>{_esc(status)}</td>"
                     f"<td>{_seconds(rec.get('seconds'))}</td>"
                     f"<td>{_esc(_worker_text(rec.get('worker')))}</td><td style='text-align:left'>{has}</td>"
                     f"<td style='text-align:left'><pre>{_esc(rec.get('error') or '')}</pre></td></tr>")
    parts.append("</table>")
    return parts


def _sweep_section(table, sweep: dict | None, figures: _Figures) -> list[str]:
    """The sweep: its grid, one row per point, and the sweep figure when plotly is there."""
    parts = [f"<h2>Sweep</h2><p id='sweep'>Grid <code>{_esc(json.dumps(sweep or {}, default=str))}</code>: one row per "
             "point (a failed point keeps its row and its error).</p>",
             _table_block(table)]
    try:
        fig = sweep_figure(table, list(sweep or {}))
    except ImportError:
        fig = None
    if fig is not None:
        parts.append(figures.div(fig, "fig-sweep"))
    return parts


def _screenshots_section(screenshots: dict, page_dir: Path) -> list[str]:
    """A browser run's screenshots per notebook, linked relative to the page (a caption alone where
    a screenshot is missing)."""
    parts = ["<h2 id='browser'>In the browser</h2><p>Each notebook opened in JupyterLab in headless Chromium "
             "and run with Run All, as a learner runs it (live widgets on); screenshots taken after the run.</p>"]
    for name, shots in screenshots.items():
        parts.append(f"<h3>{_esc(name)}</h3>")
        for caption, shot in shots:
            if not shot:
                parts.append(f"<p>{_esc(caption)}</p>")
                continue
            rel = _relative(Path(shot), page_dir)
            parts.append(f"<figure><a href='{_esc(rel)}'><img src='{_esc(rel)}' alt='{_esc(caption)}'></a>"
                         f"<figcaption>{_esc(caption)}</figcaption></figure>")
    parts.append(_up(("top", "top")))
    return parts


def _notebook_section(name: str, res: dict, rec: dict, nb_title: str, figures: _Figures) -> list[str]:
    """One notebook's section: its title and run facts, a contents list, then its figures and tables
    under headings in words, each with "back to" links."""
    from workbench.lab.formats import title_of
    from workbench.lab.replay import has_replay

    nb_id = html_id("nb", name)
    nb = rec.get("notebook") or name
    parts = [f"<h2 id='{nb_id}'>{_esc(nb_title)}</h2>"]
    meta = [f"<code>{_esc(name)}</code>", _esc(rec.get("status") or "")]
    if rec.get("seconds") is not None:
        meta.append(f"{_seconds(rec.get('seconds'))} s")
    if rec.get("output"):
        meta.append(f"executed notebook: <a href='{_esc(_file_link(Path(rec['output']).name))}'>"
                    f"{_esc(Path(rec['output']).name)}</a>")
    parts.append(f"<p class='meta'>{' · '.join(m for m in meta if m)}</p>")
    items = [("f", k, v) for k, v in res["figures"].items()] + [("t", k, v) for k, v in res["tables"].items()]
    ids = {(kind, key): html_id(f"{nb_id}-{kind}", key) for kind, key, _ in items}
    contents = ["<div class='contents'><b>Contents</b>"]
    for kind, key, value in items:
        what = "figure" if kind == "f" else "table"
        extra = ""
        if kind == "f" and isinstance(value, dict) and value.get("frames"):
            extra = " (replay)" if has_replay(value) else " (frames)"
        contents.append(f"<p>{what}: <a href='#{ids[(kind, key)]}'>{_esc(title_of(key, nb))}</a>{extra}</p>")
    if res["metrics"]:
        contents.append(f"<p>metrics: <a href='#{html_id('metrics', name)}'>all {len(res['metrics'])}</a></p>")
    contents.append("</div>")
    parts.append("".join(contents))
    parts.append("<div class='items'>")
    for kind, key, value in items:       # figures full width; narrow tables side by side
        parts.append(f"<section class='item {kind}'><h3 id='{ids[(kind, key)]}'>{_esc(title_of(key, nb))}"
                     f"<span class='key'>{_esc(key)}</span></h3>")
        if kind == "t":
            parts.append(_table_block(value))
        else:
            parts.append(figures.div(value, f"fig-{len(figures) + 1}"))
        parts.append(_up((nb_id, "contents"), ("top", "top")) + "</section>")
    parts.append("</div>")
    return parts


def _metrics_section(results: dict, nb_titles: dict) -> list[str]:
    """Every notebook's metrics, one folded table per notebook that wrote any."""
    parts = ["<h2 id='metrics'>All metrics</h2>"]
    if len(results["metrics"]):
        parts.append("<p>Every metric each notebook wrote, with its unit (the key is the name in "
                     "<code>results.csv</code> and the notebook's sidecar).</p>")
        for name, res in results["notebooks"].items():
            if not res["metrics"]:
                continue
            parts.append(f"<details id='{html_id('metrics', name)}'><summary><b>{_esc(nb_titles[name])}</b> "
                         f"({len(res['metrics'])} metrics)</summary>{_metrics_table(res['metrics'])}</details>")
    else:
        parts.append("<p>No notebook wrote metrics.</p>")
    parts.append(_up(("top", "top")))
    return parts


def write_report(path: str | Path, records: list[dict], results: dict, parameters: dict | None = None,
                 started=None, kernel: str | None = None, sweep: dict | None = None,
                 executor: str | None = None, screenshots: dict | None = None, front_page: bool = True,
                 gpu_root=None) -> Path:
    """One self-contained HTML page. A bar of links that stays at the top of the window (the
    sections and every notebook), then the front page (:mod:`workbench.lab.front_page`: every
    notebook's headline figures against their targets with its noise-aware verdicts, the claims
    table when a notebook wrote one, the latest committed GPU results), the environment, the
    notebook summary (status, seconds, worker, links), and a section per notebook: its title, a
    contents list, its figures and tables under headings in words (:func:`workbench.lab.formats.title_of`;
    the key beside it), tables with units and rounding (:func:`workbench.lab.formats.readable_table`,
    in a scroll box), "back to top" links; last, every notebook's metrics. ``screenshots``:
    {notebook: [(caption, path), ...]} from a browser run (:mod:`workbench.lab.browser`), shown
    as images linked relative to the page.

    Figures keep their plotly frames, sliders and buttons (a replay plays and scrubs offline, and
    waits for its ▶). plotly.js (4.8 MB) is in the page once, compressed like the figures' JSON
    (raw DEFLATE + base64), and a small loader inflates both and draws every figure as the page
    loads: a smoke run of every notebook is ~2.5 MB instead of 6.8.

    Every string from a run (names, parameters, sweep keys and values, errors, table cells,
    headings) is escaped; ids are :func:`html_id`, links percent-encoded; and the page's
    Content-Security-Policy allows no script but its own (the loader, its data blocks and
    plotly.js, by sha256): no inline script, event handler or ``javascript:`` link that reached
    it otherwise runs.  The page lands whole (a temporary file, then a rename)."""
    path = Path(path)
    scripts, figures = _Scripts(), _Figures()
    title = f"Workbench notebook run {path.parent.name}"
    by_name = {rec["name"]: rec for rec in records}
    shown = [name for name in results["notebooks"]]
    nb_titles = {name: _notebook_title(by_name.get(name, {"name": name})) for name in shown}

    nav = _report_nav(path.parent.name, results, nb_titles, front_page, screenshots)
    parts = [f"<nav class='bar' id='top'>{' · '.join(nav)}</nav>", f"<h1>{_esc(title)}</h1>"]
    if front_page:
        from workbench.lab.front_page import front_page_html

        parts.append(front_page_html(results, gpu_root=gpu_root))
        parts.append(_up(("top", "top")))
    parts += _environment_section(parameters, started, kernel, executor)
    parts += _summary_table(records, results, nb_titles)
    if "sweep" in results:
        parts += _sweep_section(results["sweep"], sweep, figures)
    if screenshots:
        parts += _screenshots_section(screenshots, path.parent)
    for name, res in results["notebooks"].items():
        parts += _notebook_section(name, res, by_name.get(name, {}), nb_titles[name], figures)
    parts += _metrics_section(results, nb_titles)
    parts.append("<a class='totop' href='#top'>↑ top</a>")
    parts.append(figures.scripts(scripts))

    head = (f"<meta charset='utf-8'><meta http-equiv='Content-Security-Policy' content=\"{_esc(scripts.policy())}\">"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_esc(title)}</title><style>{_CSS}</style>")
    from workbench.lab.run_folder import atomic_write

    atomic_write(path, f"<!DOCTYPE html>\n<html><head>{head}</head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
    return path


def _seconds(v) -> str:
    try:
        return f"{float(v):.1f}"
    except (TypeError, ValueError):
        return _esc(v)

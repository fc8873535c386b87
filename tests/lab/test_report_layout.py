"""The batch report a reader can find their way in: headings in words (never a raw key alone), a
contents list per notebook, "back to top" links and a bar of links that stays on screen; tables
with units and rounding; plotly.js once, compressed with the figures' JSON, so a smoke run's report
stays small; replays (frames, slider, buttons) that wait for ▶ and scrub offline (Chromium, when
/usr/bin/chromium and Playwright are here, unless WORKBENCH_BROWSER_TESTS=1 requires them)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
go = pytest.importorskip("plotly.graph_objects")
nbformat = pytest.importorskip("nbformat")

from lab_browser import chromium  # noqa: E402,F401 - the fixture, after the importorskip
from workbench.lab.formats import format_value, humanize, readable_table, table_html, title_of, unit_kind  # noqa: E402
from workbench.lab.replay import Recorder, replay_figure  # noqa: E402
from workbench.lab.results import _INFLATE_JS, collect_results, save_results, write_report  # noqa: E402
from workbench.lab.viz import replay_at_end  # noqa: E402


def replay(n: int = 12):
    rec = Recorder()
    for i in range(1, n + 1):
        rec.add([{"x": list(range(1, i + 1)), "y": [float(k % 5) for k in range(1, i + 1)]}], label=f"token {i}",
                t_ms=i * 4.5)
    fig = go.Figure(go.Scatter(x=[], y=[], mode="lines+markers"))
    fig.update_layout(xaxis_range=[0, n + 1], yaxis_range=[0, 5])
    return replay_at_end(replay_figure(fig, rec.frames, redraw=False))


def notebook(path: Path, title: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\nWhat it builds.")]
    nbformat.write(nb, str(path))
    return path


def make_report(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    side = tmp_path / "00_tour.results.json"
    table = pd.DataFrame({"ttft_ms_p50": [4691.855592, 0.0298], "kv_bytes": [19709952.0, 1024.0],
                          "share": [0.2884621917, float("nan")], "step": [0.0, 1.0]},
                         index=pd.Index(["ttft_ms", "lm_head"], name="metric"))
    save_results(side, {"ttft_ms_p50": 10.121311, "kv_bytes": 19709952, "attention_share": 0.2884621917,
                        "bench_decode_speedup": 1.1234},
                 tables={"latency_summary": table, "some_new_key_ms": pd.DataFrame({"a": [1, 2]})},
                 figures={"stream": replay(), "tier_kl": go.Figure(go.Bar(y=[1, 2])),
                          "live_block_map_mid_run": go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]))})
    side2 = tmp_path / "01_fused_kernels.results.json"
    save_results(side2, {"copy_gbps": 8.4}, figures={"roofline": go.Figure(go.Scatter(x=[1], y=[2]))})
    recs = [{"name": "00_tour", "notebook": "00_tour", "status": "ok", "seconds": 32.1, "results": str(side),
             "output": str(notebook(tmp_path / "00_tour.ipynb", "00 · A tour of the workbench"))},
            {"name": "01_fused_kernels", "notebook": "01_fused_kernels", "status": "ok", "seconds": 70.0,
             "results": str(side2), "output": None}]
    return write_report(tmp_path / "report.html", recs, collect_results(recs), gpu_root=tmp_path / "none")


def packed(page: str, block_id: str) -> str:
    body = re.search(rf"<script type='application/octet-stream' id='{block_id}'>(.*?)</script>", page, re.DOTALL)
    assert body, block_id
    return zlib.decompress(base64.b64decode(body.group(1)), -15).decode("utf-8")


# ---- names and numbers ----------------------------------------------------------------------------
def test_keys_become_headings_in_words():
    assert title_of("tier_kl") == "KL divergence per tier configuration"              # the mapping
    assert title_of("live_block_map_mid_run") == "KV block map in the middle of the run"
    assert title_of("decode", "01_fused_kernels").startswith("The decode step")         # per notebook first
    assert title_of("some_new_key_ms") == "Some new key (ms)"                          # the fallback
    assert humanize("ttft_ms_p50") == "TTFT P50 (ms)" and humanize("decode_tokens_per_s_p50") == "decode tokens/s P50"
    assert humanize("us_per_block") == "µs per block" and humanize("TTFT p50 ms") == "TTFT p50 ms"


def test_values_get_units_and_rounding():
    assert unit_kind("ttft_ms_p50") == "ms" and unit_kind("kv_bytes") == "bytes"
    assert unit_kind("share") == "fraction" and unit_kind("tokens_per_s") == "number"
    assert unit_kind("rel ppl %") == "percent" and unit_kind("vs_eager") == "ratio"
    assert format_value(4691.855592, "ms") == "4,691.9" and format_value(0.02983, "ms") == "0.03"
    assert format_value(19709952.0, "bytes") == "18.8 MiB"
    assert format_value(0.2884621917, "fraction", unit=True) == "28.8 %"
    assert format_value(float("nan")) == "—" and format_value(None) == "—" and format_value(0.0) == "0"
    assert format_value(3.0) == "3" and format_value(4691.855592) == "4,692"
    assert format_value(9.537e-07, "err") == "9.54e-07"
    assert format_value(1.1234, "ratio") == "1.12×" and format_value(True) == "yes"


def test_readable_table_has_headers_with_units_and_no_raw_floats():
    df = pd.DataFrame({"ttft_ms_p50": [4691.855592, 0.0298], "kv_bytes": [19709952.0, 1024.0],
                       "share": [0.2884621917, float("nan")], "step": [0.0, 1.0]},
                      index=pd.Index(["ttft_ms", "lm_head"], name="metric"))
    t = readable_table(df)
    assert list(t.columns) == ["TTFT P50 (ms)", "KV bytes", "share (%)", "step"]
    assert list(t.index) == ["ttft_ms", "lm_head"] and t.index.name == "metric"      # names a reader types stay
    assert t.iloc[0].tolist() == ["4,691.9", "18.8 MiB", "28.8", "0"]
    assert t.iloc[1].tolist() == ["0.03", "1.0 KiB", "—", "1"]
    stats = pd.DataFrame({"n": [3, 141], "p50": [10.121311, 213.71]}, index=["ttft_ms", "decode_tokens_per_s"])
    t = readable_table(stats)                                           # a row per metric: the unit is the row's
    assert list(t.index) == ["TTFT (ms)", "decode tokens/s"] and t["P50"].tolist() == ["10.1", "213.7"]
    assert t["n"].tolist() == ["3", "141"]
    page = table_html(df)
    assert "4691.855592" not in page and "19709952" not in page and "NaN" not in page and "nan" not in page
    assert page.count("<tr>") == 3 and "<th>metric</th>" in page                      # one header row


# ---- the page -------------------------------------------------------------------------------------
def test_report_has_headings_contents_and_back_links(tmp_path):
    page = make_report(tmp_path / "r").read_text()
    assert "<h2 id='nb-00_tour'>00 · A tour of the workbench</h2>" in page          # the notebook's own title
    assert "<h2 id='nb-01_fused_kernels'>01_fused_kernels</h2>" in page              # no notebook file: its name
    h3 = re.findall(r"<h3 id='([^']+)'>(.*?)<span class='key'>(.*?)</span></h3>", page)
    assert {(t, k) for _, t, k in h3} >= {("KL divergence per tier configuration", "tier_kl"),
                                          ("KV block map in the middle of the run", "live_block_map_mid_run"),
                                          ("Some new key (ms)", "some_new_key_ms"),
                                          ("All kernels on one roofline", "roofline")}
    contents = re.findall(r"<div class='contents'>(.*?)</div>", page, re.DOTALL)
    assert len(contents) == 2                                                   # one per notebook
    targets = set(re.findall(r"href='#([^']+)'", "".join(contents)))
    ids = set(re.findall(r"\bid='([^']+)'", page))
    assert {i for i, _, _ in h3} <= targets and targets <= ids                  # every item listed, every link lands
    assert page.count("href='#top'") >= len(h3) + 1 and "id='top'" in page      # back to top from every item
    assert "class='bar' id='top'" in page and "position:sticky" in page         # links that stay on screen
    assert "<a href='#nb-00_tour' title='00 · A tour of the workbench'>00_tour</a>" in page
    assert "(replay)" in page                                                   # the contents say which figure replays
    assert "10.1 ms" in page and "18.8 MiB" in page and "28.8 %" in page        # metrics with their units
    assert "10.121311" not in page


def test_plotly_js_once_compressed_and_figures_keep_their_frames(tmp_path):
    from plotly.offline import get_plotlyjs

    page = make_report(tmp_path / "r").read_text()
    js = get_plotlyjs()
    assert js[:300] not in page and len(page) < 2_500_000                              # 4.8 MB of plotly.js, packed
    assert packed(page, "wb-plotly-js") == js
    csp = re.search(r"content=\"([^\"]+)\"", page).group(1)
    assert "sha256-" + base64.b64encode(hashlib.sha256(js.encode()).digest()).decode() in csp   # its hash is allowed
    doc = json.loads(packed(page, "wb-figures"))
    assert len(doc["figures"]) == 4 and len(doc["templates"]) == 1                     # one template for every figure
    divs = re.findall(r"<div id='([^']+)' class='plotly-graph-div wb-figure'", page)
    assert sorted(divs) == sorted(doc["figures"])
    stream = next(f for f in doc["figures"].values() if f.get("frames"))
    assert len(stream["frames"]) == 12 and stream["layout"]["sliders"][0]["active"] == 11  # shows the end, waits for ▶
    assert [b["method"] for b in stream["layout"]["updatemenus"][0]["buttons"]] == ["animate", "animate"]
    assert "autoplay" not in page.lower() and "Plotly.animate" not in page


@pytest.mark.skipif(not shutil.which("node"), reason="node is not installed")
def test_the_pages_inflate_matches_zlib(tmp_path):
    """The loader's DEFLATE decoder (no DecompressionStream: it runs before the page's load event,
    as plotly's own calls did) against zlib: stored, fixed and dynamic blocks, and a stream that
    mixes them."""
    import random

    rng = random.Random(0)
    text = ("the quick brown fox " * 2000 + "".join(chr(rng.randrange(32, 0x3000)) for _ in range(20000))).encode()
    noise = bytes(rng.randrange(256) for _ in range(70000))
    cases = {}
    for name, (level, strategy) in {"stored": (0, zlib.Z_DEFAULT_STRATEGY), "fixed": (6, zlib.Z_FIXED),
                                    "dynamic": (9, zlib.Z_DEFAULT_STRATEGY)}.items():
        z = zlib.compressobj(level, zlib.DEFLATED, -15, 9, strategy)
        cases[name] = (z.compress(text) + z.flush(), text)
    z = zlib.compressobj(6, zlib.DEFLATED, -15)
    mixed = z.compress(text) + z.flush(zlib.Z_FULL_FLUSH) + z.compress(noise) + z.flush()
    cases["mixed"] = (mixed, text + noise)
    script = tmp_path / "inflate.js"
    script.write_text(_INFLATE_JS + """
const fs = require("fs");
for (const name of process.argv.slice(2)) {
  const out = wbInflate(new Uint8Array(fs.readFileSync(name + ".z")));
  const ref = fs.readFileSync(name + ".ref");
  console.log(name, out.length === ref.length && Buffer.compare(Buffer.from(out), ref) === 0);
}""")
    for name, (data, ref) in cases.items():
        (tmp_path / f"{name}.z").write_bytes(data)
        (tmp_path / f"{name}.ref").write_bytes(ref)
    out = subprocess.run(["node", str(script), *[str(tmp_path / n) for n in cases]], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert [line.split()[-1] for line in out.stdout.splitlines()] == ["true"] * len(cases), out.stdout


# ---- in Chromium ----------------------------------------------------------------------------------

STATE = """(id) => { const gd = document.getElementById(id);
  const label = [...gd.querySelectorAll('.slider-container text')].map((t) => t.textContent)
    .find((t) => t.includes(' = '));
  const line = gd.querySelector('.scatterlayer .trace path.js-line');
  return {label: label || null, active: gd._fullLayout.sliders[0].active,
          points: gd.querySelectorAll('.scatterlayer .trace .point').length,
          line: line ? line.getAttribute('d') : null}; }"""




@pytest.mark.slow
def test_a_replay_in_the_report_waits_scrubs_and_plays_offline(chromium, tmp_path):  # noqa: F811 - the imported fixture
    report = make_report(tmp_path / "r")
    page = chromium.new_page()
    errors, requests = [], []
    page.on("pageerror", lambda e: errors.append(str(e)[:300]))
    page.on("request", lambda r: requests.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
    try:
        page.goto(report.resolve().as_uri())
        page.wait_for_function("() => [...document.querySelectorAll('div.plotly-graph-div')]"
                               ".every((d) => d.querySelector('.main-svg'))", timeout=30_000)
        fid = page.evaluate("() => [...document.querySelectorAll('div.wb-figure')]"
                            ".find((d) => d.querySelector('.slider-container')).id")
        page.evaluate(f"() => document.getElementById('{fid}').scrollIntoView()")
        start = page.evaluate(STATE, fid)
        assert start["active"] == 11 and start["points"] == 12 and "token 12" in start["label"], start
        page.wait_for_timeout(800)
        assert page.evaluate(STATE, fid) == start                                         # no autoplay
        x = page.evaluate(f"""() => {{ const r = document.querySelectorAll('#{fid} .slider-tick-rect')[2]
            .getBoundingClientRect(); return r.left + r.width / 2; }}""")
        rail = page.locator(f"#{fid} .slider-rail-touch-rect").bounding_box()
        page.mouse.click(x, rail["y"] + rail["height"] / 2)                              # a slider step
        page.wait_for_timeout(300)
        step = page.evaluate(STATE, fid)
        assert step["active"] == 2 and step["points"] == 3 and "token 3" in step["label"], step
        assert step["line"] != start["line"]
        page.locator(f"#{fid} .updatemenu-button").first.click()                          # ▶ play
        seen = set()
        for _ in range(10):
            page.wait_for_timeout(200)
            seen.add(page.evaluate(STATE, fid)["active"])
        assert len(seen) >= 3 and max(seen) > 2, seen                                     # it plays on
        assert errors == [] and requests == [], (errors, requests)                        # offline, no error
    finally:
        page.close()

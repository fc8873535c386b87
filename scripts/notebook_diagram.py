"""Embed a notebook's opening diagram (an SVG under notebooks/figures/) in its first markdown cell.

    .venv/bin/python scripts/notebook_diagram.py notebooks/02_kv_tiers.ipynb notebooks/figures/02_kv_tiers.svg

The SVG goes in as an ``<img>`` whose source is the SVG itself (a base64 data URI, some 8 KB), so
the picture shows in JupyterLab (4.6 draws an image *attachment* only when it is PNG, JPEG, GIF,
WebP or BMP: an SVG attachment is "Cannot render unknown image mime type"), in a papermill copy
under runs/ (where a relative link to notebooks/figures would break) and in nbconvert's HTML.  The
``<img>`` follows the cell's first heading, behind a ``<!-- diagram: NAME -->`` marker; running the
script again replaces it (edit the SVG, re-run), and removes an attachment or a link of the same
name that an earlier version of the script put there.  The SVG file stays the source, committed
beside the notebooks.
"""

from __future__ import annotations

import argparse
import base64
import re
import sys
from pathlib import Path


def embed(notebook: Path, svg: Path, alt: str = "what you will build", width: int = 760) -> None:
    import nbformat

    text = svg.read_text()
    if "<svg" not in text:
        raise SystemExit(f"{svg}: not an SVG file")
    nb = nbformat.read(notebook, as_version=4)
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if cell is None:
        raise SystemExit(f"{notebook}: no markdown cell to hold the diagram")
    name, stem = svg.name, svg.stem
    attachments = cell.get("attachments") or {}
    for key in [k for k in attachments if Path(k).stem == stem]:     # an earlier version's attachment
        del attachments[key]
    if "attachments" in cell and not attachments:
        del cell["attachments"]
    source = re.sub(r"!\[[^\]]*\]\(attachment:" + re.escape(stem) + r"[^)]*\)\n?", "", cell.source)
    source = re.sub(r"<!-- diagram: " + re.escape(name) + r" -->\n<img [^\n]*>\n?", "", source)
    uri = "data:image/svg+xml;base64," + base64.b64encode(text.encode()).decode()
    block = f'<!-- diagram: {name} -->\n<img alt="{alt}" width="{width}" src="{uri}">'
    lines = source.split("\n")
    at = next((i + 1 for i, line in enumerate(lines) if re.match(r"#+ ", line)), 0)
    lines[at:at] = ["", block, ""]
    cell.source = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    nbformat.write(nb, notebook)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("svg", type=Path)
    ap.add_argument("--alt", default="what you will build")
    a = ap.parse_args(argv)
    embed(a.notebook, a.svg, a.alt)
    print(f"{a.notebook}: {a.svg.name} embedded in its first markdown cell", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

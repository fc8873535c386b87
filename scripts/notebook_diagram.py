"""Embed a notebook's opening diagram (an SVG under notebooks/figures/) in its first markdown cell.

    .venv/bin/python scripts/notebook_diagram.py notebooks/02_kv_tiers.ipynb notebooks/figures/02_kv_tiers.svg

The SVG goes in as a cell attachment (base64 in the notebook itself), so the picture shows in
JupyterLab, in a papermill copy under runs/ (where a relative link to notebooks/figures would
break) and in nbconvert's HTML.  The cell gets ``![<alt>](attachment:<name>)`` after its first
heading, once; running the script again replaces the attachment (edit the SVG, re-run).  The SVG
file stays the source, committed beside the notebooks.
"""

from __future__ import annotations

import argparse
import base64
import re
import sys
from pathlib import Path


def embed(notebook: Path, svg: Path, alt: str = "what you will build") -> None:
    import nbformat

    text = svg.read_text()
    if "<svg" not in text:
        raise SystemExit(f"{svg}: not an SVG file")
    nb = nbformat.read(notebook, as_version=4)
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if cell is None:
        raise SystemExit(f"{notebook}: no markdown cell to hold the diagram")
    name = svg.name
    cell.setdefault("attachments", {})[name] = {"image/svg+xml": base64.b64encode(text.encode()).decode()}
    link = f"![{alt}](attachment:{name})"
    if f"(attachment:{name})" not in cell.source:
        lines = cell.source.split("\n")
        at = next((i + 1 for i, line in enumerate(lines) if re.match(r"#+ ", line)), 0)
        lines[at:at] = ["", link, ""]
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

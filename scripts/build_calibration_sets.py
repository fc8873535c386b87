#!/usr/bin/env python3
"""Build the two shipped calibration sets from the reference model's corpus.

    python scripts/build_calibration_sets.py                      # apt-get download python3.11-doc
    python scripts/build_calibration_sets.py --deb python3.11-doc_3.11.2-6+deb12u8_all.deb
    python scripts/build_calibration_sets.py --sources <folder of *.rst.txt>

Writes ``data/calibration/reference.jsonl`` (markup-heavy ``library/`` reference pages) and
``data/calibration/prose.jsonl`` (``tutorial/``, ``howto/``, ``faq/`` pages with little markup),
one JSON object per line: ``{"text", "source", "domain"}``.  Both come from the *training*
split of the corpus (documents for which ``is_heldout(path)`` is False, the training script's
own rule), so no held-out document - and so nothing of the perplexity split drawn from them -
is in either set.

Selection (all deterministic: no randomness, orders come from SHA-1 hashes of paths):

* markup density of a text = markup items per 1,000 characters, counting directive lines
  (``.. function::``, ``.. note::``), inline roles (``:func:`...```, ``:c:type:`...```) and
  inline literals (````...````) - :func:`markup_density`;
* reference: ``library/*.rst.txt`` pages with density >= ``REFERENCE_MIN_DENSITY``; prose:
  ``tutorial/``, ``howto/``, ``faq/`` pages with density <= ``PROSE_MAX_DENSITY``; table-of-
  contents pages (``index.rst.txt``) are left out of both;
* each page is cut into rows of consecutive paragraphs (split at blank lines): a row is closed
  once it reaches ``ROW_TARGET`` characters, or before a paragraph that would take it over
  ``ROW_MAX``; paragraphs over ``ROW_MAX`` on their own (big tables, long code blocks) are not
  used, rows under ``ROW_MIN`` are dropped, and so are rows whose own density is on the wrong
  side of their domain's threshold, and prose rows with more than ``PROSE_MAX_INDENTED`` of
  their characters on indented lines (code and literal blocks; :func:`row_fits`);
* rows are taken round-robin over the pages in hash order (each page's rows in hash order as
  well), at most ``MAX_ROWS_PER_DOC`` per page, until a set has ``ROWS_PER_SET`` rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(ROOT))

from train_reference_model import fetch_sources, is_heldout, load_documents  # noqa: E402

OUT_DIR = ROOT / "data" / "calibration"

REFERENCE_MIN_DENSITY = 10.0  # markup items per 1,000 chars (training library pages: median 8.75, 106 of 306 >= 10)
PROSE_MAX_DENSITY = 4.5
PROSE_MAX_INDENTED = 0.5  # share of a prose row's characters on indented (code / literal block) lines
ROW_TARGET, ROW_MAX, ROW_MIN = 1800, 2500, 400  # characters
ROWS_PER_SET = 64
MAX_ROWS_PER_DOC = 3

DIRECTIVE = re.compile(r"^[ \t]*\.\. [A-Za-z][\w:-]*::", re.M)  # .. function::, .. py:method::
ROLE = re.compile(r":[A-Za-z][\w+-]*(?::[\w+-]+)?:`")  # :func:`, :c:type:`
LITERAL = re.compile(r"``[^`\n]+?``")  # ``x`` on one line


def markup_counts(text: str) -> dict:
    return {"directives": len(DIRECTIVE.findall(text)), "roles": len(ROLE.findall(text)),
            "literals": len(LITERAL.findall(text))}


def markup_density(text: str) -> float:
    """reStructuredText markup items (directive lines, inline roles, inline literals) per 1,000
    characters of ``text``."""
    return 1000.0 * sum(markup_counts(text).values()) / max(1, len(text))


def _hash(s: str) -> str:
    return hashlib.sha1(f"calibration:{s}".encode()).hexdigest()


def paragraphs(text: str) -> list[str]:
    return [p for p in (q.rstrip().strip("\n") for q in re.split(r"\n[ \t]*\n", text)) if p.strip()]


def rows_of(text: str) -> list[str]:
    """Rows of consecutive paragraphs of ``text`` (see the module docstring for the rule)."""
    rows: list[str] = []
    cur: list[str] = []
    size = 0

    def close():
        nonlocal cur, size
        if cur and size >= ROW_MIN:
            rows.append("\n\n".join(cur))
        cur, size = [], 0

    for p in paragraphs(text):
        if len(p) > ROW_MAX:
            close()
            continue
        if cur and size + 2 + len(p) > ROW_MAX:
            close()
        size += len(p) + (2 if cur else 0)
        cur.append(p)
        if size >= ROW_TARGET:
            close()
    close()
    return rows


def domain_of(path: str, density: float) -> str | None:
    if path.rsplit("/", 1)[-1] == "index.rst.txt":
        return None
    if path.startswith("library/") and path.endswith(".rst.txt") and density >= REFERENCE_MIN_DENSITY:
        return "reference"
    if path.split("/", 1)[0] in ("tutorial", "howto", "faq") and density <= PROSE_MAX_DENSITY:
        return "prose"
    return None


def indented_fraction(text: str) -> float:
    """Share of the characters of ``text`` on indented lines: in a tutorial, code and literal
    blocks (in a reference page also the bodies of ``.. function::`` directives)."""
    return sum(len(ln) for ln in text.split("\n") if ln[:1] in (" ", "\t")) / max(1, len(text))


def row_fits(domain: str, text: str) -> bool:
    """A row must pass its page's threshold too (a reference page's prose intro is not reference
    text, a tutorial's table of operators is not prose), and a prose row must be mostly prose:
    at most ``PROSE_MAX_INDENTED`` of it in indented (code / literal block) lines."""
    if domain == "reference":
        return markup_density(text) >= REFERENCE_MIN_DENSITY
    return markup_density(text) <= PROSE_MAX_DENSITY and indented_fraction(text) <= PROSE_MAX_INDENTED


def select(docs: list[dict], domain: str) -> tuple[list[dict], list[dict]]:
    """``(rows, candidate pages)`` of one domain from the training documents ``docs``."""
    cands = []
    for d in docs:
        if is_heldout(d["path"]):
            continue
        dens = markup_density(d["text"])
        if domain_of(d["path"], dens) == domain:
            order = sorted(enumerate(rows_of(d["text"])), key=lambda ir, p=d["path"]: _hash(f"{p}#{ir[0]}"))
            rows = [r for _, r in order if row_fits(domain, r)]
            cands.append({"path": d["path"], "density": dens, "chars": len(d["text"]), "rows": rows})
    cands.sort(key=lambda c: _hash(c["path"]))
    picked: list[dict] = []
    for rnd in range(MAX_ROWS_PER_DOC):
        for c in cands:
            if len(picked) == ROWS_PER_SET:
                return picked, cands
            if rnd < len(c["rows"]):
                picked.append({"text": c["rows"][rnd], "source": c["path"], "domain": domain})
    return picked, cands


def summary(rows: list[dict], tokenizer) -> dict:
    dens = [markup_density(r["text"]) for r in rows]
    chars = sum(len(r["text"]) for r in rows)
    items = sum(sum(markup_counts(r["text"]).values()) for r in rows)
    docs = {r["source"] for r in rows}
    return {"rows": len(rows), "documents": len(docs), "characters": chars,
            "bytes": sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in rows),
            "tokens": sum(len(tokenizer.encode(r["text"])) for r in rows),
            "row_chars_min": min(len(r["text"]) for r in rows), "row_chars_max": max(len(r["text"]) for r in rows),
            "density_pooled": round(1000.0 * items / chars, 2), "density_mean": round(statistics.mean(dens), 2),
            "density_min": round(min(dens), 2), "density_max": round(max(dens), 2),
            "indented_mean": round(statistics.mean(indented_fraction(r["text"]) for r in rows), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", help="folder of *.rst.txt sources (skips apt-get)")
    ap.add_argument("--deb", help="a downloaded python3.11-doc .deb (skips apt-get download)")
    ap.add_argument("--out", default=str(OUT_DIR), help="output folder (default data/calibration)")
    args = ap.parse_args(argv)

    import workbench

    tok = workbench.Tokenizer(workbench.BUNDLED_MODEL)
    docs = load_documents(fetch_sources(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(docs)} documents, {sum(not is_heldout(d['path']) for d in docs)} in the training split; "
          f"thresholds: reference >= {REFERENCE_MIN_DENSITY}, prose <= {PROSE_MAX_DENSITY} markup items / 1,000 chars")
    for domain in ("reference", "prose"):
        rows, cands = select(docs, domain)
        if len(rows) < ROWS_PER_SET:
            raise SystemExit(f"{domain}: only {len(rows)} rows from {len(cands)} pages (want {ROWS_PER_SET})")
        path = out / f"{domain}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        s = summary(rows, tok)
        used = sorted({r["source"] for r in rows})
        pd = [c["density"] for c in cands if c["path"] in used]
        print(f"\n{domain}: {len(cands)} candidate pages (page density {min(c['density'] for c in cands):.2f}-"
              f"{max(c['density'] for c in cands):.2f}), {s['documents']} used (page density "
              f"{min(pd):.2f}-{max(pd):.2f})")
        print(f"  rows {s['rows']}, documents {s['documents']}, characters {s['characters']:,} "
              f"(rows {s['row_chars_min']:,}-{s['row_chars_max']:,}), file {path.stat().st_size:,} bytes, "
              f"tokens {s['tokens']:,} (with one BOS per row)")
        print(f"  markup density per row: mean {s['density_mean']}, range {s['density_min']}-{s['density_max']}; "
              f"pooled {s['density_pooled']}; indented share mean {s['indented_mean']}")
        print(f"  sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The two shipped calibration sets (data/calibration/, built by scripts/build_calibration_sets.py):
they parse, they say where each row comes from, they share nothing with the held-out corpus
(and so nothing with its perplexity split), and they differ in domain by the measure that
selected them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import workbench
from workbench.data import heldout_documents, ngram_overlap, read_jsonl

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from build_calibration_sets import markup_density  # noqa: E402

CAL = Path(__file__).resolve().parent.parent / "data" / "calibration"
SETS = ("reference", "prose")


@pytest.fixture(scope="module")
def tok():
    return workbench.Tokenizer(workbench.BUNDLED_MODEL)


@pytest.fixture(scope="module")
def rows():
    return {name: read_jsonl(CAL / f"{name}.jsonl") for name in SETS}


@pytest.fixture(scope="module")
def ids(rows, tok):
    return {name: [tok.encode(r["text"]) for r in rs] for name, rs in rows.items()}


@pytest.mark.parametrize("name", SETS)
def test_rows_parse_and_name_their_source(rows, name):
    rs = rows[name]
    assert len(rs) == 64
    for r in rs:
        assert r["domain"] == name
        assert isinstance(r["source"], str) and r["source"].endswith(".rst.txt")
        assert 400 <= len(r["text"]) <= 2500
    prefixes = ("library/",) if name == "reference" else ("tutorial/", "howto/", "faq/")
    assert all(r["source"].startswith(prefixes) for r in rs)
    # spread over many documents: measured 64 (reference) and 26 (prose), at most 3 rows each
    sources = [r["source"] for r in rs]
    assert len(set(sources)) >= 20
    assert max(sources.count(s) for s in set(sources)) <= 3


def test_no_heldout_document_in_either_set(rows):
    heldout = {d["path"] for d in heldout_documents()}
    assert len(heldout) == 20
    for name in SETS:
        assert not heldout & {r["source"] for r in rows[name]}, name


@pytest.mark.parametrize("name", SETS)
def test_little_text_shared_with_heldout_documents(ids, tok, name):
    reference = [tok.encode(d["text"]) for d in heldout_documents()]
    # measured 16-gram overlap: reference 0.00091 (boilerplate: "sectionauthor:: Fred L. Drake, Jr."
    # and ".. deprecated-removed:: 3.11 3.13" lines), prose 0.0
    assert ngram_overlap(ids[name], reference, n=16) < 0.005


def test_reference_set_is_markup_heavier_than_prose(rows):
    dens = {name: [markup_density(r["text"]) for r in rows[name]] for name in SETS}
    mean = {name: sum(d) / len(d) for name, d in dens.items()}
    # measured: reference mean 13.79 (rows 10.17-27.99), prose mean 2.46 (rows 0.0-4.4) items / 1,000 chars
    assert mean["reference"] > 3 * mean["prose"]
    assert min(dens["reference"]) > max(dens["prose"])


@pytest.mark.parametrize("name", SETS)
def test_enough_tokens(ids, name):
    # measured (one BOS per row included): reference 30,060, prose 29,389
    assert sum(len(x) for x in ids[name]) >= 25_000

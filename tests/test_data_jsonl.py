"""A user's JSONL text file: every malformed input is one error naming the file and the line
(the CLI: exit 2, no traceback), and the split / windows a recipe records are rebuilt exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench.data import (dataset_split, jsonl_windows, ngram_overlap, pack_windows, read_jsonl, split_rows,
                            windows_from_spec)
from workbench.errors import DataError

BAD = {
    "bad_json": (b'{"text": "fine"}\n{"text": "no closing quote}\n', "line 2: bad JSON"),
    "missing_field": (b'{"text": "fine"}\n\n{"body": "x"}\n', "line 3: no 'text' field (fields: 'body')"),
    "empty": (b"\n  \n", "the file is empty"),
    "not_utf8": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "line 2: not UTF-8 (byte 0xe9 at column 14)"),
    "not_object": (b'["text"]\n', "line 1: expected a JSON object"),
    "not_string": (b'{"text": 3}\n', "line 1: field 'text' must be a string"),
    "empty_text": (b'{"text": "  "}\n', "line 1: field 'text' is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_jsonl_names_file_and_line(tmp_path, case):
    data, message = BAD[case]
    p = tmp_path / f"{case}.jsonl"
    p.write_bytes(data)
    with pytest.raises(DataError) as e:
        read_jsonl(p)
    assert str(p) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("case", ["bad_json", "missing_field", "empty", "not_utf8"])
def test_calibrate_quant_cli_exits_2_without_traceback(tmp_path, case):
    data, message = BAD[case]
    p = tmp_path / f"{case}.jsonl"
    p.write_bytes(data)
    r = subprocess.run([sys.executable, "-m", "workbench.cli.main", "calibrate-quant", "--dataset", str(p),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_missing_file_and_other_text_field(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_jsonl(tmp_path / "nope.jsonl")
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps({"body": f"row {i}", "id": i}) for i in range(3)) + "\n")
    rows = read_jsonl(p, text_field="body")
    assert [r["text"] for r in rows] == ["row 0", "row 1", "row 2"] and [r["line"] for r in rows] == [1, 2, 3]
    assert rows[1]["id"] == 1


def test_split_parts_are_disjoint_and_cover_the_file():
    rows = list(range(11))
    cal, ev = split_rows(rows, 0.5)
    assert sorted(cal + ev) == rows and not set(cal) & set(ev) and len(ev) == 5
    search, conf = dataset_split(rows, "search"), dataset_split(rows, "confirmation")
    assert sorted(search + conf) == ev and not set(search) & set(conf)
    assert len(split_rows(list(range(100)), 0.2)[1]) == 20
    with pytest.raises(Exception, match="split must be one of"):
        dataset_split(rows, "train")


def test_pack_windows():
    rows = [[0, 1, 2], [0, 3], [0, 4, 5, 6, 7]]
    assert pack_windows(rows, 4) == [[0, 1, 2, 0], [3, 0, 4, 5]]
    assert pack_windows(rows, 4, max_windows=1) == [[0, 1, 2, 0]]
    assert pack_windows([[0, 1, 2]], 8) == [[0, 1, 2]]            # shorter than a window: the whole stream
    assert ngram_overlap([[1, 2, 3, 4]], [[9, 2, 3, 4]], n=3) == 0.5


def test_windows_rebuilt_from_spec_and_refused_when_the_file_changed(tmp_path, bundled_tokenizer):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"The list type number {i} has some more methods."}) for i in range(40)))
    w, spec = jsonl_windows(p, bundled_tokenizer, 16, 3, "search")
    assert spec["split"] == "search" and spec["windows"] == len(w) == 3 and all(len(x) == 16 for x in w)
    assert windows_from_spec(spec, bundled_tokenizer) == w
    p.write_text(p.read_text() + "\n" + json.dumps({"text": "one more"}))
    with pytest.raises(DataError, match="changed since the recipe was made"):
        windows_from_spec(spec, bundled_tokenizer)

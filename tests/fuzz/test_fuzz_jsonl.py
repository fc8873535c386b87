"""Fuzzing calibration JSONL files (``workbench.data.read_jsonl`` and what the calibrator does with a
dataset before and after it loads a model: :func:`workbench.data.group_field_of`, the four splits
of :func:`workbench.data.dataset_split`, the token windows of :func:`workbench.data.jsonl_windows`).
A valid file - rows with ``text`` and ``source`` (two rows a document), as the shipped sets are - is
mutated one change at a time: a row's JSON changed anywhere (any value, retyped, removed, added), a
line dropped, repeated, split or replaced by raw bytes, the file's bytes flipped, truncated, given a
byte-order mark or CRLF line ends, a JSON escape that Python reads as a lone surrogate.

The outcome is a correct read (one row a non-blank line, each with its text; the splits partition
the rows, a document never in two parts; every window a list of token ids) or a one-line DataError
/ ConfigError naming the file.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzkit import Shown, check_refusal, dump_json, fuzz, get_value, json_values, mutated_bytes, mutated_json, note, \
    outcome

import workbench
from workbench.data import dataset_split, group_field_of, jsonl_windows, read_jsonl
from workbench.errors import ConfigError, DataError

KEYS = ("text", "source", "line", "id", "meta")
ODD_LINES = [b"", b" ", b"\t", b"{}", b"[]", b"null", b"\"text\"", b"{\"text\": \"\\ud800\", \"source\": \"d\"}",
             b"{\"text\": \"a\\u0000b\", \"source\": \"d\"}", b"{\"text\": \"\\udfff\\ud800\"}",
             b"\xef\xbb\xbf{\"text\": \"x\"}",
             b"{\"text\": \"x\", \"source\": [1]}", b"{\"text\": \"x\", \"source\": {\"a\": 1}}", b"{\"text\": NaN}",
             b"{\"text\": \"x\"} {\"text\": \"y\"}", b"{\"text\": \"x\",}", b"\xff\xfe", b"\x00" * 8,
             b"[" * 2000 + b"]" * 2000, b"{\"text\": " + b"9" * 5000 + b"}", b"{\"text\": \"" + b"x" * 5000 + b"\"}"]
SPLITS = ("calibration", "evaluation", "search", "confirmation")


@pytest.fixture(scope="module")
def tok():
    return Shown(workbench.Tokenizer(workbench.BUNDLED_MODEL), "<the bundled tokenizer>")


@pytest.fixture(scope="module")
def valid():
    rows = [{"text": f"Row {i}: the list type has methods; a tuple {'does not' if i % 3 else 'does'}.",
             "source": f"doc{i // 2}"} for i in range(10)]
    return Shown(rows, "<the valid JSONL rows>")


def encode(rows) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


def read_as_the_calibrator_does(path, tok):
    """calibrate(): read_jsonl + group_field_of before any model loads; then the four splits
    (at least one row or group each) and the windows of calibration / search / confirmation."""
    rows = read_jsonl(path, "text")
    group = group_field_of(rows, "auto", path)
    parts = {k: dataset_split(rows, k, 0.5, group) for k in SPLITS}
    windows = {k: jsonl_windows(path, tok, 16, 4, k, 0.5, "text", group)[0]
               for k in ("calibration", "search", "confirmation")}
    return rows, group, parts, windows


def check_read(data: bytes, rows, group, parts, windows) -> None:
    lines = [b for b in data.split(b"\n") if b.decode("utf-8").strip()]
    assert len(rows) == len(lines) and [r["line"] for r in rows] == sorted(r["line"] for r in rows)
    assert all(isinstance(r["text"], str) and r["text"].strip() for r in rows)
    ids = lambda part: [id(r) for r in part]                                     # noqa: E731
    cal, ev = ids(parts["calibration"]), ids(parts["evaluation"])
    assert sorted(cal + ev) == sorted(ids(rows)) and not set(cal) & set(ev)
    assert sorted(ids(parts["search"]) + ids(parts["confirmation"])) == sorted(ev)
    if group is not None:
        def groups(part):
            return {repr(r[group]) for r in part}
        assert not groups(parts["calibration"]) & groups(parts["evaluation"]), "a document in both parts"
    for ws in windows.values():
        assert all(isinstance(w, list) and all(isinstance(t, int) for t in w) for w in ws)


def run_case(tmp_path, data: bytes, tok, area: str):
    path = tmp_path / "calib.jsonl"
    path.write_bytes(data)
    kind, got = outcome(lambda: read_as_the_calibrator_does(path, tok.value), (DataError, ConfigError),
                        max_bytes=64 * 2**20 + 200 * len(data))
    if kind == "error":
        check_refusal(got, [path])
        note(f"{area}: refused")
        return got
    check_read(data, *got)
    note(f"{area}: read")
    return None


@st.composite
def mutation(draw, valid):
    rows = valid.value
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in rows]
    kind = draw(st.sampled_from(["row"] * 4 + ["line"] * 2 + ["bytes"] * 2 + ["file"]))
    i = draw(st.integers(0, len(lines) - 1))
    if kind == "row":
        new, path, action = draw(mutated_json(rows[i], KEYS))
        lines[i] = dump_json(new).replace("\n", " ").encode()
        what = f"row {i + 1}: {action} at {list(path)}: {get_value(new, path)!r:.120}"
    elif kind == "line":
        op = draw(st.sampled_from(["drop", "repeat", "odd", "json", "split"]))
        if op == "drop":
            del lines[i]
        elif op == "repeat":
            lines.insert(i, lines[i])
        elif op == "odd":
            lines[i] = draw(st.sampled_from(ODD_LINES))
        elif op == "json":
            lines[i] = json.dumps(draw(json_values(KEYS)), allow_nan=True).encode()
        else:
            cut = draw(st.integers(0, len(lines[i])))
            lines[i:i + 1] = [lines[i][:cut], lines[i][cut:]]
        what = f"line {i + 1}: {op} -> {lines[i] if i < len(lines) else b''!r:.120}"
    data = b"\n".join(lines) + b"\n"
    if kind == "bytes":
        data, what = draw(mutated_bytes(data))
    elif kind == "file":
        op = draw(st.sampled_from(["bom", "crlf", "no final newline", "empty", "blank lines", "only one document"]))
        data = {"bom": b"\xef\xbb\xbf" + data, "crlf": data.replace(b"\n", b"\r\n"),
                "no final newline": data.rstrip(b"\n"),
                "empty": b"", "blank lines": b"\n\n" + data.replace(b"\n", b"\n \n"),
                "only one document": encode([dict(r, source="one") for r in rows])}[op]
        what = f"file: {op}"
    return Shown(data, what, area=kind)


@fuzz(ci=300)
@given(data=st.data())
def test_fuzz_calibration_jsonl(valid, tmp_path, tok, data):
    case = data.draw(mutation(valid), label="mutation")
    run_case(tmp_path, case.value, tok, case.area)


def test_the_valid_file_is_read(valid, tmp_path, tok):
    assert run_case(tmp_path, encode(valid.value), tok, "valid") is None


# ---- what the fuzzing found, kept as regular tests ----------------------------------------------------

@pytest.mark.parametrize("lines, needles", [
    # a list (or object) as the group field: TypeError (unhashable) in the split
    ([b'{"text": "a", "source": [1]}', b'{"text": "b", "source": [2]}'], ["line 1", "'source'", "got list"]),
    ([b'{"text": "a", "source": "d1"}', b'{"text": "b", "source": {"doc": 2}}'], ["line 2", "'source'", "got dict"]),
    # nesting past the recursion limit: RecursionError
    ([b'{"text": "a"}', b"[" * 100_000], ["line 2", "nested too deeply"]),
    # an integer of more than 4,300 digits: ValueError
    ([b'{"text": "a", "n": ' + b"9" * 5000 + b"}"], ["line 1", "4300 digits"]),
])
def test_lines_found_by_fuzzing_are_refused_by_file_and_line(tmp_path, tok, lines, needles):
    err = run_case(tmp_path, b"\n".join(lines) + b"\n", tok, "regression")
    assert isinstance(err, DataError) and all(n in str(err) for n in needles), err


def test_the_calibrator_names_the_file_when_its_group_field_is_missing(tmp_path):
    """calibrate() refuses a dataset before any model loads; the group field's errors named the
    line only ("line 1: no 'doc' field to group rows by")."""
    from workbench.quant.calibrate import calibrate

    path = tmp_path / "calib.jsonl"
    path.write_bytes(encode([{"text": f"row {i}"} for i in range(8)]))
    kind, err = outcome(lambda: calibrate(path, group_field="doc"), (DataError,), seconds=60)
    assert kind == "error" and "line 1: no 'doc' field" in check_refusal(err, [path])


def test_a_lone_surrogate_escape_is_refused_by_line(tmp_path, tok):
    """'\\ud800' is valid JSON that Python reads as a lone surrogate; the tokenizer then raised
    TypeError ("TextInputSequence must be str")."""
    err = run_case(tmp_path, b'{"text": "fine"}\n{"text": "a \\ud800 b", "source": "d"}\n', tok, "regression")
    assert isinstance(err, DataError) and "line 2" in str(err) and "\\ud800" in str(err), err

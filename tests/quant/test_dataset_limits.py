"""The calibration dataset is read line by line within bounds: a row longer than
``max_row_bytes`` or a file past ``max_bytes`` is refused at its line having read no more than the
limit, the rows are tokenized within ``max_tokens`` (refused at the row that passes it), and what
the tokenized text holds is checked against the machine and ``memory_budget`` before the model
loads (:func:`workbench.data.read_jsonl`, :func:`workbench.data.encode_rows`,
:func:`workbench.quant.calibrate.calibrate`)."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from workbench.data import (DATASET_TOKENS_LIMIT, calibration_set, encode_rows, jsonl_windows, read_jsonl,
                            windows_from_spec)
from workbench.errors import ConfigError, DataError


def _rows(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_a_400_mb_single_row_file_is_refused_at_line_1_without_reading_it(tmp_path):
    """The finding: calibrate-quant --dataset on a 400 MB, 4-row JSONL passed 7 GB in 22 s (the
    file was read whole, split, decoded and parsed).  A sparse file: 400 MB of one line, no disk."""
    p = tmp_path / "huge.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"text": "')
        f.truncate(400 * 10**6)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(DataError, match=rf"^{p}, line 1: a row of more than 4 MiB \(the limit of one row, "
                                            r"max_row_bytes\)"):
            read_jsonl(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1 and peak < 16 << 20


def test_a_long_row_is_refused_at_its_own_line(tmp_path):
    p = _rows(tmp_path / "d.jsonl", ["short", "x" * 200, "short"])
    with pytest.raises(DataError, match=rf"^{p}, line 2: a row of more than 100 bytes"):
        read_jsonl(p, max_row_bytes=100)
    line = len(json.dumps({"text": "x" * 200}))          # exactly the limit (the newline aside) is a row
    assert [r["line"] for r in read_jsonl(p, max_row_bytes=line)] == [1, 2, 3]


def test_a_file_past_the_limit_is_refused_where_it_passes(tmp_path):
    p = _rows(tmp_path / "d.jsonl", [f"row {i} " + "y" * 80 for i in range(100)])
    with pytest.raises(DataError, match=rf"^{p}, line 11: the file passes 1,000 bytes here \(the limit of a dataset, "
                                        r"max_bytes\)"):
        read_jsonl(p, max_bytes=1000)


def test_the_reader_still_names_every_other_problem_by_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\r\n{"text": \n')
    with pytest.raises(DataError, match=rf"^{p}, line 4: bad JSON"):
        read_jsonl(p)
    p.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\r\n{"text": "c"}')          # no final newline
    assert [(r["line"], r["text"]) for r in read_jsonl(p)] == [(1, "a"), (3, "b"), (4, "c")]


def test_tokens_are_bounded_row_by_row(tmp_path, bundled_tokenizer):
    p = _rows(tmp_path / "d.jsonl", ["The list type has some more methods."] * 50)
    rows = read_jsonl(p)
    n = len(bundled_tokenizer.encode(rows[0]["text"]))
    assert sum(map(len, encode_rows(rows, bundled_tokenizer, 50 * n, p))) == 50 * n
    calls = []
    tok = type("Counting", (), {"encode": lambda self, t: calls.append(t) or bundled_tokenizer.encode(t)})()
    with pytest.raises(DataError, match=rf"^{p}, line 6: the dataset passes {5 * n + 1:,} tokens here \(the limit, "
                                        r"max_tokens / --max-dataset-tokens\)"):
        encode_rows(rows, tok, 5 * n + 1, p)
    assert len(calls) == 6                     # the rows after the one that passed are never tokenized


def test_a_raised_token_limit_is_recorded_so_a_recipe_rebuilds_within_it(tmp_path, bundled_tokenizer):
    p = _rows(tmp_path / "d.jsonl", ["The list type has some more methods, and here they are."] * 40)
    with pytest.raises(DataError, match="passes 100 tokens"):
        jsonl_windows(p, bundled_tokenizer, 16, 4, max_tokens=100)
    windows, spec = jsonl_windows(p, bundled_tokenizer, 16, 4, max_tokens=10**6)
    assert spec["max_tokens"] == 10**6 and windows_from_spec(spec, bundled_tokenizer) == windows
    _, default = jsonl_windows(p, bundled_tokenizer, 16, 4)
    assert "max_tokens" not in default and DATASET_TOKENS_LIMIT == 2_000_000


def test_calibrate_checks_the_dataset_before_the_model_loads(tmp_path, monkeypatch):
    from workbench.model import loader
    from workbench.quant.calibrate import HELD_BYTES_PER_TOKEN, calibrate

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    prose = calibration_set("prose")
    with pytest.raises(ConfigError, match=rf"^calibration data: [0-9,]+ tokens of {prose} x "
                                          r"400 B a token \(ids and the 8-gram sets of the overlap diagnostics\) = "
                                          r".* more than the memory_budget / --memory-budget of 1\.0 MiB; set "
                                          r"max_dataset_tokens / --max-dataset-tokens"):
        calibrate(prose, memory_budget="1M")
    assert HELD_BYTES_PER_TOKEN == 400
    with pytest.raises(DataError, match=rf"^{prose}, line \d+: the dataset passes 1,000 tokens here"):
        calibrate(prose, max_dataset_tokens=1000)
    with pytest.raises(ConfigError, match="max_dataset_tokens must be an integer >= 1"):
        calibrate(prose, max_dataset_tokens=0)

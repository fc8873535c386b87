"""Recorded traces: the five readers on small hand-written files in the real formats, one-line
errors for malformed rows, the prefix structure the synthetic content keeps, streaming of big
files (time and memory), determinism, and the sample files' round trip through a workload.
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from datetime import datetime, UTC

import pytest

from workbench.errors import ConfigError, DataError
from workbench.load.trace_samples import SUFFIX, write_sample
from workbench.load.trace_workload import TraceOptions, build_trace_workload, parse_window
from workbench.load.traces import FORMATS, MOONCAKE_BLOCK, ReadStats, TraceError, detect_format, read_trace

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


@pytest.fixture(scope="module")
def tok(bundled_tokenizer):
    return bundled_tokenizer


def put(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def jsonl(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


def read(path, **kw):
    st = ReadStats()
    return list(read_trace(path, stats=st, **kw)), st


def common(a: list, b: list) -> int:
    """How many leading tokens two prompts share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


def mooncake_row(t_ms: int, n: int, out: int, ids) -> dict:
    return {"timestamp": t_ms, "input_length": n, "output_length": out, "hash_ids": list(ids)}


# ---- 1. the readers -------------------------------------------------------------------------------
def test_azure_rows_times_lengths_and_left_out(tmp_path):
    p = put(tmp_path, "AzureLLMInferenceTrace_code.csv", AZURE_HEADER +
            "2023-11-16 18:15:46.6805900,374,44\n"
            "2023-11-16 18:15:50.9951690,396,109\n"
            "2023-11-16 18:15:51.0000000,879,0\n"
            "\n"
            "2023-11-16 18:16:46.6805900,100,5\n")
    assert detect_format(p) == "azure"
    rows, st = read(p)
    assert [r.line for r in rows] == [2, 3, 6]
    assert [r.at for r in rows] == pytest.approx([0.0, 4.314579, 60.0], abs=1e-5)
    assert [(r.prompt_tokens, r.max_tokens) for r in rows] == [(374, 44), (396, 109), (100, 5)]
    assert all(r.prompt is None and r.conversation is None for r in rows)
    assert st.format == "azure" and st.rows_read == 3 and st.kept == 3
    assert st.left_out == {"0 generated tokens": 1}
    assert st.first_time == pytest.approx(datetime(2023, 11, 16, 18, 15, 46, 680590, tzinfo=UTC).timestamp())


def test_azure_times_are_utc_across_a_daylight_saving_change(tmp_path, monkeypatch):
    """Zone-less stamps are UTC: in New York local time these two are 2 s apart, as recorded 3602 s."""
    if not hasattr(time, "tzset") or not os.path.exists("/usr/share/zoneinfo/America/New_York"):
        pytest.skip("needs time zone data")
    p = put(tmp_path, "dst.csv", AZURE_HEADER + "2023-03-12 01:59:59.0000000,10,2\n2023-03-12 03:00:01.0000000,10,2\n"
                                                "2023-03-12 03:00:02+00:00,10,2\n")
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        rows, _ = read(p)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert [r.at for r in rows] == pytest.approx([0.0, 3602.0, 3603.0])


def test_azure_header_with_a_byte_order_mark_and_quotes(tmp_path):
    p = tmp_path / "excel.csv"
    p.write_bytes(b'\xef\xbb\xbf"TIMESTAMP","ContextTokens","GeneratedTokens"\r\n'
                  b'2023-11-16 18:15:46.6805900,374,44\r\n2023-11-16 18:15:47.6805900,3,4\r\n')
    assert detect_format(p) == "azure"
    rows, _ = read(p)
    assert [(r.at, r.prompt_tokens, r.max_tokens) for r in rows] == [(0.0, 374, 44), (pytest.approx(1.0), 3, 4)]


def test_burstgpt_rows_leave_out_failed_requests(tmp_path):
    p = put(tmp_path, "BurstGPT_1.csv", BURST_HEADER +
            "5,ChatGPT,472,18,490,Conversation log\n"
            "45,ChatGPT,1087,0,1087,Conversation log\n"
            "118,GPT-4,417,276,693,API log\n"
            "118.5,ChatGPT,20,1,21,API log\n")
    assert detect_format(p) == "burstgpt"
    rows, st = read(p)
    assert [r.line for r in rows] == [2, 4, 5]
    assert [r.at for r in rows] == [0.0, 113.0, 113.5]
    assert [(r.prompt_tokens, r.max_tokens) for r in rows] == [(472, 18), (417, 276), (20, 1)]
    assert st.left_out == {"0 response tokens (a failed request in the recording)": 1}
    assert st.rows_read == 3 and st.first_time == 5.0


def test_mooncake_rows(tmp_path):
    p = put(tmp_path, "mooncake_trace.jsonl", jsonl(
        mooncake_row(27482, 6955, 52, range(46, 60)),
        mooncake_row(30535, 6472, 26, list(range(46, 52)) + list(range(60, 67))),
        {"timestamp": 32730, "input_length": 300, "output_length": 8}))
    assert detect_format(p) == "mooncake"
    rows, st = read(p)
    assert [r.at for r in rows] == pytest.approx([0.0, 3.053, 5.248])
    assert [(r.prompt_tokens, r.max_tokens) for r in rows] == [(6955, 52), (6472, 26), (300, 8)]
    assert rows[0].hash_ids == tuple(range(46, 60)) and len(rows[1].hash_ids) == 13 and rows[2].hash_ids == ()
    assert st.first_time == pytest.approx(27.482)


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                                  {"from": "gpt", "value": "Hello! How can I help?"},
                                  {"from": "human", "value": "Say bye"}, {"from": "gpt", "value": "Bye!"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "A question nobody answered"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
]


def check_sharegpt_rows(rows, st):
    assert [(r.conversation, r.turn) for r in rows] == [("a", 0), ("a", 1), ("c", 0)]
    assert rows[0].turns == [("system", "Be brief."), ("user", "Hi there")]
    assert rows[0].reply == "Hello! How can I help?" and rows[0].max_tokens is None
    assert rows[1].turns == rows[0].turns + [("assistant", "Hello! How can I help?"), ("user", "Say bye")]
    assert rows[0].at == 0.0 and rows[1].at == pytest.approx(3.0)          # reply_s, no think time
    assert rows[2].at > 0.0
    assert st.left_out == {"a conversation with no user turn answered": 1}


def test_sharegpt_json_list(tmp_path):
    p = put(tmp_path, "ShareGPT_V3.json", "[\n" + ",\n".join(json.dumps(c, indent=1) for c in SHAREGPT) + "\n]\n")
    assert detect_format(p) == "sharegpt"
    rows, st = read(p, reply_s=3.0, think_s=0.0)
    check_sharegpt_rows(rows, st)
    k0, k1 = (json.dumps(c, indent=1).count("\n") for c in SHAREGPT[:2])
    assert [r.line for r in rows] == [2, 2, 4 + k0 + k1]


def test_sharegpt_jsonl_same_rows(tmp_path):
    p = put(tmp_path, "sharegpt.jsonl", jsonl(*SHAREGPT))
    assert detect_format(p) == "sharegpt"
    rows, st = read(p, reply_s=3.0, think_s=0.0)
    check_sharegpt_rows(rows, st)
    assert [r.line for r in rows] == [1, 1, 3]


def test_workbench_jsonl_rows(tmp_path):
    p = put(tmp_path, "mine.jsonl", jsonl(
        {"at": 10, "prompt": "Tell me a story", "max_tokens": 20, "priority": 2},
        {"at": 11.5, "prompt_tokens": 50, "output_tokens": 7, "conversation": 3},
        {"at": 12, "prompt_tokens": 80, "max_tokens": 5, "conversation": 3},
        {"at": 10, "prompt_tokens": 60, "max_tokens": 4, "prefix": "sys", "prefix_tokens": 40}))
    assert detect_format(p) == "workbench"
    rows, st = read(p)
    assert [r.at for r in rows] == [0.0, 1.5, 2.0, 0.0]
    assert rows[0].prompt == "Tell me a story" and rows[0].max_tokens == 20 and rows[0].priority == 2
    assert (rows[1].prompt_tokens, rows[1].max_tokens, rows[1].conversation) == (50, 7, "3")
    assert [r.turn for r in rows] == [None, 0, 1, None]
    assert (rows[3].prefix, rows[3].prefix_tokens) == ("sys", 40)
    assert st.first_time == 10.0 and st.rows_read == 4


def test_window_keeps_and_rebases(tmp_path):
    p = put(tmp_path, "m.jsonl", jsonl(*(mooncake_row(1000 + 1000 * i, 10 + i, 2, []) for i in range(10))))
    rows, st = read(p, window=(2, 5))
    assert [r.at for r in rows] == [0.0, 1.0, 2.0]
    assert [r.prompt_tokens for r in rows] == [12, 13, 14]
    assert st.outside_window == 7 and st.kept == 3 and st.rows_read == 10
    rows, st = read(p, window=(2, 100), limit=2)
    assert [r.prompt_tokens for r in rows] == [12, 13] and st.stopped_at_limit and st.rows_read == 4


def test_detect_format_errors(tmp_path):
    with pytest.raises(TraceError) as e:
        detect_format(put(tmp_path, "notes.txt", "hello world\n"))
    assert one_line(e).startswith(f"{tmp_path / 'notes.txt'}:1: not a trace")
    with pytest.raises(TraceError) as e:
        detect_format(put(tmp_path, "other.csv", "a,b,c\n1,2,3\n"))
    assert one_line(e).startswith(f"{tmp_path / 'other.csv'}:1: a CSV trace must have")
    with pytest.raises(TraceError, match="no such file"):
        detect_format(tmp_path / "missing.jsonl")


# ---- 2. malformed rows: one line naming the file, the line and the field --------------------------
GOOD = {"at": 0, "prompt_tokens": 5, "max_tokens": 3}
GOOD_AZ = "2023-11-16 18:15:46.6805900,374,44\n"
GOOD_MC = mooncake_row(0, 600, 4, [1, 2])

BAD = {
    "bad JSON": ("w.jsonl", None, jsonl(GOOD, '{"at": 1, "prompt_tokens": 5,'), 2, None, "not valid JSON"),
    "not an object": ("w.jsonl", None, jsonl(GOOD, GOOD, "[1, 2]"), 3, None, "expected a JSON object, got list"),
    "missing at": ("w.jsonl", None, jsonl(GOOD, {"prompt_tokens": 5, "max_tokens": 3}), 2, "at", "missing"),
    "missing max_tokens": ("w.jsonl", None, jsonl({"at": 0, "prompt_tokens": 5}), 1, "max_tokens", "missing"),
    "missing prompt": ("w.jsonl", None, jsonl({"at": 0, "max_tokens": 5}), 1, "prompt", "exactly one"),
    "unknown field": ("w.jsonl", None, jsonl({**GOOD, "temperature": 0.5}), 1, "temperature", "unknown field"),
    "non-numeric": ("w.jsonl", None, jsonl({**GOOD, "prompt_tokens": "many"}), 1, "prompt_tokens", "expected a number"),
    "negative": ("w.jsonl", None, jsonl(GOOD, {**GOOD, "max_tokens": -3}), 2, "max_tokens", "must be >= 1"),
    "fractional": ("w.jsonl", None, jsonl({**GOOD, "prompt_tokens": 5.5}), 1, "prompt_tokens", "whole number"),
    "boolean": ("w.jsonl", None, jsonl({**GOOD, "max_tokens": True}), 1, "max_tokens", "expected a number"),
    "prefix alone": ("w.jsonl", None, jsonl({**GOOD, "prefix": "s"}), 1, "prefix_tokens", "go together"),
    "prefix too long": ("w.jsonl", None, jsonl({**GOOD, "prefix": "s", "prefix_tokens": 9}), 1, "prefix_tokens",
                        "9 > prompt_tokens 5"),
    "time before the first row": ("w.jsonl", None, jsonl({**GOOD, "at": 5}, {**GOOD, "at": 4}), 2, "at",
                                  "before the trace's first row"),
    "azure non-numeric": ("a.csv", None, AZURE_HEADER + GOOD_AZ + "2023-11-16 18:15:47,abc,4\n", 3, "ContextTokens",
                          "expected a number, got 'abc'"),
    "azure negative": ("a.csv", None, AZURE_HEADER + "2023-11-16 18:15:47,3,-1\n", 2, "GeneratedTokens",
                       "must be >= 0"),
    "azure bad time": ("a.csv", None, AZURE_HEADER + GOOD_AZ + "16/11/2023 18:15,3,4\n", 3, "TIMESTAMP",
                       "expected a time like"),
    "azure time before the first row": ("a.csv", None, AZURE_HEADER + GOOD_AZ + "2023-11-16 18:15:45,3,4\n", 3,
                                        "TIMESTAMP", "before the trace's first row"),
    "azure wrong number of fields": ("a.csv", None, AZURE_HEADER + GOOD_AZ + GOOD_AZ + "2023-11-16 18:15:47,3\n", 4,
                                     None, "the row has 2 fields, the header 3"),
    "azure column missing": ("a.csv", "azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:47,3\n", 1,
                             "GeneratedTokens", "column missing"),
    "burstgpt fractional": ("b.csv", None, BURST_HEADER + "5,ChatGPT,10.5,3,13.5,API log\n", 2, "Request tokens",
                            "whole number"),
    "burstgpt bad time": ("b.csv", None, BURST_HEADER + "soon,ChatGPT,10,3,13,API log\n", 2, "Timestamp",
                          "expected a number"),
    "burstgpt column missing": ("b.csv", "burstgpt", "Timestamp,Model,Request tokens\n1,ChatGPT,3\n", 1,
                                "Response tokens", "column missing"),
    "mooncake missing field": ("m.jsonl", None, jsonl(GOOD_MC, {"timestamp": 5, "input_length": 3}), 2,
                               "output_length", "missing"),
    "mooncake hash_ids not a list": ("m.jsonl", None, jsonl({**GOOD_MC, "hash_ids": 5}), 1, "hash_ids",
                                     "expected a list"),
    "mooncake hash_ids not integers": ("m.jsonl", None, jsonl({**GOOD_MC, "hash_ids": ["x"]}), 1, "hash_ids",
                                       "expected a list of integer"),
    "mooncake too many blocks": ("m.jsonl", None, jsonl(GOOD_MC, {**GOOD_MC, "hash_ids": [1, 2, 3]}), 2, "hash_ids",
                                 f"3 blocks of {MOONCAKE_BLOCK} tokens for an input of 600"),
    "mooncake time before the first row": ("m.jsonl", None, jsonl({**GOOD_MC, "timestamp": 5000},
                                                                  {**GOOD_MC, "timestamp": 4000}), 2, "timestamp",
                                           "1.000 s before"),
    "sharegpt unknown speaker": ("s.json", None, "[\n" + json.dumps(SHAREGPT[0]) + ",\n" + json.dumps(
        {"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "beep"}]}) + "\n]",
                                 3, "conversations[1].from", "unknown speaker 'robot'"),
    "sharegpt missing conversations": ("s.json", None, json.dumps([{"id": "x", "turns": []}]), 1, "conversations",
                                       "missing"),
    "sharegpt message without text": ("s.jsonl", "sharegpt", jsonl(SHAREGPT[2], {"conversations": [
        {"from": "human"}]}), 2, "conversations[0]", "expected"),
    "sharegpt not an object": ("s.json", None, "[\n" + json.dumps(SHAREGPT[2]) + ",\n 7\n]", 3, None,
                               "expected a conversation object, got int"),
    "sharegpt truncated list": ("s.json", None, "[\n" + json.dumps(SHAREGPT[2]) + ",\n" + json.dumps(SHAREGPT[0])[:60],
                                3, None, "not valid JSON (Unterminated string"),
    "sharegpt list without ]": ("s.json", None, "[\n" + json.dumps(SHAREGPT[2]) + ",\n" + json.dumps(SHAREGPT[2]),
                                3, None, "ends without ']'"),
    "sharegpt missing comma": ("s.json", None, "[\n" + json.dumps(SHAREGPT[2]) + "\n" + json.dumps(SHAREGPT[2]) + "]",
                               3, None, "expected ',' or ']'"),
    "sharegpt syntax error inside": ("s.json", None, '[\n{"id": "a",\n "conversations": [}\n]', 3, None,
                                     "not valid JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_row(tmp_path, case):
    name, fmt, text, line, field, why = BAD[case]
    p = put(tmp_path, name, text)
    with pytest.raises(TraceError) as e:
        list(read_trace(p, format=fmt))
    msg = one_line(e)
    where = f"{p}:{line}: " + (f"{field}: " if field else "")
    assert msg.startswith(where), (msg, where)
    assert why in msg, msg
    assert (e.value.path, e.value.line, e.value.field) == (str(p), line, field)


@pytest.mark.parametrize("name,fmt", [("e.jsonl", None), ("e.jsonl", "mooncake"), ("e.jsonl", "workbench"),
                                      ("e.json", "sharegpt"), ("e.csv", "azure"), ("e.csv", "burstgpt")])
def test_empty_file(tmp_path, name, fmt):
    p = put(tmp_path, name, "\n  \n")
    with pytest.raises(TraceError) as e:
        list(read_trace(p, format=fmt))
    assert one_line(e).startswith(f"{p}: empty file")


def test_unknown_format_and_bad_read_arguments(tmp_path):
    p = put(tmp_path, "w.jsonl", jsonl(GOOD))
    with pytest.raises(DataError) as e:
        list(read_trace(p, format="parquet"))
    assert "'parquet'" in one_line(e) and "mooncake" in str(e.value)
    for kw, what in (({"window": (5, 1)}, "window 5:1"), ({"limit": 0}, "limit 0"), ({"limit": True}, "limit True"),
                     ({"rate": 0}, "rate must be > 0")):
        with pytest.raises(DataError) as e:
            list(read_trace(p, **kw))
        assert what in one_line(e)
    with pytest.raises(TraceError, match="no such file"):
        list(read_trace(tmp_path / "gone.jsonl", format="workbench"))


@pytest.mark.parametrize("text", ["abc", "5:1", "5:5", "10", "-1:5", "1:x", "nan:3", ("a", 1), (1, 2, 3), (4, 2)])
def test_parse_window_errors(text):
    with pytest.raises(ConfigError) as e:
        parse_window(text)
    assert "window" in one_line(e) and repr(text) in str(e.value)


def test_parse_window():
    assert parse_window("60:660") == (60.0, 660.0)
    assert parse_window(":600") == (0.0, 600.0)
    assert parse_window((1, 2.5)) == (1.0, 2.5)
    assert parse_window(None) is None and parse_window("") is None
    assert TraceOptions(window="10:20").window == (10.0, 20.0)


@pytest.mark.parametrize("kw,what", [({"time_scale": 0}, "time scale"), ({"time_scale": -1}, "time scale"),
                                     ({"length_scale": 0}, "length scale"), ({"max_tokens_cap": 0}, "max tokens cap"),
                                     ({"limit": 0}, "limit"), ({"limit": 2.5}, "limit"), ({"window": "5:1"}, "window"),
                                     ({"window": (3, 1)}, "window"), ({"rate": 0}, "rate"),
                                     ({"think_s": -1}, "think_s"), ({"reply_s": -1}, "reply_s"),
                                     ({"block_size": 0}, "block size")])
def test_trace_options_errors(kw, what):
    with pytest.raises(ConfigError) as e:
        TraceOptions(**kw)
    assert what in one_line(e)


def test_build_errors(tmp_path, tok):
    p = put(tmp_path, "w.jsonl", jsonl(GOOD, {**GOOD, "at": 1}))
    with pytest.raises(ConfigError) as e:
        build_trace_workload(p, tok, 1024, TraceOptions(window=(50, 60)))
    assert one_line(e).startswith(f"{p}: no request to replay (2 rows read, 2 outside")
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        build_trace_workload(p, None, 1024)


# ---- 3. the structure kept ------------------------------------------------------------------------
def test_mooncake_hash_ids_are_shared_prefixes(tmp_path, tok):
    p = put(tmp_path, "m.jsonl", jsonl(mooncake_row(0, 1500, 10, [1, 2, 3]), mooncake_row(100, 1400, 10, [1, 2, 7]),
                                       mooncake_row(200, 700, 10, [1, 9]), mooncake_row(300, 100, 10, [5]),
                                       mooncake_row(400, 1500, 12, [1, 2, 3])))
    wl = build_trace_workload(p, tok, 4096)
    a, b, c, d, e = wl.prompts
    assert [len(x) for x in wl.prompts] == [1500, 1400, 700, 100, 1500] and wl.clipped == 0
    assert a[0] == b[0] == tok.encode("")[0]
    assert common(a, b) == 1 + 2 * MOONCAKE_BLOCK
    assert common(a, c) == common(b, c) == 1 + MOONCAKE_BLOCK
    assert common(a, d) == 1
    assert a == e                                             # equal ids, equal lengths: the same prompt
    s = wl.summary()
    assert s["repeated_prefix_share"] == pytest.approx(
        sum(16 * (common(x, max(wl.prompts[:i], key=lambda y: common(x, y), default=[])) // 16)
            for i, x in enumerate(wl.prompts)) / sum(map(len, wl.prompts)))
    assert 0 < s["repeated_prefix_share"] < 1
    assert [p.max_tokens for p in wl.params] == [10, 10, 10, 10, 12]

    half = build_trace_workload(p, tok, 4096, TraceOptions(length_scale=0.25))
    a, b, c = half.prompts[:3]
    assert [len(x) for x in half.prompts] == [375, 350, 175, 25, 375]
    assert common(a, b) == 1 + 2 * 128 and common(a, c) == 1 + 128
    assert [p.max_tokens for p in half.params] == [2, 2, 2, 2, 3]


def test_workbench_prefixes_and_conversations(tmp_path, tok):
    p = put(tmp_path, "w.jsonl", jsonl(
        {"at": 0, "prompt_tokens": 100, "max_tokens": 4, "prefix": "sys", "prefix_tokens": 40},
        {"at": 1, "prompt_tokens": 60, "max_tokens": 4, "prefix": "sys", "prefix_tokens": 40},
        {"at": 2, "prompt_tokens": 60, "max_tokens": 4, "prefix": "other", "prefix_tokens": 40},
        {"at": 3, "prompt_tokens": 50, "max_tokens": 4, "conversation": "c"},
        {"at": 4, "prompt_tokens": 80, "max_tokens": 4, "conversation": "c"},
        {"at": 5, "prompt_tokens": 70, "max_tokens": 4, "conversation": "c"},
        {"at": 6, "prompt_tokens": 80, "max_tokens": 4, "conversation": "d"},
        {"at": 7, "prompt": "Explain a list comprehension.", "max_tokens": 6, "priority": 3}))
    wl = build_trace_workload(p, tok, 1024)
    s1, s2, o, c1, c2, c3, d1, text = wl.prompts
    assert [len(x) for x in wl.prompts[:7]] == [100, 60, 60, 50, 80, 70, 80]
    assert common(s1, s2) == 41 and common(s1, o) == 1
    assert c2[:50] == c1 and common(c2, c1 + [-1]) == 50 and c3 == c2[:70]
    assert common(c1, d1) == 1 and common(c1, s1) == 1
    assert text == tok.encode("Explain a list comprehension.") and wl.params[-1].max_tokens == 6
    assert [i["kind"] for i in wl.info] == ["short"] * 3 + ["chat"] * 4 + ["short"]
    assert [i["turn"] for i in wl.info] == [None] * 3 + [0, 1, 2, 0, None]
    assert [r.priority for r in wl.trace().requests] == [0] * 7 + [3]
    assert [r.priority for r in wl.trace(priorities=False).requests] == [0] * 8
    assert all(sp.temperature == 0.0 and sp.ignore_eos for sp in wl.params)
    assert wl.summary()["conversations"] == 2
    scaled = build_trace_workload(p, tok, 1024, TraceOptions(length_scale=2.0))
    assert [len(x) for x in scaled.prompts[:7]] == [200, 120, 120, 100, 160, 140, 160]
    assert common(scaled.prompts[0], scaled.prompts[1]) == 81
    assert scaled.prompts[7] == text and scaled.params[7].max_tokens == 12     # a text prompt as it is


def test_sharegpt_turns_extend_the_previous_turn(tmp_path, tok):
    p = write_sample("sharegpt", tmp_path / "s.json", requests=120, seed=3)
    wl = build_trace_workload(p, tok, 1024)
    by_conv: dict = {}
    for ids, i in zip(wl.prompts, wl.info):
        by_conv.setdefault(i["conversation"], []).append((i["turn"], ids))
    multi = [sorted(t) for t in by_conv.values() if len(t) > 1]
    assert len(multi) > 5
    for turns in multi:
        assert [k for k, _ in turns] == list(range(len(turns)))
        for (_, a), (_, b) in zip(turns, turns[1:]):
            assert b[:len(a)] == a and len(b) > len(a)

    q = put(tmp_path, "one.json", json.dumps(SHAREGPT))
    one = build_trace_workload(q, tok, 1024, TraceOptions(think_s=0.0, reply_s=1.0))
    turn = {(i["conversation"], i["turn"]): (ids, sp, i) for ids, sp, i in zip(one.prompts, one.params, one.info)}
    assert sorted(turn) == [("a", 0), ("a", 1), ("c", 0)]
    text = tok.decode(turn["a", 1][0])
    assert text.index("Be brief.") < text.index("Hi there") < text.index("Hello! How can I help?") < \
        text.index("Say bye")
    assert turn["a", 1][0][:len(turn["a", 0][0])] == turn["a", 0][0]
    assert [turn[k][1].max_tokens for k in (("a", 0), ("a", 1), ("c", 0))] == \
        [len(tok.encode(t)) - 1 for t in ("Hello! How can I help?", "Bye!", "A")]
    assert (turn["a", 0][2]["at"], turn["a", 1][2]["at"]) == (0.0, 1.0)


def test_azure_and_burstgpt_share_nothing_beyond_bos(tmp_path, tok):
    rows = "".join(f"2023-11-16 18:{15 + i // 600:02d}:{i % 600 / 10:04.1f},{40 + i % 17},3\n" for i in range(2400))
    p = put(tmp_path, "az.csv", AZURE_HEADER + rows)
    wl = build_trace_workload(p, tok, 1024)
    assert len(wl.prompts) == 2400
    ordered = sorted(wl.prompts)
    assert max(common(a, b) for a, b in zip(ordered, ordered[1:])) == 1     # no two share more than BOS
    assert wl.summary()["repeated_prefix_share"] == 0.0
    b = build_trace_workload(write_sample("burstgpt", tmp_path / "b.csv"), tok, 1024)
    ordered = sorted(b.prompts)
    assert max(common(x, y) for x, y in zip(ordered, ordered[1:])) == 1
    assert b.summary()["repeated_prefix_share"] == 0.0


def test_clipping_cap_and_time_scale(tmp_path, tok):
    p = put(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:15:46.0,5000,40\n2023-11-16 18:15:48.0,300,2000\n"
                                              "2023-11-16 18:15:50.0,200,10\n")
    wl = build_trace_workload(p, tok, 1024)
    assert wl.clipped == 2
    assert [(len(x), sp.max_tokens) for x, sp in zip(wl.prompts, wl.params)] == [(984, 40), (2, 1022), (200, 10)]
    assert [i["prompt_tokens"] for i in wl.info] == [984, 2, 200]
    s = wl.summary()
    assert s["clipped"] == 2 and "2 prompts cut to fit the context of 1024" in wl.describe()
    capped = build_trace_workload(p, tok, 1024, TraceOptions(max_tokens_cap=16, time_scale=0.5))
    assert [sp.max_tokens for sp in capped.params] == [16, 16, 10] and capped.clipped == 1
    assert [i["at"] for i in capped.info] == [0.0, 1.0, 2.0] and [i["at"] for i in wl.info] == [0.0, 2.0, 4.0]
    assert capped.config.describe() == "time_scale=0.5, max_tokens_cap=16"

    fast = wl.scaled(0.25)
    assert [i["at"] for i in fast.info] == [0.0, 0.5, 1.0] and fast.config.time_scale == 0.25
    assert [i["at"] for i in wl.info] == [0.0, 2.0, 4.0]            # the original unchanged
    assert fast.prompts == wl.prompts and [r.at for r in fast.trace().requests] == [0.0, 0.5, 1.0]
    assert fast.duration == 1.0 and wl.duration == 4.0
    assert wl.frame()["at"].tolist() == [0.0, 2.0, 4.0] and wl.frame()["prompt_tokens"].tolist() == [984, 2, 200]
    single = build_trace_workload(p, tok, 1024, TraceOptions(limit=1))
    assert "1 requests over 0.0 s (all at once; limit=1)" in single.describe()
    with pytest.raises(ConfigError):
        wl.scaled(0)


def test_limit_stops_reading_early(tmp_path, tok):
    p = put(tmp_path, "m.jsonl", jsonl(*(mooncake_row(10 * i, 600, 4, [i % 3, 100 + i]) for i in range(500))))
    st = ReadStats()
    rows = list(read_trace(p, limit=10, stats=st))
    assert len(rows) == 10 and st.rows_read == 10 and st.kept == 10 and st.stopped_at_limit
    wl = build_trace_workload(p, tok, 1024, TraceOptions(limit=25, window=(1.0, 100.0)))
    s = wl.summary()
    assert s["requests"] == 25 and s["stopped_at_limit"] and s["rows_read"] == 125 and s["outside_window"] == 100
    assert wl.info[0]["at"] == 0.0 and wl.info[-1]["at"] == pytest.approx(0.24)
    assert "reading stopped at the limit after 125 rows" in wl.describe()
    whole = build_trace_workload(p, tok, 1024)
    assert len(whole.prompts) == 500 and not whole.stats.stopped_at_limit


# ---- 4. streaming ---------------------------------------------------------------------------------
def test_big_files_are_streamed(tmp_path, tok):
    block = "".join(f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.{i:07d},{100 + i},{1 + i % 50}\n"
                    for i in range(1000))
    az = tmp_path / "big.csv"
    with open(az, "w") as f:
        f.write(AZURE_HEADER)
        for _ in range(50 * 2**20 // len(block)):
            f.write(block)
    assert az.stat().st_size > 45 * 2**20
    mc = tmp_path / "big.jsonl"
    row = json.dumps(mooncake_row(1000, 4000, 8, range(8))) + "\n"
    mc.write_text(row * (50 * 2**20 // len(row)))
    for p in (az, mc):
        tracemalloc.start()
        t = time.perf_counter()
        st = ReadStats()
        rows = list(read_trace(p, limit=10, stats=st))
        took = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(rows) == 10 and st.rows_read == 10 and took < 0.5 and peak < 2**20, (p, took, peak)
        print(f"{p.name}: {p.stat().st_size / 2**20:.0f} MiB, 10 rows in {took * 1e3:.1f} ms, "
              f"peak {peak / 2**10:.0f} KiB")


def test_big_sharegpt_list_is_read_element_by_element(tmp_path):
    conv = {"id": "x", "conversations": [{"from": "human" if k % 2 == 0 else "gpt", "value": "word " * 60}
                                         for k in range(6)]}
    item = json.dumps(conv, indent=1)
    n = 24 * 2**20 // len(item)
    p = tmp_path / "big.json"
    with open(p, "w") as f:
        f.write("[\n" + ",\n".join([item] * n) + "\n]\n")
    size = p.stat().st_size
    tracemalloc.start()
    st = ReadStats()
    count = sum(1 for _ in read_trace(p, stats=st))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == 3 * n and st.rows_read == 3 * n
    assert peak < size / 25, (peak, size)
    print(f"ShareGPT list of {size / 2**20:.0f} MiB read with a peak of {peak / 2**10:.0f} KiB")

    # a syntax error early in a big list is reported at once, without reading the rest
    bad = tmp_path / "bad.json"
    with open(p) as src, open(bad, "w") as f:
        f.write('[\n{"id": "a" "conversations": []},\n')
        f.write(src.read()[2:])
    tracemalloc.start()
    with pytest.raises(TraceError) as e:
        list(read_trace(bad))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < size / 25, (peak, size)
    assert one_line(e).startswith(f"{bad}:2: not valid JSON (Expecting ',' delimiter")


# ---- 5. determinism -------------------------------------------------------------------------------
def test_same_file_same_ids_other_seed_other_content(tmp_path, tok):
    for fmt in ("mooncake", "workbench", "azure"):
        p = write_sample(fmt, tmp_path / f"{fmt}{SUFFIX[fmt]}", requests=60)
        one = build_trace_workload(p, tok, 1024)
        two = build_trace_workload(p, tok, 1024)
        assert one.prompts == two.prompts and one.info == two.info
        other = build_trace_workload(p, tok, 1024, TraceOptions(seed=1))
        text = {r.line for r in read_trace(p) if r.prompt is not None}
        same = [a == b for a, b in zip(one.prompts, other.prompts)]
        assert same == [i["line"] in text for i in one.info] and not all(same)
        assert [len(x) for x in one.prompts] == [len(x) for x in other.prompts]
    s = write_sample("sharegpt", tmp_path / "s.json", requests=60)
    a, b = build_trace_workload(s, tok, 1024), build_trace_workload(s, tok, 1024, TraceOptions(seed=5))
    assert sorted(a.prompts) == sorted(b.prompts)                      # text: the same ids ...
    assert [i["at"] for i in a.info] != [i["at"] for i in b.info]      # ... at other made-up times


# ---- 6. the sample files ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_samples_round_trip(tmp_path, tok, fmt):
    p = write_sample(fmt, tmp_path / f"sample{SUFFIX[fmt]}", requests=240)
    assert detect_format(p) == fmt
    wl = build_trace_workload(p, tok, 1024)
    s = wl.summary()
    assert s["requests"] == 240 and len(wl.prompts) == len(wl.params) == 240 and s["format"] == fmt
    assert wl.clipped == 0                                     # sized for the bundled model's context
    assert all(len(x) + sp.max_tokens <= 1024 for x, sp in zip(wl.prompts, wl.params))
    assert [i["at"] for i in wl.info] == sorted(i["at"] for i in wl.info) and s["duration_s"] > 0
    assert (s["repeated_prefix_share"] > 0) == (fmt in ("mooncake", "sharegpt", "workbench"))
    if fmt == "burstgpt":
        assert sum(s["left_out"].values()) > 0 and "rows left out" in wl.describe()
    assert wl.describe().startswith(f"sample{SUFFIX[fmt]} ({fmt}): 240 requests over ")
    assert len(wl.trace().requests) == 240


def test_write_sample_errors(tmp_path):
    for kw, what in (({"format": "csv"}, "trace format 'csv'"), ({"requests": 0}, "requests 0"),
                     ({"rate": 0}, "rate 0"), ({"context": 16}, "context 16")):
        with pytest.raises(ConfigError) as e:
            write_sample(**{"format": "azure", "path": tmp_path / "x.csv", **kw})
        assert what in one_line(e)

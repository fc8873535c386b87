"""A serve configuration as data (workbench.bench.serve_config): the flags and the shell command
line of an options dict, the JSON file that ``workbench serve --config FILE`` reads, every
malformed file refused in one line naming the file and the key; ``serve --config`` on the real
parser (the command line wins, unknown keys refused); ``--lookahead`` only with ``--offload``;
and one real server started from a file."""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys

import pytest

import workbench as wb
from workbench.bench.serve_config import read_serve_config, serve_argv, serve_command, write_serve_config
from workbench.cli.main import build_parser, main
from workbench.cli.serve import with_serve_config
from workbench.errors import ConfigError

CLI = [sys.executable, "-m", "workbench.cli.main"]
TUNED = {"model": "runs/smollm2", "quant": "w8a16:head", "compile": True, "window_ms": 5.0, "max_num_seqs": 8,
         "num_blocks": 96, "offload": "host", "lookahead": 4, "no_prefix_caching": False}


# ---- the formatter -----------------------------------------------------------------------------
def test_serve_argv_of_a_tuned_configuration():
    assert serve_argv(TUNED) == ["--model", "runs/smollm2", "--quant", "w8a16:head", "--compile", "--window-ms", "5",
                                 "--max-num-seqs", "8", "--num-blocks", "96", "--offload", "host", "--lookahead", "4"]


def test_serve_argv_switches_none_lists_floats_and_order():
    assert serve_argv({"compile": True, "cuda_graphs": False, "quant": None}) == ["--compile"]
    assert serve_argv({"slo_bypass_priority": [0, 3]}) == ["--slo-bypass-priority", "0", "--slo-bypass-priority", "3"]
    assert serve_argv({"slo_bypass_priority": []}) == []
    assert serve_argv({"a": 5.0, "b": 2.5, "c": 0.001, "d": 1e16, "e": -0.0, "f": 12}) == [
        "--a", "5", "--b", "2.5", "--c", "0.001", "--d", "1e+16", "--e=-0", "--f", "12"]
    # a value that starts with - is joined to its flag, so that argparse cannot read it as one
    assert serve_argv({"slo_bypass_priority": [-1], "model": "-odd"}) == ["--slo-bypass-priority=-1", "--model=-odd"]
    assert serve_argv({"port": 1, "host": "h"}) == ["--port", "1", "--host", "h"]
    assert serve_argv({"host": "h", "port": 1}) == ["--host", "h", "--port", "1"]


def test_serve_command_quotes_for_a_shell(tmp_path):
    options = {"model": "my runs/smol lm", "served_model_name": "it's", "max_num_seqs": 4}
    line = serve_command(options)
    assert line == "workbench serve --model 'my runs/smol lm' --served-model-name 'it'\"'\"'s' --max-num-seqs 4"
    assert shlex.split(line) == ["workbench", "serve", *serve_argv(options)]
    path = tmp_path / "a dir" / "serve.json"
    assert serve_command(options, config_path=path) == f"workbench serve --config '{path}'"
    assert serve_command({}, program=".venv/bin/workbench") == ".venv/bin/workbench serve"


@pytest.mark.parametrize("options, needle", [
    ({"max-num-seqs": 4}, "serve key 'max-num-seqs' is not an option name"),
    ({"a b": 1}, "serve key 'a b'"),
    ({1: 1}, "serve key 1 is not a string"),
    ({"quant": {"scheme": "w8a16"}}, "serve.quant: expected a string, a number, true / false, null or a list"),
    ({"slo_bypass_priority": [True]}, "serve.slo_bypass_priority: a list holds strings or numbers"),
    ({"window_ms": float("nan")}, "serve.window_ms: nan is not a finite number"),
])
def test_serve_argv_refuses_what_no_flag_can_say(options, needle):
    with pytest.raises(ConfigError) as e:
        serve_argv(options)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- the file ----------------------------------------------------------------------------------
def test_write_then_read_round_trip(tmp_path):
    path = tmp_path / "tuned" / "serve.json"
    options = dict(TUNED, slo_bypass_priority=[1, 2], served_model_name="a b")
    about = {"trace": "data/traces/x.jsonl", "slo": {"p95_ttft_ms": 200}, "measured_p95_ttft_ms": 41.25}
    assert write_serve_config(path, options, about=about) == path
    assert read_serve_config(path) == options
    assert list(read_serve_config(path)) == list(options)             # the order kept
    doc = json.loads(path.read_text())
    assert doc == {"workbench_serve_config": 1, "serve": options, "about": about}
    write_serve_config(path, {"max_num_seqs": 2})                      # replaced whole; no temporary file left
    assert read_serve_config(path) == {"max_num_seqs": 2}
    assert json.loads(path.read_text())["about"] == {}
    assert sorted(p.name for p in path.parent.iterdir()) == ["serve.json"]


def test_write_refuses_what_it_could_not_read_back(tmp_path):
    with pytest.raises(ConfigError, match="serve.quant"):
        write_serve_config(tmp_path / "s.json", {"quant": {"x": 1}})
    with pytest.raises(ConfigError, match="'about' is not JSON"):
        write_serve_config(tmp_path / "s.json", {}, about={"p95": float("nan")})
    assert not list(tmp_path.iterdir())


def _doc(serve) -> str:
    return json.dumps({"workbench_serve_config": 1, "serve": serve})


@pytest.mark.parametrize("text, needle", [
    (None, "serve config file not found"),
    ("{", "not JSON: Expecting property name enclosed in double quotes (line 1, column 2)"),
    ('{"workbench_serve_config": 1,\n "serve": {"port": 80,}}', "not JSON: Expecting property name enclosed in "
                                                                 "double quotes (line 2, column 23)"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    ("[1, 2]", "expected a JSON object"),
    ('{"serve": {}}', 'no "workbench_serve_config" key'),
    ('{"workbench_serve_config": 2, "serve": {}}', '"workbench_serve_config": 2 is not a version this workbench reads'),
    ('{"workbench_serve_config": "1", "serve": {}}', '"workbench_serve_config": "1" is not a version'),
    ('{"workbench_serve_config": true, "serve": {}}', '"workbench_serve_config": true is not a version'),
    ('{"workbench_serve_config": 1, "serve": {}, "serv": {}}', "unknown key 'serv'"),
    ('{"workbench_serve_config": 1}', '"serve" must be an object of serve options such as {"max_num_seqs": 8}, '
                                      "got nothing"),
    ('{"workbench_serve_config": 1, "serve": ["--port", "80"]}', '"serve" must be an object'),
    ('{"workbench_serve_config": 1, "serve": {}, "about": "tuned"}', '"about" must be an object'),
    (_doc({"max-num-seqs": 8}), "serve key 'max-num-seqs' is not an option name (letters, digits and _, such as "
                                "'max_num_seqs') (write 'max_num_seqs' for --max-num-seqs)"),
    (_doc({"--port": 8}), "(write 'port' for --port)"),
    (_doc({"": 8}), "serve key ''"),
    (_doc({"quant": {"scheme": "w8a16"}}), "serve.quant: expected a string, a number, true / false, null or a list, "
                                           "got an object"),
    (_doc({"slo_bypass_priority": [1, [2]]}), "serve.slo_bypass_priority: a list holds strings or numbers"),
    (_doc({"slo_bypass_priority": [None]}), "got null in it"),
    ('{"workbench_serve_config": 1, "serve": {"window_ms": NaN}}', "NaN is not a JSON number"),
    ('{"workbench_serve_config": 1, "serve": {"port": 1, "port": 2}}', "key 'port' appears twice"),
])
def test_malformed_files_are_one_line_naming_file_and_key(tmp_path, text, needle):
    path = tmp_path / "serve config.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_serve_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and needle in msg and "\n" not in msg, msg


def test_a_folder_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not a file"):
        read_serve_config(tmp_path)


# ---- serve --config on the real parser -----------------------------------------------------------
def _parse(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    return with_serve_config(parser, argv, args) if args.config is not None else args


def test_the_file_sets_the_flags_and_the_command_line_wins(tmp_path):
    path = write_serve_config(tmp_path / "s.json", dict(TUNED, port=8001, window_ms=5, slo_bypass_priority=[1],
                                                        max_queue_len=10))
    args = _parse(["serve", "--config", str(path), "--port", "9000", "--window-ms", "0", "--slo-bypass-priority", "2"])
    assert (args.model, args.quant, args.compile, args.max_num_seqs, args.num_blocks, args.offload, args.lookahead,
            args.max_queue_len) == ("runs/smollm2", "w8a16:head", True, 8, 96, "host", 4, 10)
    assert args.no_prefix_caching is False and args.func.__name__ == "cmd_serve"
    assert args.port == 9000                       # typed
    assert args.window_ms == 0.0                   # typed, and equal to the default: still the command line's
    assert args.slo_bypass_priority == [1, 2]      # an appended flag: the file's values, then the command line's
    assert "--port" not in args.config_flags and "--window-ms" not in args.config_flags
    assert args.config_flags["--num-blocks"] == ("num_blocks", 96)
    # the flag before --config wins too: the file's flags go first, wherever --config is
    assert _parse(["serve", "--port", "9001", "--config", str(path)]).port == 9001
    assert _parse(["serve", "--config", str(path)]).port == 8001
    plain = _parse(["serve"])
    assert plain.config is None and plain.port == 8000 and plain.lookahead is None


def test_no_check_finite_and_other_store_false_keys(tmp_path):
    path = write_serve_config(tmp_path / "s.json", {"no_check_finite": True})
    assert _parse(["serve", "--config", str(path)]).check_finite is False


def _run_main(argv, capsys) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("workbench serve: error: "), err
    return err.strip()


@pytest.mark.parametrize("serve, needle", [
    ({"foo": 1}, "unknown option 'foo' (serve has no --foo)"),
    ({"max_num_seq": 4}, "unknown option 'max_num_seq' (serve has no --max-num-seq)"),   # no abbreviations
    ({"config": "other.json"}, "'config' cannot be set from a config file"),
    ({"help": True}, "'help' cannot be set from a config file"),
    ({"port": "http"}, "argument --port: invalid int value: 'http'"),
    ({"offload": "gpu"}, "argument --offload: invalid choice: 'gpu'"),
    ({"max_num_seqs": 2.5}, "argument --max-num-seqs: expected a whole number"),
    ({"compile": 1}, "'compile' is a switch (--compile): give true or false, got 1"),
    ({"port": True}, "'port' takes a value (--port VALUE), got true"),
    ({"port": [1, 2]}, "'port' takes one value (--port VALUE), got a list"),
])
def test_bad_options_in_the_file_exit_2_naming_file_and_key(tmp_path, capsys, serve, needle):
    path = tmp_path / "s.json"
    path.write_text(_doc(serve))
    err = _run_main(["serve", "--config", str(path), "--port", "0"], capsys)
    assert f"--config {path}: " in err and needle in err, err


def test_a_malformed_file_exits_2(tmp_path, capsys):
    err = _run_main(["serve", "--config", str(tmp_path / "none.json")], capsys)
    assert err == f"workbench serve: error: {tmp_path / 'none.json'}: serve config file not found"


def test_a_later_refusal_says_the_flag_came_from_the_file(tmp_path, capsys):
    path = write_serve_config(tmp_path / "s.json", {"lookahead": 2, "max_num_seqs": 4})
    err = _run_main(["serve", "--config", str(path), "--port", "0"], capsys)
    assert "--lookahead 2 stages offloaded prefix blocks" in err and err.endswith(f"(--lookahead from --config {path})")
    # typed on the command line, the same refusal does not blame the file
    err = _run_main(["serve", "--config", str(path), "--lookahead", "3", "--port", "0"], capsys)
    assert "--lookahead 3 stages" in err and "from --config" not in err
    path = write_serve_config(tmp_path / "s.json", {"model": str(tmp_path / "no model here")})
    err = _run_main(["serve", "--config", str(path), "--port", "0"], capsys)
    assert "model folder not found" in err and err.endswith(f"(--model from --config {path})")


@pytest.mark.parametrize("argv, needle", [
    (["--lookahead", "2"], "--lookahead 2 stages offloaded prefix blocks back ahead of the requests that need them: "
                           "add --offload host or --offload disk (or drop --lookahead)"),
    (["--lookahead", "0"], "--lookahead 0 stages"),
    (["--offload", "host", "--lookahead", "-1"], "--lookahead must be a whole number >= 0"),
    (["--kv", "contiguous", "--lookahead", "2"], "--lookahead: options of the paged pool, which --kv contiguous"),
    (["--tiers", "--offload", "host", "--lookahead", "2"], "--offload, --lookahead: options of the paged pool"),
])
def test_lookahead_needs_the_offload_tier(capsys, argv, needle):
    err = _run_main(["serve", "--port", "0", *argv], capsys)
    assert needle in err, err


def test_lookahead_reaches_the_paged_config():
    from workbench.cli.serve import _serve_kv

    kv = _serve_kv(_parse(["serve", "--offload", "disk", "--lookahead", "7"]))
    assert (kv.offload, kv.lookahead, kv.effective_lookahead) == ("disk", 7, 7)
    kv = _serve_kv(_parse(["serve", "--offload", "host"]))
    assert kv.lookahead is None and kv.effective_lookahead == 4        # PagedKVConfig's default


# ---- every argv serve_argv writes, the real parser reads back -------------------------------------
def _serve_actions():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(o[2:].replace("-", "_"), a) for a in sub.choices["serve"]._actions
            for o in a.option_strings if o.startswith("--") and a.dest not in ("help", "config")]


def _value(action, rnd: random.Random):
    """A value of the kind the flag takes, and what the parser should make of it."""
    if action.nargs == 0:
        v = rnd.choice([True, False, None])
        return v, action.const if v else action.default
    if action.choices:
        v = rnd.choice(list(action.choices))
        return v, v
    if isinstance(action, argparse._AppendAction):
        v = [rnd.randint(-3, 9) for _ in range(rnd.randint(0, 3))]
        return v, v
    if action.type is float:
        v = rnd.choice([5.0, 2.5, 0.001, 1e16, 7.0, float(rnd.randint(0, 100)) / 8])
        return v, v
    if action.type is not None:                   # int, count
        v = rnd.choice([rnd.randint(0, 5000), 64.0, 1e6])
        return v, int(v)
    v = rnd.choice(["runs/smollm2", "my model dir/x", "w4a16:g128:awq", "8G", "-dash", "naïve ünïcode", ""])
    return v, v


@pytest.mark.parametrize("seed", range(12))
def test_the_serve_parser_reads_back_every_argv_serve_argv_writes(seed):
    rnd = random.Random(seed)
    actions = _serve_actions()
    picked = rnd.sample(actions, k=rnd.randint(1, len(actions)))
    options, expected = {}, {}
    for key, action in picked:
        options[key], expected[action.dest] = _value(action, rnd)
    argv = ["serve", *serve_argv(options)]
    args = build_parser().parse_args(argv)
    for dest, want in expected.items():
        assert getattr(args, dest) == want, (dest, argv)


# ---- one real server from a file -----------------------------------------------------------------
def test_serve_starts_from_a_config_file(tmp_path):
    import httpx

    if not (wb.BUNDLED_MODEL / "model.safetensors").is_file():
        pytest.skip("bundled model weights not present")
    options = {"max_num_seqs": 4, "window_ms": 5.0, "offload": "host", "lookahead": 2, "num_blocks": 64,
               "log_level": "warning", "port": 8}
    path = write_serve_config(tmp_path / "tuned serve.json", options, about={"measured": "nothing: a test"})
    from workbench.serve.spawn import spawn_server

    with spawn_server(["--config", str(path), "--port", "0"], timeout_s=180, env=dict(os.environ)) as srv:
        line, port = srv.announce, srv.port
        assert "64 KV blocks of 16" in line, line                 # num_blocks from the file
        assert port != 8
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": "bundled", "prompt": "The list type", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        info = json.loads(r.headers["x-model-info"])
        assert info["kv_prefetch"]["offload"] == "host" and info["kv_prefetch"]["lookahead"] == 2
        assert info["scheduler"]["max_num_seqs"] == 4 and info["scheduler"]["micro_batch_window_s"] == 0.005



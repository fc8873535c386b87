"""The ``workbench`` command line: help, JSON outputs, clean error exits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench.cli import main

CLI = [sys.executable, "-m", "workbench.cli"]


@pytest.mark.parametrize("sub", [[], ["generate"], ["bench"], ["run-notebooks"], ["info"]])
def test_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main(sub + ["--help"])
    assert e.value.code == 0
    assert "usage: workbench" in capsys.readouterr().out


def test_generate_json_with_token_ids(capsys):
    rc = main(["generate", "--model", "preset:tiny", "--device", "cpu", "--token-ids", "1 2 3", "4,5",
               "--max-tokens", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out) == 2 and all(len(o["token_ids"]) <= 4 for o in out)
    assert out[0]["metrics"]["ttft_ms"] > 0


def test_generate_streams_text_with_the_bundled_tokenizer(capsys):
    from workbench import BUNDLED_MODEL

    if not (BUNDLED_MODEL / "model.safetensors").is_file():
        pytest.skip("bundled model weights not present")
    rc = main(["generate", "--device", "cpu", "--max-tokens", "8", "The list type"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.startswith("The list type") and len(captured.out) > len("The list type\n")
    assert "TTFT" in captured.err


def test_info_json(capsys):
    assert main(["info", "--model", "preset:tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vocab_size"] == 512 and info["kv_bytes_per_token_fp32"] == 2 * 2 * 2 * 16 * 4  # (k, v) x layers x kv heads x head dim x fp32


def test_bench_json_reports_both_sides_and_their_ratio(capsys):
    rc = main(["bench", "--model", "preset:tiny", "--device", "cpu", "--prompt-tokens", "8", "--max-tokens", "6",
               "--num-prompts", "2", "--repeats", "1", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    for side in ("workbench", "transformers_generate"):
        assert res[side]["decode_tokens_per_s_p50"] > 0 and res[side]["ttft_ms_p50"] > 0
    assert res["decode_speedup"] == pytest.approx(res["workbench"]["decode_tokens_per_s_p50"]
                                                  / res["transformers_generate"]["decode_tokens_per_s_p50"])
    # Same weights, float32, greedy: the two implementations pick the same tokens.
    assert res["greedy_token_agreement"] >= 0.95
    assert "raw" not in res


@pytest.mark.parametrize("args, needle", [
    (["generate", "--model", "/nonexistent/model"], "/nonexistent/model"),
    (["generate", "--model", "preset:nope"], "unknown preset"),
    (["generate", "--model", "preset:tiny", "--temperature", "-1", "--token-ids", "1"], "temperature"),
    (["run-notebooks", "-p", "novalue"], "NAME=VALUE"),
])
def test_errors_exit_2_with_one_line_and_no_traceback(args, needle):
    r = subprocess.run(CLI + args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr

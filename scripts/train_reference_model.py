#!/usr/bin/env python3
"""Rebuild the bundled reference model from scratch: corpus -> tokenizer -> model -> evaluation.

    python scripts/train_reference_model.py          # full run (~80 min on 2 CPU cores)
    python scripts/train_reference_model.py --steps-short 5 --steps-long 2 --out /tmp/ref  # smoke run

Corpus: the reStructuredText sources of the Python 3.11 documentation shipped in Debian's
``python3.11-doc`` package (PSF license).  The script fetches the .deb with
``apt-get download`` (or takes ``--deb`` / ``--sources``), splits documents into train and
held-out by a hash of their path (deterministic, ~5 % held out), trains a byte-level BPE
tokenizer on the training split, trains the model, evaluates held-out perplexity next to a
unigram baseline, and writes::

    <out>/config.json  model.safetensors  tokenizer.json  tokenizer_config.json
    <out>/generation_config.json  training_stats.json
    data/corpus/heldout.jsonl        (held-out documents, one JSON object per line)

Everything is seeded; on the same machine and torch version the run is reproducible
(multi-threaded CPU reductions may differ in the last bits across machines).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench.model.config import ModelConfig  # noqa: E402
from workbench.model.loader import load_model, save_model  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402

SOURCES_IN_DEB = "usr/share/doc/python3.11/html/_sources"
EOS = "<|endoftext|>"
MODEL_SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                   bos_token_id=0, eos_token_id=0)


# ---- corpus --------------------------------------------------------------------------------
def fetch_sources(args) -> Path:
    if args.sources:
        return Path(args.sources)
    work = Path(tempfile.mkdtemp(prefix="wb-corpus-"))
    deb = Path(args.deb) if args.deb else None
    if deb is None:
        print("fetching python3.11-doc with apt-get download ...", flush=True)
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=work, check=True)
        deb = next(work.glob("python3.11-doc_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "x")], check=True)
    return work / "x" / SOURCES_IN_DEB


def load_documents(src: Path) -> list[dict]:
    docs = []
    for p in sorted(src.rglob("*.txt")):
        rel = p.relative_to(src).as_posix()
        text = p.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            docs.append({"path": rel, "text": text})
    if not docs:
        raise SystemExit(f"no documentation sources found under {src}")
    return docs


def is_heldout(path: str) -> bool:
    """~5 % of documents, chosen by a hash of the path (stable across runs and machines)."""
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % 20 == 0


# ---- tokenizer -----------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Llama tokenizers, encoding adds a beginning-of-sequence token (here the same id as EOS,
    # which also separates documents in training).
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B",
                                                       special_tokens=[(EOS, tok.token_to_id(EOS))])
    return tok


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)  # each starts with <|endoftext|>
    return np.asarray(ids, dtype=np.uint16)


# ---- training ------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(model: CausalLM, data: np.ndarray, args) -> dict:
    """Random windows from the token stream: phase 1 at short context, phase 2 at full context.

    Step counts are fixed (not derived from a time budget) so that a rerun is the same run.
    """
    gen = np.random.default_rng(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    plan = [(args.short_ctx, args.batch_tokens // args.short_ctx, args.steps_short),
            (args.ctx, max(1, args.batch_tokens // args.ctx), args.steps_long)]
    total = args.steps_short + args.steps_long
    step_fn = torch.compile(model) if args.compile else model  # ~1.5x faster on CPU
    print(f"plan (ctx, batch, steps): {plan}", flush=True)
    t0 = time.time()
    step, tokens_seen, log = 0, 0, []
    model.train()
    for ctx, bsz, n in plan:
        for _ in range(n):
            starts = gen.integers(0, len(data) - ctx - 1, size=bsz)
            x = torch.from_numpy(np.stack([data[s: s + ctx + 1] for s in starts]).astype(np.int64))
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, args.lr, args.warmup)
            logits = step_fn(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += bsz * ctx
            if step % 25 == 0 or step == total:
                el = time.time() - t0
                log.append({"step": step, "ctx": ctx, "loss": round(loss.item(), 4), "tokens": tokens_seen,
                            "seconds": round(el, 1)})
                print(f"step {step}/{total} ctx {ctx} loss {loss.item():.3f} tokens {tokens_seen:,} "
                      f"{tokens_seen / el:,.0f} tok/s {el / 60:.1f} min", flush=True)
    model.eval()
    return {"steps": step, "tokens_seen": tokens_seen, "train_seconds": round(time.time() - t0, 1),
            "plan": [list(p) for p in plan], "log": log}


# ---- evaluation ----------------------------------------------------------------------------
@torch.no_grad()
def heldout_perplexity(model: CausalLM, ids: np.ndarray, ctx: int) -> tuple[float, int]:
    """Non-overlapping windows of ``ctx`` tokens; every token after the first of a window scored."""
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, ctx):
        x = torch.from_numpy(ids[s: s + ctx + 1].astype(np.int64))[None]
        if x.shape[1] < 2:
            break
        logits = model(x[:, :-1]).float()
        nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        n += x.shape[1] - 1
    return math.exp(nll / n), n


def unigram_perplexity(train_ids: np.ndarray, test_ids: np.ndarray, vocab: int) -> float:
    """Add-one smoothed token frequencies from the training split, scored on held-out tokens."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[test_ids[1:]].mean()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "data" / "reference-model"))
    ap.add_argument("--heldout-out", default=str(ROOT / "data" / "corpus" / "heldout.jsonl"))
    ap.add_argument("--sources", help="folder of *.rst.txt sources (skips apt-get)")
    ap.add_argument("--deb", help="a downloaded python3.11-doc .deb (skips apt-get download)")
    ap.add_argument("--steps-short", type=int, default=1100, help="optimizer steps at --short-ctx")
    ap.add_argument("--steps-long", type=int, default=150, help="optimizer steps at --ctx")
    ap.add_argument("--ctx", type=int, default=1024, help="full context length (phase 2)")
    ap.add_argument("--short-ctx", type=int, default=256, help="context length of phase 1")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    docs = load_documents(fetch_sources(args))
    train_docs = [d for d in docs if not is_heldout(d["path"])]
    test_docs = [d for d in docs if is_heldout(d["path"])]
    held = Path(args.heldout_out)
    held.parent.mkdir(parents=True, exist_ok=True)
    with held.open("w") as f:
        for d in test_docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    print(f"{len(docs)} documents: {len(train_docs)} train, {len(test_docs)} held out -> {held}", flush=True)

    tok = train_tokenizer([d["text"] for d in train_docs], MODEL_SHAPE["vocab_size"])
    tok.save(str(out / "tokenizer.json"))
    train_ids = encode_documents(tok, [d["text"] for d in train_docs])
    test_ids = encode_documents(tok, [d["text"] for d in test_docs])
    print(f"tokens: {len(train_ids):,} train, {len(test_ids):,} held out", flush=True)

    cfg = ModelConfig(**MODEL_SHAPE, torch_dtype="bfloat16")
    model = init_weights(CausalLM(cfg), seed=args.seed)
    print(f"model: {cfg.num_parameters():,} parameters", flush=True)
    stats = train(model, train_ids, args)

    save_model(model, out, dtype=torch.bfloat16)  # bf16 on disk, as real checkpoints ship
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
        "unk_token": None, "pad_token": EOS, "model_max_length": args.ctx, "add_bos_token": True,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}, indent=2) + "\n")

    shipped = load_model(out, device="cpu", dtype="float32")  # evaluate what is shipped
    ppl, n_eval = heldout_perplexity(shipped, test_ids, args.ctx)
    uni = unigram_perplexity(train_ids, test_ids, cfg.vocab_size)
    stats.update({
        "parameters": cfg.num_parameters(), "train_tokens_in_corpus": int(len(train_ids)),
        "heldout_tokens": int(len(test_ids)), "heldout_documents": len(test_docs),
        "train_documents": len(train_docs), "heldout_perplexity": round(ppl, 3),
        "heldout_tokens_scored": n_eval, "unigram_perplexity": round(uni, 3), "eval_context": args.ctx,
        "seed": args.seed, "torch": torch.__version__, "args": vars(args)})
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"held-out perplexity {ppl:.2f} (unigram baseline {uni:.2f}); wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

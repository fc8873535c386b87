"""The end-to-end stack's quantization layer, chosen per model: the fastest scheme within the SLO's
quality bound, measured on this machine and cached per model.

::

    qc = choose_stack_quant(llm, model_source, max_rel_ppl=0.02)   # measured once, then read from the cache
    qc.scheme          # 'w8a16:head', or None: the stack gets no quantization layer
    qc.reason          # one sentence with the numbers
    qc.table           # per candidate and the unquantized model: speed, perplexity change, verdicts
    print(qc.describe())
    E2EConfig.preset(mode, quant=qc.scheme)    # qc.scheme None: leave "quant" out of E2EConfig.stack instead

A scheme that pays on one model may not on another: on the bundled model W8A8 is the fastest and
costs little perplexity, on SmolLM2-135M it costs about +3 % perplexity, over a +2 % bound.  So the
choice is measured for the model at hand.

**Candidates** (:data:`CANDIDATES`): the device's schemes, strings of
:meth:`workbench.quant.recipe.QuantRecipe.parse` (CPU: W8A8, W8A16 with the LM head quantized too,
W8A16; CUDA: W4A16 g128, W8A16).

**Speed**: what the end-to-end workload is made of, on each quantized copy and on the unquantized
model (``llm.model``), all held at once and measured in interleaved rounds (A B C, C B A, ...):
a ``prefill_tokens``-token prefill (256; the model's context bounds it), and single decode steps of
1 and of 8 sequences over a context of that length, each the median of a few calls
(:func:`workbench.measure.timing.time_call`, synchronized wall time).  A round's **score** is
``prefill_ms + decode_b1_ms + decode_b8_ms`` (:data:`SCORE_WEIGHTS`): the smoke trace prefills
about 50 prompt tokens per token it generates (12,369 prompt tokens, 240 new tokens in 40
requests), that is about 5 new tokens per 256-token prefill, generated in decode steps of 1 to 8
sequences, so roughly one decode step at each end per prefill.  The table gives the medians over
the rounds.

**Quality**: exactly as the ablation measures it (:meth:`~workbench.bench.end_to_end.Ablation.measure_quality`):
a fresh copy loaded from ``model_source`` and quantized by ``LLM(net, quant=scheme)``, then
:func:`~workbench.bench.e2e_measure.numerics_quality` on ``heldout_split(tokenizer, eval_context)
["evaluation"][:eval_docs]`` against :func:`~workbench.bench.e2e_measure.scored_logprobs` of the
unchanged model, so ``rel_ppl`` is the number the ablation reports for that scheme.

**The rule**: a candidate qualifies when its perplexity change is within ``max_rel_ppl`` and its
scores are lower than the unquantized model's beyond noise
(:func:`~workbench.measure.compare.compare_samples` of the per-round scores: separated ranges or
every paired round won, and a ratio beyond the machine's noise floor); of those, the lowest median
score wins.  None qualifies: ``scheme`` None (no quantization layer), and the reason says why.

**The cache**: one JSON file per key under ``cache_dir`` (``runs/.cache/stack-quant``).  The key
hashes what the answer depends on: the model (its resolved folder, ``config.json``'s content, each
weight file's name, size and modification time, the tokenizer file's), the device type (and GPU
name), the dtype, torch's version, the thread count, the candidates, ``max_rel_ppl``, the quality
windows' settings and the speed measurement's.  ``refresh=True`` measures again; a file that
cannot be read or does not hold a result for its key is measured again and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workbench.errors import ConfigError

CANDIDATES = {"cpu": ("w8a8", "w8a16:head", "w8a16"), "cuda": ("w4a16:g128", "w8a16")}
SCORE_WEIGHTS = {"prefill_ms": 1.0, "decode_b1_ms": 1.0, "decode_b8_ms": 1.0}
PREFILL_TOKENS = 256
DECODE_BATCHES = (1, 8)
PREFILL_CALLS, DECODE_CALLS = 2, 5       # timed calls per round (their median is the round's sample)
DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[2] / "runs" / ".cache" / "stack-quant"
CACHE_FORMAT = "workbench-stack-quant"
CACHE_VERSION = 1
ROW_FIELDS = ("scheme", "prefill_ms", "decode_b1_ms", "decode_b8_ms", "score", "rel_ppl", "rel_ppl_se",
              "within_bound", "faster_than_fp", "chosen")

__all__ = ["CANDIDATES", "SCORE_WEIGHTS", "QuantChoice", "choose_stack_quant", "device_candidates", "model_identity",
           "stack_quant_key"]


@dataclass
class QuantChoice:
    """The stack's quantization scheme for one model on this machine, and the measurements behind it.

    ``scheme``: the scheme string for ``E2EConfig(quant=...)``, or None (no quantization layer);
    ``table``: one dict per candidate and one for the unquantized model (``scheme`` None): medians
    of ``prefill_ms``, ``decode_b1_ms``, ``decode_b8_ms`` and ``score`` over the rounds, ``rel_ppl``
    and ``rel_ppl_se`` (the ablation's numbers), ``within_bound``, ``faster_than_fp`` (beyond
    noise), ``chosen``, and ``speedup`` / ``verdict`` (against the unquantized model);
    ``cached``: read from the cache; ``key``: the cache key; ``seconds``: this call's time;
    ``measured_seconds``: how long the measurement took when it ran."""

    scheme: str | None
    reason: str
    table: list[dict]
    cached: bool
    key: str
    seconds: float
    measured_seconds: float | None = None
    inputs: dict = field(default_factory=dict)

    def describe(self) -> str:
        """A few lines: the choice, the table, the reason."""
        head = (f"stack quantization: {self.scheme or 'none'} "
                + (f"(from the cache, measured in {self.measured_seconds:.0f} s)" if self.cached
                   else f"(measured in {self.seconds:.0f} s)"))
        cols = ["scheme", "prefill ms", "decode b1 ms", "decode b8 ms", "score ms", "ppl change", "within bound",
                "faster", "chosen"]
        rows = []
        for r in self.table:
            q, se = r.get("rel_ppl"), r.get("rel_ppl_se") or 0.0
            ppl = "-" if q is None else f"{100 * q:+.2f} % ± {100 * se:.2f}"
            rows.append([r["scheme"] or "unquantized", _num(r.get("prefill_ms")), _num(r.get("decode_b1_ms")),
                         _num(r.get("decode_b8_ms")), _num(r.get("score")), ppl, _yes(r.get("within_bound")),
                         _yes(r.get("faster_than_fp")), "<-" if r.get("chosen") else ""])
        widths = [max(len(c), *(len(x[i]) for x in rows)) for i, c in enumerate(cols)]
        lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip() for x in rows]
        return "\n".join([*lines, self.reason])

    def as_dict(self) -> dict:
        return asdict(self)


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _yes(v) -> str:
    return "-" if v is None else "yes" if v else "no"


# ---- inputs and the cache key ----------------------------------------------------------------------

def device_candidates(device) -> tuple[str, ...]:
    """The schemes tried on ``device`` (:data:`CANDIDATES`)."""
    return CANDIDATES["cuda" if str(device).startswith("cuda") else "cpu"]


def model_identity(model_source) -> dict:
    """What identifies a model's weights on disk: the resolved folder, ``config.json``'s text, and
    the name, size and modification time of each weight file and the tokenizer file (None: the
    bundled model's folder; ``"preset:<name>"``: the preset's name, its weights are seeded)."""
    from workbench.model.loader import BUNDLED_MODEL

    spec = "bundled" if model_source is None else str(model_source)
    if spec.startswith("preset:"):
        return {"preset": spec}
    folder = (BUNDLED_MODEL if spec == "bundled" else Path(spec).expanduser()).resolve()
    if not folder.is_dir():
        raise ConfigError(f"choose_stack_quant: model_source {model_source!r}: no model folder at {folder}")
    try:
        config = (folder / "config.json").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"choose_stack_quant: {folder / 'config.json'}: cannot be read ({e})") from None
    names = sorted({p.name for pattern in ("*.safetensors", "*.safetensors.index.json", "tokenizer*.json")
                    for p in folder.glob(pattern)})
    files = []
    for n in names:
        st = (folder / n).stat()
        files.append([n, st.st_size, st.st_mtime_ns])
    return {"folder": str(folder), "config": config, "files": files}


def _device_facts(llm) -> dict:
    dev = llm.device
    facts = {"device": dev.type, "dtype": str(llm.model.lm_head.weight.dtype).replace("torch.", ""),
             "torch": torch.__version__, "threads": int(llm.threads)}
    if dev.type == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(dev)
    return facts


def stack_quant_key(llm, model_source, max_rel_ppl: float, candidates=None, eval_docs: int = 2, eval_context: int = 256,
                    eval_tokens: int = 128, rounds: int = 5) -> tuple[str, dict]:
    """``(key, inputs)``: the cache key of :func:`choose_stack_quant` with these arguments, and the
    inputs it hashes (JSON-ready)."""
    candidates = tuple(candidates) if candidates is not None else device_candidates(llm.device)
    inputs = {"version": CACHE_VERSION, "model": model_identity(model_source), **_device_facts(llm),
              "candidates": list(candidates), "max_rel_ppl": float(max_rel_ppl),
              "eval": {"docs": eval_docs, "context": eval_context, "tokens": eval_tokens},
              "speed": {"prefill_tokens": _prefill_tokens(llm), "decode_batches": list(DECODE_BATCHES),
                        "rounds": rounds, "calls": [PREFILL_CALLS, DECODE_CALLS], "weights": SCORE_WEIGHTS}}
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:20], inputs


def _prefill_tokens(llm) -> int:
    return max(1, min(PREFILL_TOKENS, int(llm.max_model_len) - 1))


def _check_args(llm, candidates, max_rel_ppl, eval_docs, eval_context, eval_tokens, rounds) -> tuple[str, ...]:
    from workbench.quant.recipe import QuantRecipe

    if llm.tokenizer is None:
        raise ConfigError("choose_stack_quant: the model has no tokenizer (quality is measured on held-out text)")
    if not isinstance(max_rel_ppl, numbers.Real) or isinstance(max_rel_ppl, bool) or not math.isfinite(max_rel_ppl):
        raise ConfigError(f"choose_stack_quant: max_rel_ppl must be a finite number, got {max_rel_ppl!r}")
    for name, v, lo in (("eval_docs", eval_docs, 1), ("eval_context", eval_context, 2), ("eval_tokens", eval_tokens, 1),
                        ("rounds", rounds, 1)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
            raise ConfigError(f"choose_stack_quant: {name} must be an integer >= {lo}, got {v!r}")
    cands = device_candidates(llm.device) if candidates is None else candidates
    if isinstance(cands, str) or not all(isinstance(c, str) for c in cands) or not cands:
        raise ConfigError(f"choose_stack_quant: candidates must be a non-empty list of scheme strings, "
                          f"got {candidates!r}")
    if len(set(cands)) != len(cands):
        raise ConfigError(f"choose_stack_quant: candidates name a scheme twice: {list(cands)}")
    for c in cands:
        try:
            QuantRecipe.parse(c)
        except ConfigError as e:
            raise ConfigError(f"choose_stack_quant: candidate {c!r}: {e}") from None
    return tuple(cands)


def _read_cache(path: Path, key: str, candidates: tuple[str, ...]) -> dict | None:
    """The cached result for ``key``, or None when the file is missing or does not hold one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    try:
        ok = (doc["format"] == CACHE_FORMAT and doc["key"] == key
              and (doc["scheme"] is None or doc["scheme"] in candidates) and isinstance(doc["reason"], str)
              and isinstance(doc["table"], list) and len(doc["table"]) == len(candidates) + 1
              and all(isinstance(r, dict) and all(f in r for f in ROW_FIELDS) for r in doc["table"])
              and isinstance(doc["measured_seconds"], (int, float)))
    except (KeyError, TypeError):
        return None
    return doc if ok else None


def _write_cache(path: Path, doc: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:          # the choice stands; the next call measures again
        warnings.warn(f"choose_stack_quant: could not write the cache file {path}: {e}", stacklevel=3)


# ---- measuring ---------------------------------------------------------------------------------------

class _SpeedProbe:
    """Buffers for timing any copy of one model: a prompt, and contiguous caches of 1 and 8 rows
    whose first ``tokens`` positions count as filled (their contents do not change the work)."""

    def __init__(self, model, tokens: int) -> None:
        from workbench.model.kv_cache import KVCache

        cfg, p = model.config, model.lm_head.weight
        g = torch.Generator().manual_seed(0)
        self.tokens, self.device = tokens, p.device
        self.prompt = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g).to(p.device)
        self.caches = {b: KVCache(cfg, b, tokens + 1, device=p.device, dtype=p.dtype) for b in (1, *DECODE_BATCHES)}
        self.next = {b: torch.randint(0, cfg.vocab_size, (b, 1), generator=g).to(p.device) for b in DECODE_BATCHES}

    def prefill(self, model) -> None:
        c = self.caches[1]
        c.length = 0
        model(self.prompt, 0, c, logits_to_keep=1)

    def decode(self, model, batch: int) -> None:
        c = self.caches[batch]
        c.length = self.tokens           # one more token after `tokens` (the same slot every call)
        model(self.next[batch], self.tokens, c, logits_to_keep=1)

    def warm_up(self, model) -> None:
        self.prefill(model)
        for b in DECODE_BATCHES:
            for _ in range(2):
                self.decode(model, b)

    def sample(self, model) -> dict:
        from workbench.measure.timing import time_call

        med = lambda fn, n: statistics.median(time_call(fn, self.device, warmup=0, repeats=n, events=False))
        s = {"prefill_ms": med(lambda: self.prefill(model), PREFILL_CALLS)}
        for b in DECODE_BATCHES:
            s[f"decode_b{b}_ms"] = med(lambda b=b: self.decode(model, b), DECODE_CALLS)
        s["score"] = sum(w * s[k] for k, w in SCORE_WEIGHTS.items())
        return s


def _pct(v: float) -> str:
    return f"{100 * v:+.2f} %"


def _decide(table: list[dict], max_rel_ppl: float, names: list[str]) -> tuple[str | None, str]:
    fp = table[0]
    rows = {r["scheme"]: r for r in table[1:]}
    ok = [rows[n] for n in names if rows[n].get("within_bound") and rows[n].get("faster_than_fp")]
    bound = f"+{100 * max_rel_ppl:g} %" if max_rel_ppl >= 0 else f"{100 * max_rel_ppl:g} %"

    def why_not(r) -> str:
        if r.get("error"):
            return f"{r['scheme']} could not be measured ({r['error']})"
        parts = []
        if not r["within_bound"]:
            parts.append(f"perplexity {_pct(r['rel_ppl'])} > {bound}")
        if not r["faster_than_fp"]:
            parts.append(f"not faster beyond noise (score {r['score']:.1f} ms: {r['verdict']})")
        return f"{r['scheme']}: " + " and ".join(parts)

    if not ok:
        return None, (f"no quantization layer: no candidate is within the {bound} perplexity bound and faster than the "
                      f"unquantized model (score {fp['score']:.1f} ms) - " + "; ".join(why_not(rows[n]) for n in names))
    best = min(ok, key=lambda r: r["score"])
    others = [why_not(rows[n]) for n in names if rows[n] not in ok]
    faster_ok = [f"{r['scheme']} {r['score']:.1f} ms" for r in ok if r is not best]
    return best["scheme"], (
        f"{best['scheme']}: the fastest scheme within the {bound} perplexity bound - score {best['score']:.1f} ms vs "
        f"{fp['score']:.1f} ms unquantized ({best['speedup']:.2f}x, beyond noise), perplexity {_pct(best['rel_ppl'])} "
        f"± {100 * best['rel_ppl_se']:.2f}"
        + (f"; also qualified: {', '.join(faster_ok)}" if faster_ok else "")
        + (f"; refused: {'; '.join(others)}" if others else ""))


def _measure(llm, model_source, candidates, max_rel_ppl, eval_docs, eval_context, eval_tokens, rounds, say) -> tuple:
    from workbench.bench.e2e_measure import numerics_quality, scored_logprobs
    from workbench.data import heldout_split
    from workbench.engine.llm import LLM
    from workbench.measure.compare import compare_samples
    from workbench.model.loader import load_model
    from workbench.quant.costs import interleaved

    say(f"quality windows: {eval_docs} held-out document(s) of {eval_context} tokens, {eval_tokens} scored")
    windows = heldout_split(llm.tokenizer, eval_context)["evaluation"][:eval_docs]
    if not windows:
        raise ConfigError(f"choose_stack_quant: no held-out document has eval_context={eval_context} tokens; "
                          "give a shorter eval_context")
    ref_lp = [scored_logprobs(llm.model, w, eval_tokens) for w in windows]
    models, quality, errors = {}, {}, {}
    for s in candidates:
        say(f"{s}: load a copy, quantize, measure perplexity and KL")
        try:
            net = load_model(model_source, device=llm.device, dtype=llm.model.lm_head.weight.dtype)
            front = LLM(net, tokenizer=llm.tokenizer, threads=llm.threads, max_model_len=llm.max_model_len, quant=s)
            quality[s] = numerics_quality(front.model, windows, ref_lp, eval_tokens)
            models[s] = front.model
        except Exception as e:  # noqa: BLE001 - recorded in its row; the other candidates go on
            errors[s] = f"{type(e).__name__}: {e}"
    if llm.device.type == "cpu":
        torch.set_num_threads(int(llm.threads))        # the reference's thread count, as every configuration runs
    probe = _SpeedProbe(llm.model, _prefill_tokens(llm))
    sides = {"unquantized": llm.model, **models}
    say(f"speed: warm-up of {len(sides)} models")
    with torch.inference_mode():
        for m in sides.values():
            probe.warm_up(m)
        say(f"speed: {rounds} interleaved rounds of a {probe.tokens}-token prefill and decode steps of "
            f"{' and '.join(map(str, DECODE_BATCHES))} sequences")
        samples = interleaved({k: (lambda r, m=m: probe.sample(m)) for k, m in sides.items()}, rounds)
    del models, sides
    metrics = [*SCORE_WEIGHTS, "score"]
    med = {k: {m: statistics.median(x[m] for x in v) for m in metrics} for k, v in samples.items()}
    fp_scores = [x["score"] for x in samples["unquantized"]]
    table = [{"scheme": None, **med["unquantized"], "rel_ppl": 0.0, "rel_ppl_se": 0.0, "kl": 0.0,
              "top1_agreement": 1.0, "within_bound": 0.0 <= max_rel_ppl, "faster_than_fp": None, "chosen": False,
              "speedup": 1.0, "verdict": None, "scores": fp_scores}]
    for s in candidates:
        if s in errors:
            table.append({"scheme": s, **{m: None for m in metrics}, "rel_ppl": None, "rel_ppl_se": None,
                          "within_bound": False, "faster_than_fp": False, "chosen": False, "error": errors[s]})
            continue
        scores = [x["score"] for x in samples[s]]
        cmp = compare_samples(scores, fp_scores, names=(s, "unquantized"), metric="score", unit="ms")
        q = quality[s]
        table.append({"scheme": s, **med[s], "rel_ppl": q["rel_ppl"], "rel_ppl_se": q["rel_ppl_se"], "kl": q["kl"],
                      "top1_agreement": q["top1_agreement"], "within_bound": bool(q["rel_ppl"] <= max_rel_ppl),
                      "faster_than_fp": cmp.winner == s, "chosen": False,
                      "speedup": med["unquantized"]["score"] / med[s]["score"], "verdict": cmp.verdict,
                      "scores": scores})
    scheme, reason = _decide(table, max_rel_ppl, list(candidates))
    for r in table:
        r["chosen"] = r["scheme"] == scheme
    return scheme, reason, table, bool(errors)


def choose_stack_quant(llm, model_source, max_rel_ppl: float, *, candidates=None, eval_docs: int = 2,
                       eval_context: int = 256, eval_tokens: int = 128, cache_dir=None, refresh: bool = False,
                       rounds: int = 5, progress=None) -> QuantChoice:
    """The end-to-end stack's quantization scheme for ``llm``'s model: the fastest candidate whose
    perplexity change is at most ``max_rel_ppl`` and that is faster than the unquantized model
    beyond noise, or None (see the module docstring for the measurements and the rule).

    ``llm``: the loaded reference (``workbench.LLM``); ``model_source``: where its model came from
    (None: the bundled model; a folder), for the quantized copies; ``candidates``: scheme strings
    (None: :func:`device_candidates`); ``eval_*``: the ablation's quality settings
    (``E2EConfig.eval_docs`` / ``eval_context`` / ``eval_tokens``), so ``rel_ppl`` is the ablation's;
    ``rounds``: interleaved speed rounds (3 at least for a verdict); ``cache_dir``: where results are
    kept (None: ``runs/.cache/stack-quant``); ``refresh``: measure even when cached;
    ``progress(text)``: called as the parts run (optional)."""
    t0 = time.perf_counter()
    candidates = _check_args(llm, candidates, max_rel_ppl, eval_docs, eval_context, eval_tokens, rounds)
    key, inputs = stack_quant_key(llm, model_source, max_rel_ppl, candidates, eval_docs, eval_context, eval_tokens,
                                  rounds)
    path = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser() / f"{key}.json"
    say = progress or (lambda text: None)
    if not refresh:
        doc = _read_cache(path, key, candidates)
        if doc is not None:
            return QuantChoice(doc["scheme"], doc["reason"], doc["table"], True, key, time.perf_counter() - t0,
                               doc["measured_seconds"], inputs)
    scheme, reason, table, failed = _measure(llm, model_source, candidates, float(max_rel_ppl), eval_docs, eval_context,
                                             eval_tokens, rounds, say)
    seconds = time.perf_counter() - t0
    if not failed:                        # a candidate that failed to run is not remembered as a measurement
        _write_cache(path, {"format": CACHE_FORMAT, "key": key, "inputs": inputs, "scheme": scheme, "reason": reason,
                            "table": table, "measured_seconds": seconds,
                            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return QuantChoice(scheme, reason, table, False, key, seconds, seconds, inputs)

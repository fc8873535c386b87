"""A quantized model's quality on token windows, against the unquantized model on the same tokens.

::

    ev = EvalSet.build(windows)                      # teacher-forced windows (+ exact-match prompts cut from them)
    ref = Reference(fp_model, ev, exact_match=True)  # the unquantized model's outputs, computed once
    r = measure(q_model, ref)                        # every metric, paired with the reference token by token
    r["degradation"]["ppl"]                          # (value, standard error) in the metric's own units

**The metrics** (``METRICS``), each with its *degradation*, the amount a quantized model is worse
than the unquantized one (what ``--max-degradation`` bounds):

* ``ppl`` - perplexity of the text, ``exp(mean NLL)`` over every scored next token; degradation:
  the **relative increase**, ``ppl / ppl_ref - 1`` (``0.02`` = 2 % higher);
* ``kl`` - mean ``KL(p_ref || p_quant)`` per scored token, in nats; degradation: the **absolute
  value** (the reference's is 0);
* ``top1`` - top-1 next-token accuracy on the text (the argmax is the token that follows);
  degradation: **percentage points lost**, ``100 (acc_ref - acc)``;
* ``exact_match`` - share of prompts whose greedy continuation of ``em_tokens`` tokens is exactly
  the text's next tokens (prompts of ``em_prompt`` tokens cut from the windows); degradation:
  **percentage points lost**.

Every degradation comes with its standard error from the *paired* per-token (per-prompt)
differences: both models score the same tokens, so what makes a token hard cancels.  Tokens of
one window are correlated, so the per-token error understates the noise; the error reported is
the larger of the per-token one and the per-window one (the spread of the windows' mean
differences over the square root of their number), which counts each window once.
``agreement`` (share of positions whose argmax equals the reference's) is reported beside them.

The unquantized model's log-probabilities are kept for the KL: ``tokens x vocab x 4`` bytes
(2,048 tokens of the bundled 8,192-token vocabulary: 64 MiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from workbench.errors import ConfigError
from workbench.quant.calibrate_names import METRICS   # torch-free: the CLI's parser reads it
from workbench.model.kv_cache import KVCache

UNITS = {"ppl": "relative increase (0.02 = +2 %)", "kl": "nats per token (absolute)",
         "top1": "percentage points lost", "exact_match": "percentage points lost"}


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def token_nll(model, seqs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-token NLL of every next token (all windows concatenated, float64) and the
    log-probs per window (``[len - 1, vocab]`` float32)."""
    nll, logps = [], []
    dev = _device(model)
    for s in seqs:
        ids = torch.as_tensor(s, dtype=torch.long, device=dev)[None]
        lp = torch.log_softmax(model(ids)[0].float(), -1)[:-1]
        logps.append(lp)
        nll.append(-lp.gather(-1, ids[0, 1:, None])[:, 0].double())
    return torch.cat(nll), logps


def perplexity(model, seqs) -> float:
    """exp(mean next-token NLL) of ``model`` over token-id sequences, every position scored."""
    return math.exp(float(token_nll(model, seqs)[0].mean()))


def paired_stats(nll: torch.Tensor, nll_ref: torch.Tensor) -> dict:
    """ppl, rel_ppl and its standard error from paired per-token NLL differences."""
    d = nll - nll_ref
    ppl, ppl_ref = math.exp(float(nll.mean())), math.exp(float(nll_ref.mean()))
    se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")
    return {"ppl": ppl, "rel_ppl": ppl / ppl_ref - 1, "rel_ppl_se": (ppl / ppl_ref) * se, "tokens": int(d.numel())}


def _mean_se(x: torch.Tensor, sizes: list[int] | None = None) -> tuple[float, float]:
    """Mean and standard error of per-token values; with ``sizes`` (tokens per window, in
    order) the larger of the per-token and the per-window error (see the module docstring)."""
    x = x.double()
    se = float(x.std() / math.sqrt(x.numel())) if x.numel() > 1 else float("nan")
    if sizes and len(sizes) > 1:
        means = torch.stack([c.mean() for c in torch.split(x, sizes)])
        se = max(se, float(means.std() / math.sqrt(len(sizes))))
    return float(x.mean()), se


@dataclass
class EvalSet:
    """Teacher-forced ``windows`` and, for ``exact_match``, ``prompts`` of equal length with the
    ``targets`` the text continues them with."""

    windows: list[list[int]]
    prompts: list[list[int]] = field(default_factory=list)
    targets: list[list[int]] = field(default_factory=list)

    @classmethod
    def build(cls, windows, em_prompt: int = 64, em_tokens: int = 4, em_prompts: int = 32) -> EvalSet:
        """Exact-match prompts: each window cut into back-to-back segments of
        ``em_prompt + em_tokens`` tokens (prompt, then the tokens to match), taken round-robin
        over the windows up to ``em_prompts``."""
        windows = [list(w) for w in windows if len(w) >= 2]
        if not windows:
            raise ConfigError("EvalSet: no evaluation window of 2 tokens or more (the evaluation text is too short)")
        if em_prompt < 1 or em_tokens < 1:
            raise ConfigError(f"EvalSet: em_prompt and em_tokens must be >= 1, got {em_prompt}, {em_tokens}")
        seg = em_prompt + em_tokens
        per = [[w[i:i + seg] for i in range(0, len(w) - seg + 1, seg)] for w in windows]
        picked: list[list[int]] = []
        for j in range(max((len(p) for p in per), default=0)):
            picked += [p[j] for p in per if j < len(p)]
        picked = picked[:em_prompts]
        return cls(windows, [s[:em_prompt] for s in picked], [s[em_prompt:] for s in picked])

    @property
    def tokens(self) -> int:
        return sum(len(w) - 1 for w in self.windows)


@torch.no_grad()
def greedy_continuations(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens after each prompt (all prompts the same length: one batch)."""
    if not prompts:
        return []
    if len({len(p) for p in prompts}) != 1:
        raise ConfigError("greedy_continuations: prompts must have equal lengths (one batch)")
    p = next(model.parameters())
    ids = torch.as_tensor(prompts, dtype=torch.long, device=p.device)
    cache = KVCache(model.config, len(prompts), ids.shape[1] + n, device=p.device, dtype=p.dtype)
    tok = model(ids, 0, cache)[:, -1].argmax(-1)
    out = [tok]
    for i in range(n - 1):
        tok = model(tok[:, None], ids.shape[1] + i, cache)[:, -1].argmax(-1)
        out.append(tok)
    return torch.stack(out, 1).tolist()


class Reference:
    """The unquantized model's outputs on an :class:`EvalSet`: per-token NLL and log-probs,
    top-1 hits, and (when ``exact_match``) its exact-match hits per prompt."""

    def __init__(self, model, evalset: EvalSet, exact_match: bool = False) -> None:
        self.evalset = evalset
        self.nll, self.logps = token_nll(model, evalset.windows)
        self.next_ids = torch.cat([torch.as_tensor(w[1:], device=self.nll.device) for w in evalset.windows])
        self.top1_hits = torch.cat([lp.argmax(-1) for lp in self.logps]) == self.next_ids
        self.em_hits = _em_hits(model, evalset) if exact_match else None
        self.ppl = math.exp(float(self.nll.mean()))


def _em_hits(model, ev: EvalSet) -> torch.Tensor:
    if not ev.prompts:
        raise ConfigError("exact_match: no prompt and target fit in the evaluation windows; use shorter "
                          "prompts (em_prompt) or longer windows (context)")
    gen = greedy_continuations(model, ev.prompts, len(ev.targets[0]))
    return torch.tensor([g == t for g, t in zip(gen, ev.targets)], dtype=torch.float64)


@torch.no_grad()
def measure(model, ref: Reference) -> dict:
    """Every metric of ``model`` on ``ref``'s tokens, each paired with the reference (see the
    module docstring); ``degradation``: ``{metric: (value, se)}``."""
    nll, logps = token_nll(model, ref.evalset.windows)
    sizes = [len(w) - 1 for w in ref.evalset.windows]
    st = paired_stats(nll, ref.nll)
    st["rel_ppl_se"] = (st["ppl"] / ref.ppl) * _mean_se(nll - ref.nll, sizes)[1]     # per window, when larger
    kl_t = torch.cat([(lr.exp() * (lr - lq)).sum(-1) for lr, lq in zip(ref.logps, logps)])
    arg = torch.cat([lq.argmax(-1) for lq in logps])
    hits = arg == ref.next_ids
    kl, kl_se = _mean_se(kl_t, sizes)
    drop, drop_se = _mean_se(ref.top1_hits.double() - hits.double(), sizes)
    out = {**st, "ppl_ref": ref.ppl, "kl": kl, "kl_se": kl_se,
           "top1": float(hits.double().mean()), "top1_ref": float(ref.top1_hits.double().mean()),
           "agreement": float((arg == torch.cat([lr.argmax(-1) for lr in ref.logps])).double().mean()),
           "exact_match": None, "exact_match_ref": None, "prompts": 0}
    deg = {"ppl": (st["rel_ppl"], st["rel_ppl_se"]), "kl": (kl, kl_se), "top1": (100 * drop, 100 * drop_se)}
    if ref.em_hits is not None:
        em = _em_hits(model, ref.evalset)
        d, d_se = _mean_se(ref.em_hits - em)
        out.update(exact_match=float(em.mean()), exact_match_ref=float(ref.em_hits.mean()), prompts=int(em.numel()))
        deg["exact_match"] = (100 * d, 100 * d_se)
    out["degradation"] = deg
    return out


def parse_degradation(metric: str, value) -> float:
    """``--max-degradation`` in ``metric``'s units (see the module docstring): a number, or for
    ``ppl`` also a percentage (``"2%"`` = 0.02); for ``top1`` / ``exact_match``, points."""
    if metric not in METRICS:
        raise ConfigError(f"--target-metric must be one of {', '.join(METRICS)}, got {metric!r}")
    s = str(value).strip()
    try:
        x = float(s[:-1]) / 100 if (s.endswith("%") and metric == "ppl") else float(s)
    except ValueError:
        raise ConfigError(f"--max-degradation: expected a number ({UNITS[metric]}), got {value!r}") from None
    if not (x >= 0 and math.isfinite(x)):
        raise ConfigError(f"--max-degradation must be a finite number >= 0 ({UNITS[metric]}), got {value!r}")
    return x


def describe_degradation(metric: str, value: float, se: float | None = None) -> str:
    """The degradation in words: ``+1.23 % +-0.20`` (ppl), ``0.0123 nats`` (kl), ``1.5 points``."""
    pm = "" if se is None or se != se else (f" +-{100 * se:.2f}" if metric == "ppl" else
                                           f" +-{se:.4f}" if metric == "kl" else f" +-{se:.2f}")
    if metric == "ppl":
        return f"{100 * value:+.2f} %{pm}"
    if metric == "kl":
        return f"{value:.4f} nats{pm}"
    return f"{value:+.2f} points{pm}"

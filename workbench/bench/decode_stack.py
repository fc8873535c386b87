"""The decode stack in the engine: the paged pool with the prefix cache, the Triton paged-decode
kernel and CUDA graphs, against the contiguous graph path (``workbench decode-stack``).

What is measured, per configuration and batch size, in one process and one run:

* **decode tokens/s in the engine** - ``LLM.generate`` of ``batch`` equal-length prompts submitted
  together (``SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)``), so that they are
  prefilled in one step and decode together; the rate is the tokens after each request's first,
  over the span from the earliest first token to the last token (the decode phase).  The engine
  timestamps a token when its id is on the host (sampling ends in ``.tolist()``, which
  synchronizes with the device: :mod:`workbench.engine.metrics`), so no GPU work is left out of the
  span and no CUDA event is needed;
* **the fraction of the measured copy bandwidth at batch 1**: minimum bytes per decode step (every
  weight once, K and V of the context read once: :func:`~workbench.bench.kernel_decode.step_bytes`,
  averaged over the steps' contexts) times steps/s, over the device's copy bandwidth measured in the
  same run (:func:`~workbench.bench.kernel_timing.measure_ceilings`: a large ``dst.copy_(src)``,
  read + write, CUDA events on a GPU).  Never a datasheet figure: when the copy was not measured,
  no fraction is stated.  On a CPU the ceiling is the CPU's own measured copy bandwidth (labelled);
* **the ratio to the baseline** (the first contiguous configuration) at each batch: medians, the
  per-round paired ratios and a noise-aware verdict (:func:`workbench.measure.compare.compare_samples`);
* **greedy token agreement** with the baseline on the same prompts
  (:func:`workbench.measure.agreement.agreement`), and the logit margin at the first divergence.

Method: both engines are built first (graph capture per batch bucket, Triton JIT), then warmed up
at every batch size untimed; the timed repeats are interleaved (every configuration at a batch size
back to back, the order rotated each round) on fresh prompts per round and batch (so no prefix-cache
hit helps one side).  A configuration the engine refuses (``cuda_graphs`` on a CPU) is a row with
status ``refused`` and the engine's reason; one that fails is ``error`` with its message.

Configurations (:data:`CONFIGS`): ``paged+graphs`` / ``contiguous+graphs`` on CUDA (the defaults
there, with every Triton kernel on the decode path: :func:`~workbench.bench.kernel_decode.fused_backends`),
``paged+static`` / ``contiguous+static`` (the same static steps, eager: the CPU defaults, with eager
backends) and ``paged+compile`` / ``contiguous+compile``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from workbench.bench.decode_stack_configs import CONFIGS, DEFAULTS  # noqa: F401 - torch-free: the CLI's parser reads them
from workbench.errors import ConfigError, WorkbenchError

ROW_FIELDS = [
    "config", "batch", "status", "reason", "kv", "fast_path", "description", "build_s",
    "repeats", "decode_tok_s_p50", "decode_tok_s_min", "decode_tok_s_max", "ms_per_step_p50", "ttft_ms_p50",
    "first_token_spread_ms",
    "step_bytes", "bytes_formula", "achieved_gb_s", "ceiling_gb_s", "ceiling", "frac_of_ceiling",
    "baseline", "vs_baseline", "vs_baseline_round_min", "vs_baseline_round_max", "verdict",
    "agreement_vs_baseline", "identical_sequences", "sequences", "first_divergence_margin",
    "model", "device", "device_name", "dtype", "backends", "triton_interpreter", "timing",
    "prompt_tokens", "max_tokens", "torch", "triton",
]
ENGINE_TIMING = ("engine token timestamps (taken when the token id is on the host: the sampling .tolist() "
                 "synchronizes with the device)")


@dataclass
class DecodeStackConfig:
    model: str | None = None               # None: the device's default (DEFAULTS)
    device: str | None = None              # None: cuda if available, else cpu
    dtype: str | None = None               # None: the preset's dtype on CUDA (bf16), float32 on a CPU
    configs: tuple[str, ...] | None = None
    batches: tuple[int, ...] | None = None
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    repeats: int | None = None
    warmup_tokens: int = 4                 # tokens per untimed warm-up request (every batch size, every config)
    backend: str | None = None             # "fused" (every Triton kernel on the decode path) | "eager" | a spec
    block_size: int = 16
    budget_s: float | None = None          # stop starting repeats (after the first) past this many seconds
    measure_ceiling: bool = True           # False: no copy bandwidth, so no fraction is claimed
    copy_mib: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [c for c in (self.configs or ()) if c not in CONFIGS]
        if bad:
            raise ConfigError(f"decode-stack: unknown configuration {bad[0]!r}; choose from {', '.join(CONFIGS)}")
        if self.batches is not None and (not self.batches or any(int(b) < 1 for b in self.batches)):
            raise ConfigError(f"decode-stack: batches must be positive integers, got {self.batches!r}")
        for name, low in (("prompt_tokens", 1), ("max_tokens", 2), ("repeats", 1), ("copy_mib", 1)):
            v = getattr(self, name)
            if v is not None and v < low:
                raise ConfigError(f"decode-stack: {name} must be >= {low}, got {v}")
        if self.warmup_tokens < 2:
            raise ConfigError(f"decode-stack: warmup_tokens must be >= 2 (a decode step), got {self.warmup_tokens}")

    def resolved(self, dev: torch.device) -> dict:
        d = dict(DEFAULTS["cuda" if dev.type == "cuda" else "cpu"])
        for k in d:
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        d["batches"] = tuple(sorted({int(b) for b in d["batches"]}))
        d["configs"] = tuple(dict.fromkeys(d["configs"]))
        return d


def resolve_backends(spec: str, dev: torch.device) -> dict[str, str]:
    """``fused`` -> every op with a Triton kernel on the decode path (prefill attention eager);
    ``eager`` -> none applied (the static steps use eager backend modules); else a backend spec."""
    from workbench.bench.kernel_decode import fused_backends
    from workbench.transforms.backends import parse_backend_spec

    if spec == "fused":
        return fused_backends()
    if spec == "eager":
        return {}
    return parse_backend_spec(spec)


def decode_rate(outs) -> tuple[float, float, float]:
    """(decode tokens/s, median TTFT s, spread of the first tokens s) of requests submitted
    together: tokens after each request's first over the span earliest first token -> last token."""
    ms = [o.metrics for o in outs]
    span = max(m.token_times[-1] for m in ms) - min(m.first_token_time for m in ms)
    n = sum(len(m.token_times) - 1 for m in ms)
    if n < 1 or span <= 0:
        raise WorkbenchError(f"decode-stack: no decode phase to time ({n} decode tokens over {span:.6f} s)")
    firsts = [m.first_token_time for m in ms]
    return n / span, statistics.median(m.ttft for m in ms), max(firsts) - min(firsts)


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def _build(name: str, model, s: dict):
    """An LLM for configuration ``name`` over the shared ``model`` (capture / compile happen here)."""
    from workbench.engine.llm import LLM
    from workbench.kv.paged import PagedKVConfig
    from workbench.sched.config import SchedulerConfig

    opts = dict(CONFIGS[name])
    ctx = s["prompt_tokens"] + s["max_tokens"] + 1
    if opts["kv"] == "paged":      # room for every sequence of the largest batch, and as much again cached
        blocks = 2 * max(s["batches"]) * -(-ctx // s["block_size"])
        opts["kv"] = PagedKVConfig(block_size=s["block_size"], enable_prefix_caching=True, num_blocks=blocks)
    sched = SchedulerConfig(max_num_seqs=max(s["batches"]),        # every prompt of a batch prefilled in one step
                            max_num_batched_tokens=max(512, max(s["batches"]) * s["prompt_tokens"]))
    return LLM(model, max_model_len=ctx, scheduler=sched, **opts)


def _copy_ceiling(dev: torch.device, dtype: torch.dtype, copy_mib: int, env: dict) -> dict:
    from workbench.bench.kernel_timing import measure_ceilings

    rows, ceilings = measure_ceilings(dev, dtype, {"copy_mib": copy_mib, "matmul": 64}, env, warmup=3, repeats=10)
    row = next((r for r in rows if r["op"] == "copy"), {})
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    gbs = ceilings.get("GB/s")
    where = "HBM" if dev.type == "cuda" else "CPU memory"
    return {"gb_s": gbs, "status": row.get("status"), "error": row.get("error"), "ms_median": row.get("ms_median"),
            "ms_min": row.get("ms_min"), "ms_max": row.get("ms_max"), "bytes": row.get("bytes"),
            "label": (f"{where} copy bandwidth measured in this run ({copy_mib} MiB dst.copy_(src), read + write, "
                      f"{'CUDA events' if dev.type == 'cuda' else 'perf_counter'})") if gbs else None}


def _step_traffic(model, s: dict) -> dict:
    """The minimum bytes of one batch-1 decode step: every weight once, plus K and V of the mean
    context over the decode steps (each attends the prompt and the tokens so far)."""
    from workbench.bench.kernel_decode import step_bytes

    weights, kv_pos = step_bytes(model, 0)                         # context 0: K/V of one position
    mean_keys = s["prompt_tokens"] + s["max_tokens"] / 2          # decode step j (2..N) attends prompt + j - 1 keys
    return {"weights": weights, "kv_pos": kv_pos, "mean_keys": mean_keys, "bytes_b1": weights + kv_pos * mean_keys}


def _build_engines(model, s: dict, base: dict, say) -> tuple[dict, dict]:
    """An LLM per configuration over the shared model, and a row per (configuration, batch): a
    configuration the engine refuses or that fails to build is ``refused`` / ``error`` at every batch."""
    from workbench.bench.kernel_timing import error_text

    rows: dict[tuple[str, int], dict] = {}
    engines = {}
    for name in s["configs"]:
        opts = CONFIGS[name]
        fast = next(k for k in ("cuda_graphs", "compile", "static_decode") if opts.get(k))
        for b in s["batches"]:
            rows[name, b] = {**dict.fromkeys(ROW_FIELDS), **base, "config": name, "batch": b, "status": "ok",
                             "kv": opts["kv"], "fast_path": fast}
        say(f"build {name}")
        t0 = time.perf_counter()
        try:
            llm = _build(name, model, s)
        except ConfigError as e:                          # the engine's refusal, with its reason
            for b in s["batches"]:
                rows[name, b].update(status="refused", reason=str(e))
            continue
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            for b in s["batches"]:
                rows[name, b].update(status="error", reason=error_text(e))
            continue
        engines[name] = llm
        for b in s["batches"]:
            rows[name, b].update(description=llm.engine.describe(), build_s=round(time.perf_counter() - t0, 3))
    return rows, engines


def _summarize(rows: dict, samples: dict, s: dict, traffic: dict, ceiling: dict, final: bool = True) -> None:
    """Each row's figures from the samples so far (a snapshot after every repeat, then final)."""
    for (name, b), row in rows.items():
        got = samples[name, b]
        if row["status"] != "ok" or not got:
            if row["status"] == "ok":
                row.update(status="error", reason="no timed run") if final else \
                    row.update(reason="not timed yet (the run was stopped before its first repeat)")
            continue
        rates = [x[0] for x in got]
        p50 = statistics.median(rates)
        row.update(repeats=len(rates), decode_tok_s_p50=p50, decode_tok_s_min=min(rates), decode_tok_s_max=max(rates),
                   ms_per_step_p50=1e3 * b / p50, ttft_ms_p50=1e3 * statistics.median(x[1] for x in got),
                   first_token_spread_ms=1e3 * max(x[2] for x in got))
        if b == 1:
            bytes_b1 = traffic["bytes_b1"]
            row.update(step_bytes=bytes_b1, achieved_gb_s=bytes_b1 * p50 / 1e9,
                       bytes_formula=f"weights {traffic['weights']} B + K/V {traffic['kv_pos']} B/position x "
                                     f"{traffic['mean_keys']:g} mean keys "
                                     f"(prompt {s['prompt_tokens']} + max_tokens/2) per step")
            if ceiling["gb_s"]:
                row.update(ceiling_gb_s=ceiling["gb_s"], ceiling=ceiling["label"],
                           frac_of_ceiling=row["achieved_gb_s"] / ceiling["gb_s"])
            else:
                row["ceiling"] = f"no fraction: the copy bandwidth was not measured ({ceiling.get('error')})"


def _warm_up(cfg: DecodeStackConfig, s: dict, engines: dict, rows: dict, vocab: int, say) -> None:
    """Every configuration at every batch size (prefill shapes, Triton JIT, sampling), untimed; a
    configuration that fails here is an ``error`` row at that batch."""
    from workbench.bench.kernel_timing import error_text
    from workbench.engine.sampling import SamplingParams

    warm = SamplingParams(temperature=0, max_tokens=cfg.warmup_tokens, ignore_eos=True)
    for b in s["batches"]:
        for name, llm in engines.items():
            say(f"warm-up {name} batch {b}")
            try:
                llm.generate(_prompts(cfg.seed + 10_000 + b, b, s["prompt_tokens"], vocab), warm)
            except Exception as e:  # noqa: BLE001
                rows[name, b].update(status="error", reason=error_text(e))


def _timed_repeats(cfg: DecodeStackConfig, s: dict, engines: dict, rows: dict, vocab: int, timed: dict,
                   notes: list, t_start: float, say, save) -> int:
    """The timed repeats, interleaved (every configuration at a batch size back to back, the order
    rotated each round) on fresh prompts; they stop early when the next would pass ``cfg.budget_s``
    (a note says so).  Fills ``timed``'s samples, tokens and prompts, calls ``save`` after each
    repeat, and returns the number of repeats done."""
    from workbench.bench.kernel_timing import error_text
    from workbench.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=s["max_tokens"], ignore_eos=True)
    samples, tokens, prompts_used = timed["samples"], timed["tokens"], timed["prompts"]
    done, last_round = 0, 0.0
    names = list(engines)
    for r in range(s["repeats"]):
        elapsed = time.perf_counter() - t_start
        if r and cfg.budget_s is not None and elapsed + last_round > cfg.budget_s:
            notes.append(f"stopped after {r} of {s['repeats']} repeats: the next would pass the {cfg.budget_s:.0f} s "
                         f"budget ({elapsed:.1f} s spent, {last_round:.1f} s a repeat)")
            break
        t_round = time.perf_counter()
        say(f"repeat {r + 1}/{s['repeats']}")
        for i, b in enumerate(s["batches"]):
            prompts = _prompts(cfg.seed + 1 + 1000 * r + b, b, s["prompt_tokens"], vocab)   # fresh: no prefix hits
            prompts_used[b] += prompts
            k = (r + i) % max(1, len(names))
            for name in names[k:] + names[:k]:                    # interleaved, the order rotated
                if rows[name, b]["status"] != "ok":
                    continue
                try:
                    outs = engines[name].generate(prompts, params)
                    samples[name, b].append(decode_rate(outs))
                    tokens[name, b] += [list(o.token_ids) for o in outs]
                except Exception as e:  # noqa: BLE001
                    rows[name, b].update(status="error", reason=error_text(e))
        done, last_round = r + 1, time.perf_counter() - t_round
        save(done)                                    # what a run stopped by its time cap keeps
    return done


def run_decode_stack(cfg: DecodeStackConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark; returns ``{"rows": [...] (columns ROW_FIELDS), "config", "ceiling",
    "environment", "notes", "seconds"}``.  Refused and failed configurations are rows, not errors."""
    from workbench.bench.kernel_timing import dtype_name, environment, prepare_device
    from workbench.model.loader import load_model, resolve_device
    from workbench.transforms.backends import apply_backends, describe_backends

    t_start = time.perf_counter()
    say = progress or (lambda msg: None)
    dev = resolve_device(cfg.device)
    s = {**cfg.resolved(dev), "block_size": cfg.block_size}
    if dev.type == "cpu" and (s["backend"] == "fused" or "triton" in s["backend"]):
        dev = prepare_device(dev)            # Triton on a CPU: the interpreter, set before any kernel import
    env = environment(dev)
    torch.manual_seed(cfg.seed)
    say(f"model {s['model']} on {dev}")
    model = load_model(s["model"], device=dev, dtype=cfg.dtype)
    dtype = model.lm_head.weight.dtype
    spec = resolve_backends(s["backend"], dev)
    if spec:
        apply_backends(model, spec)
    backends = describe_backends(model)
    ceiling = {"gb_s": None, "status": "skipped", "label": None,
               "error": "not measured (measure_ceiling=False): no bandwidth fraction is claimed"}
    if cfg.measure_ceiling:
        say("copy bandwidth")
        ceiling = _copy_ceiling(dev, dtype, s["copy_mib"], env)
    traffic = _step_traffic(model, s)
    base = {"model": s["model"], "device": str(dev),
            "device_name": env["device_name"], "dtype": dtype_name(dtype),
            "backends": backends["backends"] if spec else "eager (static-step backend modules)",
            "triton_interpreter": backends["triton_interpreter"],
            "timing": ("triton-interpreter (not a speed figure)" if backends["triton_interpreter"]
                       else ENGINE_TIMING if dev.type == "cuda" else "engine token timestamps (host clock)"),
            "prompt_tokens": s["prompt_tokens"], "max_tokens": s["max_tokens"], "torch": env["torch"],
            "triton": env["triton"]}
    rows, engines = _build_engines(model, s, base, say)

    def order():
        return sorted(rows, key=lambda k: (k[1], s["configs"].index(k[0])))     # batch by batch, side by side

    def save(repeats_done):
        import copy

        from workbench.measure.gpu_results import save_partial

        snap = copy.deepcopy(rows)
        _summarize(snap, timed["samples"], s, traffic, ceiling, final=False)
        save_partial({"rows": [snap[k] for k in order()], "config": {**asdict(cfg), **s, "repeats_done": repeats_done},
                      "ceiling": ceiling, "environment": env, "notes": notes,
                      "seconds": round(time.perf_counter() - t_start, 2)})

    vocab = model.config.vocab_size
    _warm_up(cfg, s, engines, rows, vocab, say)
    timed = {"samples": {k: [] for k in rows},       # (config, batch) -> [(tok/s, ttft s, first spread s)]
             "tokens": {k: [] for k in rows},        # (config, batch) -> token ids of every request, in order
             "prompts": {b: [] for b in s["batches"]}}
    notes: list[str] = []
    save(0)
    done = _timed_repeats(cfg, s, engines, rows, vocab, timed, notes, t_start, say, save)

    _summarize(rows, timed["samples"], s, traffic, ceiling)
    _compare(rows, timed["samples"], timed["tokens"], timed["prompts"], model, s, notes)
    return {"rows": [rows[k] for k in order()], "config": {**asdict(cfg), **s, "repeats_done": done},
            "ceiling": ceiling, "environment": env, "notes": notes,
            "seconds": round(time.perf_counter() - t_start, 2)}


def _compare(rows, samples, tokens, prompts_used, model, s, notes) -> None:
    """Each configuration against the baseline (the first contiguous one that ran) at each batch."""
    from workbench.measure.agreement import agreement, divergence_margin, first_divergence
    from workbench.measure.compare import compare_samples

    ok = [n for n in s["configs"] if any(rows[n, b]["status"] == "ok" for b in s["batches"])]
    baseline = next((n for n in ok if CONFIGS[n]["kv"] == "contiguous"), None)
    if baseline is None:
        notes.append("no contiguous configuration ran: no ratios or agreement")
        return
    for b in s["batches"]:
        ref = rows[baseline, b]
        if ref["status"] != "ok":
            continue
        ref.update(baseline=baseline, vs_baseline=1.0)
        ref_rates = [x[0] for x in samples[baseline, b]]
        for name in s["configs"]:
            row = rows[name, b]
            if name == baseline or row["status"] != "ok":
                continue
            rates = [x[0] for x in samples[name, b]]
            pairs = [a / c for a, c in zip(rates, ref_rates)]
            cmp = compare_samples(rates, ref_rates, names=(name, baseline), metric="decode tokens/s",
                                  lower_is_better=False, better_word="faster")
            row.update(baseline=baseline, vs_baseline=statistics.median(rates) / statistics.median(ref_rates),
                       vs_baseline_round_min=min(pairs) if pairs else None,
                       vs_baseline_round_max=max(pairs) if pairs else None, verdict=cmp.verdict)
            refs, others = tokens[baseline, b], tokens[name, b]
            n = min(len(refs), len(others))             # the same prompts, in the same order, on both sides
            agree = agreement(refs[:n], others[:n])
            row.update(agreement_vs_baseline=agree["rate"], identical_sequences=agree["identical_sequences"],
                       sequences=agree["sequences"])
            i = next((j for j in range(n) if first_divergence(refs[j], others[j]) is not None), None)
            if i is not None:                            # how close the first disagreement was (one forward)
                try:
                    with torch.inference_mode():
                        m = divergence_margin(model, prompts_used[b][i], refs[i], others[i])
                    row["first_divergence_margin"] = m["margin"]
                    notes.append(f"{name} vs {baseline} at batch {b}: sequence {i} leaves at token {m['position']}, "
                                 f"logit margin {m['margin']:.3g} (baseline top-2 gap {m['top2_gap']:.3g})")
                except Exception as e:  # noqa: BLE001 - a diagnostic only
                    notes.append(f"{name} vs {baseline} at batch {b}: margin not computed ({e})")


def _f(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_decode_stack(res: dict) -> str:
    """The table (what the command prints last): one line per configuration and batch."""
    rows, c, ceil = res["rows"], res["config"], res["ceiling"]
    r0 = rows[0] if rows else {}
    lines = [f"decode stack: {r0.get('model')} {r0.get('dtype')} on {r0.get('device')} ({r0.get('device_name')}); "
             f"prompt {c['prompt_tokens']} + {c['max_tokens']} new tokens (EOS ignored), {c['repeats_done']} of "
             f"{c['repeats']} repeats interleaved; backends {r0.get('backends')}"
             + ("; Triton interpreter" if r0.get("triton_interpreter") else ""),
             f"copy bandwidth: {_f(ceil.get('gb_s'), '.1f')} GB/s ({ceil.get('label') or ceil.get('error')})"]
    lines += [f"note: {n}" for n in res.get("notes", [])]
    head = (f"{'config':<20}{'batch':>6}{'tok/s p50':>12}{'min..max':>22}{'ms/step':>9}{'of copy BW':>11}"
            f"{'vs base':>9}{'pairs min..max':>16}{'agree':>8}  verdict / status")
    lines += [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['config']:<20}{r['batch']:>6}  {r['status'].upper()}: {r['reason']}")
            continue
        pairs = ("-" if r["vs_baseline_round_min"] is None
                 else f"{r['vs_baseline_round_min']:.2f}..{r['vs_baseline_round_max']:.2f}")
        span = f"{_f(r['decode_tok_s_min'], '.1f')}..{_f(r['decode_tok_s_max'], '.1f')}"
        tail = r["verdict"] or ("baseline" if r["baseline"] == r["config"] else "")
        lines.append(f"{r['config']:<20}{r['batch']:>6}{_f(r['decode_tok_s_p50'], '.1f'):>12}{span:>22}"
                     f"{_f(r['ms_per_step_p50'], '.3f'):>9}{_f(r['frac_of_ceiling'], '.1%'):>11}"
                     f"{_f(r['vs_baseline'], '.2f'):>9}{pairs:>16}{_f(r['agreement_vs_baseline'], '.1%'):>8}  {tail}")
    return "\n".join(lines)


def write_rows_csv(res: dict, path: str) -> str:
    """The rows as a CSV (columns :data:`ROW_FIELDS`; the file is replaced)."""
    from workbench.measure.gpu_results import write_csv

    return str(write_csv(res["rows"], path, ROW_FIELDS))

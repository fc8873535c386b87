"""The workbench engine against Hugging Face ``transformers.generate``, same process, same run.

Every side gets the same weights, the same prompts (token ids), greedy decoding and the same
number of new tokens (EOS ignored), after a warm-up; repeats are interleaved (each side in
turn, the order rotated) so that drift in machine speed hits all.  The sides are engine
configurations (:data:`CONFIGS`: the reference configuration, the bare loop, static / compiled
/ graphed decode, optionally llama.cpp) and transformers.  Each token's time is taken when its id
reaches the host (for transformers through a streamer, which receives ``next_tokens.cpu()``),
so TTFT and decode tokens/s are measured the same way on both sides.  Greedy token agreement
is reported next to the speed: a faster engine that emits different tokens is not a win.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from workbench.engine.llm import LLM
from workbench.engine.metrics import jitter
from workbench.errors import WorkbenchError
from workbench.model.loader import BUNDLED_MODEL
from workbench.engine.sampling import SamplingParams

DEFAULT_PROMPT_TOKENS = 64


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux) and its core count."""
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def device_name(device) -> str:
    """The GPU's name on CUDA, else :func:`cpu_name`."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


@dataclass
class BenchConfig:
    model: str | None = None      # folder, preset:<name>, or None for the bundled model
    device: str | None = None
    dtype: str | None = None
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    max_tokens: int = 64
    num_prompts: int = 3
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    backend: str | None = None    # per-op backends of the workbench side (workbench.transforms.backends spec)
    threads: int | str | None = None  # torch intra-op threads for both sides (None: the engine measures)
    configs: str = "reference,loop"   # engine configurations measured (bench.CONFIGS; "all": every one)
    batch: str = "1"                  # batch sizes, comma-separated: that many prompts submitted together
    quant: str = ""                   # quantization schemes, comma-separated: each a row "q:<scheme>" on the device's
                                      # fastest engine path (paged + compile on a CPU, + CUDA graphs on a GPU)
    quality_windows: int = 4          # held-out windows for each row's perplexity against the unquantized model
    max_rel_ppl: float = 0.01         # "within quality": a row's perplexity at most this much above the unquantized
    max_model_len: int | None = None  # context of the non-reference engines (None: prompt + new tokens + 1, exactly
                                      # what a request needs: the static contiguous rows' best case; a server sizes
                                      # them for the model's context, and every static decode row attends over it)

    def __post_init__(self) -> None:
        parse_configs(self.configs)
        parse_batches(self.batch)
        parse_quant(self.quant)
        need = self.prompt_tokens + self.max_tokens + 1
        if self.max_model_len is not None and self.max_model_len < need:
            raise WorkbenchError(f"bench: max_model_len {self.max_model_len} is shorter than a request "
                                 f"({self.prompt_tokens} prompt + {self.max_tokens} new tokens + 1)")
        for name in ("prompt_tokens", "max_tokens", "num_prompts", "repeats"):
            if getattr(self, name) < 1:
                raise WorkbenchError(f"bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 2:
            raise WorkbenchError("bench: max_tokens must be >= 2 to measure decoding")


def bench_prompts(llm: LLM, n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts of exactly ``length`` tokens: windows of held-out text when the bundled tokenizer
    is available, else seeded random token ids (fine for speed: latency ignores token values)."""
    from workbench.data import heldout_token_windows

    if llm.tokenizer is not None:
        windows = heldout_token_windows(llm.tokenizer, n, length, seed=seed)
        if windows:
            return windows
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, llm.model.config.vocab_size, (n, length), generator=gen).tolist()


def hf_model_like(llm: LLM, source: str | None):
    """A transformers model with the same weights as ``llm.model``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # bench shows its own progress
    model = llm.model
    folder = BUNDLED_MODEL if source in (None, "bundled") else source
    dtype = model.lm_head.weight.dtype
    if not str(folder).startswith("preset:"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    else:  # random-weight preset: build the HF twin from our config and copy our weights
        cfg_dict = model.config.to_hf()
        cls = getattr(transformers, model.config.architecture)
        config = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
        with torch.device(model.device):  # built in place (its RoPE buffers must be real tensors)
            hf = cls(config).to(dtype)
        missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
            raise WorkbenchError(f"bench: cannot copy weights into {model.config.architecture}: "
                                 f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.to(model.device).eval()


class _TimingStreamer:
    """transformers streamer that timestamps each generated token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())

    def end(self) -> None:
        pass


# ---- the configurations measured against transformers.generate -----------------------------------------
CONFIGS = {
    "reference": "the engine's reference configuration (LLM(): one sequence at a time, contiguous cache)",
    "loop": "the bare decode loop, no engine (workbench.engine.llm.ReferenceLoop): the LLM front's per-token cost "
            "is reference minus loop",
    "static": "the engine, decode steps on static buffers (eager; what CUDA graphs capture)",
    "compile": "the engine, static decode steps through torch.compile (inductor: C++ on a CPU)",
    "cuda-graphs": "the engine, static decode steps captured as CUDA graphs (CUDA only)",
    "compile+graphs": "the engine, torch.compile'd static decode captured as CUDA graphs (CUDA only)",
    "paged": "the engine on the paged KV pool with the prefix cache, eager (batch_invariant off, as in serving)",
    "paged+compile": "the paged pool, static decode steps over its blocks through torch.compile",
    "paged+graphs": "the paged pool, static decode steps over its blocks captured as CUDA graphs (CUDA only)",
    "llama.cpp": "llama-cpp-python on an f32 GGUF of the same weights (optional: shown when installed)",
    "llama.cpp-q8_0": "llama-cpp-python on that GGUF quantized to Q8_0 by llama.cpp's own quantizer (optional)",
    "llama.cpp-source": "llama-cpp-python on the GGUF file the model folder was imported from (optional)",
}
LLAMACPP = {"llama.cpp": "f32", "llama.cpp-q8_0": "q8_0", "llama.cpp-source": "source"}
ENGINE_OPTIONS = {"reference": {}, "static": {"static_decode": True}, "compile": {"compile": True},
                  "cuda-graphs": {"cuda_graphs": True}, "compile+graphs": {"compile": True, "cuda_graphs": True},
                  "paged": {"kv": "paged", "batch_invariant": False}, "paged+compile": {"kv": "paged", "compile": True},
                  "paged+graphs": {"kv": "paged", "cuda_graphs": True}}
SINGLE_STREAM = ("loop", *LLAMACPP)          # sides that run one sequence: measured at batch 1 only


def parse_quant(text: str | None) -> list[str]:
    """``"w8a16:head,w8a8"`` -> the schemes, each checked (:meth:`QuantRecipe.parse`)."""
    from workbench.quant.recipe import QuantRecipe

    schemes = [x.strip() for x in (text or "").split(",") if x.strip()]
    for x in schemes:
        QuantRecipe.parse(x)
    return list(dict.fromkeys(schemes))


# what --configs all measures when --quant is not given: the CPU's schemes (its int8 paths: the compiled
# weight-only reduction and torch._int_mm), the GPU's (the Triton W4A16 kernel)
DEFAULT_QUANT = {"cpu": "w8a16:head,w8a8:head", "cuda": "w4a16:g128,w8a16"}


def parse_batches(text) -> list[int]:
    """``"1,8"`` (or an int, or a list) -> the sorted batch sizes; each a positive integer."""
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    try:
        out = sorted({int(str(x).strip()) for x in items if str(x).strip()})
    except ValueError:
        raise WorkbenchError(f"bench: batch must be comma-separated positive integers, got {text!r}") from None
    if not out or out[0] < 1:
        raise WorkbenchError(f"bench: batch must be comma-separated positive integers, got {text!r}")
    return out


def parse_configs(text: str | None) -> list[str]:
    """``"reference,loop,compile"`` -> the list (``all``: every configuration this device can run)."""
    names = [c.strip() for c in (text or "reference").split(",") if c.strip()]
    if names == ["all"]:
        names = [c for c in CONFIGS if "graphs" not in c or torch.cuda.is_available()]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        raise WorkbenchError(f"bench: unknown configuration {bad[0]!r}; choose from {', '.join(CONFIGS)} or all")
    if "reference" not in names:
        names.insert(0, "reference")      # every other row is compared with it
    return list(dict.fromkeys(names))


def _run_engine(llm: LLM, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float, float]:
    """The prompts submitted together: (tokens per prompt, median TTFT s, decode tokens/s of the batch =
    tokens after each request's first over the span from the first first token to the last token;
    with one prompt, that request's decode rate)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(prompts, params)
    ms = [o.metrics for o in outs]
    span = max(m.token_times[-1] for m in ms) - min(m.first_token_time for m in ms)
    return ([o.token_ids for o in outs], statistics.median(m.ttft for m in ms),
            sum(len(m.token_times) - 1 for m in ms) / span)


def _run_loop(model, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float, float]:
    from workbench.engine.llm import ReferenceLoop

    (prompt,) = prompts                                 # one sequence: measured at batch 1 only
    start = time.perf_counter()
    loop = ReferenceLoop(model, prompt, n)
    tokens, times = [], []
    for _ in range(n):
        tokens.append(loop.step())
        times.append(time.perf_counter())
    return [tokens], times[0] - start, (n - 1) / (times[-1] - times[0])


@torch.inference_mode()
def _run_hf(hf, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float, float]:
    """transformers.generate on the prompts as one batch (equal lengths: no padding)."""
    ids = torch.tensor(prompts, device=hf.device)
    streamer = _TimingStreamer()
    start = time.perf_counter()
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                streamer=streamer, pad_token_id=0, eos_token_id=None)
    t, b = streamer.times, len(prompts)
    tokens = [streamer.tokens[i::b] for i in range(b)]  # one token per sequence per step
    return tokens, t[0] - start, b * (len(t) - 1) / (t[-1] - t[0])


def _sides(cfg: "BenchConfig", llm: LLM, names: list[str], max_batch: int) -> tuple[dict, dict]:
    """name -> fn(prompts) -> (tokens per prompt, ttft s, decode tok/s); name -> a one-line description.
    Engines other than the reference run up to ``max_batch`` sequences together."""
    from workbench.kv.paged import PagedKVConfig
    from workbench.sched.config import SchedulerConfig

    sides, described, skipped = {}, {}, {}
    ctx = cfg.max_model_len or cfg.prompt_tokens + cfg.max_tokens + 1   # default: exactly what a request needs
    sched = {"scheduler": SchedulerConfig(max_num_seqs=max_batch,
                                          max_num_batched_tokens=max(512, max_batch * cfg.prompt_tokens))}
    sched = sched if max_batch > 1 else {}
    static_model = None                                 # static decode swaps in backend modules: on a copy, so the
    for name in names:                                  # reference and loop rows time the plain model
        if name == "loop":
            sides[name] = lambda p: _run_loop(llm.model, p, cfg.max_tokens)
            described[name] = "bare loop"
        elif name in LLAMACPP:
            side = _llamacpp_side(cfg, llm, LLAMACPP[name])
            if side.get("available"):
                sides[name] = (lambda run: lambda ps: (lambda r: ([r[0]], r[1], r[2]))(run(*ps)))(side["run"])
                described[name] = side["description"]
            else:
                skipped[name] = side["reason"]
        elif name == "reference":
            sides[name], described[name] = (lambda p: _run_engine(llm, p, cfg.max_tokens)), llm.engine.describe()
        else:
            if static_model is None:
                import copy

                static_model = copy.deepcopy(llm.model)
            opts = dict(ENGINE_OPTIONS[name])
            if opts.get("kv") == "paged":
                opts["kv"] = PagedKVConfig()
            try:
                eng = LLM(static_model, tokenizer=llm.tokenizer, max_model_len=ctx, **opts, **sched)
            except WorkbenchError as e:
                skipped[name] = str(e)
                continue
            sides[name] = (lambda e: lambda p: _run_engine(e, p, cfg.max_tokens))(eng)
            described[name] = eng.engine.describe() + f" (max_model_len {ctx})"
    models = {}
    quant = cfg.quant or (DEFAULT_QUANT["cuda" if llm.device.type == "cuda" else "cpu"]
                          if parse_configs(cfg.configs) == parse_configs("all") else "")
    fast = {"cuda_graphs": True} if llm.device.type == "cuda" else {"compile": True}
    for scheme in parse_quant(quant):               # the device's fastest path, on a quantized copy of the model
        import copy

        name = f"q:{scheme}"
        try:
            eng = LLM(copy.deepcopy(llm.model), tokenizer=llm.tokenizer, max_model_len=ctx, quant=scheme,
                      kv=PagedKVConfig(), **fast, **sched)
        except WorkbenchError as e:
            skipped[name] = str(e)
            continue
        sides[name] = (lambda e: lambda p: _run_engine(e, p, cfg.max_tokens))(eng)
        described[name] = eng.engine.describe() + f" (max_model_len {ctx})"
        models[name] = eng.model
    return sides, {"described": described, "skipped": skipped, "models": models}


def bench_quality(llm: LLM, models: dict, windows: int, length: int = 256) -> dict:
    """Held-out perplexity of each quantized row's model against the unquantized one, paired token by
    token (:func:`workbench.bench.e2e_measure.numerics_quality`): relative change with its standard
    error, KL and top-1 agreement; ``{}`` without a tokenizer (a shape preset has no text to score)."""
    from workbench.bench.e2e_measure import numerics_quality, scored_logprobs
    from workbench.data import heldout_split

    if not models or llm.tokenizer is None or windows < 1:
        return {}
    length = min(length, llm.max_model_len)
    wins = heldout_split(llm.tokenizer, length)["evaluation"][:windows]
    ref = [scored_logprobs(llm.model, w, length - 1) for w in wins]
    return {name: numerics_quality(m, wins, ref, length - 1) for name, m in models.items()}


def _llamacpp_side(cfg: "BenchConfig", llm: LLM, variant: str = "f32") -> dict:
    """llama.cpp as one more side, when llama-cpp-python is installed (never a dependency)."""
    try:
        from workbench.bench.llamacpp import llamacpp_side
    except ImportError as e:
        return {"available": False, "reason": f"workbench.bench.llamacpp unavailable ({e})"}
    return llamacpp_side(cfg.model, llm, cfg.max_tokens, threads=torch.get_num_threads(), variant=variant)


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Returns a JSON-ready dict: per configuration median TTFT (ms) and decode tokens/s, their
    ratios to transformers with verdicts, greedy token agreement with the reference (and the
    logit margin at the first divergence), the environment, and every raw measurement.

    With several batch sizes (``cfg.batch``, e.g. ``"1,8"``) every side runs each size: that many
    prompts submitted together (transformers: one batched ``generate``; the reference
    configuration, one request at a time, runs them one after another).  The top-level rows are the
    smallest batch; ``batches`` holds every size's rows, and ``paged_vs_contiguous`` the paged
    pool's static steps against the contiguous ones at each size (``paged+compile`` vs ``compile``,
    ``paged+graphs`` vs ``cuda-graphs``) with a verdict.

    After every group of prompts that every side has run, the result so far (without ``raw``, as
    ``workbench bench --json`` prints it) goes to :func:`workbench.measure.gpu_results.save_partial`
    (a no-op unless ``$WORKBENCH_PARTIAL_OUT`` is set): the statistics, ratios and verdicts of the
    runs done, token agreement on the prompts run so far, no perplexity (measured after the runs)."""
    import transformers
    from tqdm.auto import tqdm

    from workbench.measure.gpu_results import save_partial
    from workbench.measure.probe import noise_probe

    names = parse_configs(cfg.configs)
    batches = parse_batches(cfg.batch)
    torch.manual_seed(cfg.seed)
    llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
    threads = torch.get_num_threads()   # the engine's choice; process-wide, so transformers runs with it too
    probe = noise_probe()               # the noise floor of this run's verdicts
    if cfg.backend:
        from workbench.transforms.backends import apply_backends, parse_backend_spec
        apply_backends(llm.model, parse_backend_spec(cfg.backend))
    hf = hf_model_like(llm, cfg.model)
    pool = bench_prompts(llm, max(cfg.num_prompts, batches[-1]), cfg.prompt_tokens, cfg.seed)
    ours, info = _sides(cfg, llm, names, batches[-1])
    sides = {**ours, "transformers": lambda ps: _run_hf(hf, ps, cfg.max_tokens)}
    for b in batches:                    # also where compile / capture happen (every batch bucket used)
        for _ in range(cfg.warmup):
            for name, fn in sides.items():
                if b == 1 or name not in SINGLE_STREAM:
                    fn(pool[:b])
    steps = sum(cfg.repeats * cfg.num_prompts * sum(b == 1 or n not in SINGLE_STREAM for n in sides) for b in batches)
    bar = tqdm(total=steps, desc="bench", unit="run", disable=not progress)
    head = {"model": cfg.model or "bundled", "device": str(llm.device), "device_name": device_name(llm.device),
            "dtype": str(llm.model.lm_head.weight.dtype).removeprefix("torch."), "threads": threads,
            "threads_policy": llm.thread_choice.as_dict(), "noise": probe.as_dict(),
            "torch": torch.__version__, "transformers": transformers.__version__, "config": asdict(cfg)}
    per_batch = {}
    for b in batches:
        groups = [[pool[(i + j) % len(pool)] for j in range(b)] for i in range(cfg.num_prompts)]
        run = {n: fn for n, fn in sides.items() if b == 1 or n not in SINGLE_STREAM}

        def save(raw, tokens, done, b=b, groups=groups):
            """The result so far (this batch size's groups measured until now, the sizes before it whole;
            no perplexity yet), for a time cap that stops the run (scripts/device_check.sh)."""
            try:
                part = {**per_batch, b: _batch_rows(llm, raw, tokens, groups[:done], info, ours)}
                res = _result(head, batches, part, {}, cfg.max_rel_ppl, llm, info["skipped"])
                save_partial({k: v for k, v in res.items() if k != "raw"})
            except Exception as e:  # noqa: BLE001 - saving what there is must never stop the measuring
                print(f"bench: could not save the partial result: {type(e).__name__}: {e}", file=sys.stderr)

        raw, tokens = _measure(run, groups, cfg.repeats, threads, bar, on_group=save)
        per_batch[b] = _batch_rows(llm, raw, tokens, groups, info, ours)
    bar.close()
    quality = bench_quality(llm, info["models"], cfg.quality_windows)
    return _result(head, batches, per_batch, quality, cfg.max_rel_ppl, llm, info["skipped"])


def _result(head: dict, batches: list[int], per_batch: dict, quality: dict, max_rel_ppl: float, llm: LLM,
            skipped: dict) -> dict:
    """:func:`run_bench`'s result from each batch size's rows (:func:`_batch_rows`; the smallest size is
    the top level), the quantized rows' perplexity (``quality``; ``{}``: not measured yet) and the sides
    not measured (``skipped``: name -> why)."""
    for pb in per_batch.values():
        for name, c in pb["configs"].items():
            c["quality"] = quality.get(name) if name.startswith("q:") else "the reference's weights"
    first = per_batch[batches[0]]
    res, configs = first["stats"], first["configs"]
    raw = first["raw"]
    out = {
        **head,
        "batch": batches[0], "workbench": res["reference"], "transformers_generate": res["transformers"],
        "decode_speedup": res["reference"]["decode_tokens_per_s_p50"] / res["transformers"]["decode_tokens_per_s_p50"],
        "ttft_ratio": res["reference"]["ttft_ms_p50"] / res["transformers"]["ttft_ms_p50"],
        **first["reference_vs_hf"],
        "greedy_token_agreement": first["reference_agreement"],
        "configs": configs, "skipped": skipped,
        "fastest": max(configs, key=lambda c: configs[c]["decode_tokens_per_s_p50"] if c not in LLAMACPP else -1),
        **_fastest_within(configs, max_rel_ppl),
        "backends": _backends_row(llm.model), "quality": quality,
        "batches": {str(b): {k: v for k, v in pb.items() if k in ("configs", "fastest", "paged_vs_contiguous")}
                    | {"transformers_generate": pb["stats"]["transformers"]} for b, pb in per_batch.items()},
        "paged_vs_contiguous": {str(b): pb["paged_vs_contiguous"] for b, pb in per_batch.items()
                                if pb["paged_vs_contiguous"]},
        "raw": raw if len(batches) == 1 else {str(b): pb["raw"] for b, pb in per_batch.items()},
    }
    if "loop" in configs:                # what the LLM front + engine add to each token, vs the bare loop
        from workbench.measure.compare import compare_samples

        ref_rates = [x["decode_tokens_per_s"] for x in raw["reference"]]
        cmp = compare_samples([1e3 / x for x in ref_rates], [1e3 / x["decode_tokens_per_s"] for x in raw["loop"]],
                              names=("engine (reference)", "bare loop"), metric="ms per decode token", unit="ms")
        ms_ref = 1e3 / res["reference"]["decode_tokens_per_s_p50"]
        ms_loop = 1e3 / res["loop"]["decode_tokens_per_s_p50"]
        out["front_overhead"] = {"engine_ms_per_token": ms_ref, "loop_ms_per_token": ms_loop,
                                 "overhead_ms_per_token": ms_ref - ms_loop,
                                 "overhead_pct": 100 * (ms_ref - ms_loop) / ms_loop, "verdict": cmp.verdict}
    return out


def _measure(sides: dict, groups: list, repeats: int, threads: int, bar, on_group=None) -> tuple[dict, dict]:
    """Every side on every group of prompts, ``repeats`` times, interleaved (the order rotated after
    each group, so no side always follows the same one): raw rows and the first repeat's tokens.
    ``on_group(raw, tokens, groups_with_tokens)`` after each group every side has run."""
    raw = {k: [] for k in sides}
    tokens = {k: [] for k in sides}
    order = list(sides)
    for r in range(repeats):
        for i, group in enumerate(groups):
            for side in order:
                if torch.get_num_threads() != threads:
                    raise WorkbenchError(f"bench: torch threads changed from {threads} to "
                                         f"{torch.get_num_threads()} during the run")
                toks, ttft, dtps = sides[side](group)
                raw[side].append({"repeat": r, "prompt": i, "ttft_ms": ttft * 1e3, "decode_tokens_per_s": dtps})
                if r == 0:
                    tokens[side] += toks
                bar.update()
            order = order[1:] + order[:1]
            if on_group is not None:
                on_group(raw, tokens, i + 1 if r == 0 else len(groups))
    return raw, tokens


# (paged side, contiguous side) compared at every batch size
PAGED_PAIRS = (("paged+compile", "compile"), ("paged+graphs", "cuda-graphs"))


def _batch_rows(llm: LLM, raw: dict, tokens: dict, groups: list, info: dict, ours: dict) -> dict:
    """One batch size's rows: stats per side, each configuration against transformers (ratio and
    verdict), its greedy agreement with the reference configuration and with transformers (and the
    logit margin at each first divergence), the fastest, the paged pool against contiguous KV."""
    from workbench.measure.agreement import agreement, divergence_margin
    from workbench.measure.compare import compare_samples

    stats = {side: _stats(rows) for side, rows in raw.items()}
    rates = {side: [x["decode_tokens_per_s"] for x in rows] for side, rows in raw.items()}
    prompts = [p for g in groups for p in g]
    configs = {}
    for name in (n for n in ours if n in raw):
        cmp = compare_samples(rates[name], rates["transformers"], names=(name, "transformers.generate"),
                              metric="decode tokens/s", lower_is_better=False, better_word="faster")
        margins = [divergence_margin(llm.model, p, a, b) for p, a, b in zip(prompts, tokens["reference"], tokens[name])]
        configs[name] = {**stats[name], "description": info["described"][name],
                         "decode_vs_transformers": stats[name]["decode_tokens_per_s_p50"]
                         / stats["transformers"]["decode_tokens_per_s_p50"],
                         "decode_verdict": cmp.verdict, "decode_winner": cmp.winner,
                         "token_agreement_vs_reference": agreement(tokens["reference"], tokens[name])["rate"],
                         "token_agreement_vs_transformers": agreement(tokens["transformers"], tokens[name])["rate"],
                         "first_divergence": [m for m in margins if m is not None]}
    names_cmp = ("workbench", "transformers.generate")
    decode_cmp = compare_samples(rates["reference"], rates["transformers"], names=names_cmp, metric="decode tokens/s",
                                 lower_is_better=False, better_word="faster")
    ttft_cmp = compare_samples([x["ttft_ms"] for x in raw["reference"]], [x["ttft_ms"] for x in raw["transformers"]],
                               names=names_cmp, metric="TTFT", unit="ms")
    paged = {}
    for a, b in PAGED_PAIRS:
        if a in configs and b in configs:
            cmp = compare_samples(rates[a], rates[b], names=(a, b), metric="decode tokens/s", lower_is_better=False,
                                  better_word="faster")
            paged[f"{a} vs {b}"] = {"ratio": stats[a]["decode_tokens_per_s_p50"] / stats[b]["decode_tokens_per_s_p50"],
                                    "verdict": cmp.verdict, "winner": cmp.winner}
    return {"stats": stats, "configs": configs, "raw": raw, "paged_vs_contiguous": paged,
            "fastest": max(configs, key=lambda c: configs[c]["decode_tokens_per_s_p50"] if c not in LLAMACPP else -1),
            "reference_vs_hf": {"decode_verdict": decode_cmp.verdict, "ttft_verdict": ttft_cmp.verdict,
                                "decode_winner": decode_cmp.winner, "ttft_winner": ttft_cmp.winner},
            "reference_agreement": agreement(tokens["reference"], tokens["transformers"])["rate"]}


def _fastest_within(configs: dict, max_rel_ppl: float) -> dict:
    """The fastest of our rows whose held-out perplexity is within ``max_rel_ppl`` of the unquantized
    model (rows on its weights count as within; a quantized row without a measurement does not),
    and its decode rate as a fraction of each llama.cpp row's."""
    ok = [n for n, c in configs.items() if n not in LLAMACPP
          and (isinstance(c.get("quality"), str) or (isinstance(c.get("quality"), dict)
                                                    and c["quality"]["rel_ppl"] <= max_rel_ppl))]
    if not ok:
        return {"fastest_within_quality": None, "max_rel_ppl": max_rel_ppl, "vs_llamacpp": {}}
    best = max(ok, key=lambda n: configs[n]["decode_tokens_per_s_p50"])
    rate = configs[best]["decode_tokens_per_s_p50"]
    return {"fastest_within_quality": best, "max_rel_ppl": max_rel_ppl,
            "vs_llamacpp": {n: rate / configs[n]["decode_tokens_per_s_p50"] for n in LLAMACPP if n in configs}}


def _stats(rows: list[dict]) -> dict:
    return {"ttft_ms_p50": statistics.median(x["ttft_ms"] for x in rows),
            "decode_tokens_per_s_p50": statistics.median(x["decode_tokens_per_s"] for x in rows),
            "ttft_ms_jitter": jitter([x["ttft_ms"] for x in rows]),
            "decode_tokens_per_s_min": min(x["decode_tokens_per_s"] for x in rows),
            "decode_tokens_per_s_max": max(x["decode_tokens_per_s"] for x in rows)}


def _backends_row(model) -> dict:
    """The per-op backends of the measured model, as every benchmark row records them."""
    from workbench.transforms.backends import describe_backends

    return describe_backends(model)


def _ppl_text(q) -> str:
    """A row's perplexity against the unquantized model: ``+0.3% +-0.2`` (or "=" for the same weights)."""
    if isinstance(q, dict):
        return f"{100 * q['rel_ppl']:+.2f}% +-{100 * q['rel_ppl_se']:.2f}"
    return "=" if isinstance(q, str) else "-"


def format_bench(res: dict) -> str:
    h = res["transformers_generate"]
    lines = [f"model {res['model']} on {res['device']} ({res['device_name']}), {res['dtype']}, "
             f"{res['threads']} threads; prompt {res['config']['prompt_tokens']} tokens, "
             f"{res['config']['max_tokens']} new tokens, {res['config']['num_prompts']} prompts x "
             f"{res['config']['repeats']} repeats; workbench backends: {res['backends']['backends']}"
             + (" (Triton interpreter)" if res["backends"].get("triton_interpreter") else ""),
             f"{'engine':<24}{'TTFT p50 ms':>14}{'TTFT jitter':>13}{'decode tok/s p50':>18}{'min..max':>18}"
             f"{'vs HF':>8}{'agree':>8}{'ppl vs fp32':>17}"]
    rows = [(name, c, f"{c['decode_vs_transformers']:.2f}x", f"{c['token_agreement_vs_reference']:.0%}",
             _ppl_text(c.get("quality"))) for name, c in res["configs"].items()]
    rows += [("transformers.generate", h, "1.00x", "", "")]
    for name, r, ratio, agree, ppl in rows:
        lines.append(f"{name:<24}{r['ttft_ms_p50']:>14.2f}{r['ttft_ms_jitter']:>13.2f}"
                     f"{r['decode_tokens_per_s_p50']:>18.1f}"
                     f"{r['decode_tokens_per_s_min']:>9.1f}..{r['decode_tokens_per_s_max']:<8.1f}{ratio:>8}{agree:>8}"
                     f"{ppl:>17}")
    lines.append(f"decode speed-up (reference configuration / transformers): {res['decode_speedup']:.2f}x "
                 f"({res['decode_verdict']}); TTFT ratio: {res['ttft_ratio']:.2f} ({res['ttft_verdict']}); "
                 f"greedy token agreement: {res['greedy_token_agreement']:.1%}")
    for name, c in res["configs"].items():
        if name != "reference":
            lines.append(f"  {name}: {c['description']}; {c['decode_verdict']}")
            for d in c["first_divergence"]:
                lines.append(f"    first divergence at token {d['position']}: margin {d['margin']:.2e} "
                             f"(reference top-2 gap {d['top2_gap']:.2e})")
    for name, why in res.get("skipped", {}).items():
        lines.append(f"  {name}: not measured ({why})")
    fo = res.get("front_overhead")
    if fo:
        lines.append(f"LLM front + engine per decode token: {fo['engine_ms_per_token']:.3f} ms vs the bare loop "
                     f"{fo['loop_ms_per_token']:.3f} ms: {fo['overhead_ms_per_token']:+.3f} ms "
                     f"({fo['overhead_pct']:+.0f}%; {fo['verdict']})")
    lines.append(f"fastest configuration: {res['fastest']} ({res['configs'][res['fastest']]['decode_vs_transformers']:.2f}x "
                 "transformers)")
    best = res.get("fastest_within_quality")
    if best and (best != res["fastest"] or res.get("vs_llamacpp")):
        c = res["configs"][best]
        lines.append(f"fastest within +{100 * res['max_rel_ppl']:g} % perplexity: {best} ({c['decode_vs_transformers']:.2f}x "
                     "transformers" + "".join(f"; {r:.2f}x {n}" for n, r in res["vs_llamacpp"].items()) + ")")
    for b, pb in res.get("batches", {}).items():
        if int(b) == res.get("batch", 1):
            continue
        h = pb["transformers_generate"]
        lines.append(f"batch {b} (prompts submitted together; the reference configuration runs them one at a time):")
        for name, r in [*pb["configs"].items(), ("transformers.generate", h)]:
            ratio = f"{r['decode_vs_transformers']:.2f}x" if "decode_vs_transformers" in r else "1.00x"
            agree = f"{r['token_agreement_vs_reference']:.0%}" if "token_agreement_vs_reference" in r else ""
            lines.append(f"  {name:<22}{r['ttft_ms_p50']:>14.2f}{r['ttft_ms_jitter']:>13.2f}"
                         f"{r['decode_tokens_per_s_p50']:>18.1f}{r['decode_tokens_per_s_min']:>9.1f}.."
                         f"{r['decode_tokens_per_s_max']:<8.1f}{ratio:>8}{agree:>8}")
    for b, pairs in res.get("paged_vs_contiguous", {}).items():
        for pair, c in pairs.items():
            lines.append(f"batch {b}: {pair}: decode {c['ratio']:.2f}x ({c['verdict']})")
    pol = res.get("threads_policy") or {}
    if pol.get("step_ms"):
        steps = ", ".join(f"{t}: {ms:.2f} ms" for t, ms in pol["step_ms"].items())
        lines.append(f"threads: {res['threads']} ({pol['policy']}; decode step by thread count {steps})")
    return "\n".join(lines)

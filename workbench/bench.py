"""The workbench engine against Hugging Face ``transformers.generate``, same process, same run.

Both sides get the same weights, the same prompts (token ids), greedy decoding and the same
number of new tokens (EOS ignored), after a warm-up; repeats are interleaved (ours, theirs,
ours, ...) so that drift in machine speed hits both.  Each token's time is taken when its id
reaches the host (for transformers through a streamer, which receives ``next_tokens.cpu()``),
so TTFT and decode tokens/s are measured the same way on both sides.  Greedy token agreement
is reported next to the speed: a faster engine that emits different tokens is not a win.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .engine import LLM
from .errors import WorkbenchError
from .loader import BUNDLED_MODEL
from .sampling import SamplingParams

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
    backend: str | None = None    # per-op backends of the workbench side (workbench.backends spec)
    threads: int | str | None = None  # torch intra-op threads for both sides (None: the engine measures)

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "max_tokens", "num_prompts", "repeats"):
            if getattr(self, name) < 1:
                raise WorkbenchError(f"bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 2:
            raise WorkbenchError("bench: max_tokens must be >= 2 to measure decoding")


def bench_prompts(llm: LLM, n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts of exactly ``length`` tokens: windows of held-out text when the bundled tokenizer
    is available, else seeded random token ids (fine for speed: latency ignores token values)."""
    from .data import heldout_token_windows

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


def _run_ours(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    m = out.metrics
    return out.token_ids, m.ttft, m.decode_tokens_per_s


@torch.inference_mode()
def _run_hf(hf, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    ids = torch.tensor([prompt], device=hf.device)
    streamer = _TimingStreamer()
    start = time.perf_counter()
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                streamer=streamer, pad_token_id=0, eos_token_id=None)
    t = streamer.times
    return streamer.tokens, t[0] - start, (len(t) - 1) / (t[-1] - t[0])


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Returns a JSON-ready dict: per side median TTFT (ms) and decode tokens/s, their ratios,
    token agreement, the environment, and every raw measurement."""
    import transformers
    from tqdm.auto import tqdm

    from .measure.compare import compare_samples
    from .measure.probe import noise_probe

    torch.manual_seed(cfg.seed)
    llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
    threads = torch.get_num_threads()   # the engine's choice; process-wide, so transformers runs with it too
    probe = noise_probe()               # the noise floor of this run's verdicts
    if cfg.backend:
        from .backends import apply_backends, parse_backend_spec
        apply_backends(llm.model, parse_backend_spec(cfg.backend))
    hf = hf_model_like(llm, cfg.model)
    prompts = bench_prompts(llm, cfg.num_prompts, cfg.prompt_tokens, cfg.seed)
    sides = {"workbench": lambda p: _run_ours(llm, p, cfg.max_tokens),
             "transformers": lambda p: _run_hf(hf, p, cfg.max_tokens)}
    for _ in range(cfg.warmup):
        for fn in sides.values():
            fn(prompts[0])
    raw = {k: [] for k in sides}
    tokens = {k: [] for k in sides}
    steps = cfg.repeats * len(prompts) * len(sides)
    bar = tqdm(total=steps, desc="bench", unit="run", disable=not progress)
    for r in range(cfg.repeats):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for i, p in enumerate(prompts):
            for side in order:
                if torch.get_num_threads() != threads:
                    raise WorkbenchError(f"bench: torch threads changed from {threads} to "
                                         f"{torch.get_num_threads()} during the run")
                toks, ttft, dtps = sides[side](p)
                raw[side].append({"repeat": r, "prompt": i, "ttft_ms": ttft * 1e3, "decode_tokens_per_s": dtps})
                if r == 0:
                    tokens[side].append(toks)
                bar.update()
    bar.close()
    res = {}
    for side, rows in raw.items():
        res[side] = {"ttft_ms_p50": statistics.median(x["ttft_ms"] for x in rows),
                     "decode_tokens_per_s_p50": statistics.median(x["decode_tokens_per_s"] for x in rows),
                     "ttft_ms_jitter": statistics.pstdev(x["ttft_ms"] for x in rows),
                     "decode_tokens_per_s_min": min(x["decode_tokens_per_s"] for x in rows),
                     "decode_tokens_per_s_max": max(x["decode_tokens_per_s"] for x in rows)}
    names = ("workbench", "transformers.generate")
    decode_cmp = compare_samples([x["decode_tokens_per_s"] for x in raw["workbench"]],
                                 [x["decode_tokens_per_s"] for x in raw["transformers"]], names=names,
                                 metric="decode tokens/s", lower_is_better=False, better_word="faster")
    ttft_cmp = compare_samples([x["ttft_ms"] for x in raw["workbench"]], [x["ttft_ms"] for x in raw["transformers"]],
                               names=names, metric="TTFT", unit="ms")
    same = sum(a == b for pa, pb in zip(tokens["workbench"], tokens["transformers"]) for a, b in zip(pa, pb))
    total = sum(len(p) for p in tokens["workbench"])
    dev = llm.device
    return {
        "model": cfg.model or "bundled", "device": str(dev),
        "device_name": device_name(dev),
        "dtype": str(llm.model.lm_head.weight.dtype).removeprefix("torch."), "threads": threads,
        "threads_policy": llm.thread_choice.as_dict(), "noise": probe.as_dict(),
        "torch": torch.__version__, "transformers": transformers.__version__, "config": asdict(cfg),
        "workbench": res["workbench"], "transformers_generate": res["transformers"],
        "decode_speedup": res["workbench"]["decode_tokens_per_s_p50"] / res["transformers"]["decode_tokens_per_s_p50"],
        "ttft_ratio": res["workbench"]["ttft_ms_p50"] / res["transformers"]["ttft_ms_p50"],
        "decode_verdict": decode_cmp.verdict, "ttft_verdict": ttft_cmp.verdict,
        "decode_winner": decode_cmp.winner, "ttft_winner": ttft_cmp.winner,
        "greedy_token_agreement": same / total if total else None,
        "backends": _backends_row(llm.model),
        "raw": raw,
    }


def _backends_row(model) -> dict:
    """The per-op backends of the measured model, as every benchmark row records them."""
    from .backends import describe_backends

    return describe_backends(model)


def format_bench(res: dict) -> str:
    w, h = res["workbench"], res["transformers_generate"]
    lines = [f"model {res['model']} on {res['device']} ({res['device_name']}), {res['dtype']}, "
             f"{res['threads']} threads; prompt {res['config']['prompt_tokens']} tokens, "
             f"{res['config']['max_tokens']} new tokens, {res['config']['num_prompts']} prompts x "
             f"{res['config']['repeats']} repeats; workbench backends: {res['backends']['backends']}"
             + (" (Triton interpreter)" if res["backends"].get("triton_interpreter") else ""),
             f"{'engine':<24}{'TTFT p50 ms':>14}{'TTFT jitter':>13}{'decode tok/s p50':>18}{'min..max':>18}"]
    for name, r in (("workbench", w), ("transformers.generate", h)):
        lines.append(f"{name:<24}{r['ttft_ms_p50']:>14.2f}{r['ttft_ms_jitter']:>13.2f}"
                     f"{r['decode_tokens_per_s_p50']:>18.1f}"
                     f"{r['decode_tokens_per_s_min']:>9.1f}..{r['decode_tokens_per_s_max']:<8.1f}")
    lines.append(f"decode speed-up (workbench / transformers): {res['decode_speedup']:.2f}x "
                 f"({res['decode_verdict']}); TTFT ratio: {res['ttft_ratio']:.2f} ({res['ttft_verdict']}); "
                 f"greedy token agreement: {res['greedy_token_agreement']:.1%}")
    pol = res.get("threads_policy") or {}
    if pol.get("step_ms"):
        steps = ", ".join(f"{t}: {ms:.2f} ms" for t, ms in pol["step_ms"].items())
        lines.append(f"threads: {res['threads']} ({pol['policy']}; decode step by thread count {steps})")
    return "\n".join(lines)

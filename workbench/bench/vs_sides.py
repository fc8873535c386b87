"""The sides of ``workbench bench`` (:mod:`workbench.bench.vs_transformers`): the prompts, each
engine configuration built on the same weights, transformers' twin of the model, and one run of each
(the prompts submitted together -> tokens per prompt, TTFT, decode tokens/s; each token timed when
its id reaches the host, for transformers through a streamer)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from workbench.bench.vs_configs import (
    DEFAULT_QUANT,
    ENGINE_OPTIONS,
    LLAMACPP,
    parse_configs,
    parse_quant,
)
from workbench.engine.llm import LLM
from workbench.engine.sampling import SamplingParams
from workbench.errors import WorkbenchError
from workbench.model.loader import BUNDLED_MODEL

if TYPE_CHECKING:
    from workbench.bench.vs_configs import BenchConfig


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


def _sides(cfg: BenchConfig, llm: LLM, names: list[str], max_batch: int) -> tuple[dict, dict]:
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
                # no prefix cache: the bench repeats its prompts, and a repeat served from cached blocks would
                # time a prefix hit as the paged row's TTFT against full prefills elsewhere (prefix-bench measures it)
                opts["kv"] = PagedKVConfig(enable_prefix_caching=False)
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
                      kv=PagedKVConfig(enable_prefix_caching=False), **fast, **sched)
        except WorkbenchError as e:
            skipped[name] = str(e)
            continue
        sides[name] = (lambda e: lambda p: _run_engine(e, p, cfg.max_tokens))(eng)
        described[name] = eng.engine.describe() + f" (max_model_len {ctx})"
        models[name] = eng.model
    return sides, {"described": described, "skipped": skipped, "models": models}


def _llamacpp_side(cfg: BenchConfig, llm: LLM, variant: str = "f32") -> dict:
    """llama.cpp as one more side, when llama-cpp-python is installed (never a dependency)."""
    try:
        from workbench.bench.llamacpp import llamacpp_side
    except ImportError as e:
        return {"available": False, "reason": f"workbench.bench.llamacpp unavailable ({e})"}
    return llamacpp_side(cfg.model, llm, cfg.max_tokens, threads=torch.get_num_threads(), variant=variant)

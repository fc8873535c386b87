"""The configurations of ``workbench bench`` (:mod:`workbench.bench.vs_transformers`): what a run
measures (:class:`BenchConfig`), the engine configurations that are its sides (:data:`CONFIGS`, each
one's engine options, the optional llama.cpp sides), the quantized rows' schemes and the batch sizes,
each parsed and checked before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.errors import WorkbenchError

DEFAULT_PROMPT_TOKENS = 64

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

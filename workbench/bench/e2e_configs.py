"""The end-to-end ablation's configurations: the layers, which the device measures, their order in
the stack, and what each changes (:class:`Spec`, :func:`add_layer`).

A layer changes one thing of the baseline (continuous batching, a contiguous KV cache per
sequence, eager, unquantized, no admission window, priority 0 for all).  Conflicts are not
decided here: a layer is added to a :class:`Spec` as it is, and building the engine says whether
the combination can run (its :class:`ConfigError` is the recorded reason), except where
:class:`~workbench.kv.paged.PagedKVConfig` refuses at once (an offload tier without a prefix cache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig
from workbench.kv.tier_config import TierConfig

# layer -> (label, what it changes).  The device decides which of them are measured (device_layers).
LAYERS = {
    "compile": ("compile", "decode steps on static buffers (contiguous rows, or the paged pool's blocks when the pool "
                           "is on), torch.compile'd (on a CPU: inductor's C++)"),
    "static_decode": ("static decode", ("decode steps on static buffers, eager (the path compile and CUDA graphs "
                                        "build on)")),
    "triton": ("Triton kernels", "fused RMSNorm(+residual), RoPE(+KV write), SwiGLU, flash prefill, paged decode"),
    "cuda_graphs": ("CUDA graphs", "decode steps captured once per batch-size bucket and replayed"),
    "paged": ("paged KV pool", "KV in fixed-size blocks of one pool shared by every sequence (nothing shared yet)"),
    "prefix_cache": ("prefix cache", "cross-request prefix sharing on the paged pool (hash chain, verified by tokens)"),
    "kv_offload": ("KV offload + lookahead", ("a smaller pool; evicted prefix blocks go to host memory and are "
                                              "staged back ahead of the requests that need them")),
    "tiers": ("KV tiers", "hot / warm (PCA keys) / cold (chunk means) cache per sequence, the full K/V in host memory"),
    "weight_streaming": ("weight streaming", ("half the decoder layers resident, the rest fetched layer by layer "
                                              "ahead of use")),
    "window": ("micro-batch window", "new arrivals wait up to the window to be admitted together"),
    "priorities": ("priorities", "chat turns go first (priority 1) and may preempt documents and one-off requests"),
    "quant": ("quantization", "linear layers quantized: the scheme E2EConfig.quant names (notebook 06: the fastest "
                              "within the SLO's perplexity bound on this model, bench.e2e_quant_choice; else "
                              "the device's, DEVICE_QUANT)"),
}
# The device's fastest quantization, measured on the bundled model (decode step at batch 1 / 8, a 256-token
# prefill; 2-core AMD EPYC, 1 thread): fp32 2.3 / 3.7 / 31 ms; W8A8 (torch._int_mm, int8 activations)
# 1.7 / 2.8 / 14 ms; W8A16 (the compiled int8 reduction; torch's int8pack op took 4.3 / 27 / 32 ms)
# 1.8 / 3.4 / 31 ms; W4A16 g128 7.7 / 6.4 / 33 ms.  06's workload is mostly prefill: W8A8.  (On a real
# checkpoint W8A8's quality may not hold - SmolLM2-135M: +2.9 % perplexity, W8A16 -0.2 % - which is
# what workbench calibrate-quant weighs, and notebook 06 chooses per model: bench.e2e_quant_choice.)  On a GPU the
# Triton W4A16 kernel reads the fewest bytes.
DEVICE_QUANT = {"cpu": "w8a8", "cuda": "w4a16:g128"}
# Layers measured alone but left out of the stack, and why (the stack is the fastest configuration
# the device can build; these trade speed for memory, or exactness for memory).
ALONE_ONLY = {
    "tiers": ("a memory layer: approximate attention over a hot / warm / cold cache per sequence (outputs change), "
              "whose routing picks blocks on the host at every step, so no static decode step can replay it"),
    "weight_streaming": ("a memory layer: fewer resident weight bytes, paid for with a fetch per streamed layer "
                         "and step (measured alone; notebook 03 measures what hides the fetches)"),
}


def device_quant(device: str) -> str:
    """The quantization scheme of ``device``'s stack (:data:`DEVICE_QUANT`)."""
    return DEVICE_QUANT["cuda" if str(device).startswith("cuda") else "cpu"]
REQUIRES = {"prefix_cache": ("paged",), "kv_offload": ("paged", "prefix_cache")}   # one-at-a-time rows include these
TRITON_OPS = {"rmsnorm": "triton", "rope": "triton", "swiglu": "triton", "attention_prefill": "triton",
              "attention_decode": "triton"}


def device_layers(device: str) -> tuple[list[str], list[str], dict[str, str]]:
    """``(one-at-a-time layers, the stack's order, layers not measured on this device -> why)``.

    The stack puts the KV layout first: the paged pool (then its prefix cache and offload tier) serves
    the shared prefixes of this workload; the static decode step (compile on a CPU, CUDA graphs on a
    GPU, after the Triton kernels) runs over the pool's blocks; then the scheduler's window and
    priorities, then the device's fastest quantization (:data:`DEVICE_QUANT`).  The memory layers
    (:data:`ALONE_ONLY`: the tiered cache, weight streaming) are measured alone, not stacked."""
    common = ["paged", "prefix_cache", "kv_offload", "tiers", "weight_streaming", "window", "priorities", "quant"]
    if str(device).startswith("cuda"):
        return (["triton", "cuda_graphs", *common],
                ["triton", "paged", "prefix_cache", "kv_offload", "cuda_graphs", "window", "priorities", "quant"], {})
    why = {"triton": "the Triton kernels run on a CPU only under the interpreter (TRITON_INTERPRET=1, ~0.1 s a "
                     "launch): correct, and checked in notebook 01, but no speed layer; on a GPU this row is measured"}
    return (["compile", "cuda_graphs", *common],
            ["paged", "prefix_cache", "kv_offload", "compile", "window", "priorities", "quant"], why)


@dataclass
class E2EConfig:
    """Sizes and settings of one end-to-end ablation (``preset``: tiny / smoke / full)."""

    repeats: int = 3                     # interleaved rounds (3+ for a verdict)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    block_size: int = 16
    window_ms: float = 5.0
    compile: bool = True                 # False: the compile layer is static decode (no compile time)
    quant: str | None = None             # the stack's quantization (None: the device's fastest, DEVICE_QUANT)
    quant_variants: tuple[str, ...] = ("w4a16:g128",)   # more one-at-a-time rows
    tiers: TierConfig = field(default_factory=lambda: TierConfig(window=64, rank=8, warm_tokens=128, chunk=16,
                                                                  block=16))
    stream_resident: float = 0.5         # share of decoder layers kept resident under weight streaming
    stream_distance: int = 1
    offload_pool_factor: int = 3         # kv_offload's pool: this many times the longest request's blocks
    lookahead: int = 4
    reference_row: bool = True           # replay the trace on LLM() too (one request at a time)
    stack: tuple[str, ...] | None = None    # None: the device's order (device_layers)
    alone: tuple[str, ...] | None = None    # the layers measured one at a time (None: every layer the device has)
    batch_invariant: bool = False        # True: exact greedy tokens under batching, at a price on the paged pool
                                         # (float64 attention on a CPU); static decode paths ignore it
    eval_docs: int = 2                   # held-out documents for perplexity / KL
    eval_context: int = 384
    eval_tokens: int = 256               # scored next-token predictions per document

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"E2EConfig.repeats must be an integer >= 1, got {self.repeats!r}")
        if not 0 <= self.stream_resident < 1:
            raise ConfigError(f"E2EConfig.stream_resident must be in [0, 1), got {self.stream_resident!r}")
        for name, value in (("stack", self.stack), ("alone", self.alone)):
            unknown = [x for x in (value or ()) if x not in LAYERS]
            if unknown:
                raise ConfigError(f"E2EConfig.{name}: unknown layer(s) {unknown}; known: {', '.join(LAYERS)}")

    @classmethod
    def preset(cls, mode: str, **over) -> E2EConfig:
        sizes = {"tiny": {"repeats": 3, "compile": False, "quant_variants": (), "eval_docs": 1, "eval_context": 192,
                          "eval_tokens": 96, "max_num_seqs": 4},
                 "smoke": {"quant_variants": (), "reference_row": False, "eval_context": 256, "eval_tokens": 128},
                 "full": {"repeats": 5, "eval_docs": 4, "eval_context": 512, "eval_tokens": 256}}
        if mode not in sizes:
            raise ConfigError(f"E2EConfig.preset: mode must be one of {', '.join(sizes)}, got {mode!r}")
        return cls(**{**sizes[mode], **over})


@dataclass(frozen=True)
class Spec:
    """The options of one configuration: what ``LLM(...)`` gets, plus the replay's priorities."""

    kv: PagedKVConfig | None = None
    tiers: TierConfig | None = None
    compile: bool = False
    static_decode: bool = False
    cuda_graphs: bool = False
    backends: tuple | None = None        # ((op, backend), ...) applied to a fresh model
    stream_weights: object = None        # a WeightStreamConfig
    quant: str | None = None
    window_s: float = 0.0
    priorities: bool = False
    reference: bool = False              # LLM()'s own scheduler: one request at a time

    @property
    def fresh_model(self) -> bool:
        """Changes the model in place (backend modules, quantized layers, streamed layers, tiered
        attention, the static decoder's backend modules): such a configuration gets its own copy."""
        return bool(self.tiers or self.compile or self.static_decode or self.cuda_graphs or self.backends
                    or self.stream_weights is not None or self.quant)

    @property
    def persistent(self) -> bool:
        """Kept across runs (its compiled / captured decode steps are expensive to remake)."""
        return self.compile or self.cuda_graphs or self.static_decode

    @property
    def numerics(self) -> str | None:
        """What changes the model's outputs beyond rounding, for the perplexity / KL (None: nothing)."""
        parts = ([f"quant {self.quant}"] if self.quant else []) + ([f"tiers {self.tiers.name}"] if self.tiers else [])
        parts += ["Triton kernels"] if self.backends else []
        return ", ".join(parts) or None


def add_layer(spec: Spec, layer: str, cfg: E2EConfig, ctx: dict) -> Spec:
    """``spec`` with ``layer`` added, its other options untouched: conflicts are for the engine to
    refuse (a ConfigError when it is built; :class:`PagedKVConfig` may refuse here already).
    ``ctx``: ``offload_blocks`` (kv_offload's pool) and ``layers`` (the model's decoder layers)."""
    from workbench.prefetch.weights import WeightStreamConfig

    r = dataclasses.replace
    if layer == "paged":
        return r(spec, kv=PagedKVConfig(block_size=cfg.block_size, enable_prefix_caching=False))
    if layer == "prefix_cache":          # on the pool there is (a pool of its own without one)
        kv = spec.kv or PagedKVConfig(block_size=cfg.block_size, enable_prefix_caching=False)
        return r(spec, kv=r(kv, enable_prefix_caching=True))
    if layer == "kv_offload":           # without the prefix cache, PagedKVConfig says why it needs it
        kv = spec.kv or PagedKVConfig(block_size=cfg.block_size, enable_prefix_caching=False)
        return r(spec, kv=r(kv, num_blocks=ctx["offload_blocks"], offload="host", lookahead=cfg.lookahead))
    if layer == "tiers":
        return r(spec, tiers=cfg.tiers)
    if layer == "compile":
        return r(spec, compile=True) if cfg.compile else r(spec, static_decode=True)
    if layer == "static_decode":
        return r(spec, static_decode=True)
    if layer == "cuda_graphs":
        return r(spec, cuda_graphs=True)
    if layer == "triton":
        return r(spec, backends=tuple(sorted(TRITON_OPS.items())))
    if layer == "weight_streaming":
        resident = max(0, min(ctx["layers"] - 1, round(cfg.stream_resident * ctx["layers"])))
        return r(spec, stream_weights=WeightStreamConfig(resident_layers=resident, distance=cfg.stream_distance))
    if layer == "window":
        return r(spec, window_s=cfg.window_ms / 1e3)
    if layer == "priorities":
        return r(spec, priorities=True)
    if layer == "quant" or layer.startswith("quant:"):
        return r(spec, quant=layer.split(":", 1)[1] if ":" in layer else cfg.quant or DEVICE_QUANT["cpu"])
    raise ConfigError(f"unknown layer {layer!r}; known: {', '.join(LAYERS)}")


def layer_label(layer: str, cfg: E2EConfig | None = None) -> str:
    if layer.startswith("quant"):
        return f"quant {layer.split(':', 1)[1] if ':' in layer else (cfg.quant if cfg and cfg.quant else 'device')}"
    if layer == "compile" and cfg is not None and not cfg.compile:
        return "static decode (compile in full mode)"
    return LAYERS.get(layer, (layer,))[0]


@dataclass
class Config:
    """One configuration of the ablation: its name, group, the layers on top of the baseline, the
    layer it adds, its options, and (once built) its LLM front, or why it could not be built."""

    name: str
    group: str                           # "reference", "baseline", "one at a time", "stack"
    layers: tuple[str, ...]
    added: str | None
    spec: Spec
    front: object = None                 # the LLM built for it (validation, warm-up, its model)
    error: str | None = None             # ConfigError: "cannot combine"; other exceptions: "failed"
    failed: bool = False                 # an error that is not a ConfigError (a bug to look at)
    runs: list[dict] = field(default_factory=list)
    tokens: list = field(default_factory=list)       # per run: every request's token ids
    quality: dict = field(default_factory=dict)
    seconds_build: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.runs)

"""One configuration for an engine: :class:`EngineConfig`, its parts, and every refusal in one place.

::

    cfg = EngineConfig(kv=PagedKVConfig(block_size=16), scheduler=SchedulerConfig(max_num_seqs=8),
                       fast=FastPathConfig(compile=True))
    llm = LLM("runs/smollm2", cfg)                     # or LLMEngine(loaded, cfg)
    llm = LLM("runs/smollm2", kv=PagedKVConfig(block_size=16), compile=True)   # the same, by keyword

``EngineConfig()`` is the reference configuration: one request at a time, a contiguous cache per
request, eager steps.  Its parts:

* ``kv``: where KV lives - ``"contiguous"`` (a cache per request, the reference) or a
  :class:`~workbench.kv.paged.PagedKVConfig` (the paged pool with cross-request prefix caching);
* ``scheduler``: a :class:`~workbench.sched.SchedulerConfig`, or None for one request at a time
  (:func:`reference_scheduler` at the model's context);
* ``fast``: :class:`FastPathConfig` - static decode buffers, ``torch.compile``, CUDA graphs;
* ``tiers``: :class:`TierSetup` - a hot / warm / cold cache per request;
* ``quant``: :class:`QuantConfig` - weights quantized in place, and where quantized layers compute;
* ``stream_weights``: a :class:`~workbench.prefetch.weights.WeightStreamConfig`;
* ``memory_budget``: bytes the KV pool, caches and static buffers may take;
* ``load``: :class:`LoadOptions` - how a model folder, preset or the bundled model is loaded.

**Keywords or a config.**  ``LLM(model, **options)`` and ``LLMEngine(model, **options)`` keep the
keyword arguments every notebook, test and script uses (``kv=``, ``scheduler=``, ``compile=``,
``quant=`` ...): they are a thin front that builds the config (:meth:`EngineConfig.from_options`,
which names an unknown keyword and the known ones), as vLLM's ``LLM(model, **kwargs)`` builds its
``EngineArgs``.  Deprecating them would break every reader's first cell for no gain: the config is
what the engine, ``describe`` and the CLI read, and the keywords are one way to write it.  One
difference is kept from before: ``LLMEngine``'s keywords default to the engine's serving set-up (the
default paged pool with prefix caching, ``SchedulerConfig()``), ``LLM``'s and ``EngineConfig()``'s
to the reference.

**Refusals.**  :meth:`EngineConfig.check` decides every combination that cannot work, each with its
reason, in one place; the engine calls it once, after the model is loaded (``LLM`` also calls it
before loading, so a mistake costs no load).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig
from workbench.model.decoder import CausalLM
from workbench.model.loader import parse_dtype, resolve_device
from workbench.prefetch.weights import WeightStreamConfig
from workbench.sched.config import SchedulerConfig
from workbench.engine.loaded import is_compressed

if TYPE_CHECKING:
    from workbench.kv.tier_config import TierConfig

__all__ = ["EngineConfig", "FastPathConfig", "LoadOptions", "QuantConfig", "TierSetup", "TIERS_WITH_POOL",
           "reference_scheduler"]


def reference_scheduler(max_model_len: int) -> SchedulerConfig:
    """One sequence at a time, the whole prompt in one step, requests in arrival order."""
    return SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=max_model_len, chunked_prefill=False,
                           prefix_aware=False, max_queue_len=1 << 30, aging_s=None)


@dataclass
class LoadOptions:
    """How ``LLM`` / ``LLMEngine`` load a model given as a folder, ``"preset:<name>"`` or None (the
    bundled model); see :meth:`workbench.engine.loaded.LoadedModel.load`.  An already loaded model
    has all of these: giving any of them with one is refused."""
    tokenizer: Any = None
    device: Any = None
    dtype: Any = None
    max_model_len: int | None = None
    threads: int | str | None = None
    check_finite: bool = True

    def as_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def given(self) -> dict:
        """The options set to something other than their default (what an already loaded model refuses)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default and f.name != "check_finite"}


@dataclass
class FastPathConfig:
    """Decode steps on static buffers (``static_decode``, eager), ``torch.compile``'d (``compile``: on
    a CPU inductor's C++ for the whole step) and/or captured as CUDA graphs per batch-size bucket
    (``cuda_graphs``); ``batch_invariant``: padded packed steps whose rows do not depend on the batch
    (the eager packed path only; None: the model's default)."""
    static_decode: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    batch_invariant: bool | None = None

    @property
    def static(self) -> bool:
        """Do decode steps run on static buffers (any of the three)?"""
        return bool(self.static_decode or self.compile or self.cuda_graphs)


@dataclass
class TierSetup:
    """A hot / warm / cold cache per request: the policy (:class:`~workbench.kv.tier_config.TierConfig`),
    its fitted PCA ``basis`` (:class:`~workbench.kv.pca.PCABasis`) and, for the physical cache, the
    ``store`` (:class:`~workbench.kv.tiers_physical.TierStore`) whose offload tier holds the full K/V."""
    config: TierConfig
    basis: Any = None
    store: Any = None


@dataclass
class QuantConfig:
    """Weights quantized in place when the engine is built: ``recipe`` a
    :class:`~workbench.quant.recipe.QuantRecipe`, its string (``"w8a8"``) or a recipe file's path;
    ``calibration`` token-id sequences for the schemes that read activations (default: held-out
    windows); ``backend`` where quantized layers compute (``auto``, ``reference``, ...)."""
    recipe: Any = None
    calibration: Any = None
    backend: str = "auto"


# Why tiers and the paged pool do not combine yet (the design and its measured cost: workbench.bench.tier_pool).
TIERS_WITH_POOL = ("{who}: give kv= (the paged pool) or tiers= (a tiered cache), not both: the tiered cache keeps "
                   "a hot / warm / cold cache per sequence, routed on the host at every step, so its blocks are "
                   "not the pool's and cannot be shared; tiers on the pool (hot blocks in the pool, warm / cold "
                   "summaries of the blocks that leave the window) are a design measured by "
                   "workbench.bench.tier_pool, not built")

# keyword argument -> (part, field): what LLM(**options) / LLMEngine(**options) accept
_KEYWORDS = {
    "tokenizer": ("load", "tokenizer"), "device": ("load", "device"), "dtype": ("load", "dtype"),
    "max_model_len": ("load", "max_model_len"), "threads": ("load", "threads"),
    "check_finite": ("load", "check_finite"),
    "static_decode": ("fast", "static_decode"), "compile": ("fast", "compile"),
    "cuda_graphs": ("fast", "cuda_graphs"), "batch_invariant": ("fast", "batch_invariant"),
    "quant": ("quant", "recipe"), "quant_calibration": ("quant", "calibration"),
    "quant_backend": ("quant", "backend"),
    "kv": (None, "kv"), "scheduler": (None, "scheduler"), "stream_weights": (None, "stream_weights"),
    "memory_budget": (None, "memory_budget"),
    "tiers": ("tiers", "config"), "tier_basis": ("tiers", "basis"), "tier_store": ("tiers", "store"),
}


@dataclass
class EngineConfig:
    """Everything that decides how an engine serves (module docstring)."""
    kv: PagedKVConfig | str | None = "contiguous"
    scheduler: SchedulerConfig | None = None
    fast: FastPathConfig = field(default_factory=FastPathConfig)
    tiers: TierSetup | None = None
    quant: QuantConfig = field(default_factory=QuantConfig)
    stream_weights: WeightStreamConfig | None = None
    memory_budget: int | str | None = None
    load: LoadOptions = field(default_factory=LoadOptions)

    # ---- built from keywords -------------------------------------------------------------------
    @classmethod
    def from_options(cls, config: EngineConfig | None = None, who: str = "LLM", serving_defaults: bool = False,
                     **options) -> EngineConfig:
        """``config`` (default :class:`EngineConfig`) with ``options`` - the keyword arguments of
        ``LLM`` / ``LLMEngine`` - written into their parts.  ``serving_defaults`` (``LLMEngine``'s
        keywords): an unset ``kv`` is the default paged pool and an unset ``scheduler``
        ``SchedulerConfig()``.  An unknown keyword is a ConfigError naming the known ones."""
        unknown = sorted(set(options) - set(_KEYWORDS))
        if unknown:
            raise ConfigError(f"{who}: unknown argument{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                              f"known: model, config, {', '.join(_KEYWORDS)}")
        cfg = replace(config) if config is not None else cls(kv=None if serving_defaults else "contiguous")
        cfg.load, cfg.fast, cfg.quant = replace(cfg.load), replace(cfg.fast), replace(cfg.quant)
        tier_parts = {}
        for name, value in options.items():
            part, attr = _KEYWORDS[name]
            if part == "tiers":
                tier_parts[attr] = value
            elif part is None:
                setattr(cfg, attr, value)
            else:
                setattr(getattr(cfg, part), attr, value)
        if tier_parts:
            if tier_parts.get("config") is None:
                if tier_parts.get("store") is not None:
                    raise ConfigError(f"{who}: tier_store= is where a tiered cache keeps its blocks; give tiers= too")
            else:
                cfg.tiers = TierSetup(**tier_parts)
        if cfg.tiers is not None:
            if not isinstance(cfg.kv, PagedKVConfig):
                cfg.kv = None                # a tiered cache per request (a pool with it: refused by check)
        elif cfg.kv is None:                 # LLMEngine(kv=None): the default pool; LLM(kv=None): the reference
            cfg.kv = PagedKVConfig() if serving_defaults else "contiguous"
        if serving_defaults and cfg.scheduler is None:
            cfg.scheduler = SchedulerConfig()
        return cfg

    # ---- derived -------------------------------------------------------------------------------
    @property
    def kv_mode(self) -> str:
        """"paged", "contiguous" or "tiered" (after :meth:`check`)."""
        if self.tiers is not None:
            return "tiered"
        return "contiguous" if isinstance(self.kv, str) else "paged"

    @property
    def paged(self) -> PagedKVConfig | None:
        """The paged pool's config (None: KV lives in a cache per request)."""
        return self.kv if isinstance(self.kv, PagedKVConfig) else None

    def scheduler_for(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's config: the one given, or one request at a time (the reference)."""
        return self.scheduler if self.scheduler is not None else reference_scheduler(max_model_len)

    def memory_args(self, scheduler: SchedulerConfig) -> dict:
        """What :func:`workbench.engine.sizing.engine_memory_plan` reads of this config."""
        t = self.tiers
        return dict(kv=self.kv, scheduler=scheduler, tiers=t.config if t else None, tier_store=t.store if t else None,
                    static_decode=self.fast.static, memory_budget=self.memory_budget)

    # ---- every refusal, once -------------------------------------------------------------------
    def check(self, who: str = "LLMEngine", model=None, device=None, runner=None, loaded: bool = False,
              quantized: bool | None = None) -> None:
        """Refuse a combination that cannot work, with its reason (a ConfigError).  Each argument
        is a fact known at the call: ``model`` as given (a folder, preset, None or a loaded one),
        ``device`` the model's (loaded, or where the loader will put it), ``runner`` a custom runner,
        ``loaded`` whether the model was loaded before this engine (so loading options cannot apply
        to it), ``quantized`` whether the loaded model's layers are quantized.  Rules whose facts are
        not given are skipped (``LLM`` checks before the load, the engine after it)."""
        kv, fast, tiers = self.kv, self.fast, self.tiers
        if self.stream_weights is not None and not isinstance(self.stream_weights, WeightStreamConfig):
            raise ConfigError(f"{who}: stream_weights must be a WeightStreamConfig, got "
                              f"{type(self.stream_weights).__name__}")
        if tiers is not None and isinstance(kv, PagedKVConfig):
            raise ConfigError(TIERS_WITH_POOL.format(who=who))
        if tiers is None and not (kv == "contiguous" or isinstance(kv, PagedKVConfig)):
            got = repr(kv) if isinstance(kv, str) or kv is None else type(kv).__name__
            raise ConfigError(f"{who}: kv must be a PagedKVConfig, 'contiguous' or None, got {got}")
        mode = self.kv_mode
        sched = self.scheduler
        if mode != "paged" and sched is not None and sched.preemption_mode == "swap":
            raise ConfigError(f"{who}: preemption_mode='swap' needs the paged pool; the {mode} KV cache is kept "
                              "per sequence and is recomputed after preemption (use preemption_mode='recompute')")
        if runner is not None and mode != "paged":
            raise ConfigError(f"{who}: a custom runner needs the paged pool (kv=PagedKVConfig), not {mode} KV")
        if model is not None and self.quant.recipe is not None and is_compressed(model):
            raise ConfigError(f"{who}: {model} is a quantized checkpoint (compressed-tensors) already; drop quant= "
                              "(its layers run as stored; quant_backend= chooses where they compute)")
        if quantized is False and self.quant.recipe is not None:
            raise ConfigError(f"{who}: quant={self.quant.recipe!r} quantizes weights as a model is loaded; give it "
                              "to LLM(...) (LLMEngine serves a model as it is: quantize it first, or pass the LLM)")
        if loaded:
            given = self.load.given()
            if given:
                got = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise ConfigError(f"{who}: {got} cannot be applied to a model that is already loaded (an LLM or "
                                  f"LoadedModel); pass {'/'.join(given)} to LLM(...) instead, or pass a model "
                                  "folder, preset or None")
        if isinstance(model, CausalLM):
            self._check_model_object(who, model)
        if fast.static:
            self._check_fast_paths(who, device, runner)

    def _check_model_object(self, who: str, model: CausalLM) -> None:
        """A CausalLM object is served where it is and as it is: a device or dtype other than its own is
        refused (it was silently kept before)."""
        w = model.lm_head.weight
        want_dev = None if self.load.device is None else resolve_device(self.load.device)
        want_dtype = parse_dtype(self.load.dtype)
        if want_dev is not None and (want_dev.type, want_dev.index or 0) != (w.device.type, w.device.index or 0):
            raise ConfigError(f"{who}: device={self.load.device!r} for a model object that is on {w.device}; move it "
                              "first (model.to(...)) or pass a model folder, preset or None")
        if want_dtype is not None and want_dtype != w.dtype:
            raise ConfigError(f"{who}: dtype={self.load.dtype!r} for a model object in {w.dtype}; convert it first "
                              "(model.to(dtype)) or pass a model folder, preset or None")

    def _check_fast_paths(self, who: str, device, runner) -> None:
        """static decode / compile / CUDA graphs run decode steps on static buffers: contiguous rows
        or the paged pool, without ``batch_invariant``."""
        fast = self.fast
        if fast.cuda_graphs and device is not None and device.type != "cuda":
            raise ConfigError(f"{who}: cuda_graphs=True needs a CUDA device; the model is on {device} "
                              "(compile=True is the CPU's whole-step fast path)")
        if runner is not None:
            raise ConfigError(f"{who}: compile / cuda_graphs bring their own runner; do not pass runner=")
        if self.kv_mode == "tiered":
            raise ConfigError(f"{who}: compile / cuda_graphs run decode steps over static buffers (contiguous rows "
                              "or the paged pool); the tiered cache keeps a hot / warm / cold cache per sequence "
                              "whose routing picks blocks per step on the host, which no static step can replay "
                              "(use kv=PagedKVConfig or 'contiguous' with compile, or tiers= without it)")
        if fast.batch_invariant:
            raise ConfigError(f"{who}: batch_invariant=True is a property of the eager packed path; static "
                              "decode steps attend over whole buffer rows (leave batch_invariant unset)")


"""How an :class:`~workbench.engine.core.LLMEngine` is set up from its
:class:`~workbench.engine.config.EngineConfig` (which refuses what cannot work): the model it
serves (:func:`resolve_model`), the pool and the runner its mode needs (:func:`make_pool`,
:func:`make_runner`), and :func:`describe`, the configuration in one line.  Also :func:`describe_error`, the
one line a failed request's error says.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import torch

from workbench.engine.caches import ContiguousCaches, PhysicalTieredCaches, TieredCaches
from workbench.engine.config import LoadOptions
from workbench.engine.loaded import LoadedModel
from workbench.engine.runners import ContiguousRunner, ModelRunner, PagedStaticRunner, StaticRunner, custom_runner
from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig, PagedKVPool
from workbench.sched.config import SchedulerConfig
from workbench.engine.sizing import default_pool_tokens
from workbench.kv.tiers import apply_tiered_attention
from workbench.transforms.backends import current_backends
from workbench.quant.apply import QuantLinear
from workbench.prefetch.weights import stream_weights, weight_streamer

if TYPE_CHECKING:
    from workbench.engine.core import LLMEngine


def resolve_model(model, load: LoadOptions) -> tuple:
    """``(base, loaded)``: what ``LLMEngine(model=...)`` serves - ``model`` itself with its
    :class:`LoadedModel` when it is one (or an ``LLM``, whose model is shared; loading options given
    with it are refused by :meth:`EngineConfig.check`), else a model loaded with ``load``."""
    loaded = getattr(model, "loaded", model)
    if isinstance(loaded, LoadedModel):
        return model, loaded
    loaded = LoadedModel.load(model, **load.as_kwargs())
    return loaded, loaded


def make_pool(model, kv_mode: str, kv: PagedKVConfig | None, config: SchedulerConfig,
              max_model_len: int, static_decode: bool = False, memory_budget: int | None = None) -> PagedKVPool:
    """The paged pool (``kv`` or the default config), sized by default for ``config``'s batch
    (:func:`~workbench.engine.sizing.default_pool_tokens`); with a cache per sequence a pool
    without tensors that only counts blocks (admission, preemption, inspectors)."""
    w = model.lm_head.weight
    default_tokens = default_pool_tokens(kv_mode, config, max_model_len)
    if kv_mode == "paged":
        return PagedKVPool(model.config, kv or PagedKVConfig(), w.device, w.dtype, default_tokens,
                           scratch_blocks=1 if static_decode else 0,   # static steps' padding rows write there
                           memory_budget=memory_budget)
    return PagedKVPool(model.config, PagedKVConfig(enable_prefix_caching=False), w.device,
                       w.dtype, default_tokens, tensors=False)


def make_runner(engine: LLMEngine, batch_invariant, custom=None):
    """The runner of ``engine``'s mode: static buffers, the paged pool, or a cache per sequence
    (contiguous, or tiered: the model's attention is switched to the tiered policy in place).
    ``custom``: a runner to use instead, or a callable making one from the engine's pool."""
    model, pool, config = engine.model, engine.pool, engine.scheduler.config
    if custom is not None:
        return custom_runner(custom, pool)
    if engine.static_decode:
        static = PagedStaticRunner if engine.kv_mode == "paged" else StaticRunner
        return static(model, pool, engine.max_model_len, config.max_num_seqs,
                      compile=engine.compiled, cuda_graphs=engine.cuda_graphs)
    if engine.kv_mode == "paged":
        return ModelRunner(model, pool, batch_invariant, direct=config.max_num_seqs == 1)
    w = model.lm_head.weight
    where = {"config": model.config, "device": w.device, "dtype": w.dtype}
    if engine.kv_mode != "tiered":
        caches = ContiguousCaches(**where)
    else:
        tiers = {"tiers": engine.tiers, "basis": engine.tier_basis}
        if engine.tier_store is None:
            caches = TieredCaches(**where, **tiers)
        else:
            engine.tier_prefetcher = engine.tier_store.make_prefetcher(w.device)
            caches = PhysicalTieredCaches(**where, **tiers, store=engine.tier_store, prefetcher=engine.tier_prefetcher)
        apply_tiered_attention(model)                                    # other caches keep the exact path
    return ContiguousRunner(model, pool, caches, direct=config.max_num_seqs == 1, batch_invariant=batch_invariant)


def describe(engine: LLMEngine) -> str:
    """One line: the configuration that serves requests (metrics rows, /metrics, x-model-info)."""
    cfg = engine.scheduler.config
    parts = [describe_kv(engine), f"seqs={cfg.max_num_seqs}"]
    if cfg.max_num_seqs > 1 or cfg.chunked_prefill and cfg.max_num_batched_tokens < engine.max_model_len:
        parts.append(f"tokens={cfg.max_num_batched_tokens}" + (" chunked" if cfg.chunked_prefill else ""))
    fast = engine.config.fast
    static_only = fast.static and not (fast.compile or fast.cuda_graphs)
    parts += [name for name, on in (("static-decode", static_only), ("compile", fast.compile),
                                    ("cuda-graphs", fast.cuda_graphs)) if on]
    if engine.weight_streamer is not None:
        parts.append(engine.weight_streamer.describe())
    if getattr(engine.model, "recipe", None) is not None:
        parts.append(describe_quant(engine.model))
    ops = {op: b for op, b in current_backends(engine.model).items() if b != "eager"}
    if ops:
        parts.append("backends " + ",".join(f"{op}={b}" for op, b in ops.items()))
    return " ".join(parts)


def describe_quant(model) -> str:
    """``quant <recipe>``, the layers whose group fell back, where the layers compute."""
    out = f"quant {model.recipe.name}"
    falls: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.settings.get("fallback"):
            falls[mod.settings["fallback"]] = falls.get(mod.settings["fallback"], 0) + 1
    if falls:
        out += " (" + ", ".join(f"{n} layers {f}" for f, n in falls.items()) + ")"
    pl = getattr(model, "quant_backend", None)
    if pl:
        out += " on " + ",".join(f"{b}={n}" for b, n in pl["layers"].items())
    return out


def describe_kv(engine: LLMEngine) -> str:
    """One line: where ``engine`` keeps KV (metrics rows, headers)."""
    mode = engine.config.kv_mode
    if mode == "paged":
        c = engine.pool.config
        extra = (" prefix-cache" if c.enable_prefix_caching else "") + (f" offload={c.offload}" if c.offload else "")
        extra += f" swap={c.swap_space}" if c.swap_space else ""
        extra += f" lookahead={c.effective_lookahead}" if c.effective_lookahead else ""
        return f"paged bs={c.block_size} blocks={engine.pool.num_blocks}{extra}"
    if mode == "tiered":
        tiers = engine.config.tiers
        return f"tiered {tiers.config.name} " + (tiers.store.name if tiers.store is not None else "accounted")
    return "contiguous"


def describe_values(engine: LLMEngine) -> dict:
    """The configuration as plain values (``/metrics`` labels, ``x-model-info``)."""
    st = engine.weight_streamer
    fast = engine.config.fast
    return {"config": engine.describe(), "kv": engine.config.kv_mode, "static_decode": fast.static,
            "compile": bool(fast.compile), "cuda_graphs": bool(fast.cuda_graphs),
            "sampling": current_backends(engine.model).get("sampling", "eager"),
            "stream_weights": st.describe() if st is not None else "off",
            "quant": recipe.name if (recipe := getattr(engine.model, "recipe", None)) is not None else "off"}


def install_weight_streaming(model, config):
    """The model's :class:`~workbench.prefetch.weights.WeightStreamer` for ``config`` (None: none
    is installed, and a model that already streams keeps streaming).  A model that already streams
    with other settings is a ConfigError (its weights are shared with another engine)."""
    current = weight_streamer(model)
    if config is None:
        return current
    if current is not None:
        if current.config != config:
            raise ConfigError(f"LLMEngine: this model already streams its weights ({current.describe()}); "
                              "one model has one streaming schedule - load another copy, or remove() it first")
        return current
    return stream_weights(model, config)


def prefetch_stats(engine) -> dict:
    """The prefetch layer's counters: weight streaming and the KV pool's fetches (each None when off)."""
    st = engine.weight_streamer
    pool_stats = getattr(engine.pool, "prefetch_stats", None)
    tiers = getattr(engine, "tier_prefetcher", None)
    return {"weights": st.stats() if st is not None else None,
            "kv": pool_stats() if pool_stats is not None else None,
            "tiers": tiers.stats() if tiers is not None else None}


def kv_memory(engine) -> dict | None:
    """Measured resident KV bytes of the live physical tiered caches, per zone, each storage
    counted once (the shared PCA basis once), next to the formula; on CUDA also
    ``torch.cuda.memory_allocated`` (the whole process).  None for other KV layouts."""
    if engine.kv_mode != "tiered" or engine.tier_store is None:
        return None
    seen: set = set()
    zones = ("hot", "warm", "cold", "basis", "staging")
    out = {"sequences": 0, "measured": dict.fromkeys(zones, 0), "formula": dict.fromkeys(zones[:4], 0),
           "full": 0, "offloaded": 0}
    for cache in list(engine.active_caches.values()):
        mem = cache.memory(seen)
        out["sequences"] += 1
        for z in zones:
            out["measured"][z] += mem["measured"][z]
        for z in zones[:3]:
            out["formula"][z] += mem["formula"][z]
        out["formula"]["basis"] = max(out["formula"]["basis"], mem["formula"]["basis"])   # shared: once
        out["full"] += mem["full"]
        out["offloaded"] += mem["offloaded"]
    out["resident_kv"] = sum(out["measured"][z] for z in zones[:4])
    out["formula_kv"] = sum(out["formula"][z] for z in zones[:4])
    dev = engine.model.lm_head.weight.device
    out["cuda_allocated"] = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    return out


def describe_error(e: BaseException) -> str:
    """``TypeName: message`` of an exception, one line (what a request's error says)."""
    return "".join(traceback.format_exception_only(type(e), e)).strip()

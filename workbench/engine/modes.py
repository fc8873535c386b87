"""How an :class:`~workbench.engine.core.LLMEngine` is set up: the model it serves
(:func:`resolve_model`) and the modes it runs in, where KV lives ("paged", "contiguous",
"tiered") and the static-decode fast paths (static buffers, compile, CUDA graphs).  A
combination that cannot work is a :class:`ConfigError` saying why (:func:`kv_mode`,
:func:`check_fast_paths`); :func:`make_pool` and :func:`make_runner` build the pool and the
runner a mode needs; :func:`describe` says it in one line.  Also :func:`describe_error`, the
one line a failed request's error says.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import torch

from workbench.engine.loaded import LoadedModel
from workbench.engine.runners import ContiguousRunner, ModelRunner, PagedStaticRunner, StaticRunner
from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig, PagedKVPool
from workbench.model.kv_cache import KVCache
from workbench.sched.config import SchedulerConfig

if TYPE_CHECKING:
    from workbench.engine.core import LLMEngine


def resolve_model(model, **loading) -> tuple:
    """``(base, loaded)``: what ``LLMEngine(model=...)`` serves - ``model`` itself with its
    :class:`LoadedModel` when it is one (or an ``LLM``, whose model is shared), else a model
    loaded with ``loading`` (tokenizer, device, dtype, max_model_len, threads; None: defaults)."""
    loaded = getattr(model, "loaded", model)
    if isinstance(loaded, LoadedModel):
        # these configure the loading of a model; a loaded one has them already
        given = {name: v for name, v in loading.items() if v is not None}
        if given:
            got = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ConfigError(f"LLMEngine: {got} cannot be applied to an already loaded LLM; pass "
                              f"{'/'.join(given)} to LLM(...) instead, or pass a model folder, preset or None")
        return model, loaded
    loaded = LoadedModel.load(model, **loading)
    return loaded, loaded


# Why tiers and the paged pool do not combine yet (the design and its measured cost: workbench.bench.tier_pool).
TIERS_WITH_POOL = ("{who}: give kv= (the paged pool) or tiers= (a tiered cache), not both: the tiered cache keeps "
                   "a hot / warm / cold cache per sequence, routed on the host at every step, so its blocks are "
                   "not the pool's and cannot be shared; tiers on the pool (hot blocks in the pool, warm / cold "
                   "summaries of the blocks that leave the window) are a design measured by "
                   "workbench.bench.tier_pool, not built")


def kv_mode(kv, tiers, config: SchedulerConfig, runner) -> str:
    """"paged", "contiguous" or "tiered", or a ConfigError saying why the combination cannot work."""
    if tiers is not None:
        if kv is not None:
            raise ConfigError(TIERS_WITH_POOL.format(who="LLMEngine"))
        mode = "tiered"
    elif isinstance(kv, str):
        if kv != "contiguous":
            raise ConfigError(f"LLMEngine: kv must be a PagedKVConfig, 'contiguous' or None, got {kv!r}")
        mode = "contiguous"
    elif kv is None or isinstance(kv, PagedKVConfig):
        mode = "paged"
    else:
        raise ConfigError(f"LLMEngine: kv must be a PagedKVConfig, 'contiguous' or None, got {type(kv).__name__}")
    if mode != "paged" and config.preemption_mode == "swap":
        raise ConfigError(f"LLMEngine: preemption_mode='swap' needs the paged pool; the {mode} KV cache is kept "
                          "per sequence and is recomputed after preemption (use preemption_mode='recompute')")
    if mode != "paged" and runner is not None:
        raise ConfigError(f"LLMEngine: a custom runner needs the paged pool (kv=PagedKVConfig), not {mode} KV")
    return mode


def check_fast_paths(kv_mode: str, model, cuda_graphs: bool, runner, batch_invariant=None) -> None:
    """static decode / compile / CUDA graphs run decode steps on static buffers: contiguous rows
    (:class:`~workbench.engine.runners.StaticRunner`) or the paged pool
    (:class:`~workbench.engine.runners.PagedStaticRunner`), without ``batch_invariant``."""
    if cuda_graphs and model.device.type != "cuda":
        raise ConfigError(f"LLMEngine: cuda_graphs=True needs a CUDA device; the model is on {model.device} "
                          "(compile=True is the CPU's whole-step fast path)")
    if runner is not None:
        raise ConfigError("LLMEngine: compile / cuda_graphs bring their own runner; do not pass runner=")
    if kv_mode == "tiered":
        raise ConfigError("LLMEngine: compile / cuda_graphs run decode steps over static buffers (contiguous rows or "
                          "the paged pool); the tiered cache keeps a hot / warm / cold cache per sequence whose "
                          "routing picks blocks per step on the host, which no static step can replay (use kv= "
                          "PagedKVConfig or 'contiguous' with compile, or tiers= without it)")
    if batch_invariant:
        raise ConfigError("LLMEngine: batch_invariant=True is a property of the eager packed path; static "
                          "decode steps attend over whole buffer rows (leave batch_invariant unset)")


def make_pool(model, kv_mode: str, kv: PagedKVConfig | None, config: SchedulerConfig,
              max_model_len: int, static_decode: bool = False, memory_budget: int | None = None) -> PagedKVPool:
    """The paged pool (``kv`` or the default config), sized by default for ``config``'s batch
    (:func:`~workbench.engine.sizing.default_pool_tokens`); with a cache per sequence a pool
    without tensors that only counts blocks (admission, preemption, inspectors)."""
    from workbench.engine.sizing import default_pool_tokens

    w = model.lm_head.weight
    default_tokens = default_pool_tokens(kv_mode, config, max_model_len)
    if kv_mode == "paged":
        return PagedKVPool(model.config, kv or PagedKVConfig(), w.device, w.dtype, default_tokens,
                           scratch_blocks=1 if static_decode else 0,   # static steps' padding rows write there
                           memory_budget=memory_budget)
    return PagedKVPool(model.config, PagedKVConfig(enable_prefix_caching=False), w.device,
                       w.dtype, default_tokens, tensors=False)


def make_runner(engine: LLMEngine, batch_invariant):
    """The runner of ``engine``'s mode: static buffers, the paged pool, or a cache per sequence
    (contiguous, or tiered: the model's attention is switched to the tiered policy in place)."""
    model, pool, config = engine.model, engine.pool, engine.config
    if engine.static_decode and engine.kv_mode == "paged":
        return PagedStaticRunner(model, pool, engine.max_model_len, config.max_num_seqs,
                                 compile=engine.compiled, cuda_graphs=engine.cuda_graphs)
    if engine.static_decode:
        return StaticRunner(model, pool, engine.max_model_len, config.max_num_seqs,
                            compile=engine.compiled, cuda_graphs=engine.cuda_graphs)
    if engine.kv_mode == "paged":
        return ModelRunner(model, pool, batch_invariant, direct=config.max_num_seqs == 1)
    w = model.lm_head.weight
    cfg = model.config
    if engine.kv_mode == "tiered":
        from workbench.kv.tiers import TieredKVCache, apply_tiered_attention

        tiers, basis, store = engine.tiers, engine.tier_basis, engine.tier_store
        if store is None:
            TieredKVCache(cfg, tiers, basis, max_len=1)                  # validate now, not per request

            def make(n):
                return TieredKVCache(cfg, tiers, basis, max_len=n, device=w.device, dtype=w.dtype)
        else:
            from workbench.kv.tiers_physical import PhysicalTieredKVCache

            pf = engine.tier_prefetcher = store.make_prefetcher(w.device)
            PhysicalTieredKVCache(cfg, tiers, basis, store=store, prefetcher=pf, max_len=1).release()

            def make(n):
                return PhysicalTieredKVCache(cfg, tiers, basis, store=store, prefetcher=pf, max_len=n,
                                             device=w.device, dtype=w.dtype)
        apply_tiered_attention(model)                                    # other caches keep the exact path
    else:
        def make(n):
            return KVCache(cfg, 1, n, device=w.device, dtype=w.dtype)
    return ContiguousRunner(model, pool, make, direct=config.max_num_seqs == 1,
                            batch_invariant=batch_invariant, keep_last=engine.kv_mode == "tiered")


def describe(engine: LLMEngine) -> str:
    """One line: the configuration that serves requests (metrics rows, /metrics, x-model-info)."""
    from workbench.transforms.backends import current_backends

    cfg = engine.config
    parts = [describe_kv(engine), f"seqs={cfg.max_num_seqs}"]
    if cfg.max_num_seqs > 1 or cfg.chunked_prefill and cfg.max_num_batched_tokens < engine.max_model_len:
        parts.append(f"tokens={cfg.max_num_batched_tokens}" + (" chunked" if cfg.chunked_prefill else ""))
    static_only = engine.static_decode and not (engine.compiled or engine.cuda_graphs)
    parts += [name for name, on in (("static-decode", static_only), ("compile", engine.compiled),
                                    ("cuda-graphs", engine.cuda_graphs)) if on]
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
    from workbench.quant.apply import QuantLinear

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
    if engine.kv_mode == "paged":
        c = engine.pool.config
        extra = (" prefix-cache" if c.enable_prefix_caching else "") + (f" offload={c.offload}" if c.offload else "")
        extra += f" swap={c.swap_space}" if c.swap_space else ""
        extra += f" lookahead={c.effective_lookahead}" if c.effective_lookahead else ""
        return f"paged bs={c.block_size} blocks={engine.pool.num_blocks}{extra}"
    if engine.kv_mode == "tiered":
        store = engine.tier_store
        return f"tiered {engine.tiers.name} " + (store.name if store is not None else "accounted")
    return "contiguous"


def describe_values(engine: LLMEngine) -> dict:
    """The configuration as plain values (``/metrics`` labels, ``x-model-info``)."""
    from workbench.transforms.backends import current_backends

    st = engine.weight_streamer
    return {"config": engine.describe(), "kv": engine.kv_mode, "static_decode": engine.static_decode,
            "compile": engine.compiled, "cuda_graphs": engine.cuda_graphs,
            "sampling": current_backends(engine.model).get("sampling", "eager"),
            "stream_weights": st.describe() if st is not None else "off",
            "quant": recipe.name if (recipe := getattr(engine.model, "recipe", None)) is not None else "off"}


def install_weight_streaming(model, config):
    """The model's :class:`~workbench.prefetch.weights.WeightStreamer` for ``config`` (None: none
    is installed, and a model that already streams keeps streaming).  A model that already streams
    with other settings is a ConfigError (its weights are shared with another engine)."""
    from workbench.prefetch.weights import WeightStreamConfig, stream_weights, weight_streamer

    current = weight_streamer(model)
    if config is None:
        return current
    if not isinstance(config, WeightStreamConfig):
        raise ConfigError(f"LLMEngine: stream_weights must be a WeightStreamConfig, got {type(config).__name__}")
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

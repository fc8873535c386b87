"""What an engine is about to allocate, computed from its configuration before anything is
allocated, and refused in one line when it does not fit (:mod:`workbench.measure.allocation`).

The figures come from the same shapes the allocations use:

* the paged pool (:class:`~workbench.kv.paged.PagedKVPool`): ``num_blocks`` (given, from
  ``kv_cache_bytes``, or by default ``max_num_seqs x min(max_model_len, 2048)`` tokens;
  one request at a time: ``4 x max_model_len``) x the bytes of one block, every layer, K and V;
* its offload tier: ``offload_blocks`` blocks in host memory or in a file (the file system's
  free space), plus the staging buffers of the KV prefetch;
* a cache per sequence (contiguous, or the accounted tiered cache with its warm / int8 copies):
  ``max_num_seqs`` requests of up to ``max_model_len`` tokens each - the worst case the scheduler
  admits, allocated as requests arrive, so an engine that cannot hold it is refused up front
  rather than killed by the OOM killer when traffic reaches it;
* static decode buffers (``compile`` / ``cuda_graphs`` / ``static_decode``): ``max_num_seqs + 1``
  contiguous rows of ``max_model_len`` tokens (on the pool: block tables of ``max_model_len``).

The physical tiered cache grows with its resident zones and keeps the rest in its store's tier;
it preallocates nothing that scales with the context, so it is not planned here.

Every item names the setting that makes it smaller, by its API name and its command-line flag.
:func:`context_length` is the other half of sizing: ``max_model_len`` above the model's context
is an error (it used to be clamped silently to ``max_position_embeddings``).
"""

from __future__ import annotations

from workbench.errors import ConfigError, WorkbenchError
from workbench.kv.layout import KVLayout, dtype_bytes
from workbench.measure.allocation import MemoryPlan, format_bytes, parse_bytes
import os
import tempfile
from workbench.kv.paged import PagedKVConfig, pool_num_blocks
from workbench.sched.config import SchedulerConfig
from workbench.model.decoder import CausalLM
from workbench.model.loader import default_dtype, model_config, parse_dtype, resolve_device

# the API name and the flag of each setting a refusal names
NUM_BLOCKS = "PagedKVConfig.num_blocks / --num-blocks"
KV_CACHE_BYTES = "PagedKVConfig.kv_cache_bytes"
MAX_NUM_SEQS = "SchedulerConfig.max_num_seqs / --max-num-seqs"
MAX_MODEL_LEN = "max_model_len / --max-model-len"
OFFLOAD_BLOCKS = "PagedKVConfig.offload_blocks / --offload-blocks"
PREFETCH_BLOCKS = "PagedKVConfig.prefetch_blocks (or lookahead)"
BLOCK_SIZE = "PagedKVConfig.block_size / --block-size"
DEFAULT_SEQ_TOKENS = 2048      # a default pool holds max_num_seqs sequences of up to this many tokens


def context_length(cfg, max_model_len=None, who: str = "max_model_len") -> int:
    """The context an engine serves: ``max_model_len``, or the model's own
    (``max_position_embeddings``) when None.  Above the model's context is a ConfigError naming
    both numbers: positions past it were never trained (RoPE extrapolates, quality collapses),
    and every cache is sized by it - so it is refused, not clamped."""
    limit = cfg.max_position_embeddings
    if max_model_len is None:
        return limit
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ConfigError(f"{who}={max_model_len!r} (--max-model-len) must be an integer >= 2 (a prompt token and "
                          "a generated one), or None for the model's context")
    if max_model_len > limit:
        raise ConfigError(f"{who}={max_model_len:,} (--max-model-len) is more than the model's context: "
                          f"max_position_embeddings {limit:,} in its config; give at most {limit:,} (or leave it "
                          "out: the model's own)")
    return max_model_len


def default_pool_tokens(kv_mode: str, config, max_model_len: int) -> int:
    """Tokens a pool holds by default.  Paged: one request at a time gets room for it and cached
    prefixes of 3 more; a batch, ``max_num_seqs`` sequences of up to 2048 tokens.  A cache per
    sequence (no tensors in the pool, blocks only counted): ``max_num_seqs`` whole contexts."""
    if kv_mode != "paged":
        return config.max_num_seqs * max_model_len
    if config.max_num_seqs == 1:
        return 4 * max_model_len
    return config.max_num_seqs * min(max_model_len, DEFAULT_SEQ_TOKENS)


def _mode(kv, tiers) -> str:
    if tiers is not None:
        return "tiered"
    return "contiguous" if isinstance(kv, str) else "paged"


def _layout_text(layout: KVLayout) -> str:
    return (f"{layout.block_size} tokens x {layout.num_layers} layers x K,V x {layout.num_kv_heads} KV heads x "
            f"{layout.head_dim} x {layout.dtype_bytes} bytes")


def _token_text(cfg, e: int) -> str:
    return f"{cfg.num_hidden_layers} layers x K,V x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} x {e} bytes"


def engine_memory_plan(cfg, device, dtype, kv=None, scheduler=None, max_model_len: int | None = None,
                       tiers=None, tier_store=None, static_decode: bool = False,
                       memory_budget=None) -> MemoryPlan:
    """The :class:`MemoryPlan` of an engine over a model of config ``cfg`` on ``device`` in
    ``dtype`` (what ``LLMEngine`` would allocate for these arguments; see the module docstring).
    Checks the settings' ranges on the way (``block_size`` above the model's context); call
    :meth:`MemoryPlan.check` to compare it with the machine and ``memory_budget``."""
    config = scheduler or SchedulerConfig()
    ctx = context_length(cfg, max_model_len)
    budget = parse_bytes(memory_budget, "memory_budget (--memory-budget)")
    plan = MemoryPlan(budget=budget)
    e = dtype_bytes(dtype)
    dev = str(device)
    mode = _mode(kv, tiers)
    seqs = config.max_num_seqs
    per_token = KVLayout.from_model_config(cfg, 1, dtype).bytes_per_token
    if mode == "paged":
        paged = kv if isinstance(kv, PagedKVConfig) else PagedKVConfig()
        longest = max(cfg.max_position_embeddings, PagedKVConfig.block_size)   # 16 fits any model
        if paged.block_size > longest:
            raise ConfigError(f"PagedKVConfig.block_size={paged.block_size:,} (--block-size) is more than the model's "
                              f"context (max_position_embeddings {cfg.max_position_embeddings:,}): no request can "
                              f"fill one block, and each is allocated whole; give at most {longest:,} (16 is the "
                              "default)")
        layout = KVLayout.from_model_config(cfg, paged.block_size, dtype)
        scratch = 1 if static_decode else 0
        tokens = default_pool_tokens(mode, config, ctx)
        blocks = pool_num_blocks(layout, paged, tokens, scratch)
        fix = ""
        if paged.num_blocks is not None:
            source, flag = f"{blocks:,} blocks (num_blocks)", NUM_BLOCKS
        elif paged.kv_cache_bytes is not None:
            source, flag = f"{blocks:,} blocks (kv_cache_bytes)", KV_CACHE_BYTES
        else:
            per_seq = ("4 x max_model_len" if seqs == 1
                       else f"max_num_seqs {seqs:,} x {min(ctx, DEFAULT_SEQ_TOKENS):,}")
            source = f"{blocks:,} blocks ({per_seq} tokens / block_size {paged.block_size})"
            flag = MAX_NUM_SEQS if seqs > 1 else MAX_MODEL_LEN
            fix = f"{flag} lower, or give {NUM_BLOCKS}"
        stored = blocks + scratch
        plan.add("KV pool", stored * layout.bytes_per_block, flag,
                 f"{source}{' + 1 scratch' if scratch else ''} x {format_bytes(layout.bytes_per_block)} a block "
                 f"({_layout_text(layout)})", dev, fix)
        lookahead = paged.effective_lookahead
        staging = paged.prefetch_blocks if paged.prefetch_blocks is not None else 16 * lookahead
        host = "cpu"
        if paged.offload is not None:
            where = host if paged.offload == "host" else _disk_place(paged.offload_path)
            plan.add(f"KV offload tier ({paged.offload})", paged.offload_blocks * layout.bytes_per_block,
                     OFFLOAD_BLOCKS, f"{paged.offload_blocks:,} blocks x {format_bytes(layout.bytes_per_block)}",
                     where)
        tiers_n = (paged.offload is not None) + (paged.swap_space is not None)
        if staging and tiers_n:
            plan.add("KV prefetch staging", tiers_n * staging * layout.bytes_per_block, PREFETCH_BLOCKS,
                     f"{tiers_n} tier(s) x {staging:,} blocks x {format_bytes(layout.bytes_per_block)}",
                     dev if dev.startswith("cuda") else host)
        if static_decode:
            width = -(-ctx // paged.block_size)
            rows = sum(static_buckets(seqs))
            plan.add("static decode inputs", rows * (width * 4 + 40), MAX_NUM_SEQS,
                     f"block tables of {rows:,} rows (buckets up to max_num_seqs {seqs:,}) x {width:,} blocks", dev)
            plan.add("rotary tables", _rope_bytes(cfg, width * paged.block_size), MAX_MODEL_LEN,
                     f"cos / sin of {width * paged.block_size:,} positions", dev)
        return plan
    # a cache per sequence
    per_seq_flag = MAX_MODEL_LEN if seqs == 1 else f"{MAX_NUM_SEQS} or {MAX_MODEL_LEN}"
    if static_decode and mode == "contiguous":    # StaticRunner: max_num_seqs rows + a scratch row, masks per bucket
        rows = seqs + 1
        plan.add("static decode buffers", rows * ctx * per_token, per_seq_flag,
                 f"{rows:,} rows (max_num_seqs {seqs:,} + 1 scratch) x max_model_len {ctx:,} tokens x "
                 f"{format_bytes(per_token)} a token ({_token_text(cfg, e)})", dev)
        plan.add("static decode masks", sum(static_buckets(seqs)) * ctx + _rope_bytes(cfg, ctx), per_seq_flag,
                 f"attention masks of every batch bucket up to {seqs:,} x {ctx:,} positions", dev)
        return plan
    if mode == "tiered" and tier_store is None:
        tok = _tiered_token_bytes(cfg, tiers, e)
        plan.add("tiered KV caches", seqs * ctx * tok, per_seq_flag,
                 f"max_num_seqs {seqs:,} x max_model_len {ctx:,} tokens x {format_bytes(tok)} a token (full K/V "
                 "and the warm / int8 copies, every layer)", dev)
    elif mode == "contiguous":
        plan.add("contiguous KV caches", seqs * ctx * per_token, per_seq_flag,
                 f"max_num_seqs {seqs:,} x max_model_len {ctx:,} tokens x {format_bytes(per_token)} a token "
                 f"({_token_text(cfg, e)})", dev)
    return plan


def static_buckets(max_seqs: int) -> list[int]:
    """The static runners' batch-size buckets: 1, 2, 4, ... up to ``max_seqs``."""
    return sorted({min(1 << i, max_seqs) for i in range(max_seqs.bit_length() + 1)})


def _rope_bytes(cfg, positions: int) -> int:
    """cos and sin, fp32, of the next power of two >= ``positions`` (the rotary table's growth)."""
    return 2 * (1 << max(positions - 1, 1).bit_length()) * cfg.head_dim * 4


def _tiered_token_bytes(cfg, tiers, e: int) -> int:
    """Bytes a token takes in an accounted :class:`~workbench.kv.tiers.TieredKVCache` (every
    layer): full K and V, the warm keys' reconstruction and coefficients, int8 values, scales
    and their reconstruction, and the routing statistics."""
    nkv, hd = cfg.num_key_value_heads, cfg.head_dim
    per_layer = 2 * nkv * hd * e
    if tiers.has_warm:
        per_layer += nkv * hd * e + nkv * tiers.rank * e
    if tiers.value_format == "int8":
        per_layer += nkv * hd + nkv * 2 + nkv * hd * e
    return cfg.num_hidden_layers * per_layer + 16


def _disk_place(path) -> str:
    if path is not None:
        folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    else:
        folder = os.environ.get("WORKBENCH_PREFETCH_DIR") or tempfile.gettempdir()
    return f"disk:{folder}"


def check_engine_memory(cfg, device, dtype, **kw) -> MemoryPlan:
    """:func:`engine_memory_plan`, checked: a ConfigError naming the first allocation that does
    not fit (its figure, how it is reached, and the setting that makes it smaller)."""
    return engine_memory_plan(cfg, device, dtype, **kw).check()


def check_before_loading(model=None, device=None, dtype=None, **kw) -> MemoryPlan | None:
    """:func:`check_engine_memory` from the model's config alone, before a weight is read (so a
    refusal costs neither the load's time nor its memory): ``model`` a folder, ``"preset:<name>"``
    or None for the bundled model, on ``device`` in ``dtype`` as the loader resolves them (a
    loaded CausalLM: its own config, device and dtype).  ``kw``: :func:`engine_memory_plan`'s.
    None when the config cannot be read here: the loader then says what is wrong with it."""
    if isinstance(model, CausalLM):
        w = model.lm_head.weight
        return check_engine_memory(model.config, w.device, w.dtype, **kw)
    try:
        cfg = model_config(model)
        dev = resolve_device(device)
        dt = parse_dtype(dtype) or default_dtype(dev, cfg.torch_dtype)
    except WorkbenchError:
        return None
    return check_engine_memory(cfg, dev, dt, **kw)


__all__ = ["check_before_loading", "check_engine_memory", "context_length", "default_pool_tokens",
           "engine_memory_plan"]

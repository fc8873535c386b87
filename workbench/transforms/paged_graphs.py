"""Static decode steps over the paged pool: what ``compile=True`` and ``cuda_graphs=True`` run
when KV lives in blocks (``LLM(kv=PagedKVConfig(...), compile=True)``).

Why.  The contiguous static step (:mod:`workbench.transforms.cuda_graphs`) keeps one cache row of
``max_len`` tokens per running sequence, so it cannot share a prefix between requests, offload a
block or fork a sequence: everything the paged pool is for.  Serving engines (vLLM, SGLang) run
their graphs over the pool instead, and so does this module.

What a step reads.  Everything is a tensor in a fixed place, filled by the host before the step
(:meth:`PagedDecoder._set_inputs`), one set per batch-size bucket:

===============  ======================  ==========================================================
``ids``          ``[bs, 1]`` long        the token each row decodes
``positions``    ``[bs]`` long           its position (RoPE row)
``slots``        ``[bs]`` long           where its K/V goes in the pool (``block * block_size + offset``)
``block_tables`` ``[bs, max_blocks]``    the sequence's blocks, padded with the scratch block
``seq_lens``     ``[bs]`` int32          keys each row attends over (its position + 1)
===============  ======================  ==========================================================

Rows past the batch are padding: token 0 at position 0, K/V written to the pool's *scratch block*
(one block past the block manager's, which no sequence ever owns), attending over one key.

Attention reads the blocks in place.  On a GPU the paged-decode kernel
(``attention_decode=triton``) follows the block tables and stops at each row's length, so the
tables can be padded to the context's full width at no cost: one graph per batch bucket.  On a
CPU the torch path (``attention_decode=eager``: gather the rows' blocks, mask, SDPA) is what
``torch.compile`` fuses; it reads every block-table column, so the step takes only as many
columns as the longest row needs (``width``, at least 2), and is compiled with
that width dynamic: one compiled step serves every width and batch bucket (inductor's C++ with a
symbolic size), instead of one per pair.

::

    dec = PagedDecoder(model, pool, max_blocks=64, buckets=(1, 2, 4, 8))   # what PagedStaticRunner holds
    dec.compile()                                  # or dec.capture() on CUDA (after compile, optionally)
    logits = dec.decode(tokens, positions, tables) # tables: each row's block ids (the block manager's)

The block manager must have reserved each row's slot (``append_slot``) before the step, as for
every other runner: this module only reads the tables.
"""

from __future__ import annotations

import torch

from workbench.errors import ConfigError, WorkbenchError
from workbench.transforms.backends import apply_backends, current_backends
from workbench.transforms.static_step import StaticStep


class PagedDecodeInputs:
    """The static inputs of one batch bucket over the pool (see the module's table)."""

    def __init__(self, pool, rows: int, max_blocks: int, scratch: int) -> None:
        dev = pool.device
        self.rows = rows
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.full((rows,), scratch * pool.block_size, dtype=torch.long, device=dev)
        # one flat buffer: the tables of any width are its first rows * width entries, contiguous
        # (a strided view would be a second compiled step: torch guards on contiguity)
        self.tables_flat = torch.full((rows * max_blocks,), scratch, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)

    def tables(self, width: int) -> torch.Tensor:
        """The block tables [rows, width] as the step reads them."""
        return self.tables_flat[:self.rows * width].view(self.rows, width)

    def args(self, width: int) -> tuple:
        """What the step is called with, reading ``width`` block-table columns."""
        return self.ids, self.positions, self.slots, self.tables(width), self.seq_lens


class PagedStepCache:
    """What the layers of one static step see as their cache (``static_decode``: the attention
    module calls :meth:`attend_decode`): the pool's layer tensors and the step's inputs."""

    static_decode = True

    def __init__(self, k_cache, v_cache, positions, slots, block_tables, seq_lens, window, attend=None) -> None:
        self.k, self.v, self.window, self.attend = k_cache, v_cache, window, attend
        self.positions, self.slots, self.block_tables, self.seq_lens = positions, slots, block_tables, seq_lens

    def attend_decode(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos, sin) -> torch.Tensor:
        """One decode token per row: rotate q / k, write k / v to their slots, attend over the
        row's blocks.  q [rows, nh, hd], k / v [rows, nkv, hd] -> [rows, nh, hd]."""
        ops, layer = attn.ops, attn.layer_idx
        kc, vc = self.k[layer], self.v[layer]                        # [num_blocks + 1, block_size, nkv, hd]
        if ops.backends["rope"] == "triton":
            q, k = ops.rope_kv_write(q, k, v, cos, sin, self.positions, kc, vc, self.slots)
        else:      # every slot is valid (padding rows write to the scratch block): a plain index_copy
            q, k = ops.rope(q, k, cos, sin, self.positions)
            nkv, hd = kc.shape[2], kc.shape[3]
            kc.view(-1, nkv, hd).index_copy_(0, self.slots, k)
            vc.view(-1, nkv, hd).index_copy_(0, self.slots, v)
        attend = self.attend or ops.attention_decode
        return attend(q, kc, vc, self.block_tables, self.seq_lens, sliding_window=self.window)


class PagedDecoder(StaticStep):
    """Static decode steps of ``model`` over ``pool`` for batch-size ``buckets``: compiled with
    :meth:`compile`, graphed per bucket on CUDA with :meth:`capture`.

    ``max_blocks``: the widest block table (the engine's ``max_model_len`` in blocks).  The pool
    must have a scratch block (``PagedKVPool(..., scratch_blocks=1)``): padding rows write there.
    The model gets backend modules if it has none (all ``eager``: bitwise the reference's ops), as
    with :class:`~workbench.transforms.cuda_graphs.GraphedDecoder`; this changes it in place."""

    def __init__(self, model, pool, max_blocks: int, buckets: tuple[int, ...] = (1,)) -> None:
        if getattr(pool, "scratch_block", None) is None:
            raise ConfigError("PagedDecoder: the pool has no scratch block for padding rows; build it with "
                              "PagedKVPool(..., scratch_blocks=1)")
        if not isinstance(max_blocks, int) or max_blocks < 1:
            raise ConfigError(f"PagedDecoder: max_blocks must be a positive integer, got {max_blocks!r}")
        super().__init__(model, buckets)
        apply_backends(model, current_backends(model))
        self.pool, self.max_blocks, self.window = pool, max_blocks, model.config.sliding_window
        max_len = max_blocks * pool.block_size
        cos, sin = model.model.rotary_emb._table(max_len, self.device)
        self.cos, self.sin = cos[:max_len].to(self.dtype), sin[:max_len].to(self.dtype)
        self.inputs = {b: PagedDecodeInputs(pool, b, max_blocks, pool.scratch_block) for b in self.buckets}
        self.backends = current_backends(model)
        # the torch attention (a CPU) reads every column it is given: a step reads only the columns
        # its longest row needs; the kernel (a GPU) stops at each row's length
        self.trim_width = self.backends.get("attention_decode", "eager") == "eager"
        self._dynamic = False
        self._attend = None            # None: the module's attention_decode entry point

    def _forward(self, ids, positions, slots, block_tables, seq_lens) -> torch.Tensor:
        """One decode step over the pool: logits [rows, V]."""
        m = self.model
        c = PagedStepCache(self.pool.k_cache, self.pool.v_cache, positions, slots, block_tables, seq_lens,
                           self.window, self._attend)
        x = m.model.embed_tokens(ids)                                # [rows, 1, H]
        for layer in m.model.layers:
            x = layer(x, self.cos, self.sin, None, c)
        return m.lm_head(m.model.norm(x))[:, -1]

    def _step_args(self, bs: int) -> tuple:
        return self.inputs[bs].args(self.max_blocks)

    def compile(self, **options) -> None:
        """``torch.compile`` the step.  With trimmed widths (the torch attention) the width and
        the batch (buckets of 2 and more) are dynamic sizes: one compiled step for all of them
        (batch 1 and width 1 get their own, as torch specializes sizes 0 and 1)."""
        self._dynamic = self.trim_width
        if self._dynamic:
            options.setdefault("dynamic", None)
            # the torch attention as two reductions inductor fuses with the block-table gather
            # (measured on 2 cores, bundled model's heads: 77 vs 115 us a layer at batch 8, 128 tokens)
            from workbench_kernels.paged_decode import attention_decode_torch  # lazy: imports triton (~0.7 s)

            self._attend = attention_decode_torch
        super().compile(**options)

    def width_for(self, positions: list[int]) -> int:
        """Block-table columns a step reads: every column with the kernel (it stops at each row's
        length) and once graphs are captured (a graph reads the tables it was captured on: the full
        width); otherwise the blocks of the furthest position (at least 2: torch specializes a size of
        1, which would be one more compiled step; the width is a dynamic size of the compiled step,
        so any other is free)."""
        if not self.trim_width or self.graphs:
            return self.max_blocks
        return min(self.max_blocks, max(2, max(positions) // self.pool.block_size + 1))

    def _set_inputs(self, bs: int, tokens: list[int], positions: list[int], tables: list[list[int]]) -> int:
        """Row i decodes ``tokens[i]`` at ``positions[i]`` over the blocks ``tables[i]``; rows past
        the lists are padding.  Returns the block-table width the step reads.  At the full width
        only the columns up to the furthest position are written: the columns past a row's length
        hold block ids of earlier steps (always valid ones), which its length masks or the kernel
        never reads - rewriting 8,192 columns of a 131k-token context from Python lists measured
        11 ms a step at batch 32."""
        c, B, n = self.inputs[bs], self.pool.block_size, len(tokens)
        width = self.width_for(positions)
        cols = width if width < self.max_blocks else min(width, max(positions) // B + 1)
        pad = self.pool.scratch_block
        rows = [t[:cols] + [pad] * (cols - len(t[:cols])) for t in tables] + [[pad] * cols] * (bs - n)
        slots = [tables[i][p // B] * B + p % B for i, p in enumerate(positions)] + [pad * B] * (bs - n)
        # pinned, non-blocking copies on CUDA (InputCopies); the inputs stay separate tensors, as
        # the compiled step takes them as arguments (views of one buffer would alias them)
        self.copy_inputs((c.ids, torch.tensor(list(tokens) + [0] * (bs - n)).view(bs, 1)),
                         (c.positions, torch.tensor(list(positions) + [0] * (bs - n))),
                         (c.seq_lens, torch.tensor([p + 1 for p in positions] + [1] * (bs - n), dtype=torch.int32)),
                         (c.slots, torch.tensor(slots)),
                         (c.tables(width)[:, :cols], torch.tensor(rows, dtype=torch.int32)))
        return width

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One step for rows 0..n-1 (row i: token ``tokens[i]`` at ``positions[i]``, blocks
        ``tables[i]``, its slot reserved by the block manager): logits [n, V]."""
        n = len(tokens)
        if n == 0 or n != len(positions) or n != len(tables):
            raise ConfigError(f"decode: {n} tokens, {len(positions)} positions and {len(tables)} block tables")
        B = self.pool.block_size
        for i, (p, t) in enumerate(zip(positions, tables)):
            if p // B >= len(t):
                raise WorkbenchError(f"decode: row {i} at position {p} has {len(t)} blocks; reserve its slot first")
            if p // B >= self.max_blocks:
                raise WorkbenchError(f"decode: position {p} is past the decoder's {self.max_blocks} blocks of {B}")
        bs = self.bucket_for(n)
        width = self._set_inputs(bs, tokens, positions, tables)
        if bs in self.graphs:
            graph, out = self.graphs[bs]
            self._before_replay()
            graph.replay()                                                           # CUDA only
            return out[:n]
        args = self.inputs[bs].args(width)
        if self._dynamic:
            if bs > 1:
                for t in args:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            if width > 1:
                torch._dynamo.maybe_mark_dynamic(args[3], 1)
        return self._step(*args)[:n]

    def _warm_inputs(self, bs: int) -> None:
        """Every row padding (scratch block only): what warm-up and capture run on."""
        self._set_inputs(bs, [0], [0], [[self.pool.scratch_block]])

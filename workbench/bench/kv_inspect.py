"""kv-inspect's demonstration workloads: run the engine on a paged or tiered workload and
return the reports of :mod:`workbench.kv.inspect` (what ``workbench kv-inspect`` shows), with each
request's TTFT; and the held-out PCA basis a tiered cache needs (``workbench serve --tiers`` fits it
with :func:`fit_heldout_basis` too)."""

from __future__ import annotations

from workbench.kv.inspect import KVInspector, tier_report


# ---- demonstration workloads (the CLI's kv-inspect) ---------------------------------------------
def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress)


def inspect_paged_workload(model=None, prompts=None, num_requests: int = 8, system_tokens: int = 256,
                           max_tokens: int = 8, block_size: int = 16, num_blocks: int | None = None,
                           offload: str | None = None, enable_prefix_caching: bool = True, device=None, dtype=None,
                           progress: bool = False) -> dict:
    """Run ``prompts`` (default: the prefix bench's shared-prefix workload, ``num_requests``
    questions after a ``system_tokens``-token system prompt) one request at a time on a paged
    engine, greedy; return the inspector's report plus each request's TTFT and output length."""
    from workbench.engine.llm import LLM
    from workbench.errors import ConfigError
    from workbench.engine.sampling import SamplingParams
    from workbench.kv.paged import PagedKVConfig

    base = LLM(model, device=device, dtype=dtype)
    default = prompts is None
    if default:
        if base.tokenizer is None:
            raise ConfigError("kv-inspect: the default workload is text and this model has no tokenizer; "
                              "pass a model folder with one")
        from workbench.bench.prefix import PrefixBenchConfig, shared_prefix_prompts

        _, prompts = shared_prefix_prompts(base.tokenizer, PrefixBenchConfig(num_requests=num_requests,
                                                                             system_tokens=system_tokens))
    longest = max(len(base.encode(p)[1]) for p in prompts) + max_tokens
    if num_blocks is None:
        num_blocks = -(-longest // block_size) * 4 + 8      # as the prefix bench sizes its pool
    kv = PagedKVConfig(block_size=block_size, num_blocks=num_blocks, offload=offload,
                       enable_prefix_caching=enable_prefix_caching)
    llm = LLM(base.model, tokenizer=base.tokenizer, kv=kv, max_model_len=base.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with KVInspector(llm, history=max(256, len(prompts))) as insp:
        outs = []
        with _bar(len(prompts), "kv-inspect", progress) as bar:
            for p in prompts:           # one at a time: each TTFT is its own prefill, no queueing
                outs.append(llm.generate([p], params)[0])
                bar.update()
        rep = insp.report()
    ttft = {o.request_id: o.metrics.ttft * 1e3 for o in outs}
    for r in rep["finished"]:
        r["ttft_ms"] = ttft.get(r["seq_id"])
    llm.kv_pool.manager.check_invariants()
    rep["workload"] = {"requests": len(prompts), "max_tokens": max_tokens,
                       "prompts": "shared prefix (prefix bench)" if default else "given", "device": str(llm.device),
                       "dtype": str(llm.model.lm_head.weight.dtype).removeprefix("torch.")}
    return rep


def fit_heldout_basis(llm, tier, calibration_docs: int = 2, split=None):
    """The PCA key basis a tiered cache needs (None when ``tier`` has no warm zone), fitted on
    ``calibration_docs`` held-out calibration documents - never the evaluation ones
    (:func:`~workbench.bench.tier_eval.heldout_split`)."""
    from workbench.errors import ConfigError
    from workbench.kv.pca import fit_pca_from_model
    from workbench.bench.tier_eval import heldout_split

    if llm.tokenizer is None:
        raise ConfigError("the tiered cache's PCA basis is fitted on held-out text; this model has no tokenizer")
    split = split or heldout_split(llm.tokenizer, context=min(1024, llm.max_model_len))
    if len(split["calibration"]) < calibration_docs or not split["evaluation"]:
        raise ConfigError(f"the held-out corpus has {len(split['calibration'])} calibration documents of "
                          f"{min(1024, llm.max_model_len)} tokens; asked for {calibration_docs}")
    if not tier.has_warm:
        return None
    return fit_pca_from_model(llm.model, split["calibration"][:calibration_docs], key_space=tier.key_space,
                              source=f"heldout calibration: {', '.join(split['calibration_docs'][:calibration_docs])}")


def inspect_tiered_workload(tier, model=None, prompt=None, prompt_tokens: int = 512, max_tokens: int = 8,
                            calibration_docs: int = 2, device=None, dtype=None, progress: bool = False) -> dict:
    """Fit a PCA basis on ``calibration_docs`` held-out calibration documents (never the
    evaluation ones, see :func:`~workbench.bench.tier_eval.heldout_split`), run one long prompt
    (default: the first ``prompt_tokens`` tokens of the first evaluation document) through a
    tiered engine with :class:`~workbench.kv.tier_config.TierConfig` ``tier``, and return the
    finished request's :func:`tier_report`."""
    from workbench.engine.llm import LLM
    from workbench.errors import ConfigError
    from workbench.engine.sampling import SamplingParams
    from workbench.bench.tier_eval import heldout_split

    base = LLM(model, device=device, dtype=dtype)
    if base.tokenizer is None:
        raise ConfigError("kv-inspect --tiers: calibration and the default prompt are text; "
                          "this model has no tokenizer")
    with _bar(3, "kv-inspect --tiers", progress) as bar:
        split = heldout_split(base.tokenizer, context=min(1024, base.max_model_len))
        try:
            basis = fit_heldout_basis(base, tier, calibration_docs, split)
        except ConfigError as e:
            raise ConfigError(f"kv-inspect --tiers: {e}") from None
        bar.update()
        if prompt is None:
            ids = split["evaluation"][0][:prompt_tokens]
        else:
            ids = base.encode(prompt)[1]
        llm = LLM(base.model, tokenizer=base.tokenizer, tiers=tier, tier_basis=basis, max_model_len=base.max_model_len)
        bar.update()
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        rep = tier_report(llm.last_cache)
        bar.update()
    rep["workload"] = {"prompt_tokens": len(ids), "generated_tokens": len(out.token_ids),
                       "prompt_source": "text" if prompt is not None else split["evaluation_docs"][0],
                       "ttft_ms": out.metrics.ttft * 1e3, "device": str(llm.device)}
    rep["calibration"] = None if basis is None else {
        "documents": split["calibration_docs"][:calibration_docs], "tokens": basis.num_tokens,
        "key_space": basis.key_space, "explained_variance_at_rank": float(basis.explained(tier.rank).mean())}
    return rep

"""End to end: one realistic workload through every layer of the stack, one layer at a time and stacked.

::

    wl = build_workload(llm.tokenizer, WorkloadConfig.preset("smoke"), max_model_len=llm.max_model_len)
    ab = run_ablation(llm, wl, E2EConfig.preset("smoke"))  # build, warm up, interleaved real-time replays, quality
    ab.summary()                                            # per configuration: medians, memory, quality, verdicts
    ab.skipped_frame()                                      # what could not be measured or combined, and why
    ab.waterfall("ttft_ms_p95")                             # the stack, step by step
    recommend(ab.candidates(), SLO(ttft_p95_ms=500, max_rel_ppl=0.02))
    run_end_to_end(device="cuda", mode="tiny")              # all of it as JSON (the device check's e2e step)

The parts: :mod:`~workbench.bench.e2e_workload` (the workload), :mod:`~workbench.bench.e2e_configs`
(layers, sizes, what each changes), :mod:`~workbench.bench.e2e_measure` (a run's row, memory,
quality), :mod:`~workbench.bench.e2e_results` (tables, comparisons, the waterfall),
:mod:`~workbench.bench.e2e_recommend` (the SLO rule); this module builds and runs them.

**The workload** (:func:`build_workload`, deterministic given its seed): chat conversations that
share a few system prompts, several turns each, every turn re-sending the whole history (so the
prefix cache can reuse the system prompt and the earlier turns); long documents whose prompts
come close to the model's context; short one-off requests of mixed lengths; Poisson arrivals
for new conversations, documents and one-off requests, and a think time between the turns of
a conversation.  All text is the bundled held-out corpus (:mod:`workbench.data`), as token ids,
so a later turn's prompt is exactly an earlier one's tokens plus more.  The assistant turns in
the history are held-out text standing in for the model's replies: a trace must be fixed
before it is replayed, and a real client would send back what the model said.

**The configurations** (:meth:`Ablation.build`): the reference ``LLM()`` (one request at a time), the
*baseline* (continuous batching, a contiguous cache per sequence, eager, unquantized), each
layer added to the baseline alone (with the layers it needs, named), and the *stack*: layers
added one after another in a stated order.  Where KV lives is a choice of one: ``compile`` /
CUDA graphs run on static contiguous buffers, the prefix cache and its offload tier on the paged
pool, the tiered cache per sequence; weight streaming and quantization cannot be combined yet.
A layer that cannot join the stack is not forced: the engine's own :class:`ConfigError` is
recorded as the reason and the stack goes on without it.

**One run** replays the trace in real time on a fresh engine of that configuration (an engine
whose decode steps are compiled is kept and warmed once) and gives a row: TTFT / TPOT / E2E
(P50, P95, jitter), P95 TTFT per kind of request, throughput, prefix hit rate, preemptions,
KV bytes (measured: the pool's tensors, the live caches' storages sampled after every step, the
physical tiers' resident zones), weights bytes, process RSS (CPU; the whole process) or the
device's peak allocation during the run (CUDA).  Rounds run every configuration once, in an
order reversed every other round.  Quality: greedy token agreement with the reference on every
request; perplexity and KL on held-out text for configurations that change numerics
(quantization, tiers), paired token by token with the unchanged model.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from workbench.bench.e2e_configs import (
    ALONE_ONLY,
    LAYERS,
    REQUIRES,
    TRITON_OPS,
    Config,
    E2EConfig,
    Spec,
    add_layer,
    device_layers,
    device_quant,
    layer_label,
)
from workbench.bench.e2e_measure import (
    KVSampler,
    close_engine,
    numerics_quality,
    rss_bytes,
    run_row,
    scored_logprobs,
    weights_bytes,
)
from workbench.bench.e2e_recommend import SLO, recommend
from workbench.bench.e2e_results import METRICS, AblationResults, report_rows
from workbench.bench.e2e_workload import KINDS, Workload, WorkloadConfig, build_workload
from workbench.engine.sampling import SamplingParams
from workbench.engine.traces import Trace, replay
from workbench.errors import ConfigError
from workbench.measure.agreement import agreement

__all__ = ["ALONE_ONLY", "KINDS", "LAYERS", "METRICS", "REQUIRES", "SLO", "TRITON_OPS", "Ablation", "Config",
           "E2EConfig", "Spec", "Workload", "WorkloadConfig", "add_layer", "build_workload", "device_layers",
           "device_quant", "layer_label", "numerics_quality", "recommend", "report_rows", "run_ablation",
           "run_end_to_end", "run_row", "scored_logprobs", "weights_bytes"]


class Ablation(AblationResults):
    """Every configuration of one workload, built, replayed in interleaved rounds, and judged.

    ``llm``: the loaded reference (``LLM(model, device=...)``): its model is shared by the
    configurations that leave the model alone; ``model``: where that model came from (None: the
    bundled one), for the configurations that change a model in place and get their own copy.
    ``noise``: the relative noise floor of the verdicts (None: the last noise probe)."""

    def __init__(self, llm, workload: Workload, cfg: E2EConfig | None = None, model=None,
                 noise: float | None = None) -> None:
        import dataclasses

        cfg = cfg or E2EConfig()
        if cfg.quant is None:              # the device's fastest scheme
            cfg = dataclasses.replace(cfg, quant=device_quant(str(llm.device)))
        self.llm, self.workload, self.cfg = llm, workload, cfg
        self.model_source, self.noise = model, noise
        self.device = str(llm.device)
        singles, stack, self.not_here = device_layers(self.device)
        self.left_out = [x for x in singles if cfg.alone is not None and x not in cfg.alone]
        self.singles = [x for x in singles if x not in self.left_out] + [f"quant:{q}" for q in self.cfg.quant_variants]
        self.stack_order = list(self.cfg.stack) if self.cfg.stack else stack
        self.configs: list[Config] = []
        self.stack: list[dict] = []         # step -> layer, config name (or None when skipped), reason
        # stage, layer, reason, kind ("cannot combine" | "not here" | "left out" | "failed")
        self.skipped: list[dict] = []
        self._basis = self._split = None
        longest = max(len(p) + sp.max_tokens for p, sp in zip(workload.prompts, workload.params))
        self.ctx = {"layers": llm.model.config.num_hidden_layers,
                    "offload_blocks": self.cfg.offload_pool_factor * -(-longest // self.cfg.block_size)}

    # ---- building ----------------------------------------------------------------------------
    def split(self) -> dict:
        """:func:`workbench.data.heldout_split` at ``eval_context`` tokens (computed once)."""
        if self._split is None:
            from workbench.data import heldout_split

            self._split = heldout_split(self.llm.tokenizer, self.cfg.eval_context)
        return self._split

    def tier_basis(self):
        """The tiers' PCA basis of keys, fitted on the calibration half of the held-out split."""
        if self._basis is None:
            from workbench.kv.pca import fit_pca_from_model

            src = f"2 held-out calibration documents of {self.cfg.eval_context} tokens"
            self._basis = fit_pca_from_model(self.llm.model, self.split()["calibration"][:2], source=src)
        return self._basis

    def _llm(self, spec: Spec, net=None):
        """An ``LLM`` front of ``spec``: on ``net`` (a model already set up for it), on the shared
        model, or on a fresh copy when ``spec`` changes a model in place."""
        from workbench.engine.llm import LLM
        from workbench.sched.config import SchedulerConfig

        base = self.llm
        kw = {"tokenizer": base.tokenizer, "threads": base.threads, "max_model_len": base.max_model_len,
              "kv": spec.kv, "compile": spec.compile, "static_decode": spec.static_decode,
              "cuda_graphs": spec.cuda_graphs, "stream_weights": spec.stream_weights}
        if not spec.reference and not spec.persistent:
            kw["batch_invariant"] = self.cfg.batch_invariant
        if not spec.reference:
            kw["scheduler"] = SchedulerConfig(max_num_seqs=self.cfg.max_num_seqs,
                                              max_num_batched_tokens=self.cfg.max_num_batched_tokens,
                                              micro_batch_window_s=spec.window_s)
        if spec.tiers is not None:
            from workbench.kv.tiers_physical import TierStore

            kw.update(tiers=spec.tiers, tier_basis=self.tier_basis(), tier_store=TierStore(offload="host"))
        if net is None and spec.fresh_model:
            from workbench.model.loader import load_model

            net = load_model(self.model_source, device=base.device, dtype=base.model.lm_head.weight.dtype)
            if spec.backends:
                from workbench.transforms.backends import apply_backends

                apply_backends(net, dict(spec.backends))
            kw["quant"] = spec.quant
        return LLM(net if net is not None else base.model, **kw)

    def _add(self, name: str, group: str, layers, added, spec: Spec, stage: str) -> Config | None:
        """The configuration of ``spec`` (an identical one is reused), built; None when the engine
        refuses it or building fails (recorded in :attr:`skipped`)."""
        for c in self.configs:
            if c.spec == spec:
                return c
        c = Config(name, group, tuple(layers), added, spec)
        t0 = time.perf_counter()
        try:
            c.front = self._llm(spec)
        except ConfigError as e:
            c.error = str(e)
        except Exception as e:  # noqa: BLE001 - recorded; the other configurations go on
            c.error, c.failed = f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3).splitlines()[-1]}", True
        c.seconds_build = time.perf_counter() - t0
        if c.error is not None:
            self.skipped.append({"stage": stage, "layer": added or name, "layers": " + ".join(layers) or "-",
                                 "kind": "failed" if c.failed else "cannot combine", "reason": c.error})
            return None
        self.configs.append(c)
        return c

    def build(self, progress=None) -> Ablation:
        """Every configuration: the reference, the baseline, each layer alone, the stack.
        ``progress(k, n, name)``: called before the k-th of n configurations is built (optional)."""
        cfg, base = self.cfg, Spec()
        total = int(cfg.reference_row) + 1 + len(self.singles) + len(self.stack_order)
        count = [0]

        def tick(name: str) -> None:
            if progress is not None:
                progress(min(count[0], total), total, name)
            count[0] += 1

        if cfg.reference_row:
            tick("reference LLM()")
            self._add("reference LLM()", "reference", (), None, Spec(reference=True), "reference")
        tick("baseline")
        if self._add("baseline", "baseline", (), None, base, "baseline") is None:
            raise ConfigError(f"end to end: the baseline could not be built: {self.skipped[-1]['reason']}")
        for layer in self.singles:
            layers = (*REQUIRES.get(layer, ()), layer)
            tick("+" + " +".join(layers))
            try:
                spec = base
                for x in layers:
                    spec = add_layer(spec, x, cfg, self.ctx)
            except ConfigError as e:
                self.skipped.append({"stage": "one at a time", "layer": layer, "layers": " + ".join(layers),
                                     "kind": "cannot combine", "reason": str(e)})
                continue
            self._add("+" + " +".join(layers), "one at a time", layers, layer, spec, "one at a time")
        for layer, why in self.not_here.items():
            self.skipped.append({"stage": "one at a time", "layer": layer, "layers": layer, "kind": "not here",
                                 "reason": why})
        for layer in self.left_out:
            self.skipped.append({"stage": "one at a time", "layer": layer, "layers": layer, "kind": "left out",
                                 "reason": "not in this run's E2EConfig.alone"})
        spec, layers = base, []
        self.stack = [{"step": 0, "layer": "baseline", "config": "baseline", "reason": None}]
        for layer in self.stack_order:
            tick(f"stack: {' + '.join([*layers, layer])}")
            if layer in self.not_here:
                self.stack.append({"step": None, "layer": layer, "config": None, "reason": self.not_here[layer]})
                continue
            try:
                nxt = add_layer(spec, layer, cfg, self.ctx)
                name = f"stack: {' + '.join([*layers, layer])}"
                c = self._add(name, "stack", (*layers, layer), layer, nxt, "stack")
                reason = None if c is not None else self.skipped[-1]["reason"]
            except ConfigError as e:
                c, reason = None, str(e)
                self.skipped.append({"stage": "stack", "layer": layer, "layers": " + ".join([*layers, layer]),
                                     "kind": "cannot combine", "reason": reason})
            if c is None:
                self.stack.append({"step": None, "layer": layer, "config": None, "reason": reason})
                continue
            spec, layers = nxt, [*layers, layer]
            self.stack.append({"step": len(layers), "layer": layer, "config": c.name, "reason": None})
        for layer, why in ALONE_ONLY.items():
            if layer not in self.stack_order and layer in self.singles:
                self.stack.append({"step": None, "layer": layer, "config": None, "reason": f"measured alone: {why}"})
        if progress is not None:
            progress(total, total, "")
        return self

    def warm_up(self, progress=None) -> None:
        """Each configuration's front runs a few short requests of different lengths (every
        static batch-size bucket compiles here, not inside a timed run).  After every build: a
        streamed model resets compiled code when it is installed.  ``progress(k, n, name)``:
        called before the k-th of n configurations warms up, and once with k == n at the end."""
        n = 1 if self.cfg.max_num_seqs == 1 else self.cfg.max_num_seqs
        prompts = [p[:32] for p in self.workload.prompts[:n]]
        while len(prompts) < n:
            prompts.append(prompts[-1])
        for i, c in enumerate(self.configs):
            if progress is not None:
                progress(i, len(self.configs), c.name)
            k = 1 if c.spec.reference else n
            params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(k)]
            try:
                c.front.generate(prompts[:k], params)
            except Exception as e:  # noqa: BLE001
                c.error, c.failed = f"warm-up failed: {type(e).__name__}: {e}", True
        if progress is not None:
            progress(len(self.configs), len(self.configs), "")

    # ---- running -----------------------------------------------------------------------------
    def _run_once(self, c: Config, trace: Trace) -> tuple[dict, list]:
        engine = c.front.engine if c.spec.persistent else self._llm(c.spec, net=c.front.model).engine
        if c.spec.persistent and engine.kv_pool is not None:
            # a kept engine starts each run cold, as a fresh one does (no earlier run's prefixes)
            engine.kv_pool.reset()
        cuda = engine.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(engine.device)
            torch.cuda.reset_peak_memory_stats(engine.device)
            before = torch.cuda.memory_allocated(engine.device)
        sampler = KVSampler(engine)
        try:
            res = replay(engine, trace)
        finally:
            sampler.remove()
        row = run_row(res, self.workload)
        row.update(kv_bytes=sampler.held_bytes(), kv_used_bytes=sampler.peak_used, weights_bytes=weights_bytes(engine),
                   rss_bytes=None if cuda else rss_bytes(),
                   device_peak_bytes=torch.cuda.max_memory_allocated(engine.device) - before if cuda else None,
                   engine=engine.describe())
        if not c.spec.persistent:
            close_engine(engine)
        return row, [list(o.token_ids) for o in res.outputs]

    def replay_at(self, name: str, multiple: float = 1.0) -> dict:
        """One more real-time replay of configuration ``name``, its trace at ``multiple`` times the
        workload's rate (every arrival time divided by it): the run's row (the capacity search's step)."""
        from workbench.bench.tune import scale_trace

        c = self.config(name)
        return self._run_once(c, scale_trace(self.workload.trace(priorities=c.spec.priorities), multiple))[0]

    def run(self, repeats: int | None = None, progress=None, started=None) -> Ablation:
        """``repeats`` rounds; each runs every configuration once, the order reversed every other
        round.  A run that raises marks its configuration failed (recorded) and the rest go on.
        ``started(r, i, c)`` (optional) is called before round ``r``'s ``i``-th run, of
        configuration ``c``; ``progress(r, c, row)`` after it, with its row.  Both are called
        between runs, outside the timed replays."""
        repeats = repeats or self.cfg.repeats
        traces = {p: self.workload.trace(priorities=p) for p in (False, True)}
        for r in range(repeats):
            order = self.configs if r % 2 == 0 else self.configs[::-1]
            for i, c in enumerate(order):
                if c.failed:
                    continue
                if started:
                    started(r, i, c)
                try:
                    row, toks = self._run_once(c, traces[c.spec.priorities])
                except Exception as e:  # noqa: BLE001
                    c.error, c.failed = f"run {r + 1} failed: {type(e).__name__}: {e}", True
                    continue
                row["round"] = r + 1
                c.runs.append(row)
                c.tokens.append(toks)
                if progress:
                    progress(r, c, row)
        for c in self.configs:
            if c.failed:
                self.skipped.append({"stage": c.group, "layer": c.added or c.name, "layers": " + ".join(c.layers),
                                     "kind": "failed", "reason": c.error})
        return self

    def measure_quality(self, progress=None) -> Ablation:
        """Greedy agreement of every run with the reference configuration's tokens; perplexity,
        KL and top-1 agreement on held-out text for configurations that change numerics.
        ``progress(text)`` (optional) says which part runs."""
        from workbench.engine.llm import LLM

        say = progress or (lambda text: None)
        say("quality: the reference's greedy tokens")

        ref = LLM(self.llm.model, tokenizer=self.llm.tokenizer, threads=self.llm.threads,
                  max_model_len=self.llm.max_model_len)
        self.reference_tokens = [list(o.token_ids) for o in ref.generate(self.workload.prompts, self.workload.params)]
        for c in self.configs:
            rates = [agreement(self.reference_tokens, t) for t in c.tokens]
            c.quality = {"agreement": min(a["rate"] for a in rates) if rates else None,
                         "identical": bool(rates) and all(a["identical_sequences"] == a["sequences"] for a in rates),
                         "identical_sequences": min(a["identical_sequences"] for a in rates) if rates else None}
        wanted = [c for c in self.configs if c.spec.numerics]
        if wanted:
            windows = self.split()["evaluation"][:self.cfg.eval_docs]
            ref_lp = [scored_logprobs(self.llm.model, w, self.cfg.eval_tokens) for w in windows]
            done: dict = {}
            for c in wanted:
                key = (c.spec.quant, c.spec.tiers, c.spec.backends)
                if key not in done:
                    say(f"quality: perplexity and KL of {c.name}")
                    done[key] = numerics_quality(c.front.model, windows, ref_lp, self.cfg.eval_tokens,
                                                 c.spec.tiers, self.tier_basis() if c.spec.tiers else None)
                c.quality.update(done[key])
        return self

    def close(self) -> None:
        """Give back what the configurations hold: streamed weights' slow tier, offload tiers."""
        for c in self.configs:
            if c.front is None:
                continue
            eng = c.front.engine
            close_engine(eng)
            if eng.weight_streamer is not None:
                eng.weight_streamer.remove()


def run_ablation(llm, workload: Workload, cfg: E2EConfig | None = None, model=None, noise: float | None = None,
                 progress=None) -> Ablation:
    """Build, warm up, run (interleaved rounds), measure quality, close: the whole ablation."""
    ab = Ablation(llm, workload, cfg, model=model, noise=noise).build()
    try:
        ab.warm_up()
        ab.run(progress=progress)
        ab.measure_quality()
    finally:
        ab.close()
    return ab


def run_end_to_end(model=None, device=None, dtype=None, mode: str = "tiny", slo_ttft_p95_ms: float | None = None,
                   metric: str = "ttft_ms_p95", progress: bool = False, capacity: bool = True) -> dict:
    """The whole ablation in one call, JSON-ready (``scripts/device_check.sh``'s ``e2e`` step):
    ``rows`` (:func:`report_rows`), ``stack``, ``waterfall`` of ``metric``, the recommendation for
    P95 TTFT <= ``slo_ttft_p95_ms`` (None: the baseline's slowest round, "never slower than the
    baseline was") and perplexity +2 % at most, ``capacity`` (with ``capacity=True``: the pick's
    highest arrival-rate multiple within that SLO, :func:`workbench.bench.tune.capacity_search` with one
    round a multiple, up to 8x; None when the pick is the reference or nothing meets it), and the
    run's facts.

    After every run (one configuration in one round) the result so far goes to
    :func:`workbench.measure.gpu_results.save_partial` (a no-op unless ``$WORKBENCH_PARTIAL_OUT``
    is set): the run's facts, ``rows`` of the configurations measured so far (medians of their
    runs, verdicts against the baseline's runs so far; quality is measured after the last round)
    and the layers not measured, and ``stack``."""
    from workbench.bench.vs_transformers import device_name
    from workbench.engine.llm import LLM
    from workbench.measure.gpu_results import save_partial
    from workbench.measure.probe import noise_probe

    t0 = time.perf_counter()
    llm = LLM(model, device=device, dtype=dtype)
    probe = noise_probe()
    wl = build_workload(llm.tokenizer, WorkloadConfig.preset(mode), llm.max_model_len)
    cfg = E2EConfig.preset(mode)
    head = {"mode": mode, "device": str(llm.device), "device_name": device_name(llm.device),
            "dtype": str(llm.model.lm_head.weight.dtype).replace("torch.", ""), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "noise_threshold": probe.threshold, "workload": wl.describe(),
            "repeats": cfg.repeats}
    ab = Ablation(llm, wl, cfg, model=model).build()

    def on_run(r, c, row) -> None:
        if progress:
            print(f"[e2e] round {r + 1} {c.name}: {metric} {row[metric]:.1f}", file=sys.stderr, flush=True)
        # what is measured so far, in the finished result's shape (rows of the runs done, the stack), for a
        # time cap that stops the run (scripts/device_check.sh); the waterfall and the pick need every run
        try:
            save_partial({**head, "rows": report_rows(ab), "stack": ab.stack,
                          "seconds": time.perf_counter() - t0})
        except Exception as e:  # noqa: BLE001 - saving what there is must never stop the measuring
            print(f"[e2e] could not save the partial result: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    cap = None
    try:                                 # run_ablation's steps, saving as the runs go
        ab.warm_up()
        ab.run(progress=on_run)
        ab.measure_quality()
        slo = SLO(ttft_p95_ms=slo_ttft_p95_ms or max(ab.samples("baseline", "ttft_ms_p95")))
        rec = recommend(ab.candidates(), slo)
        if capacity and rec["pick"] not in (None, "reference LLM()"):
            from workbench.bench.tune import capacity_search   # the pick's capacity at the SLO, coarsely

            cap = capacity_search(ab, rec["pick"], slo, rounds=1, max_multiple=8.0, refine=1)
    finally:
        ab.close()
    return {**head, "rows": report_rows(ab), "stack": ab.stack, "waterfall": ab.waterfall(metric),
            "slo": slo.describe(), "recommendation": rec["pick"], "recommendation_reason": rec["reason"],
            "capacity": cap, "seconds": time.perf_counter() - t0}

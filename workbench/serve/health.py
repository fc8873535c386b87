"""What the server tells about its engine: the ``x-model-info`` header (:func:`model_info`),
the live paged KV pool for ``GET /v1/workbench/kv`` (:func:`kv_pool_report`), and the
engine's errors as ``/health`` shows them (:class:`EngineErrors`)."""

from __future__ import annotations

import time
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.kv.inspect import KV_POOL_OBJECT, pool_report_from_thread
from workbench.serve.chat_template import ChatTemplate
from workbench.serve.completion import engine_alive
from workbench.serve.guard import GuardHook
from workbench.serve.protocol import APIError
from workbench.serve.requests import CHAT_TEMPLATE_NAME


def shown_source(source: str | None) -> str | None:
    """Where the model came from, as clients may see it: a preset's name, or a folder's last part
    (``runs/smollm2``: ``smollm2``), never the server's absolute path."""
    if source is None or source.startswith("preset:") or source == "bundled":
        return source
    return Path(source).name or source


def model_info(aengine, name: str, source: str | None = None, guard: GuardHook | None = None,
               chat_template: ChatTemplate | None = None) -> dict:
    """The engine configuration that serves requests (the ``x-model-info`` header, as a dict)."""
    eng = aengine.engine
    llm, pool, cfg = eng.llm, eng.pool, eng.scheduler.config
    folder = Path(llm.tokenizer.path).parent if llm.tokenizer is not None else None
    info = {"model": name, "path": shown_source(source or (str(folder) if folder else None)),
            "architecture": getattr(eng.model.config, "architecture", None), "device": str(eng.device),
            "dtype": str(eng.model.lm_head.weight.dtype).removeprefix("torch."), "max_model_len": llm.max_model_len,
            "block_size": pool.block_size, "num_blocks": pool.num_blocks,
            "prefix_caching": pool.config.enable_prefix_caching,
            "scheduler": {k: getattr(cfg, k) for k in ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill",
                                                        "micro_batch_window_s", "preemption_mode",
                                                        "priority_preemption", "max_queue_len")},
            "chat_template": chat_template.origin if chat_template is not None else CHAT_TEMPLATE_NAME}
    if hasattr(eng, "fast_paths"):    # KV layout, static decode / compile / CUDA graphs, sampling backend
        info["engine"] = eng.fast_paths()
    streamer = getattr(eng, "weight_streamer", None)
    if streamer is not None:          # the prefetch layer's settings (its counters are on /metrics)
        info["stream_weights"] = streamer.settings()
    pc = pool.config
    if getattr(pc, "offload", None) or getattr(pc, "swap_space", None):   # the slower KV tiers and their lookahead
        info["kv_prefetch"] = {"offload": pc.offload, "swap_space": pc.swap_space,
                               "lookahead": pc.effective_lookahead, "staging_blocks": pc.prefetch_blocks}
    recipe = getattr(eng.model, "recipe", None)
    if recipe is not None:            # quantized layers: the recipe that made them and where they compute
        info["quant"] = dict(recipe.as_dict(), placement=getattr(eng.model, "quant_backend", None))
    store = getattr(eng, "tier_store", None)
    if getattr(eng, "tiers", None) is not None:      # the tiered cache: accounted, or physical with its store
        info["kv_tiers"] = {"config": eng.tiers.name, "store": store.offload if store else "accounted",
                            "predict": store.predict if store else None}
    choice = getattr(llm, "thread_choice", None)
    if choice is not None:   # torch intra-op threads and why (workbench.measure.threads)
        info["threads"] = choice.threads
        info["threads_policy"] = choice.policy
    try:
        from workbench.transforms import backends         # another layer; may be absent or still changing
    except Exception as e:  # noqa: BLE001 - the header must not take the server down
        info["backends_error"] = f"cannot import workbench.transforms.backends: {type(e).__name__}: {e}"
    else:
        describe = (getattr(backends, "describe_backends", None) if hasattr(backends, "describe_backends")
                    else getattr(backends, "current_backends", None))
        if describe is not None:
            try:
                info["backends"] = describe(eng.model)
            except Exception as e:  # noqa: BLE001
                info["backends_error"] = f"{type(e).__name__}: {e}"
    if guard is not None:
        info["slo_guard"] = guard.describe()
    return info


def kv_pool_report(aengine, name: str) -> dict:
    """``GET /v1/workbench/kv``: :func:`~workbench.kv.inspect.pool_report` of the engine's live
    paged KV pool (``block_states`` included: one state per physical block, for a block map),
    each live request's prefix reuse, plus ``object`` ("workbench.kv_pool") and ``server``:
    the served model, whether the engine thread runs, its last stats and how the snapshot was
    taken.

    The engine thread changes the pool during a step without a lock (as ``/metrics`` it is not
    stopped for a reader), so the report is read by
    :func:`~workbench.kv.inspect.pool_report_from_thread`: retried while the pool changes under
    it, kept when nothing changed during the read and its parts agree (``server.snapshot.stable``);
    503 with ``Retry-After`` if every read failed.  Blocking (it
    sleeps between tries): the route runs it on a worker thread, off the event loop."""
    eng = aengine.engine
    pool = getattr(eng, "kv_pool", None)
    if pool is None or not hasattr(pool, "manager"):
        kind = getattr(eng, "kv_mode", "another")
        raise APIError(501, f"this engine keeps KV in a {kind} cache per request, not a paged pool: nothing to "
                              "inspect here", None, "no_kv_pool")
    try:
        rep = pool_report_from_thread(pool)
    except WorkbenchError as e:                 # every read was torn: the engine is busy, ask again
        raise APIError(503, str(e), None, "kv_pool_busy", {"Retry-After": "1"}) from None
    snapshot = rep.pop("snapshot")
    alive = engine_alive(aengine)
    return {"object": KV_POOL_OBJECT, **rep,
            "server": {"model": name, "engine_alive": alive, "last_error": aengine.last_error,
                       "engine": aengine.stats(), "snapshot": snapshot}}



class EngineErrors:
    """The engine's last error and whether it is still current, for ``/health``.

    :class:`~workbench.sched.AsyncEngine` keeps ``last_error`` forever (no time, never cleared), so
    the server follows it: an error is new when ``last_error`` changes or the engine's
    ``last_step_error`` is another exception (a step that failed again the same way); it is
    noticed when an event ends a request with "error" (a failed step ends the requests it held)
    or when ``/health`` is asked, and stays current until the engine produces a token after it
    (on the engine's clock: a token computed before the error and delivered late does not count).
    An error that repeats a message word for word outside a step (``last_error`` unchanged) is not
    told apart.  Updated on the event loop only."""

    def __init__(self, aengine) -> None:
        self.aengine = aengine
        self.message: str | None = None   # the last error
        self.at: float | None = None      # when the server noticed it (Unix time)
        self.engine_at = 0.0              # ... on the engine's clock: tokens after this show recovery
        self.recovered_at: float | None = None
        self._seen: tuple = (None, None)  # (last_error, last_step_error) when last looked
        self.sync(aengine.engine.clock())

    @property
    def current(self) -> bool:
        return self.message is not None and self.recovered_at is None

    def sync(self, engine_at: float) -> None:
        """Notice an error not seen yet (``engine_at``: the engine's clock when it happened, or now)."""
        msg = self.aengine.last_error
        step_error = getattr(self.aengine.engine, "last_step_error", None)
        if msg == self._seen[0] and step_error is self._seen[1]:
            return
        self._seen = (msg, step_error)
        if msg is None and step_error is None:
            return
        self.message = msg or f"{type(step_error).__name__}: {step_error}"
        self.at, self.engine_at, self.recovered_at = time.time(), engine_at, None

    def event(self, ev) -> None:
        """One engine event of a request this server runs (cheap unless it matters)."""
        if ev.finish_reason == "error":
            self.sync(ev.time)
        elif ev.token_id >= 0 and self.current and ev.time > self.engine_at:
            self.recovered_at = time.time()

    def report(self, alive: bool) -> tuple[str | None, dict | None]:
        """(``last_error`` while current, else None; the last error with its times, or None)."""
        self.sync(self.aengine.engine.clock())
        if self.message is None:
            return None, None
        recovered = alive and self.recovered_at is not None
        return (None if recovered else self.message), {
            "message": self.message, "at": self.at, "recovered": recovered,
            "recovered_at": self.recovered_at if recovered else None}


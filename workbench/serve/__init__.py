"""An OpenAI-compatible HTTP server over the batched engine (``workbench serve``).

* ``protocol``: errors in OpenAI's shape; the raw body (Content-Type, UTF-8, nesting, lone
  surrogates);
* ``requests``: request validation (400s naming the field); the plain chat template;
* ``responses``: OpenAI's response / SSE chunk / usage / logprobs shapes;
* ``metrics``: Prometheus text for ``GET /metrics`` (TTFT / ITL histograms, finish reasons,
  queue, batch, KV, prefix hits, preemptions, rejections);
* ``app``: the Starlette app (:func:`create_app`, :class:`ServerConfig`): completions and chat
  completions (JSON or SSE), models, health, metrics, the live KV pool (``GET /v1/workbench/kv``),
  ``x-model-info`` / ``x-priority`` headers, API key, body and token limits, abort on client
  disconnect;
* ``state``: the app's state and the checks that need the engine (tokens, context, KV pool,
  ``max_tokens``), and the SLO guard's admission and queue hold;
* ``health``: ``x-model-info``, the live KV pool report and the engine's errors for ``/health``;
* ``chat_template``: a checkpoint's own Jinja chat template, applied as transformers applies it
  (:mod:`workbench.model.chat_template`, re-exported);
* ``completion``: one request on the engine (its choices, their events, the JSON or SSE answer);
* ``guard``: the SLO-guard hook (:class:`workbench.serve.slo.SLOGuard` or any object with
  ``admit(now=None, priority=0)`` and ``record(ttft_s)``): sheds with 503 + ``Retry-After``,
  learns from each request's TTFT, and shows its state on ``/metrics``;
* ``slo``: :class:`SLOGuard`, a latency circuit breaker on P95 TTFT against an EWMA baseline,
  and :class:`GuardedTarget` (the guard in front of any load target);
* ``server``: uvicorn on a background thread (:func:`start_server` -> :class:`ServerHandle`) or in
  the foreground (:func:`serve`, what the CLI runs).

::

    from workbench import serve
    with serve.start_server(device="cpu") as srv:            # bundled model, a free port on 127.0.0.1
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused")
        client.completions.create(model="bundled", prompt="The list type", max_tokens=8)

    from workbench.serve.slo import SLOConfig, SLOGuard
    start_server(device="cpu", guard=SLOGuard(SLOConfig(factor=3.0, cooldown_s=10)))

Needs ``starlette`` and ``uvicorn`` (imported on first use of the app or the server).
"""

from workbench._exports import lazy

_EXPORTS = {
    **{n: "workbench.serve.app" for n in ("ServerConfig", "create_app")},
    "model_info": "workbench.serve.health",
    **{n: "workbench.serve.guard" for n in ("GuardHook", "check_guard")},
    **{n: "workbench.serve.server" for n in ("ServerHandle", "build_engine", "serve", "start_server")},
    **{n: "workbench.serve.slo" for n in ("SLOConfig", "SLOGuard", "GuardedTarget", "Decision")},
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)

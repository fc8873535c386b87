"""Running the app: uvicorn on a background thread (notebooks, tests) or in the foreground (CLI).

::

    with start_server(model=None, device="cpu", port=0) as srv:     # the bundled model, a free port
        openai.OpenAI(base_url=srv.base_url, api_key="-").completions.create(...)
    srv.engine.stats(), srv.metrics                                  # the AsyncEngine and ServerMetrics

``engine`` may be an :class:`~workbench.sched.AsyncEngine` (used as is, started if needed, and
left running by ``stop()``), an :class:`~workbench.engine.core.LLMEngine` or an
:class:`~workbench.LLM` (wrapped; the wrapper thread is ours to stop), or None / a model path or
preset with keyword arguments for :func:`build_engine`.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
import time
from dataclasses import replace

from workbench.errors import ConfigError, WorkbenchError
from workbench.serve.app import ServerConfig, create_app


def build_engine(model=None, device=None, dtype=None, scheduler=None, kv=None, max_model_len: int | None = None):
    """An AsyncEngine (not started) over a new LLMEngine: ``model`` is a folder, ``preset:<name>``,
    None for the bundled model, or a loaded :class:`~workbench.LLM`; ``scheduler`` a
    :class:`~workbench.sched.SchedulerConfig`; ``kv`` a :class:`~workbench.kv.PagedKVConfig`."""
    from workbench.engine import AsyncEngine, LLMEngine

    return AsyncEngine(LLMEngine(model, device=device, dtype=dtype, kv=kv, scheduler=scheduler,
                                 max_model_len=max_model_len))


def _as_async_engine(engine, engine_kwargs: dict):
    """(AsyncEngine, whether we own it, the model's source for naming)."""
    from workbench.engine.llm import LLM
    from workbench.engine import AsyncEngine, LLMEngine

    if isinstance(engine, AsyncEngine):
        _no_kwargs(engine_kwargs, "an AsyncEngine")
        return engine, False, None
    if isinstance(engine, LLMEngine):
        _no_kwargs(engine_kwargs, "an LLMEngine")
        return AsyncEngine(engine), True, None
    if engine is None or isinstance(engine, (str, LLM)) or hasattr(engine, "__fspath__"):
        model = engine if engine is not None else engine_kwargs.pop("model", None)
        source = None if isinstance(model, LLM) else (None if model is None else str(model))
        return build_engine(model, **engine_kwargs), True, source
    raise ConfigError(f"start_server: engine must be an AsyncEngine, LLMEngine, LLM, a model path or None, "
                      f"got {type(engine).__name__}")


def _no_kwargs(kwargs: dict, what: str) -> None:
    if kwargs:
        raise ConfigError(f"start_server: {', '.join(sorted(kwargs))} cannot be applied to {what} that is already "
                          "built; configure the engine itself")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: the OS picks a free one).  Listening at once means a
    client that connects before uvicorn's loop starts waits in the backlog instead of being refused."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror} (another server on that port? "
                          "--port 0 picks a free one)") from None
    return sock


def _guard_text(desc: dict) -> str:
    """The start-up line's guard: its settings, not its class name, e.g. ``SLO guard on (opens when P95 TTFT
    > 2x baseline over 50 requests; reject)``."""
    c = desc.get("config") or {}
    if {"factor", "quantile", "window", "policy"} <= set(c):
        return (f"SLO guard on (opens when P{100 * c['quantile']:g} TTFT > {c['factor']:g}x baseline over "
                f"{c['window']} requests; {c['policy']})")
    return f"SLO guard on ({desc.get('type', 'custom')})"


def _url(host: str, port: int) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def exposure_warning(config: ServerConfig, sock: socket.socket | None = None) -> str | None:
    """The warning for a server that other machines can reach without an API key: judged on the
    address actually bound (``--host 0`` binds every interface as ``0.0.0.0`` does), or on
    ``config.host`` when there is no socket yet."""
    if config.api_key:
        return None
    if sock is not None:
        addr = sock.getsockname()[0]
    else:
        addr = {"": "0.0.0.0", "0": "0.0.0.0", "localhost": "127.0.0.1"}.get(config.host, config.host)
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:                               # a name not resolved yet: judge it when bound
        return None
    if ip.is_loopback:
        return None
    where = "all interfaces" if ip.is_unspecified else "an address other machines can reach"
    return (f"warning: listening on {where} ({addr}, --host {config.host}) without an API key: anyone who can reach "
            "this machine can use the model; set --api-key or WORKBENCH_API_KEY")


def _uvicorn_server(app, config: ServerConfig):
    """uvicorn with the edge's limits (:mod:`workbench.serve.connections`): at most
    ``max_connections`` open, a request's headers and body within ``request_timeout_s``, idle
    kept-alive connections closed after ``keep_alive_s``, request heads up to 16 KiB."""
    import uvicorn

    from workbench.serve.connections import HEADER_BYTES, default_max_connections, guarded_protocol

    srv = app.state.server
    protocol = guarded_protocol(config.max_connections or default_max_connections(), config.request_timeout_s,
                                srv.metrics.connections)
    return uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5,
                                         access_log=config.log_level in ("info", "debug", "trace"), http=protocol,
                                         timeout_keep_alive=config.keep_alive_s,
                                         h11_max_incomplete_event_size=HEADER_BYTES))


class ServerHandle:
    """A server running on a background thread: ``url``, ``base_url`` (for OpenAI clients),
    ``engine`` (the AsyncEngine), ``metrics``; ``stop()`` or use it as a context manager."""

    def __init__(self, server, thread: threading.Thread, app, aengine, owned: bool, config: ServerConfig,
                 port: int) -> None:
        self._server, self._thread, self.app, self.engine, self._owned = server, thread, app, aengine, owned
        self.config, self.host, self.port = config, config.host, port
        self.url = _url(config.host, port)
        self.base_url = self.url + "/v1"
        self.metrics = app.state.server.metrics
        self.guard = config.guard

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def refresh_model_info(self) -> dict:
        return self.app.state.server.refresh_model_info()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let open requests finish (5 s grace, then they are aborted), stop the
        engine if we started it."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._owned:
            self.engine.stop()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.url!r}, model={self.app.state.server.name!r}, running={self.running})"


def start_server(engine=None, config: ServerConfig | None = None, *, host: str | None = None,
                 port: int | None = None, model_name: str | None = None, api_key: str | None = None,
                 guard=None, startup_timeout: float = 60.0, **engine_kwargs) -> ServerHandle:
    """Serve ``engine`` (see the module docstring) on a background thread; returns when it accepts
    connections.  ``host``/``port``/``model_name``/``api_key``/``guard`` (an SLO guard, e.g.
    :class:`workbench.serve.slo.SLOGuard`) override ``config``; the default port here is 0 (a free
    one: read ``handle.port``)."""
    over = {k: v for k, v in dict(host=host, port=port, model_name=model_name, api_key=api_key,
                                  guard=guard).items() if v is not None}
    config = replace(config or ServerConfig(port=0), **over)
    aengine, owned, source = _as_async_engine(engine, dict(engine_kwargs))
    aengine.start()
    try:
        app = create_app(aengine, config, source)
        sock = bind_socket(config.host, config.port)
        warning = exposure_warning(config, sock)
        if warning:
            print(warning, file=sys.stderr)
        server = _uvicorn_server(app, config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="workbench-serve", daemon=True)
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise WorkbenchError(f"the HTTP server did not start within {startup_timeout} s "
                                     "(see the log above)")
            time.sleep(0.01)
    except BaseException:
        if owned:
            aengine.stop()
        raise
    return ServerHandle(server, thread, app, aengine, owned, config, sock.getsockname()[1])


def serve(engine=None, config: ServerConfig | None = None, announce=print, guard=None, **engine_kwargs) -> int:
    """Serve in the foreground until Ctrl-C (what ``workbench serve`` runs); ``guard``: an SLO
    guard (overrides ``config.guard``)."""
    config = config or ServerConfig()
    if guard is not None:
        config = replace(config, guard=guard)
    aengine, owned, source = _as_async_engine(engine, dict(engine_kwargs))
    app = create_app(aengine, config, source)
    sock = bind_socket(config.host, config.port)
    aengine.start()
    try:
        info = app.state.server.info
        url = _url(config.host, sock.getsockname()[1])
        announce(f"workbench serve: {url}/v1  model {info['model']!r} on {info['device']} ({info['dtype']}), "
                 f"{info['num_blocks']} KV blocks of {info['block_size']}, port {sock.getsockname()[1]}"
                 + (f", {_guard_text(info['slo_guard'])}" if "slo_guard" in info else ""))
        warning = exposure_warning(config, sock)
        if warning:
            print(warning, file=sys.stderr)
        _uvicorn_server(app, config).run(sockets=[sock])
    finally:
        if owned:
            aengine.stop()
    return 0

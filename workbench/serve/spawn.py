"""``workbench serve`` in a child process: started, its address read from its first line, stopped.

::

    with spawn_server(["--port", "0", "--max-num-seqs", "4"]) as srv:
        httpx.post(srv.url + "/v1/completions", json={...})
    srv.log()                      # what it printed (its last lines), e.g. for an error message

The server announces itself with one line, ``workbench serve: http://HOST:PORT/v1 ...``
(:func:`workbench.serve.server.serve`); this reads its output until that line (or the process
ends, or ``timeout_s`` passes: a :class:`~workbench.errors.WorkbenchError` with its last lines),
then keeps draining the output on a thread so the server never blocks on a full pipe.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from workbench.errors import WorkbenchError

_ANNOUNCE = re.compile(r"^workbench serve: (http://\S+?)/v1\s")


@dataclass
class ServedProcess:
    """A running ``workbench serve``: its base ``url`` (no ``/v1``), ``port`` and process."""

    url: str
    port: int
    proc: subprocess.Popen
    announce: str = ""                   # the line it printed: address, model, device, KV blocks
    lines: deque = field(default_factory=lambda: deque(maxlen=200))

    def log(self, n: int = 20) -> str:
        return "".join(list(self.lines)[-n:])


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate ``proc``, and kill it when it has not ended within ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(flags: list[str], timeout_s: float = 120.0, env: dict | None = None,
                 python: str | None = None) -> ServedProcess:
    """``python -m workbench.cli.main serve FLAGS`` (give ``--port 0`` for a free port), once it has
    announced its address; stop it with :func:`stop_process` (or use :func:`spawn_server`)."""
    argv = [python or sys.executable, "-m", "workbench.cli.main", "serve", *map(str, flags)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    lines: deque = deque(maxlen=200)
    deadline = time.monotonic() + timeout_s
    box: dict = {}

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = _ANNOUNCE.match(line)
            if m and "url" not in box:
                box["line"] = line.rstrip("\n")
                box["url"] = m.group(1)

    reader = threading.Thread(target=read, name="workbench-serve-output", daemon=True)
    reader.start()
    while "url" not in box:
        if proc.poll() is not None:
            reader.join(timeout=2)
            tail = " | ".join(x.strip() for x in list(lines)[-6:] if x.strip())
            raise WorkbenchError(f"workbench serve ended with status {proc.returncode} before it served: {tail}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise WorkbenchError(f"workbench serve did not announce its address within {timeout_s:.0f} s")
        time.sleep(0.05)
    url = box["url"]
    return ServedProcess(url, int(url.rsplit(":", 1)[1]), proc, box["line"], lines)


@contextlib.contextmanager
def spawn_server(flags: list[str], timeout_s: float = 120.0, env: dict | None = None):
    """:func:`start_server` as a context manager: the server is stopped on the way out."""
    srv = start_server(flags, timeout_s=timeout_s, env=env)
    try:
        yield srv
    finally:
        stop_process(srv.proc)

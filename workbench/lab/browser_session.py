"""The two processes a browser run needs, each for a ``with`` block: ``jupyter lab`` on a free
loopback port with its own settings (:class:`JupyterLab`) and headless Debian Chromium through
Playwright (:class:`Browser`); :func:`chromium_available` says why there is no browser here.
Running a notebook in them is :mod:`workbench.lab.browser`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# Debian's chromium; elsewhere whichever chromium is on PATH (a snap wrapper may not run in a container)
CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM") or next(
    (p for p in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or "")
     if p and Path(p).is_file()), "/usr/bin/chromium")
# as root, on a machine with no network: no sandbox, no GPU, no background connections
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage"]

_SETTINGS = {
    # every cell in the DOM: live views below the fold still render, screenshots see them
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
    # no autosave: one that lands while the run's own save starts (a notebook that runs about
    # 120 s, the default interval) makes JupyterLab ask "File Changed: overwrite or revert?" and
    # the save waits on that dialog for ever (seen in CI with 03_prefetch)
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    # as the Quick start sets it up (scripts/quickstart.sh): a saved notebook keeps its widgets' state, so
    # an interactive control (01's per-op toggle) reopens drawn, not as "model not found"
    "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium_available() -> str | None:
    """Why a browser run cannot happen here, or None when it can."""
    if not Path(CHROMIUM).is_file():
        return f"{CHROMIUM} not found (Debian: apt-get install chromium; or set WORKBENCH_CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; its own browser download is not needed)"
    return None


def _end_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the process that started it dies, so a
    test process killed by its timeout does not leave a JupyterLab and its kernels running."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


class JupyterLab:
    """``jupyter lab`` on 127.0.0.1 serving ``root_dir``, for the duration of a ``with`` block."""

    def __init__(self, root_dir, startup_timeout: float = 90.0, notebook_timeout: float | None = None) -> None:
        """``notebook_timeout``: the time a notebook gets; every kernel then writes its threads'
        stacks into ``stacks_dir`` shortly before it (:func:`workbench.lab.stacks.stack_dump_spec`), so a notebook
        past its limit says where it was."""
        self.root_dir = Path(root_dir).resolve()
        self.startup_timeout = startup_timeout
        self.notebook_timeout = notebook_timeout
        self.stacks_dir: Path | None = None
        self.token = os.urandom(12).hex()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._tmp: str | None = None

    def __enter__(self) -> JupyterLab:
        self._tmp = tempfile.mkdtemp(prefix="wb-lab-")
        settings = Path(self._tmp) / "settings"
        for rel, value in _SETTINGS.items():
            p = settings / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(value))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
               f"--ServerApp.root_dir={self.root_dir}", f"--IdentityProvider.token={self.token}",
               f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={Path(self._tmp) / 'ws'}",
               "--LabApp.expose_app_in_browser=True", "--ServerApp.quit_button=False", "--allow-root"]
        self.log_path = Path(self._tmp) / "lab.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "JUPYTER_PLATFORM_DIRS": "1"}
        if self.notebook_timeout:
            from workbench import STACK_DUMP_ENV
            from workbench.lab.stacks import stack_dump_spec

            self.stacks_dir = Path(self._tmp) / "stacks"
            self.stacks_dir.mkdir()
            env[STACK_DUMP_ENV] = stack_dump_spec(self.notebook_timeout, self.stacks_dir)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(self.root_dir), env=env,
                                     preexec_fn=_end_with_parent)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise RuntimeError(f"jupyter lab did not answer within {self.startup_timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def notebook_url(self, rel_path: str) -> str:
        return f"{self.url}/lab/tree/{rel_path}?token={self.token}&reset"

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if getattr(self, "_log", None):
            self._log.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


class Browser:
    """Headless Debian Chromium through Playwright, for a ``with`` block."""

    def __init__(self, viewport=(1280, 900)) -> None:
        self.viewport = {"width": viewport[0], "height": viewport[1]}

    def __enter__(self) -> Browser:
        from playwright.sync_api import sync_playwright

        why = chromium_available()
        if why:
            raise RuntimeError(f"no browser: {why}")
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        return self

    def new_page(self):
        page = self.browser.new_page(viewport=self.viewport)
        page.set_default_timeout(60_000)
        return page

    def __exit__(self, *exc) -> None:
        try:
            self.browser.close()
        finally:
            self._pw.stop()



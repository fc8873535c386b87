"""JIT and compile seconds of one step of the device check: :class:`CompileLog` counts them in the
step's process (``python -m workbench.cli.gpu_results run``) and writes the totals to
``$WORKBENCH_COMPILE_LOG``; :func:`read_compile_log` reads them back for ``summary.csv``
(re-exported by :mod:`workbench.measure.gpu_results`).  Standard library only: Triton and torch
are looked up when present."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

COMPILE_ENV = "WORKBENCH_COMPILE_LOG"      # where a step's process writes its JIT / compile seconds (JSON)


class CompileLog:
    """Seconds a process spends compiling: Triton JIT (``JITFunction._do_compile``: a compile, or
    a load from Triton's cache; ``triton_compiles`` counts them), Triton autotuning
    (``Autotuner._bench``: benchmarking one config, its compile included, so not counted again in
    ``triton_jit_s``) and inductor (``torch.compile``: dynamo's ``_compile.compile_inner``, read at
    the end).  ``compile_s`` is their sum.  :meth:`install` patches the Triton classes (what exists in this Triton is
    patched; a missing API is left alone); :meth:`dump` writes the totals as JSON."""

    def __init__(self) -> None:
        self.triton_compiles = 0
        self.triton_jit_s = 0.0
        self.autotune_s = 0.0
        self.autotunes = 0
        self._depth = 0

    def install(self) -> CompileLog:
        try:
            from triton.runtime.jit import JITFunction  # lazy: triton is optional (and ~0.7 s)
        except Exception:  # noqa: BLE001 - no triton: inductor only
            return self
        log = self

        def wrap(fn, bench: bool):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                if bench:
                    log._depth += 1
                try:
                    return fn(*a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    if bench:
                        log._depth -= 1
                        log.autotunes += 1
                        log.autotune_s += dt
                    else:
                        log.triton_compiles += 1
                        if not log._depth:           # inside autotuning: counted in autotune_s
                            log.triton_jit_s += dt
            wrapper.__wrapped__ = fn
            return wrapper

        if hasattr(JITFunction, "_do_compile"):
            if not hasattr(JITFunction._do_compile, "__wrapped__"):
                JITFunction._do_compile = wrap(JITFunction._do_compile, False)
        else:               # a Triton without it: the compile entry point a kernel's binder picks up on first run
            try:
                import triton.compiler as tc

                if not hasattr(tc.compile, "__wrapped__"):
                    tc.compile = wrap(tc.compile, False)
            except Exception:  # noqa: BLE001
                pass
        try:
            from triton.runtime.autotuner import Autotuner

            if hasattr(Autotuner, "_bench") and not hasattr(Autotuner._bench, "__wrapped__"):
                Autotuner._bench = wrap(Autotuner._bench, True)
        except Exception:  # noqa: BLE001
            pass
        return self

    @staticmethod
    def inductor_seconds() -> float:
        utils = sys.modules.get("torch._dynamo.utils")
        metrics = getattr(utils, "compilation_time_metrics", None) or {}
        for key in ("_compile.compile_inner", "compile_inner"):
            if key in metrics:
                return float(sum(metrics[key]))
        return 0.0

    def totals(self) -> dict:
        inductor = self.inductor_seconds()
        return {"compile_s": round(self.triton_jit_s + self.autotune_s + inductor, 2),
                "triton_compiles": self.triton_compiles, "triton_jit_s": round(self.triton_jit_s, 2),
                "autotune_s": round(self.autotune_s, 2), "autotunes": self.autotunes, "inductor_s": round(inductor, 2)}

    def dump(self, path: str | Path | None = None) -> None:
        target = path or os.environ.get(COMPILE_ENV)
        if target:
            try:
                Path(target).write_text(json.dumps(self.totals()))
            except OSError:
                pass


def read_compile_log(path: str | Path) -> dict:
    """A step's compile totals (empty when the step wrote none)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def check_triton_hooks() -> str:
    """Install a :class:`CompileLog` in this process and check it hooked this Triton's
    ``JITFunction._do_compile`` and ``Autotuner._bench`` (without them every step's compile_s reads 0);
    raises RuntimeError naming what is missing, else returns a one-line report.  It patches Triton's
    classes for the rest of the process: run it in a process of its own (``.ci/run`` does, with triton 3.6)."""
    import triton
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    CompileLog().install()
    hooks = (("JITFunction._do_compile", getattr(JITFunction, "_do_compile", None)),
             ("Autotuner._bench", getattr(Autotuner, "_bench", None)))
    missing = [n for n, f in hooks if not hasattr(f, "__wrapped__")]
    if missing:
        raise RuntimeError(f"CompileLog does not hook {missing} in triton {triton.__version__}: compile_s would read 0")
    return f"CompileLog hooks triton {triton.__version__}"

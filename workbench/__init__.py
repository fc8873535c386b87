"""The LLM-inference workbench: build, measure and tune each layer of a serving stack.

Public API (vLLM's vocabulary)::

    import workbench
    model = workbench.load_model("preset:llama-3.2-1b", device="cuda")   # logits = model(input_ids)
    llm = workbench.LLM()                                                 # the bundled model
    outs = llm.generate(["Python is"], workbench.SamplingParams(temperature=0, max_tokens=20))
    workbench.summarize(outs)                                             # P50/P95/P99 + jitter

The package is laid out as the stack, one folder per layer (lower layers never import higher
ones; ``.importlinter`` states the order and CI checks it):

* ``model/``      config, presets, checkpoint checks, loader, tokenizer, the decoder, the cache interface;
* ``kv/``         the KV-cache layer: paged blocks, prefix cache, pool, offload, hot / warm / cold tiers;
* ``prefetch/``   asynchronous weight and KV fetches: transports, the prefetcher, weight streaming, links;
* ``sched/``      the scheduler, pure Python (no torch);
* ``transforms/`` transformations of the plain model: per-op kernel backends, CUDA graphs,
  ahead-of-time kernel builds;
* ``quant/``      quantization: recipes, RTN / AWQ / GPTQ / SmoothQuant, CPU and Triton ops, the calibrator,
  compressed-tensors checkpoints;
* ``engine/``     ``LLM`` and ``LLMEngine``: runners, sampling, outputs, metrics, the engine thread;
* ``load/``       load generation against any target that streams tokens;
* ``bench/``      every benchmark (vs transformers, kernels, scheduler, prefix cache, tiers, llama.cpp) and
  the claims lab (``bench/claims/``): everything that measures;
* ``serve/``      the OpenAI-compatible server, with its SLO guard;
* ``lab/``        notebooks' side: papermill runs, sweep executors, results, report, every plotly / ipywidgets
  view; it measures nothing itself;
* ``cli/``        ``workbench ...``, the only argparse;
* ``measure/``    measuring on a noisy machine (threads, noise, A/B verdicts), used by every layer above.

Names below are imported on first use: ``import workbench`` alone loads neither torch nor plotly.
"""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path

from workbench._exports import exports as _exports
from workbench._exports import lazy as _lazy
from workbench.errors import WorkbenchError


def _register_kernels_package() -> None:
    """Make ``import workbench_kernels`` work in a plain checkout (PYTHONPATH=.), where the
    setuptools mapping of ``kernels/workbench_kernels/`` is not installed."""
    if "workbench_kernels" in _sys.modules or _ilu.find_spec("workbench_kernels") is not None:
        return
    init = _Path(__file__).resolve().parent.parent / "kernels" / "workbench_kernels" / "__init__.py"
    if init.is_file():
        spec = _ilu.spec_from_file_location("workbench_kernels", init, submodule_search_locations=[str(init.parent)])
        module = _ilu.module_from_spec(spec)
        _sys.modules["workbench_kernels"] = module
        spec.loader.exec_module(module)


_register_kernels_package()

STACK_DUMP_ENV = "WORKBENCH_STACK_DUMP"
_stack_file = None


def _arm_stack_dump() -> None:
    """``WORKBENCH_STACK_DUMP=<seconds>:<folder>`` (set by the notebook runners for the kernels
    they start): every ``seconds`` this process writes the stack of each of its threads to
    ``<folder>/stacks-<pid>.txt`` (``faulthandler``, from a C thread: it works while Python
    code is stuck), so a notebook that runs past its time limit says where it was."""
    global _stack_file
    import os

    spec = os.environ.get(STACK_DUMP_ENV, "")
    if _stack_file is not None or ":" not in spec:
        return
    seconds, folder = spec.split(":", 1)
    try:
        import faulthandler

        _stack_file = open(_Path(folder) / f"stacks-{os.getpid()}.txt", "w")  # noqa: SIM115 - open for the process' life
        faulthandler.dump_traceback_later(max(float(seconds), 1.0), repeat=True, file=_stack_file)
    except (OSError, ValueError):   # a bad value or folder: no dumps, the process runs as usual
        _stack_file = None


_arm_stack_dump()

_EXPORTS = _exports({
    "workbench.model.config": "ModelConfig",
    "workbench.model.loader": "BUNDLED_MODEL load_model save_model",
    "workbench.model.decoder": "CausalLM",
    "workbench.model.tokenizer": "Tokenizer",
    "workbench.engine.sampling": "SamplingParams",
    "workbench.engine.llm": "LLM",
    "workbench.engine.types": "RequestOutput StreamEvent",
    "workbench.engine.core": "LLMEngine",
    "workbench.engine.config": "EngineConfig",
    "workbench.engine.async_engine": "AsyncEngine",
    "workbench.engine.metrics": "RequestMetrics summarize",
    "workbench.sched.config": "SchedulerConfig",
    "workbench.kv.paged": "PagedKVConfig",
    "workbench.kv.tier_config": "TierConfig",
})
__all__ = ["WorkbenchError", *_EXPORTS]
__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
__version__ = "0.1.0"

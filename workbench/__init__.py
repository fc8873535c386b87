"""The LLM-inference workbench: build, measure and tune each layer of a serving stack.

Public API (vLLM's vocabulary)::

    import workbench
    model = workbench.load_model("preset:llama-3.2-1b", device="cuda")   # logits = model(input_ids)
    llm = workbench.LLM()                                                 # the bundled model
    outs = llm.generate(["Python is"], workbench.SamplingParams(temperature=0, max_tokens=20))
    workbench.summarize(outs)                                             # P50/P95/P99 + jitter
"""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path


def _register_kernels_package() -> None:
    """Make ``import workbench_kernels`` work in a plain checkout (PYTHONPATH=.), where the
    setuptools mapping of the ``kernels/`` folder is not installed."""
    if "workbench_kernels" in _sys.modules or _ilu.find_spec("workbench_kernels") is not None:
        return
    init = _Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    if init.is_file():
        spec = _ilu.spec_from_file_location("workbench_kernels", init, submodule_search_locations=[str(init.parent)])
        module = _ilu.module_from_spec(spec)
        _sys.modules["workbench_kernels"] = module
        spec.loader.exec_module(module)


_register_kernels_package()

from .errors import WorkbenchError  # noqa: E402
from .config import ModelConfig  # noqa: E402
from .loader import BUNDLED_MODEL, load_model, save_model
from .model import CausalLM
from .sampling import SamplingParams
from .engine import LLM, RequestOutput, StreamEvent
from .sched import LLMEngine, SchedulerConfig
from .metrics import RequestMetrics, summarize
from .tokenizer import Tokenizer

__all__ = ["WorkbenchError", "ModelConfig", "BUNDLED_MODEL", "load_model", "save_model", "CausalLM",
           "SamplingParams", "LLM", "LLMEngine", "SchedulerConfig", "RequestOutput", "StreamEvent", "RequestMetrics", "summarize", "Tokenizer"]
__version__ = "0.1.0"

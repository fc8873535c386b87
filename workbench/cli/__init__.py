"""The command line, ``workbench <command>``: the only place that parses arguments.

* ``main``: the parser of every subcommand, and ``main`` (the ``workbench`` entry point);
* the subcommands, a module per group: ``model`` (generate, info, kv-inspect), ``bench`` (bench,
  prefix-bench, sched-bench), ``notebooks`` (run-notebooks), ``serve``, ``kernels``
  (kernels-bench, kernels-aot), ``load``; ``options``: the options several of them share;
* ``gpu_results``: the device check's helper (``python -m workbench.cli.gpu_results``).
"""

from workbench._exports import lazy

_EXPORTS = {"main": "workbench.cli.main"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)

"""The command line, ``workbench <command>``: the only place that parses arguments.

* ``main``: every subcommand (generate, bench, serve, kv-inspect, run-notebooks, ...);
* ``load``: ``workbench load``.
"""

from workbench._exports import lazy

_EXPORTS = {"main": "workbench.cli.main"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)

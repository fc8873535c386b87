"""Lazy exports: a package names what it offers without importing it until it is used.

``import workbench.sched.scheduler`` must not load torch (the scheduler is pure Python), and
``import workbench`` must not load the model, the engine or plotly.  A package lists its public
names with the module each lives in; the module is imported on first access (PEP 562)::

    __all__ = ["LLM", ...]
    __getattr__, __dir__ = lazy(__name__, exports({"workbench.engine.llm": "LLM ReferenceLoop", ...}))
"""

from __future__ import annotations

import importlib
import sys


def lazy(package: str, table: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package``: ``name`` comes from module ``table[name]``."""
    def __getattr__(name: str):
        try:
            module = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)       # the next access is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__


def exports(modules: dict[str, str]) -> dict[str, str]:
    """``{module: "Name1 Name2"}`` -> ``{name: module}``, the table :func:`lazy` takes."""
    return {name: module for module, names in modules.items() for name in names.split()}

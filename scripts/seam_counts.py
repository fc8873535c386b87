"""The engine's seams in numbers: what issue 42's done-means counts, measured from the source.

    python scripts/seam_counts.py            # a table
    python scripts/seam_counts.py --json     # the same as one JSON object

Every figure is read from ``workbench/`` with :mod:`ast` (no import of the package), so it can be
run on any checkout to compare before and after.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workbench"
BACKEND_MODULES = {"workbench/transforms/backends.py", "workbench/transforms/backend_modules.py"}


def _files():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def _init_params(tree: ast.Module, cls: str) -> int | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return _params(item)
    return None


def _funcs(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _length(fn) -> int:
    return fn.end_lineno - fn.lineno + 1


def _private_calls_of_others(tree: ast.Module) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` / ``cls`` (a private name of another object)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


def _bare_dict_returns(tree) -> int:
    return sum(1 for fn in _funcs(tree) if fn.returns is not None
               and ast.unparse(fn.returns).strip("'\"") in ("dict", "dict | None"))


def counts() -> dict:
    trees = {_rel(p): ast.parse(p.read_text(), filename=str(p)) for p in _files()}
    texts = {_rel(p): p.read_text() for p in _files()}
    # imports inside functions, counted once per statement (nested functions are walked by their parent too)
    inner = 0
    for tree in trees.values():
        seen = set()
        for fn in _funcs(tree):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in seen:
                    seen.add(id(node))
        inner += len(seen)
    long_fns = sorted(((_length(fn), f"{path}:{fn.lineno} {fn.name}") for path, tree in trees.items()
                       for fn in _funcs(tree) if _length(fn) > 100), reverse=True)
    calibrate = next((_length(fn) for fn in _funcs(trees["workbench/quant/calibrate.py"])
                      if fn.name == "calibrate"), None)
    # a class's __getattr__ forwards attribute reads to another object; a module's (PEP 562, the package's
    # lazy exports in workbench/_exports.py) does not
    getattr_fwd = [f"{path}:{item.lineno}" for path, tree in trees.items() for node in ast.walk(tree)
                   if isinstance(node, ast.ClassDef) for item in node.body
                   if isinstance(item, ast.FunctionDef) and item.name == "__getattr__"]
    wb_ops = {path: len(re.findall(r"_wb_ops", text)) for path, text in texts.items()
              if "_wb_ops" in text and path not in BACKEND_MODULES}
    sched_private = _private_calls_of_others(trees["workbench/sched/scheduler.py"])
    return {
        "LLM.__init__ parameters": _init_params(trees["workbench/engine/llm.py"], "LLM"),
        "LLMEngine.__init__ parameters": _init_params(trees["workbench/engine/core.py"], "LLMEngine"),
        "functions over 100 lines": len(long_fns),
        "longest functions": [f"{n} lines {name}" for n, name in long_fns[:8]],
        "quant.calibrate.calibrate lines": calibrate,
        "scheduler: private names of other objects": len(sched_private),
        "scheduler private uses": sched_private,
        "classes defining __getattr__": len(getattr_fwd),
        "__getattr__ where": getattr_fwd,
        "_wb_ops outside the backend modules": sum(wb_ops.values()),
        "_wb_ops where": wb_ops,
        "Sequence.state uses": sum(len(re.findall(r"\.state\[|\.state\.(pop|get|setdefault)\(", t))
                                   for p, t in texts.items() if p.startswith("workbench/")),
        "imports inside functions": inner,
        "functions annotated -> dict": sum(_bare_dict_returns(t) for t in trees.values()),
        "lines over 100 characters": sum(1 for t in texts.values() for line in t.splitlines() if len(line) > 100),
        "lines over 110 characters": sum(1 for t in texts.values() for line in t.splitlines() if len(line) > 110),
        "docstrings naming workbench.sched.LLMEngine": sum(t.count("workbench.sched.LLMEngine")
                                                          for t in texts.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    c = counts()
    if args.json:
        print(json.dumps(c, indent=1))
        return
    for k, v in c.items():
        if isinstance(v, (list, dict)):
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for _, x in list(items)[:8]:
                print(f"    {x}" if isinstance(v, list) else f"    {_}: {x}")
        else:
            print(f"{k:48s} {v}")


if __name__ == "__main__":
    main()

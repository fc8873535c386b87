"""Layout promises: the kernels folder's import name, lazy notebook dependencies, env files."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, cwd: Path = ROOT) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_transformers_does_not_see_our_kernels_folder():
    # From the repository root, where a folder named kernels/ sits next to the code.
    out = _run("import transformers; from transformers.utils import is_kernels_available; "
               "import workbench_kernels, workbench; print(is_kernels_available(), workbench_kernels.__name__)")
    assert out == "False workbench_kernels"


def test_plain_checkout_import_of_kernels_package(tmp_path):
    # PYTHONPATH=<repo> without an install (as on a bare GPU machine): workbench registers the name.
    code = ("import sys; sys.path.insert(0, %r); import workbench, workbench_kernels; "
            "print(workbench_kernels.__file__)" % str(ROOT))
    assert _run(code, cwd=tmp_path).endswith("kernels/__init__.py")


def test_core_import_does_not_pull_notebook_dependencies():
    out = _run("import sys, workbench, workbench.engine, workbench.bench, workbench.cli; "
               "print(sorted(m for m in ('plotly', 'papermill', 'ipywidgets', 'anywidget', 'jupyterlab') "
               "if m in sys.modules))")
    assert out == "[]"


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = (ROOT / "environment.yml").read_text()
    names = [d.split(">")[0].split("=")[0].split(";")[0].strip() for d in project["dependencies"]]
    names += [d.split(">")[0].strip() for d in project["optional-dependencies"]["dev"]]
    missing = [n for n in names if n not in env]
    assert not missing, f"environment.yml lacks {missing}"
    assert "-e .[dev]" in env
    assert project["scripts"]["workbench"] == "workbench.cli:main"
    for needed in ("torch", "triton", "safetensors", "tokenizers", "jupyterlab", "ipywidgets", "anywidget",
                   "plotly", "pandas", "papermill", "tqdm"):
        assert any(n == needed for n in names), needed
    assert "nbval" in project["optional-dependencies"]["dev"][2]


def test_every_subpackage_is_packaged():
    """A non-editable install ships only the packages pyproject lists."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "workbench").rglob("__init__.py")}
    assert found <= listed, f"pyproject.toml [tool.setuptools] packages lacks {sorted(found - listed)}"

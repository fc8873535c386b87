"""Layout promises: the kernels folder's import name, lazy notebook dependencies, env files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, cwd: Path = ROOT, env: dict | None = None) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600,
                       env=None if env is None else {**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_transformers_does_not_see_our_kernels_folder():
    # From the repository root, where a folder named kernels/ sits next to the code and `python -c`
    # (as `python -m pytest`) puts the root first on sys.path: transformers >= 5.25 installs the
    # Hugging Face kernel hub (import name `kernels`) and imports it; a kernels/__init__.py here
    # once made it import our folder instead and fail.
    out = _run("import importlib.util as u, transformers, transformers.integrations.hub_kernels, workbench_kernels, "
               "workbench; s = u.find_spec('kernels'); "
               f"print(s is not None and s.origin is not None and s.origin.startswith({str(ROOT / 'kernels')!r}), "
               "workbench_kernels.__name__)")
    assert out == "False workbench_kernels"


def test_an_installed_kernels_package_wins_over_our_folder(tmp_path):
    # whether or not this environment has the kernel hub: a stand-in named `kernels` on sys.path
    # (after the repository root, as site-packages is) is the one `import kernels` finds
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'the installed kernels package'\n")
    out = _run("import kernels, workbench_kernels; print(kernels.WHO)", env={"PYTHONPATH": str(tmp_path)})
    assert out == "the installed kernels package"


def test_plain_checkout_import_of_kernels_package(tmp_path):
    # PYTHONPATH=<repo> without an install (as on a bare GPU machine): workbench registers the name.
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import workbench, workbench_kernels; "
            "print(workbench_kernels.__file__)")
    assert _run(code, cwd=tmp_path).endswith("kernels/workbench_kernels/__init__.py")


def test_core_import_does_not_pull_notebook_dependencies():
    out = _run("import sys, workbench, workbench.engine.llm, workbench.bench.vs_transformers, workbench.cli.main; "
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
    # the conda environment installs the same extras as the Quick start (scripts/quickstart.sh)
    # (uv's install and pip's fallback: the same extras)
    installs = re.findall(r'pip install -q (?:--python \S+ --compile-bytecode )?-e "\.\[([a-z,-]+)\]"',
                          (ROOT / "scripts" / "quickstart.sh").read_text())
    assert len(installs) == 2 and len(set(installs)) == 1, \
        f"scripts/quickstart.sh: uv's and pip's editable installs with extras: {installs}"
    extras = installs[0]
    assert f"-e .[{extras}]" in env, f"environment.yml should install -e .[{extras}] as the Quick start does"
    assert set(extras.split(",")) <= set(project["optional-dependencies"]), extras
    assert project["scripts"]["workbench"] == "workbench.cli.main:main"
    for needed in ("torch", "triton", "safetensors", "tokenizers", "jupyterlab", "ipywidgets", "anywidget",
                   "plotly", "pandas", "papermill", "tqdm"):
        assert any(n == needed for n in names), needed
    assert "nbval" in project["optional-dependencies"]["dev"][2]


def test_every_subpackage_is_packaged():
    """A non-editable install ships only the packages pyproject lists."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "workbench").rglob("__init__.py")}
    assert found <= listed, f"pyproject.toml [tool.setuptools] packages lacks {sorted(found - listed)}"


def test_declared_floors_admit_the_gpu_image():
    """The GPU machine's image (torch 2.11, triton 3.6, transformers 5.17) is inside the ranges."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {d.split(">=")[0]: d.split(">=")[1].split(";")[0].strip() for d in deps if ">=" in d}

    def version(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    for name, image in (("torch", "2.11.0"), ("triton", "3.6.0"), ("transformers", "5.17.0")):
        assert version(floors[name]) <= version(image), f"{name}>={floors[name]} excludes the GPU image's {image}"


def test_old_triton_interpreter_with_new_numpy_fails_with_one_clear_error(monkeypatch):
    """Triton 3.6's interpreter cannot run the kernels with numpy >= 2.4 (measured): a launch
    under TRITON_INTERPRET=1 says so, naming both versions, instead of a deep Triton error."""
    import numpy
    import triton

    import workbench  # noqa: F401 - registers workbench_kernels
    import workbench_kernels as wk

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for tv, nv, bad in (("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False),
                        ("3.9.0", "2.5.2", False)):
        monkeypatch.setattr(triton, "__version__", tv)
        monkeypatch.setattr(numpy, "__version__", nv)
        monkeypatch.setattr(wk, "_INTERPRETER_PROBLEM", [])
        if bad:
            with pytest.raises(RuntimeError, match=rf"triton {tv} .* numpy {nv}.*triton >= 3.7 or numpy < 2.4"):
                wk.check_interpreter()
        else:
            wk.check_interpreter()
    monkeypatch.setattr(wk, "_INTERPRETER_PROBLEM", [])
    monkeypatch.setenv("TRITON_INTERPRET", "0")      # compiled kernels: never checked
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    wk.check_interpreter()

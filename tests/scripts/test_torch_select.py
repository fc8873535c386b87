"""scripts/torch_select.py: which torch build the Quick start installs, from simulated nvidia-smi
output and the overrides; and scripts/quickstart.sh's use of it (its QUICKSTART_DRY_RUN mode)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "torch_select.py"
QUICKSTART = ROOT / "scripts" / "quickstart.sh"

_spec = importlib.util.spec_from_file_location("torch_select", SCRIPT)
torch_select = importlib.util.module_from_spec(_spec)
sys.modules["torch_select"] = torch_select   # dataclasses look their module up by name
_spec.loader.exec_module(torch_select)

# nvidia-smi's default output (header and GPU table), as printed by an R570 driver (CUDA 12.8)
SMI_H100_128 = """\
Mon Sep 21 10:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.124.06             Driver Version: 570.124.06     CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |
| N/A   31C    P0             71W /  700W |       1MiB /  81559MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+
"""
SMI_H100_124 = SMI_H100_128.replace("570.124.06", "550.54.15").replace("CUDA Version: 12.8", "CUDA Version: 12.4")
SMI_H100_130 = SMI_H100_128.replace("570.124.06", "580.65.06").replace("CUDA Version: 12.8", "CUDA Version: 13.0")
# an R520 driver (CUDA 11.8): the older, narrower table
SMI_H100_118 = """\
+-----------------------------------------------------------------------------+
| NVIDIA-SMI 520.61.05    Driver Version: 520.61.05    CUDA Version: 11.8     |
|-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |
|                               |                      |               MIG M. |
|===============================+======================+======================|
|   0  NVIDIA H100 PCIe    On   | 00000000:00:05.0 Off |                    0 |
| N/A   34C    P0    48W / 350W |      0MiB / 81559MiB |      0%      Default |
|                               |                      |             Disabled |
+-------------------------------+----------------------+----------------------+
"""
# a driver older than any CUDA build of torch 2.7+ (R470, CUDA 11.4), two GPUs
SMI_V100_114 = SMI_H100_118.replace("520.61.05", "470.82.01").replace("CUDA Version: 11.8", "CUDA Version: 11.4") \
    .replace("NVIDIA H100 PCIe   ", "Tesla V100-SXM2...") + \
    "|   1  Tesla V100-SXM2...  On   | 00000000:00:06.0 Off |                    0 |\n"
SMI_NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                 "Make sure that the latest NVIDIA driver is installed and running.\n")

OVERRIDES = ("TORCH_SPEC", "TORCH_INDEX_URL", "WORKBENCH_TORCH", "TORCH_SELECT_NO_NVIDIA_SMI",
             "TORCH_SELECT_NVIDIA_SMI_OUTPUT", "TORCH_SELECT_INDEX_REACHABLE", "QUICKSTART_DRY_RUN")


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    env.update(overrides)
    return env


def run_select(*args: str, smi: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """The script as the Quick start runs it; smi=None: no nvidia-smi (simulated)."""
    if smi is None:
        env.setdefault("TORCH_SELECT_NO_NVIDIA_SMI", "1")
    else:
        args = (*args, "--nvidia-smi-output", "-")
    return subprocess.run([sys.executable, str(SCRIPT), *args], input=smi or "", capture_output=True,
                          text=True, env=_env(**env), timeout=60)


def selection(smi: str | None = None, **env: str) -> dict:
    out = run_select("--json", smi=smi, **env)
    assert out.returncode in (0, 2), out.stderr
    return json.loads(out.stdout)


def test_no_nvidia_smi_picks_the_cpu_index():
    sel = selection()
    assert sel["detection"]["gpu"] is False
    assert (sel["flavour"], sel["index_url"]) == ("cpu", "https://download.pytorch.org/whl/cpu")
    assert sel["pip_args"] == ["install", "--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0"]
    assert not sel["warnings"] and sel["error"] is None
    explained = run_select("--explain").stdout
    assert "no NVIDIA GPU (nvidia-smi not found)" in explained and "chosen:   cpu" in explained


def test_h100_with_a_cuda_12_8_driver_gets_the_newest_build_it_runs():
    sel = selection(SMI_H100_128)
    det = sel["detection"]
    assert (det["gpu"], det["driver_version"], det["cuda_version"], det["gpus"]) == \
        (True, "570.124.06", "12.8", ["NVIDIA H100 80GB HBM3"])
    # torch 2.13 publishes cu126, cu130 and cu132: a 12.8 driver runs cu126, not the CUDA 13 ones
    assert sel["flavours"] == ["cu126", "cu130", "cu132"]
    assert (sel["flavour"], sel["index_url"]) == ("cu126", "https://download.pytorch.org/whl/cu126")
    assert not sel["warnings"]
    explained = run_select("--explain", smi=SMI_H100_128).stdout
    assert "NVIDIA H100 80GB HBM3 (driver 570.124.06, runs CUDA up to 12.8)" in explained
    assert "cu130, cu132 need a newer driver" in explained


@pytest.mark.parametrize("smi, spec, flavour", [
    (SMI_H100_128, "torch==2.13.0", "cu126"),
    (SMI_H100_128, "torch==2.11.0", "cu128"),    # 2.11 still publishes cu128
    (SMI_H100_130, "torch==2.13.0", "cu130"),
    (SMI_H100_124, "torch==2.6.0", "cu124"),
    (SMI_H100_124, "torch==2.7.1", "cu118"),
    (SMI_H100_118, "torch==2.7.1", "cu118"),
    (SMI_H100_124, "torch==2.13.0", "cpu"),      # too old for 2.13's CUDA builds
    (SMI_H100_118, "torch==2.13.0", "cpu"),
])
def test_flavour_per_driver_and_torch_release(smi, spec, flavour):
    sel = selection(smi, TORCH_SPEC=spec)
    assert sel["flavour"] == flavour
    assert sel["index_url"] == f"https://download.pytorch.org/whl/{flavour}"
    assert sel["pip_args"][-1] == spec


def test_a_driver_too_old_falls_back_to_cpu_and_says_why():
    out = run_select("--explain", smi=SMI_H100_124)
    assert out.returncode == 0
    assert "chosen:   cpu -> pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in out.stdout
    assert "driver too old" in out.stdout
    assert "the driver runs CUDA up to 12.4, torch 2.13's CUDA builds (cu126, cu130, cu132) need CUDA >= 12.6" \
        in out.stdout
    assert "update the NVIDIA driver, or set WORKBENCH_TORCH=cuda to try cu126" in out.stdout
    # a CUDA 11 driver: no 12.x/13.x build runs under minor-version compatibility either
    sel = selection(SMI_H100_118)
    assert sel["flavour"] == "cpu" and "WORKBENCH_TORCH=cuda" not in sel["warnings"][0]
    # R470 (CUDA 11.4) on two V100s, torch 2.7 (oldest build cu118)
    sel = selection(SMI_V100_114, TORCH_SPEC="torch==2.7.1")
    assert sel["detection"]["gpus"] == ["Tesla V100-SXM2...", "Tesla V100-SXM2..."]
    assert sel["flavour"] == "cpu" and "need CUDA >= 11.8" in sel["warnings"][0]


def test_nvidia_smi_without_a_driver_means_no_gpu():
    sel = selection(SMI_NO_DRIVER)
    assert sel["detection"]["gpu"] is False and "couldn't communicate" in sel["detection"]["note"]
    assert sel["flavour"] == "cpu"


def test_workbench_torch_cpu_on_a_gpu_machine():
    sel = selection(SMI_H100_128, WORKBENCH_TORCH="cpu")
    assert (sel["mode"], sel["flavour"], sel["index_url"]) == ("cpu", "cpu", "https://download.pytorch.org/whl/cpu")
    assert "an NVIDIA GPU is present" in sel["reason"]


def test_workbench_torch_cuda_without_a_gpu_is_an_error():
    """Forcing CUDA where no build can run is refused (exit 2, nothing to eval), not a silent multi-GB install."""
    out = run_select("--shell", WORKBENCH_TORCH="cuda")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "WORKBENCH_TORCH=cuda, but no NVIDIA GPU" in out.stderr and "set TORCH_INDEX_URL" in out.stderr
    sel = selection(WORKBENCH_TORCH="cuda")
    assert sel["error"] and sel["pip_args"] == [] and sel["index_url"] == ""


def test_workbench_torch_cuda_on_an_old_driver():
    # same CUDA major: the oldest such build, under minor-version compatibility, with a warning
    sel = selection(SMI_H100_124, WORKBENCH_TORCH="cuda")
    assert sel["error"] is None and sel["flavour"] == "cu126"
    assert "minor-version compatibility" in sel["warnings"][0]
    # a CUDA 11 driver and only 12.x / 13.x builds: refused
    out = run_select("--shell", smi=SMI_H100_118, WORKBENCH_TORCH="cuda")
    assert out.returncode == 2 and out.stdout == "" and "update the NVIDIA driver" in out.stderr
    # a driver that runs a build: the same choice as auto
    assert selection(SMI_H100_128, WORKBENCH_TORCH="cuda")["flavour"] == "cu126"


def test_an_invalid_workbench_torch_is_an_error():
    out = run_select("--shell", WORKBENCH_TORCH="rocm")
    assert out.returncode == 2 and out.stdout == "" and "expected one of auto, cpu, cuda" in out.stderr


def test_an_explicit_index_url_wins():
    url = "https://download.pytorch.org/whl/cu130"
    for smi in (None, SMI_H100_124):
        sel = selection(smi, TORCH_INDEX_URL=url)
        assert (sel["mode"], sel["index_url"], sel["flavour"]) == ("explicit", url, "cu130")
    sel = selection(SMI_H100_128, TORCH_INDEX_URL="https://mirror.example/simple", WORKBENCH_TORCH="cpu")
    assert (sel["index_url"], sel["flavour"]) == ("https://mirror.example/simple", "custom")
    assert "WORKBENCH_TORCH=cpu is ignored" in sel["warnings"][0]
    # and is never replaced by the reachability fallback
    out = run_select("--shell", "--probe-index", TORCH_INDEX_URL=url, TORCH_SELECT_INDEX_REACHABLE="0")
    assert f"TORCH_INDEX_URL={url}" in out.stdout.splitlines()


def test_torch_spec_picks_the_table_row():
    sel = selection(SMI_H100_128, TORCH_SPEC="torch==2.13.0+cu130")   # a local label names the build
    assert (sel["flavour"], sel["mode"]) == ("cu130", "spec")
    sel = selection(SMI_H100_130, TORCH_SPEC="torch")                  # unpinned: the newest row
    assert sel["torch_release"] == max(torch_select.CUDA_FLAVOURS, key=torch_select._vkey)
    assert "pins no version" in sel["warnings"][0]
    sel = selection(SMI_H100_130, TORCH_SPEC="torch==9.1.0")            # newer than the table
    assert sel["flavour"] == "cu130" and "update CUDA_FLAVOURS" in sel["warnings"][0]


def test_shell_output_evals_in_bash():
    spec = "torch>=2.13,<2.14"          # characters the shell must not interpret
    cmd = f'eval "$({sys.executable} {SCRIPT} --shell --nvidia-smi-output -)"; ' \
          'printf "%s|%s|%s\\n" "$TORCH_SPEC" "$TORCH_INDEX_URL" "$TORCH_FLAVOUR"'
    out = subprocess.run(["bash", "-c", cmd], input=SMI_H100_128, capture_output=True, text=True,
                         env=_env(TORCH_SPEC=spec), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{spec}|https://download.pytorch.org/whl/cu126|cu126\n"
    out = subprocess.run(["bash", "-c", f'eval "$({sys.executable} {SCRIPT} --shell)"; echo $TORCH_INDEX_URL'],
                         capture_output=True, text=True, env=_env(TORCH_SELECT_NO_NVIDIA_SMI="1"), timeout=60)
    assert out.stdout == "https://download.pytorch.org/whl/cpu\n"


def test_probe_falls_back_to_the_configured_indexes_when_the_index_does_not_resolve():
    out = run_select("--shell", "--explain", "--probe-index", TORCH_SELECT_INDEX_REACHABLE="0")
    assert "TORCH_INDEX_URL=''" in out.stdout.splitlines()
    assert "download.pytorch.org does not resolve" in out.stderr
    out = run_select("--shell", "--probe-index", TORCH_SELECT_INDEX_REACHABLE="1")
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in out.stdout.splitlines()


def test_the_table_is_well_formed():
    for release, flavours in torch_select.CUDA_FLAVOURS.items():
        assert re.fullmatch(r"2\.\d+", release)
        assert flavours and all(re.fullmatch(r"cu1\d\d", f) for f in flavours)
        assert list(flavours) == sorted(flavours, key=torch_select.flavour_cuda)
    assert torch_select.flavour_cuda("cu118") == (11, 8) and torch_select.flavour_cuda("cu130") == (13, 0)
    default_release, _, _ = torch_select.spec_release(torch_select.DEFAULT_SPEC)
    assert default_release in torch_select.CUDA_FLAVOURS


def test_the_constraint_keeps_cpu_and_cuda_builds_alike():
    """constraints/real-clients.txt pins the default TORCH_SPEC without a local label: +cpu and +cuXYZ match."""
    from packaging.requirements import Requirement

    lines = [ln for ln in (ROOT / "constraints" / "real-clients.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    torch_pin = next(Requirement(ln) for ln in lines if ln.startswith("torch"))
    assert str(torch_pin) == torch_select.DEFAULT_SPEC
    assert f"TORCH_SPEC=${{TORCH_SPEC:-{torch_select.DEFAULT_SPEC}}}" in QUICKSTART.read_text()
    version = next(iter(torch_pin.specifier)).version
    for build in ("cpu", *torch_select.CUDA_FLAVOURS["2.13"]):
        assert torch_pin.specifier.contains(f"{version}+{build}"), build


# ---- scripts/quickstart.sh --------------------------------------------------------------------

def quickstart_dry_run(root: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "quickstart.sh")], capture_output=True, text=True,
                          env=_env(QUICKSTART_DRY_RUN="1", PYTHON=sys.executable, **env), timeout=120)


@pytest.fixture
def bare_checkout(tmp_path):
    """The two scripts alone (no .venv): the dry run stops after the torch choice."""
    (tmp_path / "scripts").mkdir()
    for script in (QUICKSTART, SCRIPT):
        shutil.copy(script, tmp_path / "scripts" / script.name)
    return tmp_path


def _pip_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(".venv/bin/pip ")]
    assert len(lines) == 1, out.stdout
    return lines[0]


def test_quickstart_installs_the_selected_build_for_a_gpu(bare_checkout, tmp_path):
    smi = tmp_path / "nvidia-smi.txt"
    smi.write_text(SMI_H100_128)
    out = quickstart_dry_run(bare_checkout, TORCH_SELECT_NVIDIA_SMI_OUTPUT=str(smi), TORCH_SELECT_INDEX_REACHABLE="1")
    assert _pip_line(out) == ".venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cu126 torch==2.13.0"
    assert "NVIDIA H100 80GB HBM3" in out.stderr and "chosen:   cu126" in out.stderr   # the explanation
    assert not (bare_checkout / ".venv").exists()                                    # nothing installed
    out = quickstart_dry_run(bare_checkout, TORCH_SELECT_NVIDIA_SMI_OUTPUT=str(smi), TORCH_SELECT_INDEX_REACHABLE="1",
                             TORCH_SPEC="torch==2.11.0")
    assert _pip_line(out) == ".venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cu128 torch==2.11.0"


def test_quickstart_installs_the_cpu_build_without_a_gpu(bare_checkout):
    out = quickstart_dry_run(bare_checkout, TORCH_SELECT_NO_NVIDIA_SMI="1", TORCH_SELECT_INDEX_REACHABLE="1")
    assert _pip_line(out) == ".venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
    assert "no NVIDIA GPU" in out.stderr
    # offline (download.pytorch.org does not resolve): pip's configured indexes and find-links
    out = quickstart_dry_run(bare_checkout, TORCH_SELECT_NO_NVIDIA_SMI="1", TORCH_SELECT_INDEX_REACHABLE="0")
    assert _pip_line(out) == ".venv/bin/pip install -q torch==2.13.0"


def test_quickstart_stops_when_the_choice_is_an_error(bare_checkout):
    out = quickstart_dry_run(bare_checkout, TORCH_SELECT_NO_NVIDIA_SMI="1", WORKBENCH_TORCH="cuda")
    assert out.returncode == 2
    assert ".venv/bin/pip" not in out.stdout and "WORKBENCH_TORCH=cuda, but no NVIDIA GPU" in out.stderr


def test_quickstart_runs_the_notebooks_where_torch_sees_a_gpu():
    """In this checkout (its .venv has torch): the dry run names the device the notebooks would get."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in this checkout")
    import torch

    out = quickstart_dry_run(ROOT, TORCH_SELECT_NO_NVIDIA_SMI="1", TORCH_SELECT_INDEX_REACHABLE="1")
    _pip_line(out)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"the notebooks would run with device={expected}" in out.stdout
    assert "run-notebooks -p device=\"\\\"$device\\\"\"" in QUICKSTART.read_text()

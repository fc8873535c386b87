#!/usr/bin/env python3
"""Pick the torch build for this machine: the pip arguments the Quick start installs torch with.

    python3 scripts/torch_select.py --explain   # what was detected, what is chosen and why
    python3 scripts/torch_select.py --shell     # TORCH_SPEC=... TORCH_INDEX_URL=... lines to eval
    python3 scripts/torch_select.py --json      # the same as a JSON object
    eval "$(python3 scripts/torch_select.py --shell --explain)"   # both: the explanation goes to stderr

Standard library only: scripts/quickstart.sh runs it with the system python3 (>= 3.10) before
anything is installed.

What is detected: the header of ``nvidia-smi`` (its "Driver Version" and "CUDA Version: X.Y", the
newest CUDA the driver runs, and the GPU names).  No ``nvidia-smi`` command, or one that fails
(no driver loaded, "No devices were found"), means no usable NVIDIA GPU.

The rule (for the torch release that TORCH_SPEC names):

* no NVIDIA GPU -> the CPU wheel index, https://download.pytorch.org/whl/cpu (about 190 MB, no
  CUDA libraries);
* an NVIDIA GPU -> the newest CUDA flavour (cuXYZ index, e.g. https://download.pytorch.org/whl/cu126)
  that torch publishes for that release (the CUDA_FLAVOURS table below) and whose CUDA version is
  at most the driver's "CUDA Version";
* a driver older than every flavour of that release -> the CPU index, with a message that says
  which CUDA version the driver must run for them (and the WORKBENCH_TORCH=cuda way round).

Overrides, from the environment:

* ``TORCH_SPEC``: the requirement to install (default ``torch==2.13.0``); its version picks the
  table row.  A local label (``torch==2.13.0+cu126``) names the flavour itself.  Unpinned
  (``torch``, ``torch>=2.12``): the newest release in the table.
* ``TORCH_INDEX_URL``: an explicit index; it wins over everything else (no detection needed).
* ``WORKBENCH_TORCH=cpu|cuda|auto`` (default auto): ``cpu`` takes the CPU index even on a GPU
  machine.  ``cuda`` on a GPU whose driver is too old takes the oldest flavour of the driver's CUDA
  major version (CUDA minor-version compatibility: it may run, though Triton / torch.compile
  kernels can fail on such a driver), with a warning; ``cuda`` with no NVIDIA GPU detected, or with
  no flavour of the driver's major version, is an error (exit status 2): set TORCH_INDEX_URL to
  install a CUDA build there anyway.

For tests (and to ask "what would a machine with that GPU get?"): ``--nvidia-smi-output FILE`` (or
``-`` for stdin; also the variable TORCH_SELECT_NVIDIA_SMI_OUTPUT) reads the nvidia-smi output
from a file instead of running the command; ``TORCH_SELECT_NO_NVIDIA_SMI=1`` behaves as if the
command did not exist.

``--probe-index`` (the Quick start passes it) also checks that the chosen index's host name
resolves; where it does not (an offline machine with a local wheel cache), TORCH_INDEX_URL is
empty and pip installs TORCH_SPEC from its configured indexes.  ``TORCH_SELECT_INDEX_REACHABLE=0|1``
replaces that look-up.

Exit status: 0 with a choice; 2 on an error (invalid override, forced CUDA without a usable GPU):
``--shell`` then prints nothing on stdout, so an eval installs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field

DEFAULT_SPEC = "torch==2.13.0"
INDEX_BASE = "https://download.pytorch.org/whl"

# torch release -> the CUDA wheel flavours download.pytorch.org publishes for it (Linux x86_64;
# "stable" and "experimental" CUDA alike).  Source: pytorch/pytorch RELEASE.md, "Release
# Compatibility Matrix" (2.13: CUDA 12.6 and 13.0 stable, 13.2 experimental; 2.12 dropped 12.8),
# read in September 2026.  A new release is one line here; the newest row also serves releases
# newer than the table (said so in --explain), so keep it current.
CUDA_FLAVOURS: dict[str, tuple[str, ...]] = {
    "2.6": ("cu118", "cu124", "cu126"),
    "2.7": ("cu118", "cu126", "cu128"),
    "2.8": ("cu126", "cu128", "cu129"),
    "2.9": ("cu126", "cu128", "cu130"),
    "2.10": ("cu126", "cu128", "cu130"),
    "2.11": ("cu126", "cu128", "cu130"),
    "2.12": ("cu126", "cu130", "cu132"),
    "2.13": ("cu126", "cu130", "cu132"),
    "2.14": ("cu126", "cu130", "cu132"),
}

MODES = ("auto", "cpu", "cuda")


def _vkey(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def flavour_cuda(flavour: str) -> tuple[int, int]:
    """'cu126' -> (12, 6); 'cu118' -> (11, 8); 'cu130' -> (13, 0)."""
    digits = flavour[2:]
    return int(digits[:-1]), int(digits[-1])


def cuda_str(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def index_url(flavour: str) -> str:
    return f"{INDEX_BASE}/{flavour}"


# ---------------------------------------------------------------------------------------------
# detection

@dataclass
class Detection:
    gpu: bool                          # a usable NVIDIA GPU (nvidia-smi ran and printed a driver)
    source: str                        # "nvidia-smi", "file:PATH", "stdin", "simulated absent", ...
    note: str                          # one line: what was seen
    driver_version: str | None = None
    cuda_version: tuple[int, int] | None = None
    gpus: list[str] = field(default_factory=list)


_DRIVER_RE = re.compile(r"Driver Version:\s*([0-9][0-9.]*)")
_CUDA_RE = re.compile(r"CUDA Version:\s*([0-9]+)\.([0-9]+)")
# a GPU row of the table: "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off | ..."
_GPU_RE = re.compile(r"^\|\s*\d+\s+(.+?)\s+(?:On|Off)\s*\|", re.MULTILINE)


def parse_nvidia_smi(text: str, source: str) -> Detection:
    driver = _DRIVER_RE.search(text)
    if not driver:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "no output")
        return Detection(False, source, f"nvidia-smi reports no usable GPU ({first})")
    cuda = _CUDA_RE.search(text)
    gpus = [g.strip() for g in _GPU_RE.findall(text)]
    cuda_version = (int(cuda.group(1)), int(cuda.group(2))) if cuda else None
    names = ", ".join(gpus) if gpus else "NVIDIA GPU"
    runs = f"runs CUDA up to {cuda_str(cuda_version)}" if cuda_version else "CUDA version not shown"
    return Detection(True, source, f"{names} (driver {driver.group(1)}, {runs})",
                     driver.group(1), cuda_version, gpus)


def detect(nvidia_smi_output: str | None, env: dict[str, str]) -> Detection:
    """The detection input: a file (or '-': stdin), the simulated absence, or the real command."""
    path = nvidia_smi_output or env.get("TORCH_SELECT_NVIDIA_SMI_OUTPUT") or None
    if path == "-":
        return parse_nvidia_smi(sys.stdin.read(), "stdin")
    if path:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_nvidia_smi(f.read(), f"file {path}")
    if env.get("TORCH_SELECT_NO_NVIDIA_SMI", "") not in ("", "0"):
        return Detection(False, "simulated (TORCH_SELECT_NO_NVIDIA_SMI)", "no NVIDIA GPU (nvidia-smi not found)")
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Detection(False, "nvidia-smi", "no NVIDIA GPU (nvidia-smi not found)")
    try:
        proc = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Detection(False, exe, f"nvidia-smi could not run ({e})")
    det = parse_nvidia_smi(proc.stdout + proc.stderr, exe)
    if proc.returncode != 0 and det.gpu:
        det.note += f" [nvidia-smi exit status {proc.returncode}]"
    return det


# ---------------------------------------------------------------------------------------------
# selection

@dataclass
class Selection:
    torch_spec: str
    index_url: str                     # "" = pip's configured indexes
    flavour: str                       # "cpu", "cu126", ..., "custom", "default"
    mode: str                          # auto / cpu / cuda / explicit / spec
    reason: str
    torch_release: str | None = None   # the table row used
    flavours: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    def pip_args(self) -> list[str]:
        args = ["install"]
        if self.index_url:
            args += ["--index-url", self.index_url]
        return args + [self.torch_spec]


_SPEC_RE = re.compile(r"^\s*torch\s*(?:\[[^\]]*\])?\s*(.*)$", re.IGNORECASE)
_PIN_RE = re.compile(r"(?:===|==|~=)\s*([0-9]+)\.([0-9]+)(?:[.0-9*]*)(?:\+([A-Za-z0-9.]+))?")


def spec_release(spec: str) -> tuple[str | None, str | None, str]:
    """(release 'X.Y' or None for unpinned, local label or None, kind) from TORCH_SPEC.

    kind: "pinned", "unpinned" or "other" (a path or URL: not a torch requirement to resolve)."""
    m = _SPEC_RE.match(spec)
    if not m or "/" in spec or spec.endswith(".whl"):
        return None, None, "other"
    pin = _PIN_RE.search(m.group(1))
    if not pin:
        return None, None, "unpinned"
    return f"{pin.group(1)}.{pin.group(2)}", pin.group(3), "pinned"


def table_row(release: str | None) -> tuple[str | None, str | None]:
    """(the table row serving that release, a note when it is not the release's own row)."""
    newest = max(CUDA_FLAVOURS, key=_vkey)
    if release is None:
        return newest, f"TORCH_SPEC pins no version: assuming the newest release in the table, {newest}"
    if release in CUDA_FLAVOURS:
        return release, None
    if _vkey(release) > _vkey(newest):
        return newest, (f"torch {release} is newer than the table in scripts/torch_select.py: "
                        f"assuming {newest}'s CUDA flavours (update CUDA_FLAVOURS)")
    return None, f"torch {release} is older than the table in scripts/torch_select.py (CUDA_FLAVOURS)"


def select(det: Detection, env: dict[str, str]) -> Selection:
    spec = env.get("TORCH_SPEC") or DEFAULT_SPEC
    explicit = env.get("TORCH_INDEX_URL", "").strip()
    mode = (env.get("WORKBENCH_TORCH") or "auto").strip().lower()

    if explicit:
        last = explicit.rstrip("/").rsplit("/", 1)[-1]
        flavour = last if re.fullmatch(r"cpu|cu[0-9]+", last) else "custom"
        sel = Selection(spec, explicit, flavour, "explicit", "TORCH_INDEX_URL is set: it wins over detection")
        if env.get("WORKBENCH_TORCH"):
            sel.warnings.append(f"WORKBENCH_TORCH={env['WORKBENCH_TORCH']} is ignored: TORCH_INDEX_URL is set")
        return sel
    if mode not in MODES:
        return Selection(spec, "", "", mode, "",
                         error=f"WORKBENCH_TORCH={mode!r}: expected one of {', '.join(MODES)}")

    release, local, kind = spec_release(spec)
    if kind == "other":
        return Selection(spec, "", "default", "spec",
                         "TORCH_SPEC is a file or URL: installed as given, no index chosen")
    if local and re.fullmatch(r"cpu|cu[0-9]+", local):
        return Selection(spec, index_url(local), local, "spec",
                         f"TORCH_SPEC names the {local} build: its index", release)

    row, row_note = table_row(release)
    flavours = list(CUDA_FLAVOURS.get(row, ())) if row else []
    cpu = Selection(spec, index_url("cpu"), "cpu", mode, "", row, flavours)
    if row_note:
        cpu.warnings.append(row_note)

    def on_cpu(reason: str) -> Selection:
        cpu.reason = reason
        return cpu

    def error(msg: str) -> Selection:
        cpu.flavour, cpu.index_url, cpu.error = "", "", msg
        return cpu

    if mode == "cpu":
        return on_cpu("WORKBENCH_TORCH=cpu: the CPU-only build" + (" (an NVIDIA GPU is present)" if det.gpu else ""))
    if not det.gpu:
        if mode == "cuda":
            example = index_url(flavours[-1] if flavours else "cu126")
            return error(f"WORKBENCH_TORCH=cuda, but {det.note}: no CUDA build can run here. "
                         f"To install one anyway, set TORCH_INDEX_URL (e.g. {example})")
        return on_cpu("no NVIDIA GPU: the CPU-only build (small, no CUDA libraries)")
    if not flavours:
        if mode == "cuda":
            return error(f"no CUDA flavours known for {spec}: set TORCH_INDEX_URL")
        return on_cpu(f"no CUDA flavours known for {spec}: the CPU-only build "
                      "(set TORCH_INDEX_URL for a CUDA one)")
    if det.cuda_version is None:
        if mode == "cuda":
            return error("nvidia-smi shows no 'CUDA Version': cannot tell which CUDA build the driver runs; "
                         "set TORCH_INDEX_URL")
        return on_cpu("nvidia-smi shows no 'CUDA Version', so no CUDA build can be matched to the driver: "
                      "the CPU-only build (set TORCH_INDEX_URL for a CUDA one)")

    drv = det.cuda_version
    fits = [f for f in flavours if flavour_cuda(f) <= drv]
    if fits:
        best = max(fits, key=flavour_cuda)
        newer = [f for f in flavours if flavour_cuda(f) > drv]
        why = f"the newest CUDA build of torch {row} that a driver with CUDA {cuda_str(drv)} runs"
        if newer:
            why += f" ({', '.join(newer)} need a newer driver)"
        return Selection(spec, index_url(best), best, mode, why, row, flavours, cpu.warnings)

    oldest = min(flavours, key=flavour_cuda)
    need = (f"the driver runs CUDA up to {cuda_str(drv)}, torch {row}'s CUDA builds ({', '.join(flavours)}) "
            f"need CUDA >= {cuda_str(flavour_cuda(oldest))}")
    same_major = sorted((f for f in flavours if flavour_cuda(f)[0] == drv[0]), key=flavour_cuda)
    if mode == "cuda":
        if not same_major:
            return error(f"WORKBENCH_TORCH=cuda, but {need} and none has CUDA major version {drv[0]}: "
                         "update the NVIDIA driver, or set TORCH_INDEX_URL")
        pick = same_major[0]
        sel = Selection(spec, index_url(pick), pick, mode,
                        f"WORKBENCH_TORCH=cuda: {pick}, under CUDA minor-version compatibility", row, flavours,
                        cpu.warnings)
        sel.warnings.append(f"{need}; {pick} may run under CUDA minor-version compatibility, but Triton / "
                            "torch.compile kernels can fail: update the NVIDIA driver for a supported set-up")
        return sel
    hint = "update the NVIDIA driver"
    if same_major:
        hint += f", or set WORKBENCH_TORCH=cuda to try {same_major[0]} under CUDA minor-version compatibility"
    cpu.warnings.append(f"NVIDIA driver too old for a CUDA build of torch {row}: {need}; {hint}")
    return on_cpu(f"driver too old for torch {row}'s CUDA builds: the CPU-only build instead")


# ---------------------------------------------------------------------------------------------
# index reachability (--probe-index)

def host_resolves(url: str, timeout: float = 5.0) -> bool:
    host = re.sub(r"^[a-z+]+://", "", url).split("/", 1)[0].split(":", 1)[0]
    if not host or url.startswith("file:"):
        return True
    result: list[bool] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, 443)
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=look_up, daemon=True)
    t.start()
    t.join(timeout)
    return bool(result and result[0])


def apply_probe(sel: Selection, env: dict[str, str]) -> None:
    """Where the chosen (not explicit) index cannot be reached, pip's configured indexes instead."""
    if sel.error or not sel.index_url or sel.mode == "explicit":
        return
    forced = env.get("TORCH_SELECT_INDEX_REACHABLE", "")
    reachable = forced not in ("0", "false", "no") if forced else host_resolves(sel.index_url)
    if reachable:
        return
    host = sel.index_url.split("/")[2]
    sel.warnings.append(f"{host} does not resolve from this machine: installing {sel.torch_spec} from pip's "
                        f"configured indexes instead of {sel.index_url} (a local wheel in pip's find-links, "
                        "or PyPI's default build, which on Linux is a CUDA one of several GB)")
    sel.index_url = ""


# ---------------------------------------------------------------------------------------------
# output

def explain(det: Detection, sel: Selection) -> str:
    lines = [f"torch build for {sel.torch_spec}:",
             f"  detected: {det.note}  [{det.source}]"]
    if sel.torch_release and sel.flavours:
        lines.append(f"  torch {sel.torch_release} CUDA builds: {', '.join(sel.flavours)} "
                     "(CUDA_FLAVOURS in scripts/torch_select.py)")
    if sel.error:
        lines.append(f"  error:    {sel.error}")
    else:
        lines.append(f"  chosen:   {sel.flavour} -> pip {' '.join(shlex.quote(a) for a in sel.pip_args())}")
        lines.append(f"  why:      {sel.reason}")
    lines += [f"  warning:  {w}" for w in sel.warnings]
    return "\n".join(lines)


def as_json(det: Detection, sel: Selection) -> str:
    d = asdict(sel)
    d["pip_args"] = [] if sel.error else sel.pip_args()
    d["detection"] = asdict(det)
    if det.cuda_version:
        d["detection"]["cuda_version"] = cuda_str(det.cuda_version)
    return json.dumps(d, indent=2)


def as_shell(sel: Selection) -> str:
    return "\n".join(f"{k}={shlex.quote(v)}" for k, v in (
        ("TORCH_SPEC", sel.torch_spec), ("TORCH_INDEX_URL", sel.index_url), ("TORCH_FLAVOUR", sel.flavour)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--explain", action="store_true", help="human-readable report (to stderr with --shell)")
    ap.add_argument("--shell", action="store_true",
                    help="TORCH_SPEC= / TORCH_INDEX_URL= / TORCH_FLAVOUR= lines to eval")
    ap.add_argument("--json", action="store_true", help="the detection and the choice as JSON")
    ap.add_argument("--nvidia-smi-output", metavar="FILE",
                    help="read nvidia-smi's output from FILE ('-': stdin) instead of running it")
    ap.add_argument("--probe-index", action="store_true",
                    help="fall back to pip's configured indexes when the chosen index's host does not resolve")
    args = ap.parse_args(argv)
    if args.json and args.shell:
        ap.error("--json and --shell are exclusive")

    env = dict(os.environ)
    try:
        det = detect(args.nvidia_smi_output, env)
    except OSError as e:
        print(f"torch_select: error: cannot read the nvidia-smi output: {e}", file=sys.stderr)
        return 2
    sel = select(det, env)
    if args.probe_index:
        apply_probe(sel, env)

    if args.json:
        print(as_json(det, sel))
        if args.explain:
            print(explain(det, sel), file=sys.stderr)
    elif args.shell:
        if args.explain:
            print(explain(det, sel), file=sys.stderr)
        else:
            for w in sel.warnings:
                print(f"torch_select: warning: {w}", file=sys.stderr)
            if sel.error:
                print(f"torch_select: error: {sel.error}", file=sys.stderr)
        if not sel.error:
            print(as_shell(sel))
    else:  # --explain, and the default
        print(explain(det, sel))
    return 2 if sel.error else 0


if __name__ == "__main__":
    sys.exit(main())

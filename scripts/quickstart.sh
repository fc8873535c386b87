#!/usr/bin/env bash
# Set up the workbench in ./.venv and run the main job: every notebook, with the bundled model, on
# the GPU when the installed torch sees one (device="cuda") and on the CPU otherwise, ending with
# the path of the HTML report.
#
#   bash scripts/quickstart.sh               # set up + run the notebook batch
#   bash scripts/quickstart.sh --setup-only  # set up only
#   QUICKSTART_DRY_RUN=1 bash scripts/quickstart.sh   # print the torch install it would run; change nothing
#
# Which torch build (scripts/torch_select.py decides; `python3 scripts/torch_select.py --explain`
# shows its reasoning; it runs only while .venv has no torch yet):
#   * detected: `nvidia-smi`'s header, its driver's "CUDA Version: X.Y" (no nvidia-smi: no GPU);
#   * no NVIDIA GPU -> the CPU-only wheels, https://download.pytorch.org/whl/cpu (no CUDA libraries);
#   * an NVIDIA GPU -> the newest CUDA build of that torch release (cu126, cu130, cu132 for 2.13:
#     the CUDA_FLAVOURS table in the script) whose CUDA version the driver runs, from its
#     https://download.pytorch.org/whl/cuXYZ index; a driver too old for all of them -> the CPU
#     build, with a message naming the CUDA version the driver must run for them;
#   * overrides: TORCH_SPEC (the requirement, default torch==2.13.0), WORKBENCH_TORCH=cpu|cuda|auto
#     (force a CPU or CUDA build), TORCH_INDEX_URL (an explicit index: wins over everything);
#   * where download.pytorch.org does not resolve (an offline machine), TORCH_SPEC comes from pip's
#     configured indexes and find-links instead.
# Those indexes also serve torch's dependencies (filelock, sympy, nvidia-* libraries, triton, ...):
# no second index is needed.  Delete .venv (or `.venv/bin/pip uninstall torch`) to choose again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
start=$(date +%s)

# Sets TORCH_SPEC, TORCH_INDEX_URL, TORCH_FLAVOUR and TORCH_PIP_ARGS; prints the explanation.
select_torch() {
  local selection
  selection=$(TORCH_SPEC="$TORCH_SPEC" "$PYTHON" scripts/torch_select.py --shell --explain --probe-index)
  eval "$selection"
  TORCH_PIP_ARGS=(install -q)
  if [ -n "$TORCH_INDEX_URL" ]; then
    TORCH_PIP_ARGS+=(--index-url "$TORCH_INDEX_URL")
  fi
  TORCH_PIP_ARGS+=("$TORCH_SPEC")
}

# "cuda" when the torch in .venv sees a GPU, "cpu" otherwise
notebook_device() {
  .venv/bin/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')"
}

if [ "${QUICKSTART_DRY_RUN:-0}" != 0 ]; then
  select_torch
  echo "== dry run: the torch install would be"
  echo ".venv/bin/pip ${TORCH_PIP_ARGS[*]}"
  if .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "== dry run: with the torch now in .venv, the notebooks would run with device=$(notebook_device)"
  fi
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "== choosing the torch build (scripts/torch_select.py)"
  select_torch
  echo "== installing $TORCH_SPEC ($TORCH_FLAVOUR${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL})"
  .venv/bin/pip "${TORCH_PIP_ARGS[@]}"
else
  echo "== keeping the torch in .venv: $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
fi
echo "== installing the workbench, its test tools and the real clients the tests drive (lm-eval, guidellm)"
# the constraints file keeps the torch installed above (+cpu or +cuXYZ: `torch==2.13.0` matches both):
# neither client may pull another build.
# uv resolves and downloads the ~200 packages in parallel: 62 s where pip took ~200 s (same versions;
# measured on a 2-core machine with empty caches). --compile-bytecode: where PYTHONDONTWRITEBYTECODE=1,
# as on these machines, an install without .pyc files makes every kernel and test process compile its
# imports from source (+20-37 s per notebook). Without a uv wheel for this machine, pip does it.
if .venv/bin/pip install -q uv 2>/dev/null && .venv/bin/uv --version >/dev/null 2>&1; then
  .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode -e ".[dev,real-clients,ray,gguf]" \
    -c constraints/real-clients.txt
else
  echo "   (no uv here: installing with pip)"
  .venv/bin/pip install -q -e ".[dev,real-clients,ray,gguf]" -c constraints/real-clients.txt
fi
.venv/bin/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (workbench)" >/dev/null
# JupyterLab from .venv saves widget state with a notebook: an interactive control (01's per-op toggle) then
# reopens drawn instead of "Error displaying widget: model not found" (live views replace their own widgets)
.venv/bin/python scripts/lab_settings.py
echo "== set up in $(( $(date +%s) - start )) s"

if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
device=$(notebook_device)
if [ "$device" = cuda ]; then
  echo "== running the notebooks on the GPU (torch.cuda.is_available(): device=\"cuda\") with the bundled model"
else
  echo "== running the notebooks on the CPU (torch sees no GPU: device=\"cpu\") with the bundled model"
fi
.venv/bin/workbench run-notebooks -p device="\"$device\""
echo "== done in $(( $(date +%s) - start )) s"

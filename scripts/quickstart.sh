#!/usr/bin/env bash
# Set up the workbench in ./.venv and run the main job: every notebook, on the CPU, with the
# bundled model, ending with the path of the HTML report.
#
#   bash scripts/quickstart.sh               # set up + run the notebook batch
#   bash scripts/quickstart.sh --setup-only  # set up only
#
# TORCH_SPEC picks the torch build (default torch==2.13.0; on a machine without a local CPU
# wheel, PyPI serves a CUDA build of several GB: set PIP_EXTRA_INDEX_URL to
# https://download.pytorch.org/whl/cpu for a small CPU-only one).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
start=$(date +%s)

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "== installing $TORCH_SPEC"
  .venv/bin/pip install -q "$TORCH_SPEC"
fi
echo "== installing the workbench, its test tools and the real clients the tests drive (lm-eval, guidellm)"
# the constraints file keeps the torch installed above: neither client may pull another (CUDA) build.
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
echo "== set up in $(( $(date +%s) - start )) s"

if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
echo "== running the notebooks on the CPU with the bundled model"
.venv/bin/workbench run-notebooks -p device='"cpu"'
echo "== done in $(( $(date +%s) - start )) s"

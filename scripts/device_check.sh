#!/usr/bin/env bash
# One GPU session's worth of checks, in one call, within about ten minutes:
#
#   bash scripts/device_check.sh [OUT_DIR]        # OUT_DIR default: runs/device_check
#
# 1. the kernel, backend, CUDA-graph and batched-engine tests on the GPU (compiled Triton, not
#    the interpreter);  2. workbench kernels-bench at full size (ceilings, every kernel vs eager
#    and torch.compile, the Llama-3.2-1B-shaped decode step eager / fused / fused + CUDA graphs);
#    3. workbench sched-bench on the GPU;  4. the engine vs transformers.generate.
# Every step has its own time limit and its own log; a failed step is reported and the next
# one runs.  The summary table prints last.  On a machine without CUDA it runs the same steps
# at CPU sizes (a dry run of the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/device_check}}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
WB=("$PY" -m workbench.cli)
export PYTHONUNBUFFERED=1
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$CUDA" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv" 2>&1
  DEV=cuda; SIZE=full; SCHED=(--streams 8 --max-tokens 64 --trace-requests 48 --rate 20)
else
  DEV=cpu; SIZE=small; SCHED=(--streams 4 --max-tokens 8 --trace-requests 8 --rate 8 --overhead-batch 8
                              --overhead-tokens 4 --long-prompt-tokens 128 --windows-ms 0 5)
fi
declare -a NAMES STATUS SECS
step() {   # step NAME TIMEOUT_S command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  NAMES+=("$name"); SECS+=($(( $(date +%s) - t0 )))
  if [ $rc = 0 ]; then STATUS+=("ok"); elif [ $rc = 124 ]; then STATUS+=("timeout"); else STATUS+=("failed rc=$rc"); fi
  tail -n 3 "$OUT/$name.log"
}

step tests 240 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_kernels_pointwise.py \
  tests/test_kernels_attention.py tests/test_backends.py tests/test_cuda_graphs.py tests/test_batched_backends.py
step kernels_bench 300 "${WB[@]}" kernels-bench --device "$DEV" --size "$SIZE" --csv "$OUT/kernel_bench.csv" \
  --json "$OUT/kernel_bench.json"
step sched_bench 150 "${WB[@]}" sched-bench --device "$DEV" "${SCHED[@]}" --json
step engine_bench 120 "${WB[@]}" bench --device "$DEV" --json --repeats 3

cp "$OUT/sched_bench.log" "$OUT/sched_bench.json" 2>/dev/null
echo
echo "== device check summary ($DEV) -> $OUT"
printf "%-16s %-14s %6s\n" step status seconds
for i in "${!NAMES[@]}"; do printf "%-16s %-14s %6s\n" "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}"; done
if [ -f "$OUT/kernel_bench.log" ]; then echo; tail -n 30 "$OUT/kernel_bench.log"; fi

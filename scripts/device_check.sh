#!/usr/bin/env bash
# One GPU session's worth of checks and benchmarks, in one call, within 8 minutes:
#
#   bash scripts/device_check.sh [OUT_DIR]
#
# The steps, most valuable rows first (GPU cap in seconds; the caps sum to 445 s, which leaves the
# start-up (~10 s: the probe's torch import, nvidia-smi) and the tables inside
# DEVICE_CHECK_BUDGET_S = 480 s):
#
#   1. warmup           55  compile and autotune, once, every Triton kernel at the launch configurations the
#                           steps below use (workbench.bench.kernel_launch_cases.bench_launch_cases: the kernel
#                           bench's full sizes, the decode roofline, decode-stack's batches, the W4A16 /
#                           W8A16 / W4A8 table, notebook 06's ablation): 8 processes compile without
#                           launching, then each case runs once (autotuning its configs), then
#                           torch.compile of the kernel bench's ops at their sizes (inductor's cache);
#                           phases past 48 s are skipped (the later steps then compile what is left);
#   2. decode_roofline  30  `workbench kernels-bench --sections ceilings,decode`: the measured copy / matmul
#                           ceilings and the bf16 decode step of a Llama-3.2-1B-shaped model at batch 1,
#                           eager / fused / fused + CUDA graphs (ms, fraction of the roofline, launches);
#   3. kernels_bench    40  `--sections kernels`: each fused kernel's GB/s (TFLOP/s) vs eager, then vs
#                           torch.compile (rows appended to kernel_bench.csv as they are measured);
#   4. decode_stack     35  `workbench decode-stack`: the paged pool + prefix cache + Triton paged decode +
#                           CUDA graphs vs the contiguous graph path, batch 1 / 8 / 32 (saved per round);
#   5. quant_bench      20  the W4A16 split-K GEMV / GEMM, W8A16 and W4A8 kernels vs dense bf16 at m = 1, 4,
#                           16, 64 on Llama-7B-sized layers (saved per row; exits 1 beyond 1e-2 error);
#   6. prefetch_link    15  the pinned host -> HBM link's GB/s per block size (and the host copy);
#   7. e2e              45  notebook 06's ablation at its tiny size: every layer alone and stacked (saved
#                           after every run of a configuration), then the pick's capacity at the SLO (the
#                           highest multiple of the trace's rate it serves within it: workbench tune's search);
#   then the rest, in the time that remains:
#   8. tests            45  the kernel, backend, CUDA-graph, batched-engine, CUDA prefetch, CUDA tiers and
#                           quantized-kernel tests on the GPU (compiled Triton; 8 xdist workers, at most 5
#                           failures, 60 s a test): a crash here stops nothing else;
#   9. engine_bench     25  `workbench bench`: reference, bare loop, CUDA-graphed decode vs transformers
#                           (saved after every group of prompts all sides have run);
#  10. engine_fast      40  torch.compile'd decode, alone and captured as CUDA graphs (inductor compiles;
#                           saved as step 9);
#  11. sched_bench      20  `workbench sched-bench` (saved per experiment and per trace row);
#  12. prefetch_bench   25  weight streaming with half the layers offloaded vs all resident (hit rate, stall,
#                           prefetch_efficiency), reusing step 6's link; saved per section;
#  13. tier_bench       20  `workbench tier-bench`: the physical hot / warm / cold cache (saved per config);
#  14. prefix_bench     15  `workbench prefix-bench` (saved per round);
#  15. calibrate        15  `workbench calibrate-quant --objective latency` on the GPU's own kernels (saved
#                           per measured mix).
#
# A step gets its cap or the time left, whichever is less; one that would start with under 5 s
# left is skipped.  A failed step is reported and the next one runs.  A step stopped by its cap
# keeps what it measured: the kernel bench appends its CSV row by row, and the steps marked
# "saved" above (and the warm-up, per case) write what they have to <step>.partial.json as they go,
# in the shape of their finished JSON (a partial table, said so in meta.json; a step stopped before
# its first row writes none, so the previous run's table stays the latest).  Every step runs
# through `python -m workbench.cli.gpu_results run`, which records its JIT (Triton compiles or cache
# loads), autotuning and inductor seconds: the summary prints them per step (compile_s), so a kernel
# the warm-up missed shows where it was paid.
# Triton's and inductor's caches live in runs/device_check/cache/ (TRITON_CACHE_DIR,
# TORCHINDUCTOR_CACHE_DIR; TRITON_CACHE_AUTOTUNING=1 keeps the autotuner's choices): compiled once,
# reused by every later step (and by a second run on the same machine;
# DEVICE_CHECK_FRESH_CACHE=1 empties them first).
#
# Where the tables go (workbench/measure/gpu_results.py writes them, called through
# `python -m workbench.cli.gpu_results`; see results/gpu/README.md):
#   with CUDA     results/gpu/<device>-<YYYY-MM-DD>/ (committed; a second run that day: -2, -3 ...):
#                 meta.json, summary.csv, warmup.csv, kernel_bench.csv, decode_stack.csv, quant_bench.csv,
#                 prefetch_bench.csv, e2e.csv, engine_bench.csv, engine_fast_bench.csv, sched_bench.csv,
#                 tier_bench.csv, prefix_bench.csv, calibrate.csv, device_check.log.  Where $OUT is set
#                 (the device tool's folder of files that come back, at most 8 files) the folder is also
#                 archived to $OUT/<device>-<date>.tar: extract it into results/gpu/ here and commit it.
#   without CUDA  a dry run of the script itself at CPU sizes, into runs/device_check/ (git-ignored),
#                 never into results/gpu/: every step runs its code path at sizes a CPU runs in seconds
#                 (the warm-up records every GPU launch configuration on meta tensors, nothing compiles;
#                 the quantized kernels run under the Triton interpreter); the summary shows each step's
#                 GPU cap beside the CPU limit it ran under.
#   OUT_DIR       given: the tables go there instead.
# Raw outputs of every step (stdout, stderr, partial JSON, compile seconds) stay in runs/device_check/raw/.
#
# Runs from a plain checkout (PYTHONPATH=.), no install step: with $PYTHON, else the first of
# .venv/bin/python, python3, python whose torch sees CUDA (else the first that imports torch: the
# dry run), so a carried CPU virtualenv never turns a GPU run into the dry run.  Without .git (a
# copied checkout) set GIT_COMMIT for meta.json.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-480}
RESERVE=10                      # the tables, the copy and the summary after the last step
DEADLINE=$((T0 + BUDGET - RESERVE))
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RUN_DIR=runs/device_check
WORK=$RUN_DIR/raw
rm -rf "$WORK" && mkdir -p "$WORK"
CACHE=$RUN_DIR/cache
[ "${DEVICE_CHECK_FRESH_CACHE:-0}" = 1 ] && rm -rf "$CACHE"
mkdir -p "$CACHE/triton" "$CACHE/inductor"
export TRITON_CACHE_DIR="$PWD/$CACHE/triton" TORCHINDUCTOR_CACHE_DIR="$PWD/$CACHE/inductor" TRITON_CACHE_AUTOTUNING=1

PROBE_PY='
import json, os, platform, subprocess
import torch
d = {"cuda_available": torch.cuda.is_available(), "torch": torch.__version__, "cuda": torch.version.cuda,
     "python": platform.python_version(), "host_cpus": os.cpu_count()}
for name in ("triton", "transformers", "numpy"):
    try:
        d[name] = __import__(name).__version__
    except Exception:
        d[name] = None
if d["cuda_available"]:
    d["device_name"] = torch.cuda.get_device_name(0)
    try:
        d["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        pass
print(json.dumps(d))
'
PY="" PROBE=""
if [ -n "${PYTHON:-}" ]; then CANDIDATES=("$PYTHON"); else CANDIDATES=(.venv/bin/python python3 python); fi
for c in "${CANDIDATES[@]}"; do
  { [ -x "$c" ] || command -v "$c" > /dev/null 2>&1; } || continue
  out=$(timeout -k 5 60 "$c" -c "$PROBE_PY" 2> /dev/null | tail -n 1) || continue
  [ -z "$PY" ] && { PY=$c; PROBE=$out; }
  if [[ "$out" == *'"cuda_available": true'* ]]; then PY=$c; PROBE=$out; break; fi
done
[ -n "$PY" ] || { echo "device check: no python with torch among ${CANDIDATES[*]} (set PYTHON=...)" >&2; exit 2; }
IFS=$'\t' read -r CUDA DIR < <("$PY" -m workbench.cli.gpu_results start --probe "$PROBE" ${1:+--out "$1"})
if [ -z "${DIR:-}" ]; then echo "device check: could not create the output folder" >&2; exit 2; fi

HAS_XDIST=0; "$PY" -c "import xdist" 2> /dev/null && HAS_XDIST=1
HAS_TIMEOUT=0; "$PY" -c "import pytest_timeout" 2> /dev/null && HAS_TIMEOUT=1
if [ "$CUDA" = 1 ]; then
  DEV=cuda; SIZE=full; RUN=(--triton)         # count Triton JIT / autotuning too (no interpreter here)
  WARMUP=(--workers 8 --budget-s 48)          # 16 cores: 8 compile processes; the cap is 55 s
  TESTS=(tests/kernels/test_kernels_pointwise.py tests/kernels/test_kernels_attention.py tests/transforms/test_backends.py
         tests/transforms/test_cuda_graphs.py tests/transforms/test_batched_backends.py tests/prefetch/test_cuda_prefetch.py
         tests/kv/test_tiers_cuda.py tests/kernels/test_kernels_quant.py)
  [ $HAS_XDIST = 1 ] && TESTS=(-n 8 --dist loadfile "${TESTS[@]}")
  [ $HAS_TIMEOUT = 1 ] && TESTS=(--timeout 60 "${TESTS[@]}")
  SCHED=(--streams 8 --max-tokens 64 --trace-requests 48 --rate 20)
  PREFIX=(--num-requests 50)
  ENGINE=(--repeats 3 --configs reference,loop,cuda-graphs)
  FAST=(--repeats 3 --configs reference,compile,compile+graphs)
  QUANT=(--kernel-ms 1,4,16,64 --kernel-shapes 4096x4096,11008x4096)
  PREFETCH=(--repeats 2 --budget-s 15)        # Llama-3.2-1B-shaped layers: each run installs ~1.8 GB
  TIER=(--docs 1 --eval-tokens 48 --config default)
  # the calibrator with the latency objective on the GPU's own kernels (Triton W4A16 / W8A16 at the
  # bundled model's shapes, decode steps of each measured mix against the unquantized model)
  CALIB=(--dataset reference --objective latency --search-space w8a16,w4a16:g128 --context 128 --eval-windows 2
         --calib-windows 2 --max-measured 4 --rounds 3 --decode-steps 8)
  # Llama-3.2-1B-shaped bf16 (random weights), every Triton kernel on the decode path: 128-token prompts, 64 new
  # tokens, 5 interleaved rounds of 2 configs x 3 batches (~1.5 s a round, after ~5 s of start-up and ~5 s of
  # capture, the kernels compiled by the warm-up); a round that would end past 25 s is not started
  DECODE=(--model preset:llama-3.2-1b --configs paged+graphs,contiguous+graphs --backend fused --batches 1,8,32
          --prompt-tokens 128 --max-tokens 64 --repeats 5 --budget-s 25)
else                            # the dry run: CPU sizes, the interpreter's quick kernel tests
  DEV=cpu; SIZE=small; RUN=()
  WARMUP=(--budget-s 120)
  TESTS=(tests/kernels/test_kernels_pointwise.py tests/kernels/test_kernels_attention.py tests/transforms/test_cuda_graphs.py
         tests/kernels/test_kernels_quant.py -k "not quant or unpacking or errors")
  SCHED=(--streams 4 --max-tokens 8 --trace-requests 8 --rate 8 --overhead-batch 8 --overhead-tokens 4
         --long-prompt-tokens 128 --windows-ms 0 5)
  PREFIX=(--num-requests 8 --max-tokens 4 --rounds 1)
  ENGINE=(--repeats 2 --num-prompts 2 --max-tokens 8 --configs reference,loop,static)
  FAST=(--repeats 2 --num-prompts 2 --max-tokens 8 --configs reference,compile)
  QUANT=()                      # the kernels under the interpreter at 256 x 256, m = 1, 4 (quant_kernels.DRY_RUN)
  PREFETCH=(--repeats 1 --budget-s 40)
  TIER=(--docs 1 --eval-tokens 16 --context 160 --calibration-docs 1 --config default)
  CALIB=(--dataset reference --objective latency --search-space w8a16 --context 32 --eval-windows 1
         --calib-windows 1 --max-measured 2 --rounds 3 --decode-steps 2)
  DECODE=(--model preset:tiny --configs paged+static,contiguous+static --backend eager --batches 1,4
          --prompt-tokens 16 --max-tokens 8 --repeats 3 --budget-s 20)     # fp32; the same static steps, eager
fi

GPU_PLANNED=0
step() {   # step NAME GPU_CAP CPU_CAP -m MODULE ARGS... | -c CODE ARGS...: stdout -> $WORK/NAME.out, stderr -> .log
  local name=$1 gpu_cap=$2 cpu_cap=$3; shift 3
  local cap t0 limit status rc comp
  GPU_PLANNED=$((GPU_PLANNED + gpu_cap))
  if [ "$CUDA" = 1 ]; then cap=$gpu_cap; else cap=$cpu_cap; fi
  t0=$(date +%s)
  limit=$(( DEADLINE - t0 - 5 ))          # timeout -k 5: a step that ignores TERM is killed 5 s later
  (( limit > cap )) && limit=$cap
  if (( limit < 5 )); then
    printf '%s\tskipped (no time left)\t0\t0\t%s\n' "$name" "$gpu_cap" >> "$WORK/steps.tsv"
    echo "== $name: skipped, no time left"; return
  fi
  echo "== $name (limit ${limit}s; GPU cap ${gpu_cap}s)"
  WORKBENCH_PARTIAL_OUT="$WORK/$name.partial.json" WORKBENCH_COMPILE_LOG="$WORK/$name.compile.json" \
    timeout -k 5 "$limit" "$PY" -m workbench.cli.gpu_results run "${RUN[@]}" -- "$@" > "$WORK/$name.out" 2> "$WORK/$name.log"
  rc=$?
  if [ $rc = 0 ]; then status=ok; elif [ $rc = 124 ] || [ $rc = 137 ]; then status=timeout; else status="failed rc=$rc"; fi
  comp=$("$PY" -c 'import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    d = {}
print("\t".join(str(d.get(k, "")) for k in ("compile_s", "triton_compiles", "triton_jit_s", "autotune_s", "inductor_s")))' \
    "$WORK/$name.compile.json")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" $(( $(date +%s) - t0 )) "$limit" "$gpu_cap" "$comp" >> "$WORK/steps.tsv"
  tail -n 2 "$WORK/$name.out" | cut -c1-160
  [ "$status" = ok ] || tail -n 3 "$WORK/$name.log" | cut -c1-300
}

WB=(-m workbench.cli.main)
GR=(-m workbench.cli.gpu_results step)
echo "device check: $DEV, $PY, tables -> $DIR"
# ---- the most valuable rows first ----
step warmup 55 150 "${GR[@]}" warmup --device "$DEV" "${WARMUP[@]}"
step decode_roofline 30 60 "${WB[@]}" kernels-bench --device "$DEV" --size "$SIZE" --sections ceilings,decode \
  --csv "$WORK/kernel_bench.csv" --quiet
step kernels_bench 40 60 "${WB[@]}" kernels-bench --device "$DEV" --size "$SIZE" --sections kernels \
  --csv "$WORK/kernel_bench.csv" --quiet
step decode_stack 35 60 "${WB[@]}" decode-stack --device "$DEV" "${DECODE[@]}" --json --quiet
step quant_bench 20 90 "${GR[@]}" quant-kernels --device "$DEV" "${QUANT[@]}"
step prefetch_link 15 45 "${GR[@]}" prefetch-link --device "$DEV"
step e2e 45 120 -c 'import json, sys; from workbench.bench.end_to_end import run_end_to_end
print(json.dumps(run_end_to_end(device=sys.argv[1], mode="tiny", progress=True), default=str))' "$DEV"
# ---- then the rest, while time remains ----
step tests 45 150 -m pytest -q --maxfail=5 -p no:cacheprovider "${TESTS[@]}"
step engine_bench 25 60 "${WB[@]}" bench --device "$DEV" "${ENGINE[@]}" --json --quiet
step engine_fast 40 90 "${WB[@]}" bench --device "$DEV" "${FAST[@]}" --json --quiet
step sched_bench 20 60 "${WB[@]}" sched-bench --device "$DEV" "${SCHED[@]}" --json --quiet
step prefetch_bench 25 60 "${GR[@]}" prefetch-stream --device "$DEV" --link-json "$WORK/prefetch_link.out" "${PREFETCH[@]}"
step tier_bench 20 60 "${WB[@]}" tier-bench --device "$DEV" "${TIER[@]}" --json
step prefix_bench 15 45 "${WB[@]}" prefix-bench --device "$DEV" "${PREFIX[@]}" --json --quiet
step calibrate 15 90 "${WB[@]}" calibrate-quant --device "$DEV" "${CALIB[@]}" --out "$WORK/calibrate" --json --quiet

echo
echo "== tables"
timeout -k 2 20 "$PY" -m workbench.cli.gpu_results write-tables "$DIR" --work "$WORK" \
  || echo "writing the tables failed (raw outputs in $WORK)"
if [ "$CUDA" = 1 ] && [ -z "${1:-}" ] && [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  # one archive: the device tool brings back at most 8 files, and the folder holds more tables than that
  tar -C "$(dirname "$DIR")" -cf "$OUT/$(basename "$DIR").tar" "$(basename "$DIR")" \
    && echo "archived to \$OUT/$(basename "$DIR").tar: tar -xf it in results/gpu/ and commit the folder"
fi
if [ -s "$WORK/decode_roofline.out" ]; then echo; echo "== decode roofline (last lines)"; tail -n 8 "$WORK/decode_roofline.out"; fi
echo
echo "== device check summary ($DEV) -> $DIR"
printf "%-16s %-24s %7s %7s %9s %9s %8s\n" step status seconds limit_s gpu_cap_s compile_s compiles
while IFS=$'\t' read -r name status secs limit gcap comp ncomp _; do
  printf "%-16s %-24s %7s %7s %9s %9s %8s\n" "$name" "$status" "$secs" "$limit" "$gcap" "${comp:--}" "${ncomp:--}"
done < "$WORK/steps.tsv"
echo "planned GPU caps: ${GPU_PLANNED} s of steps in a ${BUDGET} s budget (${RESERVE} s kept for the tables)"
echo "total: $(( $(date +%s) - T0 )) s of a ${BUDGET} s budget"
cut -f2 "$WORK/steps.tsv" | grep -qv '^ok$' && exit 1
exit 0

#!/usr/bin/env bash
# One GPU session's worth of checks and benchmarks, in one call, within 8 minutes:
#
#   bash scripts/device_check.sh [OUT_DIR]
#
# 1. tests: the kernel, backend, CUDA-graph and batched-engine tests on the GPU (compiled Triton,
#    not the interpreter);  2. kernels_bench: `workbench kernels-bench` at full size (ceilings,
#    every kernel vs eager and torch.compile, the Llama-3.2-1B-shaped decode step eager / fused /
#    fused + CUDA graphs);  3. sched_bench: `workbench sched-bench`;  4. engine_bench: the engine's
#    reference configuration, the bare loop and CUDA-graphed decode vs transformers.generate
#    (`workbench bench`);  5. engine_fast: torch.compile'd decode, alone and captured as CUDA graphs;
#    6. prefix_bench: `workbench prefix-bench`;  7. prefetch_bench: `workbench prefetch-bench` (the
#    pinned host -> HBM link's GB/s per block size, weight streaming with half the layers offloaded
#    vs all resident: tokens/s, prefetch hit rate, stall, prefetch_efficiency).  The tests of step 1
#    include the CUDA transport and streamed weights inside captured CUDA graphs;  8. tier_bench:
#    `workbench tier-bench` (the physical hot / warm / cold cache: measured resident bytes vs the
#    formula and the full cache, routed blocks over pinned host -> HBM: hit rate, stall, bytes per
#    step, per predictor).  The tests of step 1 also run the physical tiered cache on CUDA
#    (same logits as the accounted cache; measured bytes vs torch.cuda.memory_allocated);
#    9. quant_bench: `workbench quant-bench --kernels` (the W4A16 split-K GEMV / GEMM, W8A16 and
#    W4A8 Triton kernels vs dense bf16 F.linear at m = 1, 4, 16, 64 on Llama-7B-sized layers; it
#    exits 1 when a kernel's error against its reference exceeds 1e-2), after quant_tests (the
#    kernels' tests against their torch references, compiled on the GPU);  10. decode_stack: `workbench
#    decode-stack` (the paged pool + prefix cache + Triton paged decode + CUDA graphs against the contiguous
#    graph path, same backends, in the engine on a Llama-3.2-1B-shaped bf16 model at batch 1, 8 and 32:
#    decode tokens/s, at batch 1 the fraction of the copy bandwidth measured in the same run, the ratio
#    paged / contiguous and greedy token agreement);  11. e2e: notebook 06's ablation
#    at its tiny size (workbench.bench.end_to_end.run_end_to_end: one realistic workload, every layer
#    alone against the baseline and stacked, the Triton kernels and CUDA graphs as the kernel layers on a
#    GPU; TTFT / TPOT / E2E P95, throughput, measured memory, greedy agreement and perplexity per
#    configuration, the layers the engine refused to combine and why).
#
# Every step has its own time cap, and the whole script (summary included) ends within
# DEVICE_CHECK_BUDGET_S = 480 s: a step that would run past that gets the time left, or is
# skipped.  A failed step is reported and the next one runs.  The summary table prints last;
# the exit status is 1 when any step did not pass.
#
# Where the tables go (workbench/measure/gpu_results.py writes them, called through
# `python -m workbench.cli.gpu_results`; see results/gpu/README.md):
#   with CUDA     results/gpu/<device>-<YYYY-MM-DD>/ (committed; a second run that day: -2, -3 ...):
#                 meta.json, summary.csv, engine_bench.csv, kernel_bench.csv, sched_bench.csv,
#                 prefix_bench.csv, prefetch_bench.csv, tier_bench.csv, quant_bench.csv, calibrate.csv,
#                 decode_stack.csv, e2e.csv,
#                 device_check.log.  Where $OUT is set (the device
#                 tool's folder of files that come back, at most 8 files) the folder is also archived to
#                 $OUT/<device>-<date>.tar: extract it into results/gpu/ here and commit the folder.
#   without CUDA  a dry run of the script itself at CPU sizes, into runs/device_check/ (git-ignored),
#                 never into results/gpu/.
#   OUT_DIR       given: the tables go there instead.
# Raw outputs of every step (stdout, stderr) stay in runs/device_check/raw/.
#
# Runs from a plain checkout (PYTHONPATH=.), no install step: with $PYTHON, else .venv/bin/python,
# else python3 / python.  Without .git (a copied checkout) set GIT_COMMIT for meta.json.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-480}
RESERVE=15                      # the tables, the copy and the summary after the last step
DEADLINE=$((T0 + BUDGET - RESERVE))
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif command -v python3 > /dev/null; then PY=python3
else PY=python; fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK=runs/device_check/raw
rm -rf "$WORK" && mkdir -p "$WORK"

PROBE=$(timeout -k 5 60 "$PY" - <<'EOF'
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
EOF
) || { echo "device check: '$PY' cannot import torch (set PYTHON=...)" >&2; exit 2; }
IFS=$'\t' read -r CUDA DIR < <("$PY" -m workbench.cli.gpu_results start --probe "$PROBE" ${1:+--out "$1"})
if [ -z "${DIR:-}" ]; then echo "device check: could not create the output folder" >&2; exit 2; fi

if [ "$CUDA" = 1 ]; then
  DEV=cuda; SIZE=full
  TESTS=(tests/kernels/test_kernels_pointwise.py tests/kernels/test_kernels_attention.py tests/transforms/test_backends.py
         tests/transforms/test_cuda_graphs.py tests/transforms/test_batched_backends.py tests/prefetch/test_cuda_prefetch.py
         tests/kv/test_tiers_cuda.py)
  QUANT_TESTS=(tests/kernels/test_kernels_quant.py)   # its own step: ~60 kernel compiles
  # 16 cores there: compile the tests' kernels in 4 processes when pytest-xdist is installed
  "$PY" -c "import xdist" 2> /dev/null && TESTS=(-n 4 --dist loadfile "${TESTS[@]}")
  SCHED=(--streams 8 --max-tokens 64 --trace-requests 48 --rate 20)
  PREFIX=(--num-requests 50)
  ENGINE=(--repeats 3 --configs reference,loop,cuda-graphs)
  FAST=(--repeats 3 --configs reference,compile,compile+graphs)
  PREFETCH=(--options eager)      # compile with streaming is checked on the CPU; here it would not fit the cap
  QUANT=(--skip-quality --preset none --kernels --kernel-ms 1,4,16,64 --kernel-shapes 4096x4096,11008x4096)
  # the calibrator with the latency objective on the GPU's own kernels (Triton W4A16 / W8A16 at the
  # bundled model's shapes, decode steps of each measured mix against the unquantized model)
  CALIB=(--dataset reference --objective latency --search-space w8a16,w4a16:g128 --context 128 --eval-windows 2
         --calib-windows 2 --max-measured 4 --rounds 3 --decode-steps 8)
  # Llama-3.2-1B-shaped bf16 (random weights), every Triton kernel on the decode path: 128-token prompts, 64 new
  # tokens, 5 interleaved rounds of 2 configs x 3 batches (~1.5 s a round, after ~5 s of start-up and ~5 s of
  # capture, JIT and warm-up); a round that would end past 20 s of the run is not started (the first always runs)
  DECODE=(--model preset:llama-3.2-1b --configs paged+graphs,contiguous+graphs --backend fused --batches 1,8,32
          --prompt-tokens 128 --max-tokens 64 --repeats 5 --budget-s 20)
else                            # the dry run: CPU sizes, the interpreter's quick kernel tests
  DEV=cpu; SIZE=small
  TESTS=(tests/kernels/test_kernels_pointwise.py tests/kernels/test_kernels_attention.py tests/transforms/test_cuda_graphs.py)
  SCHED=(--streams 4 --max-tokens 8 --trace-requests 8 --rate 8 --overhead-batch 8 --overhead-tokens 4
         --long-prompt-tokens 128 --windows-ms 0 5)
  PREFIX=(--num-requests 8 --max-tokens 4 --rounds 1)
  ENGINE=(--repeats 2 --num-prompts 2 --max-tokens 8 --configs reference,loop,static)
  FAST=(--repeats 2 --num-prompts 2 --max-tokens 8 --configs reference,compile)
  PREFETCH=(--options eager)
  QUANT=(--recipes fp32,w4a16:g128,w8a8 --docs 1 --context 64 --preset tiny --decode-steps 2)   # no GPU kernels here
  QUANT_TESTS=(tests/kernels/test_kernels_quant.py -k "unpacking or errors")
  CALIB=(--dataset reference --objective latency --search-space w8a16 --context 32 --eval-windows 1
         --calib-windows 1 --max-measured 2 --rounds 3 --decode-steps 2)
  DECODE=(--model preset:tiny --configs paged+static,contiguous+static --backend eager --batches 1,4
          --prompt-tokens 16 --max-tokens 8 --repeats 3 --budget-s 20)     # fp32; the same static steps, eager
fi

step() {   # step NAME CAP_S command...: stdout -> $WORK/NAME.out, stderr -> $WORK/NAME.log
  local name=$1 cap=$2; shift 2
  local t0 limit status rc
  t0=$(date +%s)
  limit=$(( DEADLINE - t0 - 3 ))          # timeout -k 3: a step that ignores TERM is killed 3 s later
  (( limit > cap )) && limit=$cap
  if (( limit < 5 )); then
    printf '%s\tskipped (no time left)\t0\t%s\n' "$name" "$cap" >> "$WORK/steps.tsv"
    echo "== $name: skipped, no time left"; return
  fi
  echo "== $name (limit ${limit}s)"
  timeout -k 3 "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.log"
  rc=$?
  if [ $rc = 0 ]; then status=ok; elif [ $rc = 124 ] || [ $rc = 137 ]; then status=timeout; else status="failed rc=$rc"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" $(( $(date +%s) - t0 )) "$limit" >> "$WORK/steps.tsv"
  tail -n 2 "$WORK/$name.out" | cut -c1-160
  [ "$status" = ok ] || tail -n 3 "$WORK/$name.log" | cut -c1-300
}

WB=("$PY" -m workbench.cli.main)
echo "device check: $DEV, $PY, tables -> $DIR"
step tests 65 "$PY" -m pytest -q -x -p no:cacheprovider "${TESTS[@]}"
step kernels_bench 65 "${WB[@]}" kernels-bench --device "$DEV" --size "$SIZE" --csv "$WORK/kernel_bench.csv" --quiet
step sched_bench 35 "${WB[@]}" sched-bench --device "$DEV" "${SCHED[@]}" --json --quiet
step engine_bench 35 "${WB[@]}" bench --device "$DEV" "${ENGINE[@]}" --json --quiet
step engine_fast 40 "${WB[@]}" bench --device "$DEV" "${FAST[@]}" --json --quiet
step prefix_bench 25 "${WB[@]}" prefix-bench --device "$DEV" "${PREFIX[@]}" --json --quiet
step prefetch_bench 30 "${WB[@]}" prefetch-bench --device "$DEV" "${PREFETCH[@]}" --json --quiet
step tier_bench 30 "${WB[@]}" tier-bench --device "$DEV" --docs 1 --eval-tokens 48 --config default --json
step quant_tests 25 "$PY" -m pytest -q -x -p no:cacheprovider "${QUANT_TESTS[@]}"
step quant_bench 25 "${WB[@]}" quant-bench "${QUANT[@]}" --json --quiet
step calibrate 20 "${WB[@]}" calibrate-quant --device "$DEV" "${CALIB[@]}" --out "$WORK/calibrate" --json --quiet
# the end-to-end stack rows, after the kernel rows: by now the Triton kernels they launch are compiled (tests,
# kernels_bench, quant_tests).  decode_stack's 30 s came from tests, kernels_bench, engine_bench, prefetch_bench,
# calibrate and e2e, 5 s each (the budget stays 480 s); it is sized for ~20 s (DECODE above)
step decode_stack 30 "${WB[@]}" decode-stack --device "$DEV" "${DECODE[@]}" --json --quiet
step e2e 40 "$PY" -c 'import json, sys; from workbench.bench.end_to_end import run_end_to_end
print(json.dumps(run_end_to_end(device=sys.argv[1], mode="tiny", progress=True), default=str))' "$DEV"

echo
echo "== tables"
timeout -k 2 10 "$PY" -m workbench.cli.gpu_results write-tables "$DIR" --work "$WORK" \
  || echo "writing the tables failed (raw outputs in $WORK)"
if [ "$CUDA" = 1 ] && [ -z "${1:-}" ] && [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  # one archive: the device tool brings back at most 8 files, and the folder holds more tables than that
  tar -C "$(dirname "$DIR")" -cf "$OUT/$(basename "$DIR").tar" "$(basename "$DIR")" \
    && echo "archived to \$OUT/$(basename "$DIR").tar: tar -xf it in results/gpu/ and commit the folder"
fi
if [ -s "$WORK/kernels_bench.out" ]; then echo; echo "== kernel bench (last lines)"; tail -n 25 "$WORK/kernels_bench.out"; fi
echo
echo "== device check summary ($DEV) -> $DIR"
printf "%-14s %-24s %7s %7s\n" step status seconds limit_s
while IFS=$'\t' read -r name status secs limit; do
  printf "%-14s %-24s %7s %7s\n" "$name" "$status" "$secs" "$limit"
done < "$WORK/steps.tsv"
echo "total: $(( $(date +%s) - T0 )) s of a ${BUDGET} s budget"
cut -f2 "$WORK/steps.tsv" | grep -qv '^ok$' && exit 1
exit 0

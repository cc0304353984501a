#!/usr/bin/env bash
# The measurement suite in one command, in pieces that each fit a time budget.
#
#   bash profiling/run_suite.sh                     # on a GPU: op latency, chunk sweep, max length per
#                                                   # strategy, fixed-length comparison, plots
#   bash profiling/run_suite.sh --tiny              # CPU smoke sizes (results in .../cpu-smoke/)
#   bash profiling/run_suite.sh --side-by-side      # the CPU side-by-side of benchmarks/README.md
#
# Options: --budget-min N (minutes per piece, default 10, at most 10), --only REGEX (run only the
# pieces whose name matches, e.g. --only 'lengths fpdt|plot', so that a session limited to 10
# minutes per command can run the suite one call at a time), --device-mem-gib X
# (simulated capacity for the max-length search on the CPU; default 2 for --side-by-side),
# --out-dir DIR (default benchmarks/results/<device>/<date>). Every piece runs under
# `timeout` and `nice`; a piece that runs out of time is reported and the suite goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

BUDGET=10; TINY=0; SIDE=0; MEM=""; OUT=""; ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-min) BUDGET="$2"; shift 2;;
    --tiny) TINY=1; shift;;
    --side-by-side) SIDE=1; shift;;
    --device-mem-gib) MEM="$2"; shift 2;;
    --out-dir) OUT="$2"; shift 2;;
    --only) ONLY="$2"; shift 2;;
    *) echo "run_suite.sh: unknown option $1 (see the header of this file)" >&2; exit 2;;
  esac
done
if [ "$BUDGET" -gt 10 ] || [ "$BUDGET" -lt 1 ]; then echo "--budget-min must be 1..10" >&2; exit 2; fi
CAP=$((BUDGET * 60 - 20))            # per-trial cap inside a piece
if [ -z "$OUT" ]; then
  OUT=$(python -c "from profiling import bench_common as bc; print(bc.results_dir($TINY == 1))")
fi
mkdir -p "$OUT"
FAILED=0
piece() {   # piece NAME CMD...: run one piece under the budget
  local name="$1"; shift
  if [ -n "$ONLY" ] && ! [[ "$name" =~ $ONLY ]]; then return 0; fi
  echo "== $name ($(date -u +%H:%M:%S), budget ${BUDGET} min)"
  timeout "${BUDGET}m" nice -n 10 "$@" || { echo "!! $name stopped (exit $?)"; FAILED=$((FAILED + 1)); }
}

if [ "$TINY" = 1 ]; then
  piece op_latency python -m profiling.op_latency --tiny --out-dir "$OUT"
  piece chunk_sweep python -m profiling.chunk_sweep --tiny --no-offload-too --out-dir "$OUT"
  piece lm_head_wgrad python -m profiling.lm_head_wgrad --tiny --repeats 1 --out-dir "$OUT"
  piece hf_integration python -m profiling.hf_integration --tiny --out-dir "$OUT"
  for s in fpdt fpdt-no-offload hf alst; do
    piece "max_seqlen $s" python -m profiling.max_seqlen --tiny --strategies "$s" --lengths 64 128 \
      --tag "$s" --out-dir "$OUT"
  done
elif [ "$SIDE" = 1 ]; then
  # The CPU side-by-side (benchmarks/README.md): the same small Llama, fp32, every strategy at 2K..16K; a trial over the
  # simulated capacity is still measured (slopes use it) and marked out of memory. 4K-token
  # chunks for fpdt; one piece per strategy and length. Then the longest length under the
  # capacity, by bisection at 256-token steps, for the strategies that reach it within these
  # lengths (hf); the others' longest is extrapolated from their fit by plot.py.
  CFG=benchmarks/side_by_side_config.json
  # This machine's kernel and copy rates for the planner's step-time prediction (its shapes).
  piece op_latency python -m profiling.op_latency --chunks 1024 2048 4096 --heads 8 --kv-heads 2 --head-dim 64 \
    --dtype fp32 --gemm-size 2048 --warmup 1 --iters 3 --bandwidth-sizes-mib 1 16 64 --out-dir "$OUT"
  CAL=()
  [ -f "$OUT/calibration.json" ] && CAL=(--calibration "$OUT/calibration.json")
  for len in 2048 4096 8192 16384; do
    for s in fpdt fpdt-no-offload hf alst; do
      piece "lengths $s $len" python -m profiling.max_seqlen --model-config "$CFG" --dtype fp32 --chunk-size 4096 \
        --strategies "$s" --lengths "$len" --device-mem-gib "${MEM:-2}" --trial-timeout-s "$CAP" \
        --tag "lengths-$s-$len" --out-dir "$OUT" "${CAL[@]}"
    done
  done
  piece "bisect hf" python -m profiling.max_seqlen --model-config "$CFG" --dtype fp32 --chunk-size 256 \
    --strategies hf --min-len 2048 --max-len 16384 --resolution 256 --device-mem-gib "${MEM:-2}" \
    --trial-timeout-s "$CAP" --tag "bisect-hf" --out-dir "$OUT"
  # Every strategy's longest length measured, at a capacity these CPU steps reach in minutes
  # (1 GiB): bisection stops a trial at the allocation that passes it; fpdt's lengths are whole
  # 4K chunks, the others' multiples of 512 (ALST's loss shards follow fpdt's rule at 4K chunks).
  # The ranges are narrowed to where the answers lie (found by the fixed-length runs and a first,
  # wider bisection), so that each piece fits its 10 minutes on two CPU cores.
  BMEM=1
  piece "bisect1 hf" python -m profiling.max_seqlen --model-config "$CFG" --dtype fp32 --chunk-size 4096 \
    --step 256 --strategies hf --min-len 512 --max-len 4096 --resolution 256 --device-mem-gib "$BMEM" \
    --no-timed-step --trial-timeout-s "$CAP" --tag "bisect1-hf" --out-dir "$OUT"
  piece "bisect1 alst" python -m profiling.max_seqlen --model-config "$CFG" --dtype fp32 --chunk-size 4096 \
    --step 512 --strategies alst --min-len 12288 --max-len 16384 --resolution 512 --device-mem-gib "$BMEM" \
    --no-timed-step --trial-timeout-s "$CAP" --tag "bisect1-alst" --out-dir "$OUT"
  for range in "fpdt-no-offload 8192 16384" "fpdt 24576 28672"; do
    set -- $range
    piece "bisect1 $1" python -m profiling.max_seqlen --model-config "$CFG" --dtype fp32 --chunk-size 4096 \
      --strategies "$1" --min-len "$2" --max-len "$3" --resolution 4096 --device-mem-gib "$BMEM" \
      --no-timed-step --trial-timeout-s "$CAP" --tag "bisect1-$1" --out-dir "$OUT"
  done
else
  # The kernel rates at the head shape of the model the max-length pieces train (max_seqlen.py's
  # default, Llama-3.2-1B: 32 / 8 heads of 64): the planner's step time beside them uses these rates.
  # --backends all: every attention kernel that runs here and torch's SDPA (what hf and alst run),
  # side by side at the same shapes.
  # Chunks up to 64K: every kernel at 128K and 256K would not fit one 10-minute piece.
  piece op_latency python -m profiling.op_latency --heads 32 --kv-heads 8 --head-dim 64 --backends all \
    --chunks 8192 16384 32768 65536 --out-dir "$OUT"
  CAL=()
  [ -f "$OUT/calibration.json" ] && CAL=(--calibration "$OUT/calibration.json")
  # Whether the attention kernel explains fpdt's step time against alst's, in one short call
  # (--only 'op_latency|kernel', about 7 minutes on an H100): fpdt with its automatic kernel, fpdt on
  # FlashAttention-2 (torch's cuda_flash, the automatic choice before 2026-11-24; rows
  # "fpdt [cuda_flash]" in the table) and alst, at 64K and 128K. The "lengths" pieces repeat the
  # first and last at more lengths.
  piece "kernel fpdt" python -m profiling.max_seqlen --strategies fpdt --lengths 65536 131072 \
    --trial-timeout-s "$CAP" --tag "kernel-fpdt" --out-dir "$OUT" "${CAL[@]}"
  piece "kernel fpdt cuda_flash" python -m profiling.max_seqlen --strategies fpdt --lengths 65536 131072 \
    --attention-backend cuda_flash --trial-timeout-s "$CAP" --tag "kernel-fpdt-cuda_flash" --out-dir "$OUT" "${CAL[@]}"
  piece "kernel alst" python -m profiling.max_seqlen --strategies alst --lengths 65536 131072 \
    --trial-timeout-s "$CAP" --tag "kernel-alst" --out-dir "$OUT"
  piece chunk_sweep python -m profiling.chunk_sweep --seq-len 262144 --no-offload-too --trial-timeout-s "$CAP" --out-dir "$OUT"
  piece lm_head_wgrad python -m profiling.lm_head_wgrad --out-dir "$OUT" "${CAL[@]}"
  piece hf_integration python -m profiling.hf_integration --seq-lens 32768 65536 131072 --chunk-size 16384 \
    --out-dir "$OUT"
  for s in fpdt fpdt-no-offload hf alst; do
    piece "lengths $s" python -m profiling.max_seqlen --strategies "$s" --lengths 65536 131072 262144 524288 \
      --trial-timeout-s "$CAP" --tag "lengths-$s" --out-dir "$OUT" "${CAL[@]}"
    piece "bisect $s" python -m profiling.max_seqlen --strategies "$s" ${MEM:+--device-mem-gib "$MEM"} \
      --trial-timeout-s "$CAP" --tag "bisect-$s" --out-dir "$OUT" "${CAL[@]}"
  done
fi
README_ARG=()
[ "$TINY" = 1 ] && README_ARG=(--readme "")   # smoke runs never touch benchmarks/README.md
piece plot python -m profiling.plot "$OUT" "${README_ARG[@]}"
echo "== done: results in $OUT ($FAILED piece(s) stopped early)"

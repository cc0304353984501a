#!/usr/bin/env bash
# The GPU evidence of one device-tool call (about 9 minutes): is fpdt's step as fast as ALST's at
# equal length, on which kernels, what do saved attention outputs buy, and do the Gated DeltaNet and
# expert kernels (fla, grouped GEMM) give Transformers' numbers. Pieces in order of value; each runs
# only when the time left covers its estimate (H100 step times of 2026-11-24; the small hybrid and
# MoE models' are estimates, they have not run on a GPU), and the results are packed into
# $OUT/results.tgz after every piece, so a call stopped at the device tool's limit still returns
# what finished.
#
#   1. the CUDA tests (pytest -m cuda), then the offload and streamed-layer ones under
#      TORCH_CUDA_SANITIZER
#   2. parity of the small Qwen3.5 and Qwen3-MoE models (benchmarks/models/) against Transformers:
#      one bf16 step of 4096 tokens in 4 chunks on fla and grouped GEMM, each loss and gradient
#      against a float64 run beside plain Transformers bf16's own error (profiling/model_parity.py;
#      it exits 1, "stopped" in the log, when fpdt fails its criterion: an error within twice
#      plain bf16's, more for tensors of few elements, and routes moved where experts route)
#   3. op_latency --backends all at the Llama-3.2-1B head shape (32 query / 8 KV heads of 64),
#      one 64K chunk: forward and backward of every kernel and of torch's SDPA, with the kernel
#      each ran; its calibration.json gives the planner's predictions below measured rates
#   4. fpdt (automatic kernel, attention_checkpoint=recompute) and alst at 128K: one timed step
#      each, and one more step traced between them (--profile-step: kernels by time, GPU busy time)
#   5. fpdt on each small model at 64K in 16K chunks: one counted step (device peak, step time,
#      the planner's prediction, the delta-rule and expert kernels as layer_kernels)
#   6. fpdt-save (attention_checkpoint=save) at 128K, traced like 4
#   7. fpdt-save at 256K, one counted step, if time remains
#
#   FPDT_GIT_COMMIT=$(git rev-parse --short HEAD) bash profiling/gpu_session.sh evidence   # device tool
#   bash profiling/gpu_evidence.sh --tiny                  # dry run on the CPU (tiny sizes, cpu-smoke/)
#
#   bash profiling/gpu_evidence.sh --streamed              # the second call: fpdt with and without
#                                                          # stream_layers at 256K, one counted step each
# Options: --budget-s N (seconds for all pieces, default 530), --tiny, --streamed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
TINY=0; BUDGET=530; STREAMED=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) TINY=1; shift;;
    --streamed) STREAMED=1; shift;;
    --budget-s) BUDGET="$2"; shift 2;;
    *) echo "gpu_evidence.sh: unknown option $1 (see the header of this file)" >&2; exit 2;;
  esac
done
DEADLINE=$(( $(date +%s) + BUDGET ))
DIR=$(python3 -c "from profiling import bench_common as bc; print(bc.results_dir($TINY == 1))")
LOG="$DIR/evidence.log"
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" "$DIR" 2>/dev/null; cp "$LOG" "$OUT/" 2>/dev/null; fi; }
piece() {   # piece NAME NEED CAP CMD...: run CMD if the time left covers NEED seconds, for at most CAP
  local name="$1" need="$2" cap="$3"; shift 3
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt "$need" ]; then
    echo "-- $name skipped: ${left}s left, it needs about ${need}s" | tee -a "$LOG"; return 0
  fi
  [ "$cap" -lt $(( left - 5 )) ] || cap=$(( left - 5 ))
  echo "== $name ($(date -u +%H:%M:%S), ${left}s left, at most ${cap}s)" | tee -a "$LOG"
  timeout --kill-after=5 "$cap" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "!! $name stopped (exit $rc)" | tee -a "$LOG"
  pack
}

if [ "$TINY" = 1 ]; then   # the CPU counts a 128-token step of the 16-expert model in 1-2 minutes
  SIZES=(--tiny); L0=128; L1=128; L2=256; OPL=(--tiny); CAP0=300
else
  SIZES=(); L0=65536; L1=131072; L2=262144; CAP0=120
  OPL=(--heads 32 --kv-heads 8 --head-dim 64 --backends all --chunks 65536)
fi
if [ "$STREAMED" = 1 ]; then   # 1B at 256K: an fpdt step ~78 s on an H100, plus ~20 s of start-up
  HALF=$(( (DEADLINE - $(date +%s) - 10) / 2 ))
  for strategy in fpdt-stream fpdt; do
    piece "$strategy $L2" 100 "$HALF" python3 -m profiling.max_seqlen "${SIZES[@]}" --strategies "$strategy" \
      --lengths "$L2" --no-timed-step --trial-timeout-s $(( HALF - 10 )) --tag "evidence-$strategy-long" --out-dir "$DIR"
  done
  echo "== done ($(date -u +%H:%M:%S)): results in $DIR" | tee -a "$LOG"
  pack
  exit 0
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  python3 -c "from fpdt.bench.environment import software; print(software())"; } | tee "$DIR/gpu.txt" | tee -a "$LOG"
piece "cuda tests" 60 150 python3 -m pytest -q -m cuda tests -p no:cacheprovider
# the offload and streamed-layer CUDA tests again under PyTorch's CUDA sanitizer (stream races)
piece "sanitizer" 30 90 env TORCH_CUDA_SANITIZER=1 python3 -m pytest -q -m cuda tests/attention/test_cuda.py \
  tests/model/test_streaming.py -p no:cacheprovider
SMALL=(benchmarks/models/qwen3_5_small.json benchmarks/models/qwen3_moe_small.json)
# four runs of each model (float64, fp32, bf16, fpdt); the float64 delta rule steps token by token
# (about 12K steps), and fla's first calls compile and autotune its Triton kernels
piece "parity" 90 240 python3 -m profiling.model_parity "${SIZES[@]}" --model-config "${SMALL[@]}" --out-dir "$DIR"
piece "op_latency" 45 120 python3 -m profiling.op_latency "${OPL[@]}" --out-dir "$DIR"
CAL=()
[ -f "$DIR/calibration.json" ] && CAL=(--calibration "$DIR/calibration.json")
# NEED and CAP per strategy at 128K: start-up (~20 s) + counted, traced and timed steps (H100:
# fpdt 22 s, alst 17 s a step); a trial's own limit sits 10 s inside the piece's.
long_step() {   # long_step STRATEGY NEED CAP
  piece "$1 $L1" "$2" "$3" python3 -m profiling.max_seqlen "${SIZES[@]}" --strategies "$1" --lengths "$L1" \
    --profile-step --trial-timeout-s $(( $3 - 10 )) --tag "evidence-$1" --out-dir "$DIR" "${CAL[@]}"
}
long_step fpdt 100 200
long_step alst 80 170
# one counted step of each small model at 64K in 4 chunks: start-up (~20 s) and a step not yet
# timed on a GPU (a Llama-3.2-1B fpdt step took 7 s at 64K)
for model in "${SMALL[@]}"; do
  name=$(basename "$model" .json)
  piece "fpdt $name $L0" 45 "$CAP0" python3 -m profiling.max_seqlen "${SIZES[@]}" --model-config "$model" --strategies fpdt \
    --lengths "$L0" --chunk-size 16384 --no-timed-step --trial-timeout-s $(( CAP0 - 10 )) --tag "evidence-$name" \
    --out-dir "$DIR" "${CAL[@]}"
done
long_step fpdt-save 90 180
LONG=$(( DEADLINE - $(date +%s) - 15 ))
piece "fpdt-save $L2" 100 "$LONG" python3 -m profiling.max_seqlen "${SIZES[@]}" --strategies fpdt-save --lengths "$L2" \
  --no-timed-step --trial-timeout-s $(( LONG - 10 )) --tag "evidence-fpdt-save-long" --out-dir "$DIR" "${CAL[@]}"
echo "== done ($(date -u +%H:%M:%S)): results in $DIR" | tee -a "$LOG"
pack

#!/usr/bin/env bash
# Everything a session with a GPU owes, from the repository root on the GPU machine:
#
#   bash profiling/gpu_session.sh              # 1. the CUDA tests (attention kernels, offload streams,
#                                              #    FPDTAttention, the model), 2. profiling/attention_offload.py
#                                              #    at S=256K, 3. profiling/model_memory.py (Llama-3.2-1B shape)
#   bash profiling/gpu_session.sh install      # only the packages from .gpu-wheels/ (then run steps by hand)
#   bash profiling/gpu_session.sh evidence     # one ~9-minute call: CUDA tests, parity of the small
#                                              # Qwen3.5 and Qwen3-MoE against Transformers (fla, grouped
#                                              # GEMM), every kernel's latency, a 64K step of each small
#                                              # model, fpdt against alst at 128K with traced steps, saved
#                                              # attention outputs against recompute (profiling/gpu_evidence.sh)
#   bash profiling/gpu_session.sh evidence --streamed  # the second call: fpdt with and without
#                                              # stream_layers at 256K, one counted step each
#   bash profiling/gpu_session.sh sanitizer    # the CUDA offload and streaming tests under TORCH_CUDA_SANITIZER
#   bash profiling/gpu_session.sh suite REGEX  # pieces of the measurement suite (profiling/run_suite.sh
#                                              # --only REGEX), each within 10 minutes, e.g. 'op_latency',
#                                              # 'chunk_sweep', 'lengths fpdt$', 'bisect hf', 'plot'
#
# The device tool allows 10 minutes per command, so the suite runs one call per few pieces; results
# land in benchmarks/results/<gpu>/<date>/ (commit them), logs in $OUT when set (device tool), else /tmp.
# The alst strategy and the trainer need DeepSpeed, and the Gated DeltaNet layers' CUDA kernel needs
# fla-core (fla), which the GPU machine lacks and cannot download: run `bash profiling/gpu_wheels.sh`
# here first and carry `.gpu-wheels` (device tool: carry=[".gpu-wheels"]); this script installs from
# it when DeepSpeed, pytest or fla is missing. Without it, max_seqlen.py reports alst as skipped (the
# other strategies do not need DeepSpeed) and Gated DeltaNet runs fpdt's PyTorch delta rule
# (model_parity.py records which ran).
#
# What the first GPU session (2026-11-24, one H100, 30 minutes of device time) learned:
# - only $OUT comes back: this script packs benchmarks/results into $OUT/results.tgz on exit;
#   unpack it here (tar xzf) and commit;
# - git-ignored paths (a scratch folder) travel only when named in carry;
# - a Llama-3.2-1B fpdt step takes ~7 s at 64K, ~22 s at 128K, ~78 s at 256K (a trial runs two
#   steps plus ~20 s of start-up; a chunk-sweep trial three, for its profiler warm-up), so a
#   bisection past 256K does not fit one 10-minute call; what it owes next is listed at the end
#   of benchmarks/README.md's GPU section.
# - fpdt ran torch's FlashAttention-2 kernel there while hf and alst ran whatever torch's SDPA
#   dispatched to (cuDNN first on sm90 when the runtime cuDNN is recent enough), unrecorded. Trials
#   now record attention_kernel and fpdt's automatic choice follows torch's SDPA; a session's first
#   call should be `suite 'op_latency|kernel'` (about 7 minutes: every kernel's latency, then fpdt
#   on its automatic kernel and on cuda_flash, and alst, at 64K and 128K), then `suite 'lengths
#   fpdt$'` and `suite 'lengths alst$'`, one call each (each fills its 9-minute budget).
# - a call killed at the device tool's limit runs no EXIT trap: suite mode stops run_suite.sh at
#   9.5 minutes, so the results are still packed.
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${OUT:-/tmp}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for spec in deepspeed pytest pytest_timeout:pytest-timeout fla:fla-core; do   # module[:distribution]
  pkg=${spec%%:*}; dist=${spec#*:}
  if ! python3 -c "import $pkg" 2>/dev/null; then
    if [ -d .gpu-wheels ]; then
      python3 -m pip install -q --no-index --find-links .gpu-wheels "$dist" 2>&1 | tail -3
    else
      echo "gpu_session.sh: $pkg is missing and there is no .gpu-wheels/ (bash profiling/gpu_wheels.sh, then carry it)"
    fi
  fi
done
# The device tool returns only what lands in $OUT: pack the results folder there on every exit.
if [ -n "${OUT:-}" ]; then trap 'tar czf "$OUT/results.tgz" benchmarks/results 2>/dev/null' EXIT; fi
if [ "${1:-}" = "install" ]; then exit 0; fi
if [ "${1:-}" = "evidence" ]; then        # one ~9-minute call: profiling/gpu_evidence.sh's header
  bash profiling/gpu_evidence.sh "${@:2}"
  exit 0
fi
if [ "${1:-}" = "sanitizer" ]; then
  TORCH_CUDA_SANITIZER=1 python3 -m pytest -q -s -m cuda tests/attention/test_cuda.py tests/model/test_streaming.py 2>&1 | tee "$logs/sanitizer.log"
  exit 0
fi
if [ "${1:-}" = "suite" ]; then
  timeout 570 bash profiling/run_suite.sh --budget-min 9 \
    --only "${2:?give the pieces to run, e.g. 'op_latency|chunk_sweep'}" 2>&1 | tee -a "$logs/suite.log"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$logs/gpu.txt"
python3 -m pytest -q -s -m cuda tests 2>&1 | tee "$logs/cuda_tests.log"
python3 -m profiling.attention_offload 2>&1 | tee "$logs/attention_offload.log"
python3 -m profiling.model_memory 2>&1 | tee "$logs/model_memory.log"
cp benchmarks/results/*.md "$logs/" 2>/dev/null || true

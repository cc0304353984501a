#!/usr/bin/env bash
# Everything a session with a GPU owes, in one go (run from the repository root on the GPU machine):
#   1. the CUDA parity tests (attention kernels, offload streams, FPDTAttention),
#   2. profiling/attention_offload.py at S=256K, chunks of 32K and 64K,
#   3. profiling/model_memory.py for the Llama-3.2-1B-shaped model at 32K/128K/512K.
# Results land in benchmarks/results/ (commit them); logs go to $OUT when set (device tool), else /tmp.
# The trainer's 1B run needs DeepSpeed, which the GPU machine lacks: carry its wheel (see the device README).
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${OUT:-/tmp}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$logs/gpu.txt"
python3 -m pytest -q -m cuda tests/attention 2>&1 | tee "$logs/cuda_tests.log"
python3 profiling/attention_offload.py 2>&1 | tee "$logs/attention_offload.log"
python3 profiling/model_memory.py 2>&1 | tee "$logs/model_memory.log"
cp benchmarks/results/*.md "$logs/" 2>/dev/null || true

#!/usr/bin/env bash
# Fill .gpu-wheels/ (git-ignored) with what the GPU machine lacks and cannot download (it has no
# package registry; ../shared/ENVIRONMENT.md): DeepSpeed, built here as a pure-Python wheel (no ops
# compiled; the trainer uses torch's Adam, so nothing is JIT-built there), its dependencies, pytest,
# and fla-core (fla: the Gated DeltaNet kernel, pure Python over Triton, which the GPU machine's torch
# brings) with einops, its one dependency; fla-core is taken without dependencies, since its extras
# would pull a torch. Binary wheels are taken for CPython 3.10 to 3.13 on manylinux x86_64, since the
# GPU machine's Python version is not known in advance. About 16 MB.
#
#   bash profiling/gpu_wheels.sh                 # here, with PyPI reachable
#   run(command="bash profiling/gpu_session.sh", carry=[".gpu-wheels"])   # device tool
#
# gpu_session.sh installs from .gpu-wheels/ (pip --no-index) when DeepSpeed, pytest or fla is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DS_VERSION=$(python3 -c "from importlib.metadata import version; print(version('deepspeed'))" 2>/dev/null || echo 0.19.8)
# fla-core: the version installed here, whose source CI checks fpdt's call against (tests/ops/test_delta_rule.py)
FLA_VERSION=$(python3 -c "from importlib.metadata import version; print(version('fla-core'))" 2>/dev/null || echo 0.6.0)
dest=.gpu-wheels
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download -q --no-deps --no-binary deepspeed -d "$tmp" "deepspeed==$DS_VERSION"
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation -w "$dest" "$tmp"/deepspeed-*.tar.gz
pip download -q --no-deps -d "$dest" "fla-core==$FLA_VERSION"     # py3-none-any; einops comes below
for v in 310 311 312 313; do
  pip download -q --only-binary=:all: --implementation cp --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dest" hjson msgpack ninja py-cpuinfo pydantic psutil einops packaging tqdm \
    pytest pytest-timeout
done
ls "$dest"
du -sh "$dest"

"""fpdt-train on one GPU with no FPDT flags and no DeepSpeed JSON: its CUDA defaults (64K
chunks, attention offload, offloaded layer-input checkpoints, bf16) train the tiny model at
128K tokens. Needs CUDA and DeepSpeed (on the GPU machine: profiling/gpu_wheels.sh); skipped
on the CPU.

What it checks: the start-up lines say what was chosen and what the planner predicts; the
loss is finite and falls with AdamW; each step reports the allocator's peak and a host
stash; and the measured peak is at most the planner's prediction (which includes the
runtime reserve and allocator slack, so it should sit above a tiny model's peak)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.train.helpers import fresh_env, write_fixture

pytestmark = pytest.mark.cuda
SEQ_LEN = 128 * 1024
STEPS = 4


@pytest.mark.slow
def test_the_cuda_defaults_train_at_128k(tmp_path):
    cfg, data = write_fixture(str(tmp_path), n_tokens=(STEPS + 1) * (SEQ_LEN + 1))
    log = str(tmp_path / "run.jsonl")
    env = fresh_env("FPDT_RUNTIME")
    proc = subprocess.run([sys.executable, "-m", "fpdt.cli", "--model-config", cfg, "--data", data,
                           "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--log-json", log],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"seq_len={SEQ_LEN} chunk=65536 chunks=2 offload=on checkpoint=offload" in out and "dtype=bf16" in out
    predicted = [line for line in out.splitlines() if line.startswith("fpdt-plan's model of this run: device peak ")]
    assert predicted, out[-3000:]
    predicted_gib = float(predicted[0].split("device peak ")[1].split(" ")[0])
    with open(log) as f:
        records = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in records]
    assert len(records) == STEPS and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    for r in records:
        assert r["peak_mem_gib"] > 0 and r["peak_reserved_gib"] >= r["peak_mem_gib"] and r["host_stash_gib"] > 0, r
    print(f"planner {predicted_gib:.2f} GiB, measured peak {max(r['peak_mem_gib'] for r in records):.2f} GiB")
    assert max(r["peak_mem_gib"] for r in records) <= predicted_gib

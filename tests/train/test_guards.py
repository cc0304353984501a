"""No silent divergence, bounded disk use: non-finite steps stop the run (or are skipped
with --skip-nonfinite N), every save says so, --keep-last N prunes old checkpoints but
never the one 'latest' names."""

from __future__ import annotations

import contextlib
import io
import os
import re

import numpy as np
import pytest
import torch

from fpdt.train import saving
from tests.distributed import run_distributed
from tests.train.helpers import SGD_CLIP, ds_config, quiet, write_fixture, write_json


# ----------------------------------------------------------------------------- retention

def test_prune_keeps_the_newest_and_what_latest_names(tmp_path):
    for n in (1, 2, 3, 4, 10):
        (tmp_path / f"step{n}").mkdir()
    (tmp_path / "latest").write_text("step2")
    removed = saving.prune(str(tmp_path), keep_last=2)
    assert sorted(os.path.basename(p) for p in removed) == ["step1", "step3"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step10", "step2", "step4"]
    assert saving.prune(str(tmp_path), keep_last=0) == []


# ----------------------------------------------------------------------------- skip logic on a stand-in engine

class _Engine:
    """Stands in for the DeepSpeed engine: the loss of step t is ``losses[t]``."""

    def __init__(self, losses, grad_norms):
        self.losses, self.grad_norms = losses, grad_norms
        self.step_index = 0
        self.backwards = []
        self.updates = []

    def __call__(self, input_ids, labels, position_ids):
        return torch.tensor(self.losses[self.step_index], requires_grad=False)

    def backward(self, loss):
        self.backwards.append(self.step_index)

    def step(self):
        self.updates.append(self.step_index)

    def get_lr(self):
        return [0.1]

    def get_global_grad_norm(self):
        return self.grad_norms[self.step_index]


def _spec(skip: int):
    import torch.distributed as dist

    from fpdt.train.config import RunLayout
    from fpdt.train.loop import LoopSpec
    from fpdt.train.metrics import ModelShape
    from fpdt.train.parallel import ParallelState

    plan = RunLayout(world_size=1, seq_len=8, chunk_size=8, mlp_chunks=2)
    ps = ParallelState(rank=0, world_size=1, dp=1, sp_rank=0, dp_rank=0, sp_group=dist.group.WORLD,
                       device=torch.device("cpu"))
    shape = ModelShape(num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=8,
                       vocab_size=16)
    return LoopSpec(plan=plan, parallel=ps, micro_batch=1, grad_accum=1, shape=shape, peak_flops=None,
                    recompute=False, skip_nonfinite=skip)


def _run(losses, norms, skip):
    from fpdt.train.data import Windows
    from fpdt.train.loop import NonFiniteStep, run_steps
    from fpdt.train.progress import Progress

    engine = _Engine(losses, norms)
    windows = Windows(np.arange(90) % 16, seq_len=8)
    done = []

    def on_end(n):
        done.append(n)
        engine.step_index = n

    try:
        run_steps(engine, windows, _spec(skip), 0, len(losses), Progress(len(losses), 0, False, None), on_end)
        error = None
    except NonFiniteStep as e:
        error = str(e)
    return engine, done, error


def _skip_body(rank, world_size):
    nan, inf = float("nan"), float("inf")
    # a nan loss is dropped before its backward and update; the run goes on
    engine, done, error = _run([1.0, nan, 1.0, 1.0], [1.0] * 4, skip=1)
    assert error is None and done == [1, 2, 3, 4]
    assert engine.backwards == engine.updates == [0, 2, 3]
    # more than N: stop at the (N+1)-th, naming it
    engine, done, error = _run([1.0, nan, inf, 1.0], [1.0] * 4, skip=1)
    assert error == "step 3: loss is inf, and 1 non-finite steps were already skipped (--skip-nonfinite 1)"
    assert engine.updates == [0] and done == [1, 2]
    # without --skip-nonfinite: stop at the first, before the step's save
    engine, done, error = _run([1.0, 1.0, nan], [1.0] * 3, skip=0)
    assert error == "step 3: loss is nan (not finite)" and done == [1, 2]
    # a finite loss with a non-finite gradient norm: the update was applied, so always stop
    engine, done, error = _run([1.0, 1.0], [1.0, inf], skip=5)
    assert error == "step 2: gradient norm is inf (not finite) and its update was applied"


@pytest.mark.slow
def test_skip_nonfinite_drops_the_step_before_backward():
    run_distributed(_skip_body, world_size=1)


# ----------------------------------------------------------------------------- real runs on 2 ranks

def _main(argv):
    from fpdt.cli.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        status = main(argv)
    return status, err.getvalue()


def _guards_body(rank, world_size, tmp):
    quiet()
    cfg, data = os.path.join(tmp, "config.json"), os.path.join(tmp, "tokens.npy")
    base = ["--model-config", cfg, "--data", data, "--seq-len", "64", "--sp", "2"]

    # 1. saves say so; --keep-last 2 leaves the newest two
    ck = os.path.join(tmp, "ok")
    status, out = _main([*base, "--steps", "3", "--deepspeed", os.path.join(tmp, "sgd.json"), "--save-dir", ck,
                         "--save-every", "1", "--keep-last", "2"])
    assert status == 0, out
    if rank == 0:
        for n in (1, 2, 3):
            assert re.search(rf"saved step {n} to {re.escape(os.path.join(ck, f'step{n}'))} \(\d+\.\d MiB\)", out), out
        assert f"removed {os.path.join(ck, 'step1')} (--keep-last 2)" in out
        assert sorted(t for t in os.listdir(ck) if t.startswith("step")) == ["step2", "step3"]

    # 2. a diverging run stops at the first non-finite step, naming it and the last checkpoint
    ck = os.path.join(tmp, "diverge")
    argv = [*base, "--steps", "6", "--deepspeed", os.path.join(tmp, "huge_lr.json"), "--save-dir", ck,
            "--save-every", "1"]
    status, out = _main(argv)
    assert status == 1, out
    lines = [l for l in out.splitlines() if l.startswith("fpdt-train: error:")]
    if rank == 0:
        assert len(lines) == 1, out
        m = re.match(r"fpdt-train: error: step (\d+): loss is nan \(not finite\); the run stopped without saving\. "
                     r"Last good checkpoint: (\S+) \(resume with --resume", lines[0])
        assert m, lines[0]
        bad = int(m.group(1))
        assert m.group(2) == os.path.join(ck, f"step{bad - 1}")
        assert saving.read_latest(ck) == f"step{bad - 1}"
        assert not os.path.exists(os.path.join(ck, f"step{bad}"))
    else:
        assert lines == [], out   # the same error is printed once, by rank 0

    # 3. --skip-nonfinite 2: two such steps are skipped, the third stops the run
    status, out = _main([*base, "--steps", "8", "--deepspeed", os.path.join(tmp, "huge_lr.json"),
                         "--skip-nonfinite", "2"])
    assert status == 1, out
    if rank == 0:
        assert len(re.findall(r"step \d+: loss is nan, step skipped \(\d of --skip-nonfinite 2\)", out)) == 2, out
        assert re.search(r"fpdt-train: error: step \d+: loss is nan, and 2 non-finite steps were already skipped "
                         r"\(--skip-nonfinite 2\); the run stopped without saving\. No checkpoint was saved", out), out


@pytest.mark.slow
def test_saves_retention_and_nonfinite_on_two_ranks(tmp_path):
    tmp = str(tmp_path)
    write_fixture(tmp)
    write_json(os.path.join(tmp, "sgd.json"), ds_config({"type": "SGD", "params": {"lr": 0.1}}, SGD_CLIP))
    # SGD at lr 1e30 without clipping: the first update overflows the weights, the next loss is nan
    write_json(os.path.join(tmp, "huge_lr.json"), ds_config({"type": "SGD", "params": {"lr": 1e30}}, SGD_CLIP))
    run_distributed(_guards_body, world_size=2, args=(tmp,), timeout=300)

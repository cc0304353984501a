"""Ctrl-C during ``fpdt-train``: one line naming the newest complete checkpoint and the command that
resumes from it, exit status 130, no traceback (docs/train.md, "Configuration and errors")."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fpdt.cli.train import interrupted_line
from fpdt.train.saving import TRAINER_FILE
from tests.train.helpers import write_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tag(save_dir, step: int, ranks=(0, 1), whole: bool = True) -> str:
    """A checkpoint dir with the trainer files of ``ranks`` (rank 1's truncated unless ``whole``)."""
    d = os.path.join(save_dir, f"step{step}")
    os.makedirs(d)
    for r in ranks:
        path = os.path.join(d, TRAINER_FILE.format(rank=r))
        torch.save({"step": step, "run": {}, "world_size": 2}, path)
        if r == 1 and not whole:
            with open(path, "r+b") as f:
                f.truncate(10)
    return d


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"save_dir": None, "resume": None, **kw})


def test_names_the_newest_complete_checkpoint_and_the_command(tmp_path):
    ck = str(tmp_path / "ck")
    _tag(ck, 2)
    three = _tag(ck, 3)
    _tag(ck, 4, ranks=(0,))             # rank 1 had not written its files yet
    _tag(ck, 5, whole=False)            # rank 1 was writing
    argv = ["--data", "a b.txt", "--steps", "9", "--save-dir", ck, "--resume", f"{ck}/step2"]
    line = interrupted_line(_args(save_dir=ck, resume=f"{ck}/step2"), argv, world_size=2)
    assert line == (f"fpdt-train: interrupted (Ctrl-C); the last complete checkpoint is {three} (step 3); resume "
                    f"with: fpdt-train --data 'a b.txt' --steps 9 --save-dir {ck} --resume {three}")
    assert interrupted_line(_args(save_dir=ck), [f"--resume={ck}"], 2).endswith(f"fpdt-train --resume {three}")


def test_says_when_nothing_was_saved(tmp_path):
    assert interrupted_line(_args(), []) == ("fpdt-train: interrupted (Ctrl-C): nothing was saved (pass --save-dir "
                                             "DIR --save-every N to keep checkpoints to --resume from)")
    ck = str(tmp_path / "ck")
    _tag(ck, 1, ranks=(0,), whole=False)
    _tag(ck, 2, whole=False)
    assert "before any checkpoint in" in interrupted_line(_args(save_dir=ck), [], 2)
    old = _tag(str(tmp_path / "old"), 7)              # a resumed run that saved nothing new yet
    assert f"is {old} (step 7)" in interrupted_line(_args(save_dir=ck, resume=old), ["--resume", old], 2)


@pytest.mark.slow
def test_ctrl_c_during_a_run(tmp_path):
    cfg, data = write_fixture(str(tmp_path))
    ck = str(tmp_path / "ck")
    argv = ["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "500", "--save-dir", ck,
            "--save-every", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "fpdt.cli", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # as in a terminal
    try:
        deadline = time.monotonic() + 240
        while not os.path.isfile(os.path.join(ck, "step4", TRAINER_FILE.format(rank=0))):
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint at step 4"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("fpdt-train: interrupted (Ctrl-C); the last complete checkpoint is "), last
    tag = last.split("checkpoint is ")[1].split(" ")[0]
    assert int(tag.rsplit("step", 1)[1]) >= 4 and os.path.isdir(tag)
    assert last.endswith(f"resume with: fpdt-train {' '.join(argv)} --resume {tag}")

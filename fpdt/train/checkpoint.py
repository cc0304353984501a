"""Training checkpoints: DeepSpeed's, plus what the trainer needs to continue exactly.

Layout of ``--save-dir DIR``::

    DIR/latest                       tag of the newest checkpoint (written by DeepSpeed)
    DIR/config.json                  the model's HF config (for fpdt-export)
    DIR/tokenizer.json               copied from the model directory, when there is one
    DIR/step<N>/                     DeepSpeed's files for optimizer step N (ZeRO shards,
                                     optimizer and scheduler state, fp32 master weights)
    DIR/step<N>/fpdt_trainer_rank<r>.pt   per rank: steps done, run shape, RNG states

Resuming restores the model, optimizer and scheduler through ``engine.load_checkpoint``
and the RNG states from the trainer file. The data position needs no state: the windows
of step ``t`` are a pure function of ``t`` and the run shape (:mod:`fpdt.train.data`), so
the next step sees exactly the windows it would have seen without the interruption.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fpdt.train.config import ConfigError

TRAINER_FILE = "fpdt_trainer_rank{rank}.pt"


def tag_for(step: int) -> str:
    return f"step{step}"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_model_files(save_dir: str, hf_config: dict, tokenizer_path: str | None) -> None:
    """Rank 0: the model config (and tokenizer) next to the checkpoints, for export."""
    import json

    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if tokenizer_path and os.path.isfile(tokenizer_path):
        shutil.copyfile(tokenizer_path, os.path.join(save_dir, "tokenizer.json"))


def save(engine, save_dir: str, step: int, rank: int, run_info: dict[str, Any]) -> str:
    """Save optimizer step ``step`` (collective: every rank calls it). Returns the tag dir."""
    tag = tag_for(step)
    engine.save_checkpoint(save_dir, tag=tag, client_state={"fpdt_step": step})
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    torch.save({"step": step, "run": run_info, "rng": rng_state()},
               os.path.join(tag_dir, TRAINER_FILE.format(rank=rank)))
    dist.barrier()
    return tag_dir


def resolve(path: str) -> tuple[str, str]:
    """``--resume PATH`` -> ``(save_dir, tag)``. PATH is a save dir (newest checkpoint,
    from its ``latest`` file) or one ``step<N>`` directory inside it."""
    path = os.path.normpath(path)
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return path, f.read().strip()
    if os.path.isfile(os.path.join(path, TRAINER_FILE.format(rank=0))):
        return os.path.dirname(path), os.path.basename(path)
    raise ConfigError(f"--resume {path}: not a checkpoint (no 'latest' file and no "
                      f"{TRAINER_FILE.format(rank=0)}); pass the --save-dir of a run or one of its step<N> dirs")


def load(engine, path: str, rank: int) -> dict[str, Any]:
    """Restore engine and RNG from ``--resume PATH``; returns the trainer state
    (``{"step", "run", "rng"}``)."""
    save_dir, tag = resolve(path)
    trainer_file = os.path.join(save_dir, tag, TRAINER_FILE.format(rank=rank))
    if not os.path.isfile(trainer_file):
        raise ConfigError(f"--resume {path}: {trainer_file} is missing; resume with the same number of "
                          f"processes that saved the checkpoint")
    load_path, _ = engine.load_checkpoint(save_dir, tag=tag)
    if load_path is None:
        raise ConfigError(f"--resume {path}: DeepSpeed found no checkpoint under tag {tag!r}")
    state = torch.load(trainer_file, weights_only=False)
    set_rng_state(state["rng"])
    return state


def check_same_run(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Differences between the saved and the current run shape that change what the next
    step trains on (the resumed step would then not be the one the run would have taken)."""
    return [f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}"
            for k in sorted(current) if saved.get(k) != current.get(k)]

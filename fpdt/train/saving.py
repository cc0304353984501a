"""Training checkpoints: DeepSpeed's, plus what the trainer needs to continue exactly.

``--save-dir DIR`` holds ``latest`` (DeepSpeed's tag of the newest), ``config.json`` and
``tokenizer.json`` (for export), ``adapter_config.json`` after a LoRA run (read-only), and per
optimizer step ``step<N>/``: DeepSpeed's files, ``fpdt_trainer_rank<r>.pt`` per rank (steps done,
run shape, RNG states, LoRA spec) and the ``config.json`` / ``tokenizer.json`` export reads.
Resuming restores model, optimizer, scheduler and RNG states; the data position needs none. A
LoRA run saves with ``exclude_frozen_parameters`` and resumes non-strictly (:func:`_adapters_only`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import zipfile
from dataclasses import dataclass
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


def write_model_files(save_dir: str, hf_config: dict, tokenizer_path: str | None, lora=None,
                      base_model: str | None = None) -> None:
    """Rank 0: the model config (and tokenizer) next to the checkpoints, for export; a LoRA run
    adds PEFT's ``adapter_config.json`` (``base_model_name_or_path``: ``base_model``), a full run
    removes an earlier one.
    """
    import json

    from fpdt.model.lora import ADAPTER_CONFIG, peft_adapter_config

    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    adapter_config = os.path.join(save_dir, ADAPTER_CONFIG)
    if lora is not None:
        with open(adapter_config, "w") as f:
            json.dump(peft_adapter_config(lora, base_model), f, indent=2)
    elif os.path.isfile(adapter_config):
        os.remove(adapter_config)
    if tokenizer_path and os.path.isfile(tokenizer_path):
        shutil.copyfile(tokenizer_path, os.path.join(save_dir, "tokenizer.json"))


def save(engine, save_dir: str, step: int, rank: int, run_info: dict[str, Any], precision: str | None = None,
         lora: dict[str, Any] | None = None) -> str:
    """Save optimizer step ``step`` (collective). Returns the tag dir. ``precision`` and the world
    size go into the trainer file, so :func:`inspect` refuses a resume that changes them; ``lora``: a
    LoRA run's record (:func:`fpdt.train.lora.record`), the frozen parameters then not saved.
    """
    tag = tag_for(step)
    engine.save_checkpoint(save_dir, tag=tag, client_state={"fpdt_step": step, "fpdt_lora": lora},
                           exclude_frozen_parameters=lora is not None)
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    torch.save({"step": step, "run": run_info, "rng": rng_state(), "precision": precision, "world_size": world,
                "zero_stage": stage, "lora": lora},
               os.path.join(tag_dir, TRAINER_FILE.format(rank=rank)))
    if rank == 0:   # the tag keeps the model files it was trained with: a later run may rewrite DIR's
        for name in TAG_MODEL_FILES:
            if os.path.isfile(os.path.join(save_dir, name)):
                shutil.copyfile(os.path.join(save_dir, name), os.path.join(tag_dir, name))
    dist.barrier()
    return tag_dir


TAG_MODEL_FILES = ("config.json", "tokenizer.json")
"""Copied from the save dir into each ``step<N>`` dir at save (a few KB to MB), so that export
reads the config a tag was trained with even after another model's run rewrote ``DIR/``'s."""


def model_file(save_dir: str, tag: str, name: str) -> str:
    """Path of model file ``name`` for checkpoint ``tag``: the tag's own copy, or (checkpoints
    written before tags kept one) the save dir's."""
    own = os.path.join(save_dir, tag, name)
    return own if os.path.isfile(own) else os.path.join(save_dir, name)


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


def load(engine, path: str, rank: int, lora: bool = False) -> dict[str, Any]:
    """Restore the engine from ``--resume PATH``; returns the trainer state (``{"step", "run",
    "rng", "lora", ...}``). The caller restores ``state["rng"]`` (:func:`set_rng_state`) right before
    the first step, after any set-up that draws random numbers. ``lora``: the checkpoint left the
    frozen parameters out.
    """
    save_dir, tag = resolve(path)
    trainer_file = os.path.join(save_dir, tag, TRAINER_FILE.format(rank=rank))
    if not os.path.isfile(trainer_file):
        raise ConfigError(f"--resume {path}: {trainer_file} is missing; resume with the same number of "
                          f"processes that saved the checkpoint")
    if lora:
        load_path, _ = engine.load_checkpoint(save_dir, tag=tag, load_module_strict=False, custom_load_fn=_adapters_only)
    else:
        load_path, _ = engine.load_checkpoint(save_dir, tag=tag)
    if load_path is None:
        raise ConfigError(f"--resume {path}: DeepSpeed found no checkpoint under tag {tag!r}")
    return torch.load(trainer_file, weights_only=False)


def _adapters_only(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """DeepSpeed's module load for a checkpoint saved without its frozen parameters: a non-strict
    ``load_state_dict`` that refuses, before loading anything, a checkpoint holding a frozen
    parameter (the base comes from ``--model`` or ``--seed``) or missing a key that is not frozen, or
    with unexpected keys. The second name of a tied weight (``lm_head.weight``) stays in such a
    checkpoint and is loaded as saved.
    """
    frozen = {n for n, p in dst.named_parameters() if not p.requires_grad}
    held = sorted(frozen & set(src))
    if held:
        raise ConfigError(f"the checkpoint's model state holds {len(held)} frozen base weight(s) (e.g. {held[0]}), "
                          f"which a LoRA run's checkpoint leaves out (its base is read from --model or drawn from "
                          f"--seed); resume from a checkpoint fpdt-train --lora-rank saved")
    result = dst.load_state_dict(src, strict=False)
    missing = sorted(set(result.missing_keys) - frozen)
    if missing or result.unexpected_keys:
        raise ConfigError(f"the checkpoint's model state does not match this model beyond its frozen parameters: "
                          f"missing {missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}; resume with "
                          f"the --lora-* flags and model it was trained with")


def check_same_run(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Differences between the saved and the current run shape that change what the next
    step trains on (the resumed step would then not be the one the run would have taken)."""
    return [f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}"
            for k in sorted(current) if saved.get(k) != current.get(k)]


# ----------------------------------------------------------------------------- inspection before DeepSpeed starts

_RANK_FILE = re.compile(r"^(.*?)(zero_pp_rank_|fpdt_trainer_rank)(\d+)(.*)$")


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a checkpoint directory says about the run that wrote it (read without DeepSpeed)."""

    save_dir: str
    """The ``--save-dir`` it lives in."""
    tag: str
    """Its ``step<N>`` name."""
    step: int
    """Optimizer steps done when it was written."""
    world_size: int
    """Processes that wrote it (trainer files present)."""
    precision: str | None
    """``"bf16"``/``"fp16"``/``"fp32"``, or ``None`` when unknown (older checkpoints that are not bf16)."""
    run: dict[str, Any]
    """The run shape stored with it (see ``cli.run_info``)."""
    lora: dict[str, Any] | None = None
    """A LoRA run's :func:`fpdt.train.lora.record`; None for full training (and checkpoints
    written before LoRA existed, which all trained every weight)."""

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)


def inspect(path: str, zero_stage: int | None = None) -> SavedCheckpoint:
    """Read ``--resume PATH`` without DeepSpeed, checking that every file is there and whole.

    Raises :class:`ConfigError` naming the file and the fix for: a missing tag directory,
    a missing rank file (rank ``r`` lacks a kind of file another rank has, or a file that
    DeepSpeed writes for ZeRO stage ``zero_stage`` is absent), or a truncated / corrupt
    ``.pt`` file (not a complete zip archive, which every ``torch.save`` file is).
    """
    save_dir, tag = resolve(path)
    tag_dir = os.path.join(save_dir, tag)
    if not os.path.isdir(tag_dir):
        raise ConfigError(f"--resume {path}: {os.path.join(save_dir, 'latest')} names {tag!r} but {tag_dir} does not "
                          f"exist; resume from one of {available_tags(save_dir) or 'no step<N> dirs'}")
    names = sorted(os.listdir(tag_dir))
    kinds: dict[tuple[str, str, str], set[int]] = {}
    for name in names:
        m = _RANK_FILE.match(name)
        if m:
            kinds.setdefault((m.group(1), m.group(2), m.group(4)), set()).add(int(m.group(3)))
    world = len(kinds.get(("", "fpdt_trainer_rank", ".pt"), ()))
    _check_rank_files(path, save_dir, tag, kinds, world)
    for name in names:
        full = os.path.join(tag_dir, name)
        if name.endswith(".pt") and not zipfile.is_zipfile(full):
            raise ConfigError(f"--resume {path}: checkpoint file {full} is truncated or corrupt; resume from "
                              f"{_others(save_dir, tag)}")
    state = torch.load(os.path.join(tag_dir, TRAINER_FILE.format(rank=0)), weights_only=False)
    saved_stage = state.get("zero_stage")
    if zero_stage is not None and saved_stage is not None and saved_stage != zero_stage:
        raise ConfigError(f"--resume {path}: the checkpoint was written with ZeRO stage {saved_stage}, this run's "
                          f"DeepSpeed JSON asks for stage {zero_stage}; resume with the stage it was saved with")
    if zero_stage is not None:  # the files DeepSpeed needs for this stage
        prefix = "bf16_" if any(n.startswith("bf16_zero_pp_rank_") for n in names) else ""
        if zero_stage >= 1:
            kinds.setdefault((prefix, "zero_pp_rank_", "_mp_rank_00_optim_states.pt"), set())
        if zero_stage == 3:
            kinds.setdefault(("", "zero_pp_rank_", "_mp_rank_00_model_states.pt"), set())
        elif "mp_rank_00_model_states.pt" not in names:
            kinds[("", "mp_rank_", "_model_states.pt")] = set()  # rank 00 of model parallelism: "mp_rank_00"
        _check_rank_files(path, save_dir, tag, kinds, world)
    precision = state.get("precision")
    if precision is None and any(n.startswith("bf16_zero_pp_rank_") for n in names):
        precision = "bf16"
    return SavedCheckpoint(save_dir=save_dir, tag=tag, step=int(state["step"]), world_size=world,
                           precision=precision, run=dict(state.get("run") or {}), lora=state.get("lora"))


def _check_rank_files(path: str, save_dir: str, tag: str, kinds: dict[tuple[str, str, str], set[int]],
                      world: int) -> None:
    for (pre, mid, post), ranks in kinds.items():
        for r in range(max(world, max(ranks, default=-1) + 1)):
            if r not in ranks:
                name = f"{pre}{mid}{r:02d}{post}" if mid == "mp_rank_" else f"{pre}{mid}{r}{post}"
                raise ConfigError(f"--resume {path}: checkpoint file {os.path.join(save_dir, tag, name)} is missing "
                                  f"(the save was cut short, or the file was deleted); resume from "
                                  f"{_others(save_dir, tag)}")


def _others(save_dir: str, tag: str) -> str:
    others = [t for t in available_tags(save_dir) if t != tag]
    return f"another checkpoint ({', '.join(others)})" if others else "an earlier save (none is left in this directory)"


def last_complete(save_dir: str, world_size: int) -> SavedCheckpoint | None:
    """The newest checkpoint of ``save_dir`` whose files are all there and whole (:func:`inspect`)
    for ``world_size`` ranks, skipping one a stopped run left half-written; None if there is none."""
    for tag in reversed(available_tags(save_dir)):
        try:
            saved = inspect(os.path.join(save_dir, tag))
        except Exception:  # noqa: BLE001 -- incomplete (a missing or truncated file): try the one before
            continue
        if saved.world_size == world_size:
            return saved
    return None


def available_tags(save_dir: str) -> list[str]:
    """The ``step<N>`` directories of ``save_dir``, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    tags = [n for n in os.listdir(save_dir) if re.fullmatch(r"step\d+", n) and os.path.isdir(os.path.join(save_dir, n))]
    return sorted(tags, key=lambda t: int(t[4:]))


# ----------------------------------------------------------------------------- retention

def read_latest(save_dir: str) -> str | None:
    """The tag ``save_dir/latest`` names, or ``None``."""
    latest = os.path.join(save_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip() or None


def dir_size(path: str) -> int:
    """Bytes of all files under ``path``."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Rank 0, after a checkpoint is complete: delete all but the newest ``keep_last``
    ``step<N>`` dirs, never the one ``latest`` names. Returns the deleted dirs."""
    if keep_last < 1:
        return []
    protected = read_latest(save_dir)
    tags = available_tags(save_dir)
    doomed = [t for t in tags[:max(0, len(tags) - keep_last)] if t != protected]
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    return [os.path.join(save_dir, t) for t in doomed]

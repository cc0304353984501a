"""Checks that need files but no process group, run before the model is built and DeepSpeed
starts: the model's ``config.json``, the DeepSpeed batch settings, the checkpoint directory and
the file system (:func:`fpdt.train.config.validate` checks the rest). Each raises
:class:`~fpdt.train.config.ConfigError` with one line naming the file or flag and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from fpdt.attention.kernels import AttentionBackend, get_backend
from fpdt.comm.heads import kv_replication_factor
from fpdt.model import ModelConfig, UnsupportedConfigError
from fpdt.model.weights import checkpoint_files
from fpdt.options import layer_count_problems
from fpdt.train import saving
from fpdt.train.config import ConfigError

# ModelConfig fields that must agree between a checkpoint and the model that resumes it.
ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                       "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias")


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from, checked."""

    config_path: str
    """The ``config.json`` in use."""
    config: ModelConfig
    """It, parsed and validated (unsupported features refused)."""


def model_source(model: str | None, model_config: str | None) -> ModelSource:
    """Check ``--model DIR`` (config.json + safetensors) or ``--model-config JSON|DIR``."""
    if model is not None:
        if not os.path.exists(model):
            raise ConfigError(f"--model {model}: no such directory")
        if not os.path.isdir(model):
            raise ConfigError(f"--model {model} is a file; --model takes a checkpoint directory (config.json + "
                              f"safetensors); for random weights from a config.json use --model-config {model}")
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--model {model}: no config.json in the directory; pass a Hugging Face checkpoint "
                              f"directory")
        try:
            checkpoint_files(model)
        except FileNotFoundError:
            raise ConfigError(f"--model {model}: no model.safetensors or model.safetensors.index.json in the "
                              f"directory (only safetensors checkpoints load; convert .bin weights with "
                              f"transformers, or pass --model-config {path} to start from random weights)") from None
    else:
        assert model_config is not None
        if not os.path.exists(model_config):
            raise ConfigError(f"--model-config {model_config}: no such file or directory")
        path = os.path.join(model_config, "config.json") if os.path.isdir(model_config) else model_config
        if not os.path.isfile(path):
            raise ConfigError(f"--model-config {model_config}: no config.json in the directory")
    return ModelSource(config_path=path, config=read_model_config(path))


def read_model_config(path: str) -> ModelConfig:
    """Parse ``config.json``; a syntax error or an unsupported feature names the file."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 JSON file") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    try:
        return ModelConfig.from_hf(hf)
    except UnsupportedConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None


def check_heads(cfg: ModelConfig, hp: int, config_path: str, flag: str = "--sp") -> None:
    """Ulysses gives each rank ``H / hp`` query heads: the head-parallel degree ``hp``
    (``--sp``, or ``--hp`` of a 2D mesh) must divide ``H``."""
    try:
        kv_replication_factor(cfg.num_heads, cfg.num_kv_heads, hp)
    except ValueError:
        divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
        raise ConfigError(f"{flag} {hp} does not divide the model's {cfg.num_heads} attention heads ({config_path}); "
                          f"Ulysses gives every rank num_heads / {flag[2:]} heads: use {flag} in {divisors}") from None


def check_layer_counts(cfg: ModelConfig, config_path: str, **counts: int | None) -> None:
    """:func:`fpdt.options.layer_count_problems` of ``counts`` against the model, prefixed with its
    ``config.json``."""
    for problem in layer_count_problems(cfg.num_layers, **counts):
        raise ConfigError(f"{config_path}: {problem}")


def check_batch_size(ds_config: Mapping[str, Any], world_size: int) -> None:
    """DeepSpeed's ``train_batch_size = micro x grad_accum x world size`` (every rank,
    SP ranks included, counts as a data-parallel rank), checked with a message that says so."""
    tbs = ds_config.get("train_batch_size")
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", gas)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"DeepSpeed JSON: {key}={value!r} must be a positive integer")
    if tbs is None:
        return
    why = ("DeepSpeed counts every rank (SP ranks too) as data parallel, so train_batch_size must be "
           "micro batch x gradient_accumulation_steps x world size")
    fix = "drop train_batch_size and set train_micro_batch_size_per_gpu (sequences per SP group) instead"
    if micro is not None and gas is not None:
        if tbs != micro * gas * world_size:
            raise ConfigError(f"DeepSpeed JSON: train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} x "
                              f"gradient_accumulation_steps {gas} x world size {world_size} = "
                              f"{micro * gas * world_size}; {why}: set it to {micro * gas * world_size}, or {fix}")
        return
    known = micro if micro is not None else (gas if gas is not None else 1)
    if tbs % (known * world_size):
        given = ("train_micro_batch_size_per_gpu" if micro is not None else
                 "gradient_accumulation_steps" if gas is not None else "1")
        raise ConfigError(f"DeepSpeed JSON: train_batch_size {tbs} is not divisible by {given} {known} x world size "
                          f"{world_size} = {known * world_size}; {why}: use a multiple of {known * world_size}, or {fix}")


def grad_accum_steps(ds_config: Mapping[str, Any], world_size: int) -> int:
    """The gradient accumulation DeepSpeed will use (given, or derived from train_batch_size)."""
    gas = ds_config.get("gradient_accumulation_steps")
    if gas is not None:
        return int(gas)
    tbs, micro = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    if tbs is not None and micro is not None:
        return int(tbs) // (int(micro) * world_size)
    return 1


def micro_batch_size(ds_config: Mapping[str, Any], world_size: int) -> int:
    """Sequences per SP group per micro step that DeepSpeed will use (given, or derived from
    ``train_batch_size`` as :func:`grad_accum_steps` does)."""
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    if micro is not None:
        return int(micro)
    tbs = ds_config.get("train_batch_size")
    if tbs is not None:
        return max(1, int(tbs) // (grad_accum_steps(ds_config, world_size) * world_size))
    return 1


def check_skip_nonfinite(skip: int, ds_config: Mapping[str, Any], world_size: int) -> None:
    """``--skip-nonfinite`` drops a whole optimizer step before its backward, which a step
    with several accumulated micro steps does not allow."""
    gas = grad_accum_steps(ds_config, world_size)
    if skip and gas != 1:
        raise ConfigError(f"--skip-nonfinite needs gradient_accumulation_steps 1 (the DeepSpeed JSON gives {gas}): "
                          f"a step whose gradients are partly accumulated cannot be dropped; use a larger "
                          f"train_micro_batch_size_per_gpu instead, or drop --skip-nonfinite")


def check_save_dir(save_dir: str | None) -> None:
    """``--save-dir`` must be a directory or creatable as one."""
    check_output_dir("--save-dir", save_dir)


def check_output_dir(flag: str, path: str | None) -> None:
    """A directory the run writes (``--save-dir``, ``--export-hf``) must be one or be creatable as
    one, checked before training starts (not after the run, when the export is written)."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory; pass a directory path "
                          f"(it is created if missing)")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: {parent} is a file, so the directory cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {parent} is not writable; pick a directory you can write to")


def check_output_file(flag: str, path: str | None) -> None:
    """A file the run appends to (``--log-json``) must not be a directory."""
    if path is not None and os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; pass a file path")


def check_resume(path: str, *, steps: int, world_size: int, precision: str, model: ModelSource,
                 zero_stage: int | None = None, default_config: bool = False) -> saving.SavedCheckpoint:
    """``--resume PATH`` against this run: files whole, same world size, same precision, same
    architecture, and ``--steps`` not below the saved step. ``default_config``: the run has no
    ``--deepspeed`` JSON (its precision is the device's default)."""
    if not os.path.exists(path):
        raise ConfigError(f"--resume {path}: no such directory; pass the --save-dir of a run or one of its step<N> dirs")
    saved = saving.inspect(path, zero_stage)
    if saved.world_size != world_size:
        raise ConfigError(f"--resume {path}: the checkpoint was written by {saved.world_size} processes, this run has "
                          f"{world_size}; resume with the same number of processes (ZeRO shards are per rank)")
    if saved.precision is not None and saved.precision != precision:
        source = ("without --deepspeed this run trains in" if default_config else "this run's DeepSpeed JSON asks for")
        fix = (f"pass a --deepspeed JSON in {saved.precision}" if default_config else
               "use the precision it was saved with")
        raise ConfigError(f"--resume {path}: the checkpoint was trained in {saved.precision}, {source} {precision}; "
                          f"{fix} (or export it with fpdt-export and start a new run from the export with --model)")
    saved_cfg = os.path.join(saved.save_dir, "config.json")
    if os.path.isfile(saved_cfg):
        theirs = read_model_config(saved_cfg)
        diffs = [f"{k} {getattr(theirs, k)} vs {getattr(model.config, k)}" for k in ARCHITECTURE_FIELDS
                 if getattr(theirs, k) != getattr(model.config, k)]
        if diffs:
            raise ConfigError(f"--resume {path}: the checkpoint's model ({saved_cfg}) differs from {model.config_path}: "
                              f"{', '.join(diffs)} (checkpoint vs this run); resume with the model config it was "
                              f"trained with")
    if steps < saved.step:
        raise ConfigError(f"--steps {steps} is below the step of the checkpoint ({saved.step}, {saved.tag_dir}); "
                          f"--steps counts the total, so pass --steps {saved.step + max(steps, 1)} to train "
                          f"{max(steps, 1)} more steps")
    return saved


def attention_kernel(name: str | None, device, dtype, head_dim: int) -> AttentionBackend:
    """The attention kernel the run will use: ``name`` (``--attention-backend``) or the automatic
    choice; one that is not installed, does not fit, or fails its self-check is a
    :class:`ConfigError` before any process group or model exists.
    """
    try:
        return get_backend(name, device, dtype, head_dim)
    except (RuntimeError, ValueError) as e:
        flag = f"--attention-backend {name}" if name else "automatic attention-kernel selection"
        raise ConfigError(f"{flag}: {e}") from e

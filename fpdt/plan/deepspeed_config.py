"""Planner settings from the DeepSpeed JSON a run will use (``fpdt-plan --deepspeed``).

Read: ``zero_optimization`` -- ``stage``, ``offload_optimizer.device`` and
``offload_param.device`` (``"cpu"``/``"nvme"`` = on the host), and the keys that allocate
device memory (``reduce_bucket_size``, ``sub_group_size``, ``contiguous_gradients``) --
the precision (``bf16`` / ``fp16`` enabled: 2-byte weights; neither: fp32), the micro
batch (``train_micro_batch_size_per_gpu``: sequences per SP group, or what DeepSpeed derives
from ``train_batch_size`` over the GPUs), and the
``"fpdt"`` section ``fpdt-train`` reads from the same file (:data:`FPDT_KEYS`): what it
sets is fixed for the plan, as it will be for the run; what it leaves out the planner
chooses. ZeRO keys absent from the file keep DeepSpeed's defaults. Command-line flags win
over the file (the caller applies them afterwards, as ``fpdt-train`` does).
"""

from __future__ import annotations

import dataclasses
import json

from fpdt.plan.planner import Choice
from fpdt.train.config import merge_options
from fpdt.train.preflight import micro_batch_size

FPDT_KEYS = ("sp", "hp", "cp", "placement", "inner_ring", "chunk_size", "offload", "checkpoint", "lm_head_wgrad",
             "mlp_chunks", "loss_chunks", "attention_backend", "checkpoint_device_layers")
"""Keys of the JSON's ``"fpdt"`` section that are planner choices (same names as ``fpdt-train``'s)."""


def _enabled(section) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _on_host(section) -> bool:
    return isinstance(section, dict) and section.get("device", "none") in ("cpu", "nvme")


def apply_deepspeed_config(path: str, choice: Choice, world_size: int = 1) -> Choice:
    """``choice`` with the ZeRO and precision settings of the DeepSpeed JSON at ``path``
    (``world_size``: the GPUs, to derive the micro batch from ``train_batch_size``)."""
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object")
    return apply_deepspeed_dict(cfg, choice, world_size)


def apply_deepspeed_dict(cfg: dict, choice: Choice, world_size: int = 1) -> Choice:
    """``choice`` with the settings of an already-parsed DeepSpeed config (see the module)."""
    zero = cfg.get("zero_optimization", {}) or {}
    changes = {"zero_stage": int(zero.get("stage", 0)),
               "offload_optimizer": _on_host(zero.get("offload_optimizer")),
               "offload_param": _on_host(zero.get("offload_param")),
               "dtype": "bf16" if _enabled(cfg.get("bf16")) or _enabled(cfg.get("fp16")) else "fp32"}
    for key in ("reduce_bucket_size", "sub_group_size"):
        if key in zero:
            changes[key] = float(zero[key])
    if "contiguous_gradients" in zero:
        changes["contiguous_gradients"] = bool(zero["contiguous_gradients"])
    if "train_micro_batch_size_per_gpu" in cfg or "train_batch_size" in cfg:   # sequences per SP group
        changes["batch"] = micro_batch_size(cfg, world_size)                   # as DeepSpeed derives it
    section = cfg.get("fpdt", {}) or {}
    merge_options({}, section)      # fpdt-train's checks of the section: unknown keys, types, values
    changes.update({k: section[k] for k in FPDT_KEYS if section.get(k) is not None})
    return dataclasses.replace(choice, **changes)

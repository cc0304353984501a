"""Planner settings from the DeepSpeed JSON a run will use (``fpdt-plan --deepspeed``).

Read: ``zero_optimization`` -- ``stage``, ``offload_optimizer.device`` and
``offload_param.device`` (``"cpu"``/``"nvme"`` = on the host), and the keys that allocate
device memory (``reduce_bucket_size``, ``sub_group_size``, ``contiguous_gradients``) --
and the precision (``bf16`` / ``fp16`` enabled: 2-byte weights; neither: fp32). The
``"fpdt"`` section is not read: chunk size and mesh stay the planner's to choose unless
given as flags. Keys absent from the file keep DeepSpeed's defaults.
"""

from __future__ import annotations

import dataclasses
import json

from fpdt.plan.planner import Choice


def _enabled(section) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _on_host(section) -> bool:
    return isinstance(section, dict) and section.get("device", "none") in ("cpu", "nvme")


def apply_deepspeed_config(path: str, choice: Choice) -> Choice:
    """``choice`` with the ZeRO and precision settings of the DeepSpeed JSON at ``path``."""
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object")
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
    return dataclasses.replace(choice, **changes)

"""Planner settings from the DeepSpeed JSON a run will use (``fpdt-plan --deepspeed``): the ZeRO
stage, offload and device buffers, the precision, the micro batch and the ``"fpdt"`` section,
read as ``fpdt-train`` reads them; flags win over the file (``docs/plan.md``). A value
``"auto"`` is read as Hugging Face's Trainer fills it where the plan can know it, else as absent.
"""

from __future__ import annotations

import json

from fpdt.plan.planner import Choice
from fpdt.train.config import merge_options, option_field
from fpdt.train.preflight import micro_batch_size

AUTO = "auto"
"""Hugging Face's placeholder for a value the Trainer fills in."""


def _given(section, key: str):
    """``section[key]``, or None when absent or ``"auto"``."""
    value = section.get(key) if isinstance(section, dict) else None
    return None if value == AUTO else value


def _enabled(section) -> bool | None:
    """Whether a ``bf16`` / ``fp16`` section is on; None when it says ``"auto"``."""
    if isinstance(section, dict) and section.get("enabled") == AUTO:
        return None
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _on_host(section) -> bool:
    return isinstance(section, dict) and section.get("device", "none") in ("cpu", "nvme")


def apply_deepspeed_config(path: str, choice: Choice, world_size: int = 1, hidden_size: int | None = None) -> Choice:
    """``choice`` with the ZeRO and precision settings of the DeepSpeed JSON at ``path``
    (``world_size``: the GPUs, to derive the micro batch from ``train_batch_size``;
    ``hidden_size``: the model's, for a ``reduce_bucket_size`` of ``"auto"``)."""
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object")
    return apply_deepspeed_dict(cfg, choice, world_size, hidden_size)


def apply_deepspeed_dict(cfg: dict, choice: Choice, world_size: int = 1, hidden_size: int | None = None) -> Choice:
    """``choice`` with the settings of an already-parsed DeepSpeed config (see the module)."""
    zero = cfg.get("zero_optimization", {}) or {}
    changes = {"zero_stage": int(_given(zero, "stage") or 0),
               "offload_optimizer": _on_host(zero.get("offload_optimizer")),
               "offload_param": _on_host(zero.get("offload_param"))}
    half = [_enabled(cfg.get("bf16")), _enabled(cfg.get("fp16"))]
    if True in half:
        changes["dtype"] = "bf16"
    elif None not in half:
        changes["dtype"] = "fp32"
    for key in ("reduce_bucket_size", "sub_group_size"):
        if _given(zero, key) is not None:
            changes[key] = float(zero[key])
    if zero.get("reduce_bucket_size") == AUTO and hidden_size:
        changes["reduce_bucket_size"] = float(hidden_size * hidden_size)       # what the Trainer fills in
    if _given(zero, "contiguous_gradients") is not None:
        changes["contiguous_gradients"] = bool(zero["contiguous_gradients"])
    sizes = {k: _given(cfg, k) for k in ("train_micro_batch_size_per_gpu", "train_batch_size",
                                          "gradient_accumulation_steps")}
    if sizes["train_micro_batch_size_per_gpu"] is not None or sizes["train_batch_size"] is not None:
        changes["batch"] = micro_batch_size({k: v for k, v in sizes.items() if v is not None},  # sequences
                                            world_size)                          # per SP group, as DeepSpeed does
    section = cfg.get("fpdt", {}) or {}
    merge_options({}, section)      # fpdt-train refuses its unknown keys; plan() checks the values (option_problems)
    changes.update({option_field(k): v for k, v in section.items() if v is not None})
    return choice.fix(**changes)

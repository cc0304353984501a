"""DeepSpeed set-up: communication back end, ZeRO-3 external parameters, the engine.

This is the only place (with :mod:`fpdt.train.saving`, :mod:`fpdt.train.export` and
:mod:`fpdt.train.zero_load`) that imports DeepSpeed; nothing below ``fpdt.train`` does.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Mapping

import torch


def _deepspeed():
    import deepspeed

    return deepspeed


def skip_cpu_shm_comm() -> None:
    """Keep DeepSpeed on plain gloo on CPU instead of JIT-compiling its shared-memory op.

    DeepSpeed's CPU accelerator builds ``deepspeed_shm_comm`` (a faster intra-node
    all-reduce) on first use, which costs ~35 s of C++ compilation per fresh machine:
    more than the whole example run. Gloo is what the tests and the CPU example need.
    Set ``FPDT_DS_SHM_COMM=1`` to let DeepSpeed build and use it.
    """
    if os.environ.get("FPDT_DS_SHM_COMM") == "1":
        return
    import deepspeed.ops

    try:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (AttributeError, TypeError):  # a DeepSpeed without the probe table: nothing to skip
        pass


def init_deepspeed_comm(device: torch.device, timeout: timedelta | None = None) -> None:
    """Let DeepSpeed adopt the already-initialised default process group (``timeout`` for
    any group it creates itself)."""
    if device.type != "cuda":
        skip_cpu_shm_comm()
    kw = {} if timeout is None else {"timeout": timeout}
    _deepspeed().init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", **kw)


class _DropMessages(logging.Filter):
    """Drops log records whose message contains one of ``needles``."""

    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.needles)


def quiet_deepspeed_warnings() -> None:
    """Silence DeepSpeed warnings that are noise for ``fpdt-train``.

    * "Attempting to get learning rate from scheduler before it has started": ``WarmupLR``
      logs it from its own constructor (it asks itself for the first rate); the rate it
      then uses is ``warmup_min_lr``, which the shipped configs set above zero.
    """
    from deepspeed.utils import logger

    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages("get learning rate from scheduler before it has started"))


def register_external_params(model: torch.nn.Module) -> int:
    """Tell ZeRO-3 which modules use parameters of submodules they never call.

    ZeRO-3 gathers a module's own parameters around its forward and re-partitions them
    afterwards. The fused FPDT Functions read their projections' weights without calling
    those ``nn.Linear`` modules (:mod:`fpdt.model.external_params`), so without this the weights
    could still be partitioned (empty) when read. Returns how many parameters were registered.
    """
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    from fpdt.model.external_params import directly_read

    n = 0
    streamed = getattr(getattr(model, "options", None), "stream_layers", False)
    for module, p in directly_read(model, lm_head=True, streamed=streamed):
        register_external_parameter(module, p)
        n += 1
    return n


def build_engine(model: torch.nn.Module, ds_config: Mapping[str, Any]):
    """``deepspeed.initialize`` on ``model`` with the (fpdt-free) DeepSpeed dict.

    Returns the engine; its optimizer and LR scheduler come from the JSON (DeepSpeed's
    own optimizers, or any ``torch.optim`` class named by ``"type"``, e.g. ``"SGD"``).
    """
    deepspeed = _deepspeed()
    cfg = dict(ds_config)
    if int((cfg.get("zero_optimization") or {}).get("stage", 0)) == 3:
        register_external_params(model)
        if getattr(getattr(model, "options", None), "stream_layers", False):
            # a streamed layer runs its submodules in its own Functions, backward included: ZeRO-3
            # gathers the whole layer around it (one layer's parameters at a time)
            from fpdt.model.llama import FPDTDecoderLayer

            deepspeed.utils.set_z3_leaf_modules(model, [FPDTDecoderLayer])
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine

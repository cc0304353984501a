"""Load a Hugging Face checkpoint straight into ZeRO-3-partitioned parameters.

:func:`from_pretrained_zero3` checks ``config.json`` and the safetensors headers on every rank
against a meta model (before any collective), builds the model inside ``deepspeed.zero.Init``,
then gathers each parameter in turn for rank 0 to read and copy in before DeepSpeed broadcasts and
re-partitions it: host memory per rank is its shards plus one full tensor for a moment. Names are
checked as :func:`fpdt.model.from_pretrained` checks them; the RoPE buffer is recomputed in fp32.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from fpdt.model import FPDTForCausalLM, ModelConfig
from fpdt.model.build import construct
from fpdt.model.weights import check_missing, check_shape, check_unexpected, checkpoint_files, model_name


def _full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    """A parameter's logical shape (a ZeRO-3 partitioned one reports ``[0]`` as its own)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def checkpoint_plan(path: str | os.PathLike, model: FPDTForCausalLM) -> list[tuple[str, list[str]]]:
    """``[(safetensors file, [checkpoint tensor names to load from it])]`` for ``model`` (meta,
    ordinary or partitioned), from the file headers alone.

    Raises the ``ValueError`` of :func:`fpdt.model.from_pretrained` for tensors the model
    does not have, shape mismatches and parameters the checkpoint lacks. Names are in a
    fixed (sorted) order per file, the same on every rank.
    """
    from safetensors import safe_open

    shapes = {name: _full_shape(p) for name, p in model.named_parameters()}  # tied head: the embedding only
    plan: list[tuple[str, list[str]]] = []
    loaded: set[str] = set()
    for file in checkpoint_files(os.fspath(path)):
        names, unexpected = [], []
        with safe_open(file, framework="pt", device="cpu") as f:
            for stored in sorted(f.keys()):
                name = model_name(stored, model.config)
                if name is None:
                    continue
                if name not in shapes:
                    unexpected.append(name)
                    continue
                check_shape(name, f.get_slice(stored).get_shape(), shapes[name])
                names.append(stored)
                loaded.add(name)
        check_unexpected(unexpected)
        plan.append((file, names))
    check_missing(model, loaded)
    return plan


def from_pretrained_zero3(path: str | os.PathLike, ds_config: Mapping[str, Any], *, dtype: torch.dtype,
                          device: torch.device, **fpdt_options) -> FPDTForCausalLM:
    """The checkpoint at ``path`` as a ZeRO-3-partitioned model.

    Args:
        path: Hugging Face checkpoint directory (``config.json`` + safetensors).
        ds_config: the DeepSpeed config dict without ``"fpdt"`` (the one later given to
            ``deepspeed.initialize``; ``zero.Init`` reads its offload and persistence settings).
        dtype: the training dtype, the one ``ds_config`` asks for.
        device: this rank's compute device (where the RoPE buffer goes).
        **fpdt_options: :class:`fpdt.model.FPDTOptions` fields.

    Collective over the default group; parameters are partitioned over the whole world.
    """
    import deepspeed
    from safetensors import safe_open

    path = os.fspath(path)
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        shape_model = construct(cfg, **fpdt_options)
    plan = checkpoint_plan(path, shape_model)  # fails here, on every rank, for a checkpoint that does not fit
    del shape_model

    # The parameter dtype comes from the config (bf16 / fp16 / fp32, as the trainer's own
    # ``dtype`` does). An explicit ``dtype=`` is not passed: DeepSpeed 0.19 evaluates
    # ``dtype or torch.float16 if accelerator.is_fp16_supported() else <bf16 if supported>``,
    # so on an accelerator without fp16 (its CPU one) the argument is ignored and bf16 used.
    init = deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(dict(ds_config)))
    if init.dtype != dtype:
        raise RuntimeError(f"deepspeed.zero.Init would create {init.dtype} parameters for a {dtype} run: "
                           f"set the precision with the DeepSpeed config's \"bf16\" / \"fp16\" sections")
    with init:
        model = construct(cfg, **fpdt_options)
    model.reset_rope(device)  # zero.Init cast every float tensor made in __init__ (inv_freq too) to `dtype`

    params = dict(model.named_parameters())
    source = dist.get_rank() == 0  # modifier_rank 0 of the world group the parameters are partitioned over
    read_on = str(device) if device.type == "cuda" else "cpu"
    for file, names in plan:
        reader = safe_open(file, framework="pt", device=read_on) if source else contextlib.nullcontext()
        with reader as f:
            for name in names:
                p = params[model_name(name, cfg)]
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if source:
                        p.data.copy_(f.get_tensor(name))  # converts to the training dtype
    return model

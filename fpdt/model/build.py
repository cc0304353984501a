"""Building an FPDT model: from a config (random init) or a Hugging Face checkpoint, without
a second host copy (built on ``meta``, then each tensor read straight to its device and dtype,
:mod:`fpdt.model.weights`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from fpdt.model.config import ModelConfig
from fpdt.model.llama import FPDTForCausalLM
from fpdt.model.weights import _load_file, _resolve_dtype, check_missing, checkpoint_files
from fpdt.options import FPDTOptions


def _options(fpdt_options: dict[str, Any]) -> FPDTOptions:
    """``options=`` (an :class:`FPDTOptions`) and/or its fields as keywords, validated."""
    return FPDTOptions.build(fpdt_options.pop("options", None), **fpdt_options)


def construct(config: ModelConfig | Mapping[str, Any] | str | os.PathLike | Any,
              **fpdt_options) -> FPDTForCausalLM:
    """The bare module tree for ``config``, in the caller's device / tensor-creation context (``meta``:
    shape-only; ``zero.Init``: partitioned), with ``torch.nn``'s default initialisation. Call
    ``model.reset_rope(device)`` after: the RoPE buffer is whatever that context made of it.
    """
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    return FPDTForCausalLM(cfg, _options(fpdt_options))


def from_config(config: ModelConfig | Mapping[str, Any] | str | os.PathLike | Any, *,
                device: torch.device | str | None = None, dtype: torch.dtype | str | None = None,
                **fpdt_options) -> FPDTForCausalLM:
    """A randomly initialised model (Transformers' init scheme; seed with ``torch.manual_seed``).

    ``config``: a :class:`ModelConfig`, a ``config.json`` dict or path, or a ``transformers`` config;
    ``device`` (default CPU; ``"meta"`` defers initialisation to ``to_empty`` + ``init_weights()``);
    ``dtype`` (default fp32); ``**fpdt_options``: :class:`FPDTOptions` fields.
    """
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    with torch.device("meta"):
        model = construct(cfg, **fpdt_options)
    if dtype is not None:
        model.to(_resolve_dtype(dtype))
    device = torch.device(device if device is not None else "cpu")
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty keeps the tie, but make it explicit
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_weights()
    return model


def from_pretrained(path: str | os.PathLike, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | str | None = None, **fpdt_options) -> FPDTForCausalLM:
    """Load a Hugging Face checkpoint directory (``config.json`` + safetensors).

    Args:
        path: the checkpoint directory (single file or sharded with an index).
        device: where the parameters go (default CPU); tensors are read straight there.
        dtype: parameter dtype; default: as stored in the checkpoint.
        **fpdt_options: :class:`FPDTOptions` fields (chunks, offload, checkpointing, group, ...).
    """
    path = os.fspath(path)
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        model = construct(cfg, **fpdt_options)
    device = torch.device(device if device is not None else "cpu")
    loaded: set[str] = set()
    experts: dict = {}                 # per-expert tensors of a layer not yet all read (fused when they are)
    for file in checkpoint_files(path):
        loaded |= _load_file(model, file, device, _resolve_dtype(dtype), experts)
    if experts:
        raise ValueError(f"checkpoint has incomplete per-expert tensors for {sorted(experts)[:4]}")
    check_missing(model, loaded)
    model.reset_rope(device)
    return model

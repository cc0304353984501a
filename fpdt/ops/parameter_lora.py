"""Parameters that PEFT's ``target_parameters`` LoRA adapts (its ``ParamWrapper``, PEFT >= 0.17), read
as the wrapped module's forward would see them: the base parameter plus each active adapter's delta
weight (PEFT's own ``get_delta_weight``: ``scaling * B A`` per expert, shaped as the parameter).
Gradients reach the adapters through that sum, autograd's; the delta is as large as the parameter,
as in PEFT's forward. Fused mixture-of-experts weights (``experts.gate_up_proj``,
``experts.down_proj``) are read this way by fpdt's chunked experts.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from fpdt.ops.projections import ProjectionError, _peft_forward_hooks


def _param_wrapper() -> type | None:
    """PEFT's ``ParamWrapper`` class if PEFT is loaded (a model cannot hold one otherwise)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "ParamWrapper", None)


def base_module(module: nn.Module) -> nn.Module:
    """``module`` without PEFT's ``ParamWrapper`` layers around it."""
    wrapper = _param_wrapper()
    while wrapper is not None and type(module) is wrapper:
        module = module.base_layer
    return module


def read_parameters(module: nn.Module, names: tuple[str, ...], owner: str) -> tuple[torch.Tensor, ...]:
    """``module``'s parameters ``names`` with the deltas of PEFT's ``ParamWrapper`` adapters around it
    (none: the parameters themselves). Refused with :class:`ProjectionError`, naming the fix, for what
    the sum would not compute as PEFT's forward does (forward hooks, adapters merged but disabled)
    and for another wrapper type around ``module``. ``owner`` names the module, for the message."""
    wrapper_type = _param_wrapper()
    wrappers = []
    while wrapper_type is not None and type(module) is wrapper_type:
        wrappers.append(module)
        module = module.base_layer
    if hasattr(module, "base_layer") or hasattr(module, "lora_A"):
        raise ProjectionError(f"{owner} is wrapped by {type(module).__name__}, whose computation fpdt's chunked "
                              f"function would skip: only PEFT's target_parameters LoRA (ParamWrapper) is read")
    weights = {n: getattr(module, n) for n in names}
    for w in wrappers:
        if w.parameter_name not in weights:
            raise ProjectionError(f"{owner}: PEFT adapts its parameter {w.parameter_name!r}, which fpdt's chunked "
                                  f"function does not read; adapt {' or '.join(names)}")
        if _peft_forward_hooks(w):
            raise ProjectionError(f"{owner}.{w.parameter_name} has PEFT forward hooks (per-sample adapter_names), "
                                  f"which the chunked function does not run: call the model without adapter_names")
        if w.disable_adapters and w.merged:
            raise ProjectionError(f"{owner}.{w.parameter_name} has adapters merged into its weight but disabled "
                                  f"(PEFT would unmerge them inside its forward): call unmerge_adapter() first")
        if w.disable_adapters or w.merged:
            continue
        for adapter in w.active_adapters:
            if adapter in w.lora_A:
                weights[w.parameter_name] = weights[w.parameter_name] + w.get_delta_weight(adapter)
    return tuple(weights[n] for n in names)

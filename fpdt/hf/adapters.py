"""The projections fpdt's chunked functions compute themselves, read from a Transformers model:
a plain ``nn.Linear``, or PEFT's LoRA ``Linear`` around one.

The chunked q/k/v projection (:mod:`fpdt.attention.projected_attention`) and the chunked MLP
(:mod:`fpdt.model.mlp`) read the weights directly instead of calling the modules. For a PEFT
LoRA layer they read its base ``nn.Linear`` and its active adapters
(:class:`fpdt.ops.lora.LoraAdapters`) and compute what PEFT's ``forward`` computes, chunk by
chunk: ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` per active adapter, ``x`` cast to
the adapters' dtype and the sum cast back. A layer with adapters disabled, or merged into the
base weight, is its base layer. Dropout follows the dropout module's train/eval mode; the
masks are fpdt's (:mod:`fpdt.ops.lora`), not the ones PEFT would draw.

Refused, naming the fix: anything else in those places (quantised layers, other adapter
types), LoRA variants (DoRA, ...), adapters disabled while merged, active adapters of one
layer in different dtypes (PEFT casts the input cumulatively from one to the next), PEFT's
input casting turned off with adapters in another dtype than the base (PEFT's own forward
fails), and PEFT's per-sample ``adapter_names`` (mixed-adapter batches: PEFT passes them
through forward hooks on the LoRA layers, which the chunked functions do not call).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

from torch import nn

from fpdt.hf.errors import FPDTHFError
from fpdt.ops.lora import LoraAdapters, LoraLayout, LoraTerm


@dataclass
class Projections:
    """Base linears of a chunked function's projections, and their LoRA terms (None if none)."""
    bases: list[nn.Linear]
    adapters: LoraAdapters | None


def _peft_lora_linear() -> type | None:
    """PEFT's LoRA ``Linear`` class if PEFT is loaded (a model cannot hold one otherwise)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "Linear", None)


def read_projections(modules: dict[str, nn.Module], owner: str, fix: str) -> Projections:
    """``modules`` (name -> module, in the function's order) as base linears and LoRA terms;
    refused with ``fix`` for what the chunked function would compute differently. ``owner``
    names the module that holds them (e.g. ``LlamaMLP``), for the message."""
    lora_linear = _peft_lora_linear()
    bases, terms, tensors = [], [], []
    for name, m in modules.items():
        if type(m) is nn.Linear:
            bases.append(m)
            terms.append(())
            continue
        if lora_linear is None or type(m) is not lora_linear:
            kinds = ", ".join(type(x).__name__ for x in modules.values())
            raise FPDTHFError(f"the chunked function reads {'/'.join(modules)}'s weights directly, and {owner}'s are "
                              f"{kinds} (only nn.Linear and PEFT's LoRA Linear are computed as their own forward "
                              f"would; a quantised layer's or another adapter's computation would be skipped): {fix}")
        base = m.base_layer
        if type(base) is not nn.Linear:
            raise FPDTHFError(f"{owner}.{name} is a LoRA layer on {type(base).__name__} (a quantised or wrapped "
                              f"layer), whose weight the chunked function cannot read: {fix}")
        bases.append(base)
        row = []
        if _peft_forward_hooks(m):
            raise FPDTHFError(f"{owner}.{name} has PEFT forward hooks (per-sample adapter_names, mixed-adapter "
                              f"batches), which the chunked function does not run: call the model without "
                              f"adapter_names, or {fix}")
        if m.disable_adapters and m.merged:
            raise FPDTHFError(f"{owner}.{name} has adapters merged into its weight but disabled (PEFT would "
                              f"unmerge them inside its forward): call unmerge_adapter() first")
        if not (m.disable_adapters or m.merged):
            for adapter in m.active_adapters:
                if adapter not in m.lora_A:
                    continue
                variant = getattr(m, "lora_variant", {}).get(adapter)
                if variant is not None or getattr(m, "use_dora", {}).get(adapter) \
                        or adapter in getattr(m, "lora_magnitude_vector", {}):     # DoRA before PEFT's variants
                    kind = type(variant).__name__ if variant is not None else "DoRA"
                    raise FPDTHFError(f"{owner}.{name}'s adapter {adapter!r} is a LoRA variant ({kind}, e.g. DoRA), "
                                      f"which the chunked function does not compute: plain LoRA, or {fix}")
                a, b, drop = m.lora_A[adapter], m.lora_B[adapter], m.lora_dropout[adapter]
                if not (type(a) is nn.Linear and type(b) is nn.Linear and a.bias is None):
                    raise FPDTHFError(f"{owner}.{name}'s adapter {adapter!r} is not two plain linears: {fix}")
                if type(drop) not in (nn.Dropout, nn.Identity):
                    raise FPDTHFError(f"{owner}.{name}'s adapter {adapter!r} has dropout {type(drop).__name__}: "
                                      f"{fix}")
                if row and a.weight.dtype != tensors[-3].dtype:
                    raise FPDTHFError(f"{owner}.{name}'s active adapters are in different dtypes "
                                      f"({tensors[-3].dtype}, {a.weight.dtype}); PEFT casts the input from one to "
                                      f"the next: give them one dtype, or {fix}")
                if not getattr(m, "cast_input_dtype_enabled", True) and a.weight.dtype != base.weight.dtype:
                    raise FPDTHFError(f"{owner}.{name}: PEFT's input casting is disabled and its adapter "
                                      f"{adapter!r} is {a.weight.dtype} on a {base.weight.dtype} layer (PEFT's "
                                      f"own forward would fail): enable the casting, or cast the adapters")
                p = float(drop.p) if type(drop) is nn.Dropout and drop.training else 0.0
                row.append(LoraTerm(scaling=float(m.scaling[adapter]), dropout=p, stream=len(tensors) // 3))
                tensors += [a.weight, b.weight, b.bias]
        terms.append(tuple(row))
    adapters = LoraAdapters(LoraLayout(tuple(terms)), tuple(tensors)) if tensors else None
    return Projections(bases, adapters)


def _peft_forward_hooks(module: nn.Module) -> bool:
    """Whether PEFT put forward pre-hooks on ``module`` (to inject ``adapter_names``)."""
    for hook in module._forward_pre_hooks.values():
        fn = hook.func if isinstance(hook, functools.partial) else hook
        if getattr(fn, "__module__", "").startswith("peft."):
            return True
    return False


def lean_lora(module: nn.Module, owner: str) -> Projections | None:
    """``module`` as a base linear and its LoRA terms if it is a PEFT LoRA layer whose terms
    fpdt computes (then the caller computes it with
    :func:`fpdt.attention.output_projection.output_projection`, which keeps less for backward than
    PEFT's forward); None for anything else, which the caller runs as a module (its own forward)."""
    lora_linear = _peft_lora_linear()
    if lora_linear is None or type(module) is not lora_linear:
        return None
    try:
        proj = read_projections({"o_proj": module}, owner, "")
    except FPDTHFError:            # a LoRA variant, a quantised base, ...: PEFT's own forward
        return None
    return proj if proj.adapters is not None else None


def read_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Every parameter a chunked function may read from ``module`` (a projection or norm; its
    base layer's and its adapters' with PEFT), for ZeRO-3's external-parameter registration."""
    return list(module.parameters())

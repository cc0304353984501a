"""The projections fpdt's chunked functions compute themselves (q/k/v, o, the MLP), read from their
modules: a plain ``nn.Linear`` (with fpdt's LoRA adapters, if any), or PEFT's LoRA ``Linear``
around one, computed as PEFT's ``forward`` would, chunk by chunk. Anything else is refused with
:class:`ProjectionError` naming the fix (the list: ``docs/hf.md``, "Projections the chunked
functions read").
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

from torch import nn

from fpdt.ops.lora import LoraAdapters, LoraLayout, LoraTerm


class ProjectionError(ValueError):
    """A projection a chunked function cannot compute as its module's own forward would; the
    message names the fix."""


@dataclass
class Projections:
    """Base linears of a chunked function's projections, and their LoRA terms (None if none)."""
    bases: list[nn.Linear]
    adapters: LoraAdapters | None


def _peft_lora_linear() -> type | None:
    """PEFT's LoRA ``Linear`` class if PEFT is loaded (a model cannot hold one otherwise)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "Linear", None)


def read_projections(modules: dict[str, nn.Module], owner: str, fix: str, training: bool = True) -> Projections:
    """``modules`` (name -> module, in the function's order) as base linears and LoRA terms;
    refused with ``fix`` for what the chunked function would compute differently. ``owner``
    names the module that holds them (e.g. ``LlamaMLP``), for the message; ``training``: whether
    the dropout of fpdt's own adapters counts (PEFT's follows its dropout modules)."""
    lora_linear = _peft_lora_linear()
    bases, terms, tensors = [], [], []
    for name, m in modules.items():
        if type(m) is nn.Linear:
            bases.append(m)
            terms.append(_own_terms(m, training, tensors))
            continue
        if lora_linear is None or type(m) is not lora_linear:
            kinds = ", ".join(type(x).__name__ for x in modules.values())
            raise ProjectionError(f"the chunked function reads {'/'.join(modules)}'s weights directly, and {owner}'s are "
                              f"{kinds} (only nn.Linear and PEFT's LoRA Linear are computed as their own forward "
                              f"would; a quantised layer's or another adapter's computation would be skipped): {fix}")
        base = m.base_layer
        if type(base) is not nn.Linear:
            raise ProjectionError(f"{owner}.{name} is a LoRA layer on {type(base).__name__} (a quantised or wrapped "
                              f"layer), whose weight the chunked function cannot read: {fix}")
        bases.append(base)
        row = []
        if _peft_forward_hooks(m):
            raise ProjectionError(f"{owner}.{name} has PEFT forward hooks (per-sample adapter_names, mixed-adapter "
                              f"batches), which the chunked function does not run: call the model without "
                              f"adapter_names, or {fix}")
        if m.disable_adapters and m.merged:
            raise ProjectionError(f"{owner}.{name} has adapters merged into its weight but disabled (PEFT would "
                              f"unmerge them inside its forward): call unmerge_adapter() first")
        if not (m.disable_adapters or m.merged):
            for adapter in m.active_adapters:
                if adapter not in m.lora_A:
                    continue
                variant = getattr(m, "lora_variant", {}).get(adapter)
                if variant is not None or getattr(m, "use_dora", {}).get(adapter) \
                        or adapter in getattr(m, "lora_magnitude_vector", {}):     # DoRA before PEFT's variants
                    kind = type(variant).__name__ if variant is not None else "DoRA"
                    raise ProjectionError(f"{owner}.{name}'s adapter {adapter!r} is a LoRA variant ({kind}, e.g. DoRA), "
                                      f"which the chunked function does not compute: plain LoRA, or {fix}")
                a, b, drop = m.lora_A[adapter], m.lora_B[adapter], m.lora_dropout[adapter]
                if not (type(a) is nn.Linear and type(b) is nn.Linear and a.bias is None):
                    raise ProjectionError(f"{owner}.{name}'s adapter {adapter!r} is not two plain linears: {fix}")
                if type(drop) not in (nn.Dropout, nn.Identity):
                    raise ProjectionError(f"{owner}.{name}'s adapter {adapter!r} has dropout {type(drop).__name__}: "
                                      f"{fix}")
                if row and a.weight.dtype != tensors[-3].dtype:
                    raise ProjectionError(f"{owner}.{name}'s active adapters are in different dtypes "
                                      f"({tensors[-3].dtype}, {a.weight.dtype}); PEFT casts the input from one to "
                                      f"the next: give them one dtype, or {fix}")
                if not getattr(m, "cast_input_dtype_enabled", True) and a.weight.dtype != base.weight.dtype:
                    raise ProjectionError(f"{owner}.{name}: PEFT's input casting is disabled and its adapter "
                                      f"{adapter!r} is {a.weight.dtype} on a {base.weight.dtype} layer (PEFT's "
                                      f"own forward would fail): enable the casting, or cast the adapters")
                p = float(drop.p) if type(drop) is nn.Dropout and drop.training else 0.0
                row.append(LoraTerm(scaling=float(m.scaling[adapter]), dropout=p, stream=len(tensors) // 3))
                tensors += [a.weight, b.weight, b.bias]
        terms.append(tuple(row))
    adapters = LoraAdapters(LoraLayout(tuple(terms)), tuple(tensors)) if tensors else None
    return Projections(bases, adapters)


def _own_terms(linear: nn.Linear, training: bool, tensors: list) -> tuple[LoraTerm, ...]:
    """The term of the adapter :func:`fpdt.model.lora.add_lora` attached to ``linear`` (``lora_A``
    ``[r, in]``, ``lora_B`` ``[out, r]``, ``lora_scaling``, ``lora_dropout``), its tensors appended
    to ``tensors``; none without one."""
    a = getattr(linear, "lora_A", None)
    if a is None:
        return ()
    p = float(linear.lora_dropout) if training else 0.0
    term = LoraTerm(scaling=float(linear.lora_scaling), dropout=p, stream=len(tensors) // 3)
    tensors += [a.weight, linear.lora_B.weight, None]
    return (term,)


def _peft_forward_hooks(module: nn.Module) -> bool:
    """Whether PEFT put forward pre-hooks on ``module`` (to inject ``adapter_names``)."""
    for hook in module._forward_pre_hooks.values():
        fn = hook.func if isinstance(hook, functools.partial) else hook
        if getattr(fn, "__module__", "").startswith("peft."):
            return True
    return False


def read_output_projection(module: nn.Module, owner: str, training: bool = True) -> Projections | None:
    """``module`` (an output projection) as a base linear and its LoRA terms, when the chunked
    output projection (:mod:`fpdt.attention.output_projection`) computes it as its own forward
    would; None for anything else (a quantised layer, a LoRA variant, ...), which then runs as itself."""
    try:
        return read_projections({"o_proj": module}, owner, "", training)
    except ProjectionError:
        return None

"""fpdt's Gated DeltaNet in place of a Transformers Qwen3.5 ``linear_attn`` module (:func:`fpdt.hf.apply_fpdt`).

:class:`TransformersGatedDeltaNet` is :class:`fpdt.model.gated_deltanet.GatedDeltaNet` holding the
module's own submodules and parameters under their names (``state_dict`` keys do not change), called
as Transformers' ``Qwen3_5DecoderLayer`` calls its linear attention. Its sequence is this rank's
slice in the FPDT layout; packed documents come as the ``doc_ids`` keyword argument
:func:`fpdt.hf.forward.causal_lm_forward` passes to every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from fpdt.hf.errors import FPDTHFError
from fpdt.hf.groups import resolve_group
from fpdt.model.gated_deltanet import FusedGatedDeltaNet, GatedDeltaNet
from fpdt.ops.projections import ProjectionError, read_projections


def gated_deltanet_classes() -> dict[type, bool]:
    """Transformers' Gated DeltaNet classes whose math :class:`GatedDeltaNet` computes (matched by
    class) -> whether their projections are Qwen3-Next's fused ones (:class:`FusedGatedDeltaNet`)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    return {Qwen3_5GatedDeltaNet: False, Qwen3_5MoeGatedDeltaNet: False, Qwen3NextGatedDeltaNet: True}


def is_gated_deltanet(module: nn.Module | None) -> bool:
    return module is not None and (type(module) in gated_deltanet_classes() or isinstance(module, GatedDeltaNet))


class TransformersGatedDeltaNet(GatedDeltaNet):
    """A :class:`GatedDeltaNet` over a Transformers ``Qwen3_5GatedDeltaNet``'s modules:
    ``forward(hidden_states [B, S_local, hidden], cache=None, attention_mask=None, **kwargs)`` ->
    ``[B, S_local, hidden]``; a cache or a padding mask is refused, ``doc_ids`` read from ``kwargs``."""

    @classmethod
    def adopt(cls, module: nn.Module) -> "TransformersGatedDeltaNet":
        """The replacement of ``module``, refused (naming the fix) unless Transformers' class with plain
        linears, or plain LoRA (PEFT's) on Qwen3.5's unfused ones."""
        classes = gated_deltanet_classes()
        if type(module) not in classes:
            raise FPDTHFError(f"{type(module).__module__}.{type(module).__name__} is not Transformers' Qwen3.5 / "
                              f"Qwen3-Next Gated DeltaNet, which fpdt replaces; it may compute something else")
        if classes[type(module)] and not issubclass(cls, FusedGatedDeltaNet):
            return TransformersFusedGatedDeltaNet.adopt(module)
        if type(module.conv1d) is not nn.Conv1d or module.conv1d.bias is not None:
            raise FPDTHFError(f"fpdt's Gated DeltaNet reads conv1d's weight directly, and it is "
                              f"{type(module.conv1d).__name__} (plain nn.Conv1d without bias only): leave conv1d out "
                              f"of the LoRA targets")
        fused = issubclass(cls, FusedGatedDeltaNet)
        if fused and any(type(getattr(module, n)) is not nn.Linear for n in cls.projection_names):
            raise FPDTHFError(f"fpdt's Gated DeltaNet reads Qwen3-Next's fused projections {cls.projection_names} "
                              f"directly, and one is not a plain nn.Linear (LoRA on them is not supported): target "
                              f"only the attention and MLP projections")
        try:
            proj = read_projections({n: getattr(module, n) for n in cls.projection_names}, type(module).__name__,
                                    GatedDeltaNet.projection_fix, module.training)
        except ProjectionError as e:
            raise FPDTHFError(str(e)) from None
        if any(base.bias is not None for base in proj.bases):
            raise FPDTHFError("fpdt's Gated DeltaNet computes its projections without bias, and one has a bias: "
                              "it may compute something else than Qwen3.5's")
        with torch.device("meta"):
            self = cls(module.hidden_size, module.num_k_heads, module.num_v_heads, module.head_k_dim,
                       module.head_v_dim, module.conv_kernel_size, module.layer_norm_epsilon)
        for name in (*cls.projection_names, "conv1d"):
            setattr(self, name, getattr(module, name))
        self.dt_bias, self.A_log = module.dt_bias, module.A_log
        self.norm.weight = module.norm.weight
        self.norm.eps = module.norm.variance_epsilon
        self.layer_idx, self.stash_label = module.layer_idx, f"layer {module.layer_idx}"
        return self.train(module.training)

    @property
    def group(self):
        """The sequence-parallel group (a :class:`fpdt.hf.groups.TrainerGroup` resolved per call)."""
        return resolve_group(self.__dict__.get("_group"))

    @group.setter
    def group(self, group) -> None:
        self.__dict__["_group"] = group

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        if cache is not None or kwargs.get("cache_params") is not None:
            raise FPDTHFError("fpdt's Gated DeltaNet keeps no recurrent cache: call the model with use_cache=False")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise FPDTHFError("fpdt's Gated DeltaNet cannot apply a padding mask: pass the window's right-padding "
                              "mask to fpdt.hf.prepare_inputs (padding labelled -100) instead of to the model")
        return super().forward(hidden_states, doc_ids=kwargs.get("doc_ids"))


class TransformersFusedGatedDeltaNet(TransformersGatedDeltaNet, FusedGatedDeltaNet):
    """:class:`TransformersGatedDeltaNet` over Transformers' ``Qwen3NextGatedDeltaNet`` (its fused
    ``in_proj_qkvz`` / ``in_proj_ba``, regrouped by :class:`FusedGatedDeltaNet`)."""

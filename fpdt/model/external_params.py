"""The parameters fpdt's fused Functions read without calling the module that owns them, for
ZeRO-3's external-parameter registration (``deepspeed.zero.register_external_parameter``).

ZeRO-3 gathers a module's own parameters around its forward. The chunked functions read their
projections' weights directly, so each such weight is registered with the module whose forward
reads it; both entry points (``fpdt-train`` and :func:`fpdt.hf.apply_fpdt`) register exactly these.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

from fpdt.attention.module import FPDTAttention
from fpdt.model.gated_deltanet import GatedDeltaNet
from fpdt.model.mlp import ChunkedSwiGLU
from fpdt.model.moe import ChunkedMoE
from fpdt.ops.projections import read_output_projection



def _reads_o_proj(attention: FPDTAttention) -> bool:
    """Whether the attention computes ``o_proj`` from its weights (inside its chunk pipeline)."""
    return read_output_projection(attention.o_proj, type(attention).__name__, attention.training) is not None


def directly_read(model: nn.Module, *, lm_head: bool, streamed: bool = False) -> Iterator[tuple[nn.Module, nn.Parameter]]:
    """``(reader, parameter)`` for every parameter of ``model`` read directly:

    * each :class:`fpdt.attention.FPDTAttention`: its q/k/v projections' (and q/k norms'), and
      ``o_proj``'s when it reads it (any plain or LoRA linear);
    * each :class:`fpdt.model.ChunkedSwiGLU`: its three projections', each ``ChunkedMoE`` its
      router's, experts' and shared expert's; in an
      :class:`fpdt.model.llama.FPDTDecoderLayer`, also ``post_attention_layernorm``'s (when fused in);
    * each :class:`fpdt.model.gated_deltanet.GatedDeltaNet`: its projections', conv's and norm's;
    * ``lm_head``: ``model.lm_head.weight`` (the chunked loss), read by ``model``;
    * ``streamed`` (:mod:`fpdt.model.streaming`): the embedding and final norm, read by ``model``.

    A projection's parameters include its adapters' (fpdt's or PEFT's)."""
    from fpdt.model.llama import FPDTDecoderLayer

    if streamed:
        yield model, model.model.embed_tokens.weight
        yield model, model.model.norm.weight
    for module in model.modules():
        names: tuple[str, ...] = ()
        if isinstance(module, FPDTDecoderLayer):
            if module.norm_in_mlp:
                yield module.mlp, module.post_attention_layernorm.weight
        elif isinstance(module, FPDTAttention):
            names = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm") + (("o_proj",) if _reads_o_proj(module) else ())
        elif isinstance(module, ChunkedSwiGLU):
            names = ("gate_proj", "up_proj", "down_proj")
        elif isinstance(module, ChunkedMoE):
            names = ("gate", "experts", "shared_expert", "shared_expert_gate")
        elif isinstance(module, GatedDeltaNet):
            names = module.read_children
        for name in names:
            child = getattr(module, name, None)
            if child is not None:
                for p in child.parameters():
                    yield module, p
    if lm_head:
        yield model, model.lm_head.weight

"""Putting FPDT into a decoder model: small steps in one order (:func:`apply_all`), made on a model
by a :class:`DecoderAdapter` (``fpdt.model``'s or ``fpdt.hf``'s). The chunk counts are decided here
only. The steps and their order: ``docs/model.md``, "Module tree and the apply steps"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from fpdt.model.layer_checkpoints import LayerCheckpoints
from fpdt.model.loss import default_loss_chunks
from fpdt.model.mlp import default_mlp_chunks
from fpdt.model.moe import ChunkedMoE, default_moe_chunks
from fpdt.options import FPDTOptions

ATTENTION_FIELDS = ("num_chunks", "offload", "group", "mesh", "backend", "runtime")
"""The options the attention reads (:func:`apply_attention`), under the same names in both models."""


def mlp_chunks_for(options: Any, config: Any) -> int:
    """The SwiGLU MLP's token chunks: ``options.mlp_chunks``, or ``ceil(2 u I / hidden)`` if None
    (a model without dense MLPs, Qwen3.5-MoE, has no ``I``: 1 then)."""
    if options.mlp_chunks is not None:
        return options.mlp_chunks
    width = getattr(config, "intermediate_size", 0) or 1
    return default_mlp_chunks(config.hidden_size, width, options.num_chunks)


def moe_chunks_for(options: Any, config: Any) -> int | None:
    """The MoE MLPs' token chunks: ``options.mlp_chunks``, or :func:`fpdt.model.moe.default_moe_chunks`
    if None; None for a config without experts (``config.moe``)."""
    moe = getattr(config, "moe", None)
    if moe is None and getattr(config, "num_experts", None):
        moe = config                                        # a Transformers config (fpdt.hf; Mixtral: I wide)
        widths = (getattr(moe, "moe_intermediate_size", None) or moe.intermediate_size, moe.num_experts,
                  moe.num_experts_per_tok, getattr(moe, "shared_expert_intermediate_size", 0) or 0)
    elif moe is not None:
        widths = (moe.moe_intermediate_size, moe.num_experts, moe.top_k, moe.shared_expert_intermediate_size)
    if moe is None:
        return None
    if options.mlp_chunks is not None:
        return options.mlp_chunks
    ffn, experts, top_k, shared = widths
    return default_moe_chunks(config.hidden_size, ffn, experts, top_k, options.num_chunks, shared)


def loss_chunks_for(options: Any, config: Any, tokens: int | None = None) -> int:
    """The LM head and loss's token chunks: ``options.loss_chunks``, or if None
    :func:`~fpdt.model.loss.default_loss_chunks` (``ceil(2 u V / hidden)``, floored for ``tokens``)."""
    if options.loss_chunks is not None:
        return options.loss_chunks
    return default_loss_chunks(config.vocab_size, config.hidden_size, options.num_chunks, tokens)


def norm_chunks(num_chunks: int) -> int:
    """The RMSNorms' token chunks, ``2 u`` (:mod:`fpdt.model.chunks`)."""
    return 2 * num_chunks


class DecoderAdapter:
    """One model as the apply steps see it: ``config`` (``hidden_size``, ``intermediate_size``,
    ``vocab_size``), ``layers`` (each with ``self_attn`` and ``mlp``). Subclasses implement
    :meth:`norms`, :meth:`set_layer_checkpoints` and :meth:`set_loss_chunks`."""

    config: Any
    layers: list[nn.Module]

    def norms(self) -> list[nn.Module]:
        """The RMSNorms the lean-norm step changes (those of the layers and the final one)."""
        raise NotImplementedError

    def start_attention(self, options: FPDTOptions) -> None:
        """The model-wide part of the attention step, before the layers' (nothing by default)."""

    def set_attention(self, layer: nn.Module, options: FPDTOptions) -> None:
        """Make the layer's token mixer (``self_attn``, or a Gated DeltaNet ``linear_attn``) read
        :data:`ATTENTION_FIELDS`."""
        for name in ATTENTION_FIELDS:
            setattr(token_mixer_of(layer), name, getattr(options, name))

    def set_norm_chunks(self, norm: nn.Module, num_chunks: int) -> None:
        norm.num_chunks = num_chunks

    def set_mlp_chunks(self, layer: nn.Module, num_chunks: int) -> None:
        """``num_chunks`` token chunks for ``layer.mlp``, a :class:`fpdt.model.ChunkedSwiGLU`."""
        layer.mlp.num_chunks = num_chunks

    def set_layer_checkpoints(self, checkpoints: LayerCheckpoints) -> None:
        """The decoder layers run under ``checkpoints`` (nothing to do when it is not enabled)."""
        raise NotImplementedError

    def set_loss_chunks(self, num_chunks: int) -> None:
        """``num_chunks`` token chunks for the LM head and loss; 0: full logits."""
        raise NotImplementedError

    def layer_checkpoints(self) -> LayerCheckpoints | None:
        """The checkpoints an earlier apply set (None: first apply)."""
        return None


def token_mixer_problems(linear_attention: bool, options: FPDTOptions) -> list[str]:
    """What a model with Gated DeltaNet layers (``linear_attention``: Qwen3.5) cannot run with
    (empty when it can, or without such layers), each naming the fix; ``fpdt.model`` and ``fpdt.hf``."""
    if not linear_attention:
        return []
    out = []
    if options.mesh is not None and options.mesh.cp > 1:
        out.append(f"a context-parallel ring (cp={options.mesh.cp}) is not implemented for Gated DeltaNet layers, "
                   f"whose state would pass between ring ranks: use Ulysses only (cp=1)")
    return out


def has_attention(layer: nn.Module) -> bool:
    """Whether a decoder layer mixes tokens by attention (``self_attn``), not by a Gated DeltaNet."""
    return getattr(layer, "self_attn", None) is not None


def token_mixer_of(layer: nn.Module) -> nn.Module:
    """A decoder layer's ``self_attn``, or its ``linear_attn`` (hybrid models)."""
    return layer.self_attn if has_attention(layer) else layer.linear_attn


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_all` decided for one model."""

    mlp_chunks: int
    loss_chunks: int
    norm_chunks: int
    checkpoints: LayerCheckpoints


def apply_attention(adapter: DecoderAdapter, options: FPDTOptions) -> None:
    """Every decoder layer's attention becomes FPDT's, with the options in :data:`ATTENTION_FIELDS`."""
    adapter.start_attention(options)
    for layer in adapter.layers:
        adapter.set_attention(layer, options)


def apply_lean_norms(adapter: DecoderAdapter, num_chunks: int) -> int:
    """Every RMSNorm runs over :func:`norm_chunks` token chunks; returns that count."""
    chunks = norm_chunks(num_chunks)
    for norm in adapter.norms():
        adapter.set_norm_chunks(norm, chunks)
    return chunks


def is_moe_mlp(mlp) -> bool:
    """Whether ``mlp`` is a mixture of experts: fpdt's :class:`ChunkedMoE` or a Transformers sparse block (``experts``)."""
    return isinstance(mlp, ChunkedMoE) or hasattr(mlp, "experts")


def apply_chunked_mlp(adapter: DecoderAdapter, mlp_chunks: int, moe_chunks: int | None = None) -> None:
    """Every decoder layer's SwiGLU MLP runs over ``mlp_chunks`` token chunks, an MoE MLP over ``moe_chunks``."""
    for layer in adapter.layers:
        adapter.set_mlp_chunks(layer, moe_chunks if is_moe_mlp(getattr(layer, "mlp", None)) else mlp_chunks)


def apply_layer_checkpointing(adapter: DecoderAdapter, options: FPDTOptions) -> LayerCheckpoints:
    """The model's one :class:`LayerCheckpoints` for ``options.checkpointing``; returned."""
    checkpoints = LayerCheckpoints(options, len(adapter.layers), [has_attention(layer) for layer in adapter.layers],
                                   previous=adapter.layer_checkpoints())
    adapter.set_layer_checkpoints(checkpoints)
    return checkpoints


def apply_chunked_loss(adapter: DecoderAdapter, loss_chunks: int) -> None:
    """The LM head and cross-entropy run fused over ``loss_chunks`` token chunks."""
    adapter.set_loss_chunks(loss_chunks)


def apply_all(adapter: DecoderAdapter, options: FPDTOptions) -> Applied:
    """Every step, in order, for validated ``options``."""
    mlp_chunks = mlp_chunks_for(options, adapter.config)
    loss_chunks = loss_chunks_for(options, adapter.config)
    apply_attention(adapter, options)
    # a streamed layer (fpdt.model.streaming) calls its norms and MLP once per attention chunk: the
    # same token chunks as one call over the whole sequence, split over u calls
    calls = options.num_chunks if options.stream_layers else 1
    norms = apply_lean_norms(adapter, options.num_chunks // calls)
    moe_chunks = moe_chunks_for(options, adapter.config)
    apply_chunked_mlp(adapter, -(-mlp_chunks // calls), None if moe_chunks is None else -(-moe_chunks // calls))
    checkpoints = apply_layer_checkpointing(adapter, options)
    apply_chunked_loss(adapter, loss_chunks)
    return Applied(mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, norm_chunks=norms, checkpoints=checkpoints)

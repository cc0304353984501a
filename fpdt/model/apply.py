"""Putting FPDT into a decoder model: small steps in one documented order, for both entry points.

As torchtitan applies its parallelisms (each a small function, run in a fixed order on a model
that is otherwise plain), FPDT's pieces go into a model through the steps here. A step decides
what changes (which options reach the attention, how many token chunks each op takes, one
:class:`fpdt.model.layer_checkpoints.LayerCheckpoints` for the model); a
:class:`DecoderAdapter` makes the change on one kind of model:

* ``fpdt.model``: :class:`fpdt.model.llama.FPDTAdapter` sets attributes on its own modules
  (``FPDTForCausalLM.configure`` runs the steps again after every change of options);
* ``fpdt.hf``: :class:`fpdt.hf.apply_steps.TransformersAdapter` first puts the same modules
  (:class:`fpdt.attention.FPDTAttention`, :class:`fpdt.model.ChunkedSwiGLU`, fpdt's ``RMSNorm``)
  in place of a Transformers model's, holding its parameters, through
  :class:`fpdt.hf.patches.Patches`, so that :func:`fpdt.hf.remove_fpdt` undoes each change.

The order (:func:`apply_all`):

1. :func:`apply_attention`: FPDT's sequence-parallel chunked attention in every decoder layer;
2. :func:`apply_lean_norms`: the RMSNorms over ``2 u`` token chunks;
3. :func:`apply_chunked_mlp`: each SwiGLU MLP over ``mlp_chunks`` token chunks;
4. :func:`apply_layer_checkpointing`: the decoder layers under one ``LayerCheckpoints``
   (the layer-input stash, ``checkpointing`` ``"on"`` / ``"offload"``);
5. :func:`apply_chunked_loss`: the LM head and loss over ``loss_chunks`` token chunks.

The chunk counts are decided here only (:func:`mlp_chunks_for`, :func:`loss_chunks_for`,
:func:`norm_chunks`; the budget behind them: :mod:`fpdt.model.chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from fpdt.model.layer_checkpoints import LayerCheckpoints
from fpdt.model.loss import default_loss_chunks
from fpdt.model.mlp import default_mlp_chunks
from fpdt.options import FPDTOptions

ATTENTION_FIELDS = ("num_chunks", "offload", "group", "mesh", "backend", "runtime")
"""The options the attention reads (:func:`apply_attention`), under the same names in both models."""


def mlp_chunks_for(options: Any, config: Any) -> int:
    """The SwiGLU MLP's token chunks: ``options.mlp_chunks``, or if None the default
    ``ceil(2 u I / hidden)`` (:func:`fpdt.model.mlp.default_mlp_chunks`). ``options`` has
    ``mlp_chunks`` and ``num_chunks`` (an :class:`FPDTOptions`, the planner's ``Setup``);
    ``config`` has ``hidden_size`` and ``intermediate_size``."""
    if options.mlp_chunks is not None:
        return options.mlp_chunks
    return default_mlp_chunks(config.hidden_size, config.intermediate_size, options.num_chunks)


def loss_chunks_for(options: Any, config: Any) -> int:
    """The LM head and loss's token chunks: ``options.loss_chunks``, or if None the default
    ``ceil(2 u V / hidden)`` (:func:`fpdt.model.loss.default_loss_chunks`); as :func:`mlp_chunks_for`,
    with ``config.vocab_size``."""
    if options.loss_chunks is not None:
        return options.loss_chunks
    return default_loss_chunks(config.vocab_size, config.hidden_size, options.num_chunks)


def norm_chunks(num_chunks: int) -> int:
    """The RMSNorms' token chunks, ``2 u``: their fp32 ``[n, hidden]`` temporaries within the
    chunk budget (:mod:`fpdt.model.chunks`)."""
    return 2 * num_chunks


class DecoderAdapter:
    """One model as the apply steps see it: its decoder layers, each layer's attention and MLP,
    its RMSNorms, and the module-specific change each step makes.

    ``config`` has ``hidden_size``, ``intermediate_size`` and ``vocab_size``; ``layers`` lists the
    decoder layers in order, each with ``self_attn`` and ``mlp``. A subclass implements
    :meth:`norms`, :meth:`set_layer_checkpoints` and :meth:`set_loss_chunks`."""

    config: Any
    layers: list[nn.Module]

    def norms(self) -> list[nn.Module]:
        """The RMSNorms the lean-norm step changes (those of the layers and the final one)."""
        raise NotImplementedError

    def start_attention(self, options: FPDTOptions) -> None:
        """The model-wide part of the attention step, before the layers' (nothing by default)."""

    def set_attention(self, layer: nn.Module, options: FPDTOptions) -> None:
        """Make ``layer.self_attn``, an :class:`fpdt.attention.FPDTAttention`, read
        :data:`ATTENTION_FIELDS` of ``options``; without a layer checkpoint its ``o_proj`` reads
        its input from the attention's stash (else every layer would keep it to backward)."""
        for name in ATTENTION_FIELDS:
            setattr(layer.self_attn, name, getattr(options, name))
        layer.self_attn.o_proj_input_from_stash = options.checkpointing == "off"

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


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_all` decided for one model."""

    mlp_chunks: int
    loss_chunks: int
    norm_chunks: int
    checkpoints: LayerCheckpoints


def apply_attention(adapter: DecoderAdapter, options: FPDTOptions) -> None:
    """Every decoder layer's attention becomes FPDT's (Ulysses or the 2D mesh, chunked, offloaded
    with ``offload``), with the options in :data:`ATTENTION_FIELDS`."""
    adapter.start_attention(options)
    for layer in adapter.layers:
        adapter.set_attention(layer, options)


def apply_lean_norms(adapter: DecoderAdapter, num_chunks: int) -> int:
    """Every RMSNorm runs :func:`fpdt.model.rmsnorm.rms_norm` (saves its input and an fp32 scale
    per token) over :func:`norm_chunks` token chunks; returns that count."""
    chunks = norm_chunks(num_chunks)
    for norm in adapter.norms():
        adapter.set_norm_chunks(norm, chunks)
    return chunks


def apply_chunked_mlp(adapter: DecoderAdapter, mlp_chunks: int) -> None:
    """Every decoder layer's SwiGLU MLP runs over ``mlp_chunks`` token chunks
    (:class:`fpdt.model.mlp.ChunkedSwiGLUFunction`, intermediates recomputed in backward)."""
    for layer in adapter.layers:
        adapter.set_mlp_chunks(layer, mlp_chunks)


def apply_layer_checkpointing(adapter: DecoderAdapter, options: FPDTOptions) -> LayerCheckpoints:
    """The model's one :class:`LayerCheckpoints` for ``options.checkpointing``: each decoder layer
    checkpointed, its input kept on the device or (``"offload"``) in the host stash; returned."""
    checkpoints = LayerCheckpoints(options, len(adapter.layers))
    adapter.set_layer_checkpoints(checkpoints)
    return checkpoints


def apply_chunked_loss(adapter: DecoderAdapter, loss_chunks: int) -> None:
    """The LM head and cross-entropy run fused over ``loss_chunks`` token chunks
    (:func:`fpdt.model.loss.sequence_parallel_lm_loss`)."""
    adapter.set_loss_chunks(loss_chunks)


def apply_all(adapter: DecoderAdapter, options: FPDTOptions) -> Applied:
    """Every step, in the documented order (the module docstring), for validated ``options``."""
    mlp_chunks = mlp_chunks_for(options, adapter.config)
    loss_chunks = loss_chunks_for(options, adapter.config)
    apply_attention(adapter, options)
    # a streamed layer (fpdt.model.streaming) calls its norms and MLP once per attention chunk: the
    # same token chunks as one call over the whole sequence, split over u calls
    calls = options.num_chunks if options.stream_layers else 1
    norms = apply_lean_norms(adapter, options.num_chunks // calls)
    apply_chunked_mlp(adapter, -(-mlp_chunks // calls))
    checkpoints = apply_layer_checkpointing(adapter, options)
    apply_chunked_loss(adapter, loss_chunks)
    return Applied(mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, norm_chunks=norms, checkpoints=checkpoints)

"""The apply steps of :mod:`fpdt.model.apply` on a Transformers causal LM.

:class:`TransformersAdapter` makes each step's change by binding a forward to the model's
modules through :class:`fpdt.hf.patches.Patches` (so :func:`fpdt.hf.remove_fpdt` undoes it):

* attention: fpdt's attention registered under a new name and made the model's; with
  ``chunked_qkv`` each attention module is replaced by
  :class:`fpdt.hf.attention.TransformersAttention`, fpdt's own attention holding its projections;
* lean norms: the RMSNorms (Llama, Mistral, Qwen2, Qwen3 classes) are replaced by fpdt's
  :class:`fpdt.model.llama.RMSNorm` holding their weights;
* chunked MLP: each SwiGLU MLP is replaced by :class:`fpdt.model.ChunkedSwiGLU` holding its
  projections (PEFT LoRA layers read by :mod:`fpdt.ops.projections`);
* layer checkpointing: each decoder layer's forward under the model's one
  :class:`fpdt.model.layer_checkpoints.LayerCheckpoints`;
* chunked loss: the causal LM's forward (:func:`fpdt.hf.forward.causal_lm_forward`) with the
  model's :class:`fpdt.hf.settings.HFSettings`, and for position-dependent RoPE the rotary
  embedding's (:func:`fpdt.hf.forward.global_rope_forward`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fpdt.hf.attention import FPDTHFError, TransformersAttention, register_settings
from fpdt.hf.forward import BOTH_CHECKPOINTS, RECOMPUTED_ROPE_TYPES, causal_lm_forward, global_rope_forward
from fpdt.hf.gated_deltanet import TransformersGatedDeltaNet
from fpdt.hf.patches import Patches
from fpdt.hf.settings import HFSettings, layer_checkpoints_of
from fpdt.hf.trainer import TRAINER_ATTN_NAME
from fpdt.attention.module import norm_eps
from fpdt.model.apply import DecoderAdapter, has_attention
from fpdt.model.checkpointing import checkpointed, donation_check
from fpdt.model.layer_checkpoints import LayerCheckpoints
from fpdt.model.llama import RMSNorm
from fpdt.model.mlp import ChunkedSwiGLU
from fpdt.model.moe import ChunkedMoE
from fpdt.model.streaming import streamed_layer
from fpdt.ops.parameter_lora import base_module
from fpdt.ops.projections import ProjectionError, read_projections
from fpdt.options import FPDTOptions


def _lean_rmsnorm_classes() -> tuple[type, ...]:
    """Transformers RMSNorm classes whose forward is exactly :func:`fpdt.model.rmsnorm.rms_norm`'s
    (fp32 normalisation, cast to the input dtype, then the weight multiply); matched by class."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    return (LlamaRMSNorm, MistralRMSNorm, MixtralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, Qwen3MoeRMSNorm,
            *_zero_centred_rmsnorm_classes())


def _zero_centred_rmsnorm_classes() -> tuple[type, ...]:
    """Transformers RMSNorm classes computing ``cast(x_hat * (1 + weight))`` in fp32 (Qwen3.5's):
    replaced by :class:`fpdt.model.llama.RMSNorm` with ``zero_centred``."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    return Qwen3_5RMSNorm, Qwen3_5MoeRMSNorm, Qwen3NextRMSNorm


def _lean_norms(model: nn.Module, layers: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    """The model's RMSNorms as ``(parent, name)``, refused (naming the fix) unless their class is a known one."""
    known = _lean_rmsnorm_classes()
    norm = getattr(layers[0], "input_layernorm", None)
    if type(norm) not in known:
        names = ", ".join(c.__name__ for c in known)
        raise FPDTHFError(f"lean_norms replaces Transformers' {names}; this model's layer norm is "
                          f"{type(norm).__module__}.{type(norm).__name__}, which may compute something else: "
                          f"apply_fpdt(..., lean_norms=False)")
    return [(parent, name) for parent in model.modules() for name, m in parent.named_children() if type(m) in known]


def _checkpointed_layer_forward(self, hidden_states, *args, **kwargs):
    """A decoder layer's forward under fpdt's checkpoint; bound to the layer, whose
    ``_fpdt_layer_index`` and ``_fpdt_checkpoints`` (the model's LayerCheckpoints) are set by the apply step
    (copied with the model)."""
    i, checkpoints = self._fpdt_layer_index, self._fpdt_checkpoints
    mode = checkpoints.mode
    if "fpdt_stream" in kwargs:                   # stream_layers: the layer is one streamed pass
        return streamed_layer(self, hidden_states, kwargs["fpdt_stream"])
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        raise FPDTHFError(BOTH_CHECKPOINTS.format(mode=mode))
    if not args and type(self) in _pre_norm_layer_classes():
        def branches(saved):                      # the layer's attention call records / replays its output
            return _residual_branches(self, kwargs if saved is None else dict(kwargs, fpdt_saved=saved))
        return checkpoints.checkpointed_layer(i, hidden_states, branches, list(self.parameters()))
    if i == 0:
        checkpoints.start()                       # stash keys unique per forward call
    keys = checkpoints.arguments(i, hidden_states.device)
    if keys["saved"] is not None:
        kwargs = dict(kwargs, fpdt_saved=keys["saved"])
    run = type(self).forward                      # Transformers' own forward (its checkpoint wrapper is off)
    # the decoder layer ends with a residual add, which saves nothing: its output may be freed
    return checkpointed(lambda x: run(self, x, *args, **kwargs), hidden_states, list(self.parameters()),
                        free_output=True, **keys)


@functools.cache
def _pre_norm_layer_classes() -> tuple[type, ...]:
    """Transformers decoder layers whose forward is exactly ``h = x + self_attn(input_layernorm(x), **kwargs)[0]``,
    then ``h + mlp(post_attention_layernorm(h))`` (one shared source in Transformers 5; the parity tests
    against Transformers hold fpdt's split of it to that); matched by class."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    return (LlamaDecoderLayer, MistralDecoderLayer, MixtralDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer,
            Qwen3_5DecoderLayer, Qwen3_5MoeDecoderLayer, Qwen3MoeDecoderLayer, Qwen3NextDecoderLayer)


def _residual_branches(layer: nn.Module, kwargs: dict):
    """``layer``'s two residual branches (:func:`fpdt.model.checkpointing.checkpointed_residual`),
    called with the keyword arguments the model passed to the layer, as its forward calls them (a
    Qwen3.5 layer's token mixer is ``self_attn`` or ``linear_attn``). As in
    :meth:`fpdt.model.llama.DecoderLayer.attention_branch` and ``mlp_branch``, fpdt's own RMSNorm
    (``lean_norms``) goes inside the chunked attention (``chunked_qkv``) and chunked MLP, which
    normalise a chunk at a time, so no full-length normalised tensor is made; other norms run as
    themselves first."""
    norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm

    def attention(x):
        if not has_attention(layer):
            return layer.linear_attn(hidden_states=norm(x), **kwargs)
        if isinstance(layer.self_attn, TransformersAttention) and isinstance(norm, RMSNorm):
            return layer.self_attn(hidden_states=x, norm=norm, donate=donation_check(x), **kwargs)[0]
        return layer.self_attn(hidden_states=norm(x), **kwargs)[0]

    def mlp(h):
        if (isinstance(layer.mlp, (ChunkedSwiGLU, ChunkedMoE)) and isinstance(post_norm, RMSNorm)
                and not post_norm.zero_centred):          # the chunked MLPs multiply by the weight itself
            return layer.mlp(h, norm=post_norm)
        return layer.mlp(post_norm(h))
    return attention, mlp


def _renormalised_top_k(block: nn.Module) -> bool:
    """Whether a Transformers sparse MoE block renormalises its top-k probabilities: its router's
    ``norm_topk_prob`` (Qwen3-MoE, Qwen3-Next), always (Mixtral, Qwen3.5-MoE); other classes, and
    Mixtral's training-time router jitter, are refused (matched by class)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    kind = type(block)
    if kind in (Qwen3MoeSparseMoeBlock, Qwen3NextSparseMoeBlock):
        return bool(base_module(block.gate).norm_topk_prob)     # under PEFT's wrapper too (refused later)
    if kind is MixtralSparseMoeBlock and block.jitter_noise:
        raise FPDTHFError(f"router_jitter_noise={block.jitter_noise}: fpdt's experts route without noise; "
                          f"load the model with router_jitter_noise=0")
    if kind in (MixtralSparseMoeBlock, Qwen3_5MoeSparseMoeBlock):
        return True
    raise FPDTHFError(f"{kind.__module__}.{kind.__name__} is not a mixture-of-experts block fpdt knows (Qwen3-MoE, "
                      f"Qwen3.5-MoE, Qwen3-Next, Mixtral); it may route differently")


class TransformersAdapter(DecoderAdapter):
    """A Transformers ``*ForCausalLM`` (``model``, its decoder ``layers``) for the apply steps;
    every change goes through ``patches``. ``trainer``: under the Hugging Face Trainer's sequence
    parallelism (:mod:`fpdt.hf.trainer`). ``chunked_qkv`` / ``lean_norms``: as
    :func:`fpdt.hf.apply_fpdt`'s; the norms are refused here, naming the fix, unless of a known
    class. The adapter records what the steps decided, for the model's :class:`HFSettings`."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], patches: Patches, *, trainer: bool,
                 chunked_qkv: bool, lean_norms: bool):
        self.model, self.config, self.layers, self.patches = model, model.config, layers, patches
        self.trainer, self.chunked_qkv, self.lean_norms = trainer, bool(chunked_qkv), bool(lean_norms)
        self._norms = _lean_norms(model, layers) if lean_norms else []
        self.options: FPDTOptions | None = None
        self.attn_implementation: str | None = None
        self.mlp_chunks = 0

    def norms(self) -> list[nn.Module]:
        # found again here: the attention step has put the q/k norms (Qwen3) under new parents
        self._norms = _lean_norms(self.model, self.layers) if self.lean_norms else []
        return [getattr(parent, name) for parent, name in self._norms]

    def start_attention(self, options: FPDTOptions) -> None:
        """Register fpdt attention under a new name and make it the model's (under the Trainer,
        the name its SP setup checks; the forward switches to fpdt's while it runs); with
        ``chunked_qkv``, every layer's attention module becomes a :class:`TransformersAttention`."""
        self.options = options
        name = self.attn_implementation = register_settings(options, self.patches)
        if self.trainer:
            # The name the Trainer's SP setup checks; the chunked attention modules never call the function
            # behind it, and the forward switches to `name` (fpdt's mask function) while it runs.
            self.model.set_attn_implementation(TRAINER_ATTN_NAME)
        else:
            self.model.set_attn_implementation(name)
        if not self.trainer and self.model.config._attn_implementation != name:
            raise FPDTHFError(f"{type(self.model).__name__} did not take attention implementation {name!r}; it "
                              f"does not use Transformers' AttentionInterface")
        for layer in self.layers:
            if not has_attention(layer):       # a Qwen3.5 Gated DeltaNet layer: always fpdt's
                self.patches.replace(layer, "linear_attn", TransformersGatedDeltaNet.adopt(layer.linear_attn))
            elif self.chunked_qkv:
                self.patches.replace(layer, "self_attn", TransformersAttention.adopt(layer.self_attn, name))

    def set_attention(self, layer: nn.Module, options: FPDTOptions) -> None:
        """With ``chunked_qkv``, the layer's :class:`TransformersAttention` reads the options; else
        the module's own forward calls the registered implementation, which reads them. A Gated
        DeltaNet layer's module reads them always."""
        if self.chunked_qkv or not has_attention(layer):
            super().set_attention(layer, options)

    def set_norm_chunks(self, norm: nn.Module, num_chunks: int) -> None:
        for parent, name in self._norms:
            if getattr(parent, name) is norm:
                zero_centred = type(norm) in _zero_centred_rmsnorm_classes()
                self.patches.replace(parent, name, RMSNorm.from_weight(norm.weight, norm_eps(norm), num_chunks,
                                                                       zero_centred).train(norm.training))

    def set_mlp_chunks(self, layer: nn.Module, num_chunks: int) -> None:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):       # a sparse MoE block: fpdt's chunked experts, statistics per call
            if self.trainer:
                raise FPDTHFError("mixture-of-experts models run under apply_fpdt without the Trainer's sequence "
                                  "parallelism (not yet): use group=None or a process group")
            try:
                moe = ChunkedMoE.from_block(mlp, num_chunks, _renormalised_top_k(mlp)).train(mlp.training)
            except ValueError as e:
                raise FPDTHFError(str(e)) from None
            moe.layer_index = self.layers.index(layer)
            self.patches.replace(layer, "mlp", moe)
            return
        self.mlp_chunks = num_chunks
        if not num_chunks:                # 0: Transformers' own MLP
            return
        names = ("gate_proj", "up_proj", "down_proj")
        try:
            read_projections({n: getattr(mlp, n) for n in names}, type(mlp).__name__, "apply_fpdt(..., mlp_chunks=0)",
                             mlp.training)
        except ProjectionError as e:
            raise FPDTHFError(str(e)) from None
        chunked = ChunkedSwiGLU.from_projections(*(getattr(mlp, n) for n in names), num_chunks).train(mlp.training)
        chunked.projection_fix = "apply_fpdt(..., mlp_chunks=0)"
        self.patches.replace(layer, "mlp", chunked)

    def set_layer_checkpoints(self, checkpoints: LayerCheckpoints) -> None:
        if not checkpoints.enabled:   # Transformers' own checkpointing may be used instead
            return
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, ChunkedMoE):   # records its statistics in the pass without gradients only
                self.patches.set(layer.mlp, "checkpointed", True)
            self.patches.set(layer, "_fpdt_layer_index", i)
            self.patches.set(layer, "_fpdt_checkpoints", checkpoints)
            self.patches.bind(layer, "forward", _checkpointed_layer_forward)

    def layer_checkpoints(self) -> LayerCheckpoints | None:
        return layer_checkpoints_of(self.layers)

    def set_loss_chunks(self, num_chunks: int) -> None:
        """The causal LM's forward (sequence-parallel inputs, the loss over ``num_chunks``) with the
        model's :class:`HFSettings` as ``model.fpdt``, and for RoPE types that depend on the largest
        position a rotary embedding that sees the whole window's."""
        model = self.model
        settings = HFSettings(attn_implementation=self.attn_implementation, options=self.options,
                              mlp_chunks=self.mlp_chunks, loss_chunks=num_chunks, chunked_qkv=self.chunked_qkv,
                              lean_norms=self.lean_norms)
        self.patches.bind(model, "forward", causal_lm_forward)
        self.patches.set(model, "fpdt", settings)
        rotary = getattr(model.model, "rotary_emb", None)
        rope_types = getattr(rotary, "rope_type", "default")          # per layer type in some models
        if set(rope_types.values() if isinstance(rope_types, dict) else [rope_types]) & set(RECOMPUTED_ROPE_TYPES):
            self.patches.bind(rotary, "forward", global_rope_forward(settings))

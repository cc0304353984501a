"""Llama-family and hybrid (Qwen3.5) causal LMs on FPDT layers, with Transformers' module tree and
parameter names (``docs/model.md``, ``docs/models.md``). Shapes: ``B`` batch, ``S`` global sequence,
``S_local = S / P`` tokens on each of the ``P`` sequence-parallel ranks, in the FPDT layout (:mod:`fpdt.layout`)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from fpdt.attention import FPDTAttention, RotaryEmbedding
from fpdt.attention.saved_attention import SavedAttention
from fpdt.comm import sp_group_of, sp_rank_size
from fpdt.layout.documents import canonical_doc_ids, sequence_parallel_doc_ids
from fpdt.model.apply import DecoderAdapter, apply_all, loss_chunks_for, mlp_chunks_for, token_mixer_problems
from fpdt.model.checkpointing import donation_check
from fpdt.model.config import LINEAR_ATTENTION, ModelConfig
from fpdt.model.layer_checkpoints import LayerCheckpoints
from fpdt.model.inputs import prepare_inputs, require_position_ids
from fpdt.model.loss import sequence_parallel_lm_loss
from fpdt.model.mlp import ChunkedSwiGLU
from fpdt.model.moe import ChunkedMoE, MoEExperts, MoERouter, RouterStatistics, balancing_loss
from fpdt.model.rmsnorm import rms_norm
from fpdt.model.rope_scaling import rope_inv_freq
from fpdt.model.streaming import StreamedModel, StreamedRun, streamed_layer, streamed_loss
from fpdt.model.weights import save_pretrained
from fpdt.offload import HostStash
from fpdt.options import FPDTOptions


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` in fp32, cast back before the weight multiply.
    ``[..., hidden]`` -> same; saves the input and an fp32 ``rstd`` per token only. ``zero_centred``
    (Qwen3.5): ``cast(x_hat * (1 + weight))`` in fp32, the weight stored as an offset from 1."""

    def __init__(self, hidden_size: int, eps: float, num_chunks: int = 1, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centred else torch.ones(hidden_size))
        self.eps = eps
        self.num_chunks = num_chunks
        self.zero_centred = zero_centred

    @classmethod
    def from_weight(cls, weight: nn.Parameter, eps: float, num_chunks: int = 1,
                    zero_centred: bool = False) -> "RMSNorm":
        """A norm holding an existing ``weight`` parameter (``fpdt.hf`` adopts a Transformers model's)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.weight, self.eps, self.num_chunks, self.zero_centred = weight, float(eps), num_chunks, zero_centred
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.num_chunks, self.zero_centred)


def token_mixer(cfg: ModelConfig, i: int) -> tuple[str, nn.Module]:
    """Layer ``i``'s token mixer and the name it has in Transformers: ``("linear_attn", Gated DeltaNet)``
    or ``("self_attn", FPDTAttention)`` (Qwen3.5's gated, with per-head q/k norms and partial RoPE)."""
    if cfg.layer_type(i) == LINEAR_ATTENTION:
        from fpdt.model.gated_deltanet import FusedGatedDeltaNet, GatedDeltaNet

        layout = FusedGatedDeltaNet if cfg.linear_fused_projections else GatedDeltaNet
        return "linear_attn", layout(
            cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
    if not (cfg.attn_output_gate or cfg.qk_norm or cfg.rotary_dim != cfg.head_dim):
        return "self_attn", FPDTAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                          qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias)
    attn = FPDTAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qkv_bias=cfg.qkv_bias,
                         o_bias=cfg.o_bias, output_gate=cfg.attn_output_gate,
                         rotary_dim=cfg.rotary_dim if cfg.rotary_dim != cfg.head_dim else None,
                         qk_norm_zero_centred=cfg.qk_norm and cfg.zero_centred_norms)
    if cfg.qk_norm:
        attn.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norms)
        attn.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norms)
    return "self_attn", attn


class FPDTDecoderLayer(nn.Module):
    """Pre-norm block: ``h + mixer(norm(h))``, then ``h + mlp(norm(h))``; options set by
    :func:`fpdt.model.apply.apply_all`. The token mixer of layer ``layer_idx`` (:func:`token_mixer`) is
    ``self_attn`` (attention) or ``linear_attn`` (Gated DeltaNet, ``cfg.layer_types``); the other is None."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        zc = cfg.zero_centred_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=zc)
        self.self_attn = self.linear_attn = None
        name, mixer = token_mixer(cfg, layer_idx)
        setattr(self, name, mixer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=zc)
        self.mlp = decoder_mlp(cfg, layer_idx)    # dense SwiGLU or experts, per layer
        self.norm_in_mlp = not zc      # the chunked MLP applies post_attention_layernorm inside (Llama's norm)

    @property
    def mixer(self) -> nn.Module:
        """The layer's token mixer (``self_attn`` or ``linear_attn``)."""
        return self.self_attn if self.self_attn is not None else self.linear_attn

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor | None = None, rope: RotaryEmbedding | None = None,
                doc_ids: torch.Tensor | None = None, fpdt_stream: tuple[StreamedRun, int] | None = None,
                router_stats: RouterStatistics | None = None) -> torch.Tensor:
        """``h`` ``[B, S_local, hidden]``, ``position_ids`` ``[B, S_local]`` -> ``[B, S_local, hidden]``;
        ``doc_ids`` ``[B, S]`` (None: one document). With ``fpdt_stream``, ``h`` is the empty token of
        :mod:`fpdt.model.streaming` and input and output are chunks in its host stashes."""
        if fpdt_stream is not None:
            return streamed_layer(self, h, fpdt_stream)
        h = h + self.attention_branch(h, position_ids, rope, doc_ids)
        return h + self.mlp_branch(h, router_stats)

    def attention_branch(self, h: torch.Tensor, position_ids: torch.Tensor, rope: RotaryEmbedding,
                         doc_ids: torch.Tensor | None = None, saved: SavedAttention | None = None) -> torch.Tensor:
        """``mixer(norm(h))``, ending with ``o_proj`` / ``out_proj`` (output not saved; the attention
        applies the norm a chunk at a time inside and, in a checkpoint's backward, adds its input
        gradient into the layer's gradient); ``saved``: the
        saved attention outputs (attention layers only; None for a Gated DeltaNet layer)."""
        if self.linear_attn is not None:
            return self.linear_attn(self.input_layernorm(h), doc_ids=doc_ids)
        return self.self_attn(h, position_ids, rope, doc_ids=doc_ids, saved=saved, norm=self.input_layernorm,
                              donate=donation_check(h))

    def mlp_branch(self, h: torch.Tensor, router_stats: RouterStatistics | None = None,
                   checkpointed: bool = False) -> torch.Tensor:
        """``mlp(norm(h))``, one chunked function with the norm inside (saves ``h`` and an fp32 scale per
        token); a zero-centred norm runs before it as its own module. An MoE MLP records into
        ``router_stats``, under a layer checkpoint (``checkpointed``) not in its recompute."""
        if isinstance(self.mlp, ChunkedMoE):
            record = not (checkpointed and torch.is_grad_enabled())
            if not self.norm_in_mlp:
                return self.mlp(self.post_attention_layernorm(h), stats=router_stats, record=record)
            return self.mlp(h, norm=self.post_attention_layernorm, stats=router_stats, record=record)
        if not self.norm_in_mlp:
            return self.mlp(self.post_attention_layernorm(h))
        return self.mlp(h, norm=self.post_attention_layernorm)


def decoder_mlp(cfg: ModelConfig, i: int) -> nn.Module:
    """Layer ``i``'s MLP: :class:`ChunkedMoE` where the config routes it (:meth:`ModelConfig.is_moe_layer`), else SwiGLU."""
    if not cfg.is_moe_layer(i):
        return ChunkedSwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
    moe = cfg.moe
    mlp = ChunkedMoE(cfg.hidden_size, moe.moe_intermediate_size, moe.num_experts, moe.top_k, moe.norm_topk_prob,
                     shared_intermediate_size=moe.shared_expert_intermediate_size)
    mlp.layer_index = i
    return mlp


class FPDTModel(nn.Module):
    """Embedding, decoder layers and final norm (HF ``LlamaModel``'s names)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else None
        # padding_idx as in Transformers: the pad row gets no gradient.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList(FPDTDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        for i, layer in enumerate(self.layers):
            layer.mixer.stash_label = f"layer {i}"
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norms)
        self._rope_args = (cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        inv_freq, scaling = rope_inv_freq(*self._rope_args)
        self.rotary_emb = RotaryEmbedding(inv_freq, scaling)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute ``rotary_emb.inv_freq`` in fp32 on ``device`` (default: where it is; not on meta)."""
        device = torch.device(device) if device is not None else self.rotary_emb.inv_freq.device
        if device.type != "meta":
            self.rotary_emb.inv_freq = rope_inv_freq(*self._rope_args)[0].to(device)

    def _apply(self, fn, recurse=True):
        # ``model.to(bf16)`` would round inv_freq (positions of long sequences need fp32) and
        # ``to_empty`` leaves it undefined: recompute it after every such move.
        out = super()._apply(fn, recurse)
        self.reset_rope()
        return out


class FPDTForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention, MLP and loss run chunked over the sequence.

    Build it with :func:`fpdt.model.from_pretrained` or :func:`fpdt.model.from_config`; options:
    :class:`fpdt.options.FPDTOptions`, changed later with :meth:`configure`."""

    def __init__(self, config: ModelConfig, options: FPDTOptions | None = None):
        super().__init__()
        self.config = config
        self.options = (options or FPDTOptions()).validate()
        self.options.check_layers(config.num_layers)
        self.model = FPDTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lora = None   # a fpdt.model.lora.LoraSpec once add_lora attached adapters
        self.router_stats: RouterStatistics | None = None   # the last forward's (MoE), for metrics
        self.configure()

    # ------------------------------------------------------------------ options
    def configure(self, **changes) -> "FPDTForCausalLM":
        """Change options (any :class:`FPDTOptions` field) and re-run the apply steps on the layers."""
        opts = self.options.updated(**changes)
        opts.check_layers(self.config.num_layers)
        check_token_mixers(self.config, opts)
        self.options = opts
        apply_all(FPDTAdapter(self), opts)
        return self

    @property
    def mlp_chunks(self) -> int:
        return mlp_chunks_for(self.options, self.config)

    @property
    def loss_chunks(self) -> int:
        return loss_chunks_for(self.options, self.config)

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return sp_group_of(self.options.group, self.options.mesh)

    def sp_rank_size(self) -> tuple[int, int]:
        """``(rank, size)`` in the sequence-parallel group (:func:`fpdt.comm.sp_rank_size`)."""
        return sp_rank_size(self.options.group, self.options.mesh)

    def prepare_inputs(self, input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                       cu_seqlens: torch.Tensor | None = None, shift: bool = True) -> dict[str, torch.Tensor]:
        """:func:`fpdt.model.prepare_inputs` for this SP rank and ``num_chunks``: global ``[B, S]`` -> ``model(**inputs)``."""
        rank, sp = self.sp_rank_size()
        return prepare_inputs(input_ids, labels=labels, position_ids=position_ids, doc_ids=doc_ids,
                              cu_seqlens=cu_seqlens, shift=shift, sp_size=sp, rank=rank,
                              num_chunks=self.options.num_chunks, mesh=self.options.mesh)

    # ------------------------------------------------------------------ weights
    def save_pretrained(self, path, **kwargs) -> None:
        """:func:`fpdt.model.save_pretrained` (a checkpoint ``transformers`` loads)."""
        save_pretrained(self, path, **kwargs)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Transformers' random init (normal linear/embedding weights, zero biases, unit norms) and the RoPE buffer."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
            if isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.zero_centred else 1.0)
            if isinstance(module, MoEExperts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            if isinstance(module, MoERouter):
                module.weight.normal_(0.0, std)
        for layer in self.model.layers:
            if layer.linear_attn is not None:
                init_gated_deltanet(layer.linear_attn, std)
        self.reset_rope()

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the fp32 RoPE buffer (done automatically after ``to``/``to_empty``)."""
        self.model.reset_rope(device)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, doc_ids: torch.Tensor | None = None,
                return_logits: bool = False, num_valid_tokens: int | torch.Tensor | None = None,
                output_router_logits: bool | None = None):
        """Loss of this rank's tokens, normalised by the global valid-token count.

        Args:
            input_ids: ``[B, S_local]`` long, this rank's tokens in the FPDT layout.
            labels: ``[B, S_local]`` long, *already shifted* targets in the same layout (``-100``: ignore).
            position_ids: ``[B, S_local]`` long global positions; may be omitted only without SP.
                Positions restarting at 0 mark packed documents (one all-gather and one host read).
            doc_ids: ``[B, S]`` document ids of the whole global window (non-decreasing, the same on
                every SP rank); they replace the documents the positions mark.
            return_logits: also return fp32 logits ``[B, S_local, V]`` (small inputs only).
            num_valid_tokens: denominator override (e.g. a gradient-accumulation window's count).
            output_router_logits: add ``router_aux_loss_coef`` x the balancing loss over the whole
                sequence (MoE; None: the config's). :attr:`router_stats` keeps the call's statistics.

        Returns ``loss`` (fp32 scalar, ``None`` without labels), or ``(loss, logits)``. Every SP rank
        returns the global mean; parameter gradients *summed* over the SP group are its gradient
        (``docs/model.md``, gradient convention)."""
        B, S_local = input_ids.shape
        rank, sp = self.sp_rank_size()
        positions_given = position_ids is not None
        require_position_ids(position_ids, sp)
        if position_ids is None:
            position_ids = torch.arange(S_local, device=input_ids.device).expand(B, S_local)
        if position_ids.shape != input_ids.shape or (labels is not None and labels.shape != input_ids.shape):
            raise ValueError(f"input_ids {tuple(input_ids.shape)}, labels "
                             f"{None if labels is None else tuple(labels.shape)} and position_ids "
                             f"{tuple(position_ids.shape)} must all be [B, S_local]")
        if self.model.rotary_emb.inv_freq.is_meta:
            raise RuntimeError("the model is still on the meta device: materialise it (to_empty + "
                               "init_weights, or from_pretrained) first")
        if doc_ids is not None:
            doc_ids = canonical_doc_ids(doc_ids.to(input_ids.device), (B, S_local * sp))
        elif positions_given:
            doc_ids = sequence_parallel_doc_ids(position_ids, self.options.num_chunks, group=self.options.group,
                                                mesh=self.options.mesh)    # [B, S] or None (one document)
        moe = self.config.moe
        stats = None if moe is None else RouterStatistics(moe.num_experts, moe.top_k, group=self.sp_group)
        self.router_stats = stats
        with_aux = stats is not None and labels is not None and (
            moe.output_router_logits if output_router_logits is None else output_router_logits)
        if self.options.stream_layers:
            if return_logits:
                raise ValueError("return_logits materialises [B, S_local, V] logits, and stream_layers keeps every "
                                 "full-length tensor off the device: call with stream_layers=False to get logits")
            spec = StreamedModel(self.options, self.loss_chunks, self.model.rotary_emb.cos_sin, self._checkpoints,
                                 stats, moe.router_aux_loss_coef if with_aux else None)
            return streamed_loss(self, spec, input_ids, labels, position_ids, doc_ids, num_valid_tokens, sp,
                                 self.sp_group)
        h = self._decoder(input_ids, position_ids, doc_ids, stats)         # [B, S_local, hidden]
        aux = None
        if with_aux:
            h, aux = balancing_loss(h, stats)                               # its backward runs before the layers'
        loss = None if labels is None else self._loss(h, labels, num_valid_tokens, sp)
        if aux is not None:
            loss = loss + moe.router_aux_loss_coef * aux
        if return_logits:
            return loss, self.lm_head(h).float()
        return loss

    def _decoder(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 doc_ids: torch.Tensor | None, stats: RouterStatistics | None = None) -> torch.Tensor:
        rope = self.model.rotary_emb
        h = self.model.embed_tokens(input_ids)
        checkpoints = self._checkpoints
        for i, layer in enumerate(self.model.layers):
            if not checkpoints.enabled:
                h = layer(h, position_ids, rope, doc_ids, router_stats=stats)
                continue

            def branches(saved, layer=layer):
                return (functools.partial(layer.attention_branch, position_ids=position_ids, rope=rope,
                                          doc_ids=doc_ids, saved=saved),
                        functools.partial(layer.mlp_branch, router_stats=stats, checkpointed=True))
            h = checkpoints.checkpointed_layer(i, h, branches, list(layer.parameters()))
        return self.model.norm(h)

    @property
    def saving_layers(self) -> int:
        """How many first decoder layers keep their attention output for the recompute (0 with ``"recompute"``)."""
        return self._checkpoints.saving

    @property
    def _stash(self) -> HostStash | None:
        """The host stash of the offloaded layer inputs (None until an offloading forward made it)."""
        return self._checkpoints.stash

    def _loss(self, h: torch.Tensor, labels: torch.Tensor, num_valid_tokens, sp: int) -> torch.Tensor:
        return sequence_parallel_lm_loss(h, self.lm_head.weight, labels, group=self.sp_group, sp=sp,
                                         num_chunks=loss_chunks_for(self.options, self.config, h.shape[0] * h.shape[1]),
                                         wgrad=self.options.lm_head_wgrad,
                                         num_valid_tokens=num_valid_tokens)

    def extra_repr(self) -> str:
        o = self.options
        return (f"num_chunks={o.num_chunks}, offload={o.offload}, mlp_chunks={self.mlp_chunks}, "
                f"loss_chunks={self.loss_chunks}, lm_head_wgrad={o.lm_head_wgrad!r}, checkpointing={o.checkpointing!r}"
                + (f", checkpoint_device_layers={o.checkpoint_device_layers}" if o.checkpoint_device_layers else "")
                + (f", attention_checkpoint='save', saving_layers={self.saving_layers}"
                   if o.attention_checkpoint == "save" else ""))


@torch.no_grad()
def init_gated_deltanet(gdn: nn.Module, std: float) -> None:
    """Transformers' init of a Gated DeltaNet's own parameters: normal conv weight, ``dt_bias`` 1,
    ``A_log = log(U(0.01, 16))``, gated-norm weight 1 (its projections are ``nn.Linear``)."""
    gdn.conv1d.weight.normal_(0.0, std)
    gdn.dt_bias.fill_(1.0)
    gdn.A_log.copy_(torch.empty_like(gdn.A_log, dtype=torch.float32).uniform_(0.01, 16).log_())
    gdn.norm.weight.fill_(1.0)


def check_token_mixers(cfg: ModelConfig, options: FPDTOptions) -> None:
    """Raise the first of :func:`fpdt.model.apply.token_mixer_problems` for ``cfg``."""
    for problem in token_mixer_problems(cfg.has_linear_attention, options):
        raise ValueError(problem)


class FPDTAdapter(DecoderAdapter):
    """:class:`FPDTForCausalLM` for the apply steps: options set as module attributes on every ``configure``."""

    def __init__(self, model: FPDTForCausalLM):
        self.model = model
        self.config = model.config
        self.layers = list(model.model.layers)

    def norms(self) -> list[nn.Module]:
        return [m for m in self.model.modules() if isinstance(m, RMSNorm)]

    def set_layer_checkpoints(self, checkpoints: LayerCheckpoints) -> None:
        self.model._checkpoints = checkpoints      # the decoder loop of FPDTForCausalLM._decoder

    def set_loss_chunks(self, num_chunks: int) -> None:
        pass        # the forward reads FPDTForCausalLM.loss_chunks, the same count (loss_chunks_for)

    def layer_checkpoints(self) -> LayerCheckpoints | None:
        return getattr(self.model, "_checkpoints", None)

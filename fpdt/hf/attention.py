"""FPDT attention as a Transformers attention implementation.

Transformers models that follow its ``AttentionInterface`` (Llama, Qwen2, Mistral and most
decoder-only models of transformers >= 4.48) project and rotate q/k/v themselves, then
call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with

* ``query`` ``[B, H, S_local, D]``, ``key``/``value`` ``[B, H_kv, S_local, D]`` (after RoPE,
  with the position ids the caller passed: global positions in the FPDT layout), and
* ``attention_mask``: what ``ALL_MASK_ATTENTION_FUNCTIONS[...]`` built for the same name.

:func:`register_settings` registers, under one name, an attention function that runs
:func:`fpdt.attention.fpdt_attention` (Ulysses all-to-all, chunked online-softmax
attention, optional host offload; or the 2D mesh) and returns ``[B, S_local, H, D]``, and a
mask function that builds no mask (the attention is causal over the whole global window)
and refuses a padding mask that hides any token, which fpdt cannot honour. Anything else
the model passes that would change the result (dropout during training, a sliding window,
a KV cache) is refused with the fix rather than ignored.

With ``chunked_qkv`` (the default), Llama, Mistral, Qwen2 and Qwen3 attention modules are replaced
by :class:`TransformersAttention`: fpdt's own :class:`fpdt.attention.FPDTAttention` (the one
:class:`fpdt.model.FPDTForCausalLM` runs) holding the module's projections under their names,
called as Transformers calls its attention.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from fpdt.attention import FPDTAttention, fpdt_attention
from fpdt.hf.errors import FPDTHFError
from fpdt.hf.groups import resolve_group
from fpdt.hf.patches import Patches
from fpdt.ops.projections import ProjectionError, read_projections
from fpdt.options import FPDTOptions

_names = itertools.count()

O_PROJ_FROM_STASH = "fpdt_o_proj_from_stash"
"""The keyword argument :func:`fpdt.hf.forward.causal_lm_forward` passes to every attention call
with :func:`o_proj_stash_layers`' answer (absent: no layer's ``o_proj`` reads from the stash)."""


def _refuse_unhonoured(module: torch.nn.Module, name: str, attention_mask, dropout: float,
                       sliding_window: int | None, kwargs: dict) -> None:
    """Raise for anything a Transformers attention call asks that fpdt attention would ignore."""
    if attention_mask is not None:
        raise FPDTHFError(f"attention implementation {name!r} got an attention mask; fpdt attention is "
                          f"causal over the whole sequence and takes none (right padding labelled -100 is "
                          f"exact without it: pass the window's mask to fpdt.hf.prepare_inputs)")
    if dropout:
        raise FPDTHFError(f"attention dropout {dropout} is not supported by fpdt attention: set the "
                          f"config's attention_dropout to 0")
    if sliding_window is not None:
        raise FPDTHFError(f"sliding-window attention (window {sliding_window}) is not supported by fpdt "
                          f"attention: disable the config's sliding window (use_sliding_window=False)")
    ignored = sorted(k for k in ("cu_seq_lens_q", "cu_seq_lens_k", "softcap", "s_aux", "sinks")
                     if kwargs.get(k) is not None)
    if ignored:
        raise FPDTHFError(f"fpdt attention cannot honour {', '.join(ignored)} (packed sequences, logit "
                          f"soft-capping or attention sinks): use another attention implementation")
    if not getattr(module, "is_causal", True):
        raise FPDTHFError(f"{type(module).__name__} is not causal; fpdt attention is causal only")


def _attention(settings: FPDTOptions, name: str):
    def fpdt_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                               scaling: float | None = None, dropout: float = 0.0,
                               sliding_window: int | None = None, **kwargs):
        _refuse_unhonoured(module, name, attention_mask, dropout, sliding_window, kwargs)
        if query.dim() != 4 or key.dim() != 4:
            raise FPDTHFError(f"expected query [B, H, S, D] and key [B, H_kv, S, D], got {tuple(query.shape)} "
                              f"and {tuple(key.shape)}")
        out = fpdt_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                             group=resolve_group(settings.group), mesh=settings.mesh,
                             num_chunks=settings.num_chunks,
                             offload=settings.offload, causal=True, softmax_scale=scaling,
                             backend=settings.backend, doc_ids=kwargs.get("doc_ids"),
                             saved=kwargs.get("fpdt_saved"), runtime=settings.runtime)
        return out, None                                               # [B, S_local, H, D], no weights

    return fpdt_attention_forward


def plain_linears(*modules: torch.nn.Module) -> bool:
    """Functions that read ``.weight``/``.bias`` directly are exact only for a plain
    ``nn.Linear`` (not a PEFT/LoRA wrapper, a quantised linear, ...), which computes nothing else."""
    return all(type(m) is torch.nn.Linear for m in modules)


def _no_window(module: torch.nn.Module) -> None:
    return None


def _chunked_qkv_classes() -> dict[type, Callable[[torch.nn.Module], int | None]]:
    """Transformers attention classes whose forward is exactly: q/k/v ``nn.Linear``
    projections (Qwen3: then an RMSNorm of q and k per head), RoPE from
    ``position_embeddings``, attention, ``o_proj`` (so :func:`chunked_qkv_attention_forward`
    may replace it), each with the sliding window its own forward would pass to the attention
    (Qwen2, Qwen3: per layer; Mistral: the config's; Llama: none). Matched by class, not name:
    a remote-code class of the same name is not these."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

    return {LlamaAttention: _no_window, Qwen3MoeAttention: lambda m: m.sliding_window,
            MistralAttention: lambda m: getattr(m.config, "sliding_window", None),
            Qwen2Attention: lambda m: m.sliding_window,
            Qwen3Attention: lambda m: m.sliding_window}


def _qk_norm(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of Qwen3's per-head q/k RMSNorms (read directly: refused unless Transformers' own
    class, with one epsilon); none for other classes."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeRMSNorm

    if type(module) not in (Qwen3Attention, Qwen3MoeAttention):
        return ()
    q, k = module.q_norm, module.k_norm
    if not (type(q) in (Qwen3RMSNorm, Qwen3MoeRMSNorm) and type(k) in (Qwen3RMSNorm, Qwen3MoeRMSNorm)):
        raise FPDTHFError(f"the chunked q/k/v projection reads Qwen3Attention's q_norm/k_norm weights directly, and "
                          f"they are {type(q).__name__}, {type(k).__name__}: apply_fpdt(..., chunked_qkv=False)")
    if q.variance_epsilon != k.variance_epsilon:
        raise FPDTHFError("q_norm and k_norm have different epsilons: apply_fpdt(..., chunked_qkv=False)")
    return "q_norm", "k_norm"


def check_chunked_qkv(module: torch.nn.Module) -> tuple[int | None, tuple[str, ...]]:
    """Refuse, naming the fix, an attention module that :class:`TransformersAttention` would
    compute differently; else return the sliding window its own forward would pass and the names
    of Qwen3's q/k norms (:func:`_qk_norm`)."""
    kind = type(module).__name__
    known = _chunked_qkv_classes()
    if type(module) not in known:
        names = ", ".join(f"{c.__module__}.{c.__name__}" for c in known)
        raise FPDTHFError(f"the chunked q/k/v projection replaces the attention of {names} only; "
                          f"{type(module).__module__}.{kind} may compute something else around it (q/k norms, "
                          f"fused projections, ...): apply_fpdt(..., chunked_qkv=False)")
    try:
        read_projections({n: getattr(module, n) for n in ("q_proj", "k_proj", "v_proj")}, kind,
                         TransformersAttention.projection_fix, module.training)
    except ProjectionError as e:
        raise FPDTHFError(str(e)) from None
    return known[type(module)](module), _qk_norm(module)


def o_proj_stash_layers(layers: list[torch.nn.Module], options: FPDTOptions) -> frozenset[int]:
    """The ``layer_idx`` of the decoder ``layers`` whose ``o_proj`` reads its input back from the
    attention's stash in this forward: with ``offload`` and no layer checkpoint, neither fpdt's
    (``checkpointing="off"``) nor Transformers' own on that layer (its ``gradient_checkpointing`` in
    training). Under a checkpoint the layer keeps nothing to backward anyway."""
    if not (options.offload and options.checkpointing == "off" and torch.is_grad_enabled()):
        return frozenset()
    return frozenset(layer.self_attn.layer_idx for layer in layers
                     if not (getattr(layer, "gradient_checkpointing", False) and layer.training))


class TransformersAttention(FPDTAttention):
    """:class:`fpdt.attention.FPDTAttention` holding a Transformers attention module's projections
    (and Qwen3's q/k norms) under their names, so ``state_dict`` keys do not change; called as a
    Transformers decoder layer calls its attention, ``(hidden_states, position_embeddings=(cos, sin),
    **kwargs) -> (output, None)``. RoPE is the model's own tables, sliced per chunk. The call's
    ``doc_ids``, ``fpdt_saved`` and :data:`O_PROJ_FROM_STASH` keyword arguments come from
    :func:`fpdt.hf.forward.causal_lm_forward` and the layer checkpoint; whatever else would change
    the result is refused. ``group`` may be a :class:`fpdt.hf.groups.TrainerGroup`, resolved per call."""

    projection_fix = "apply_fpdt(..., chunked_qkv=False)"

    @classmethod
    def adopt(cls, module: torch.nn.Module, implementation: str) -> "TransformersAttention":
        """The replacement of ``module`` (refused by :func:`check_chunked_qkv`, naming the fix)."""
        window, norms = check_chunked_qkv(module)
        cfg = module.config
        self = cls.from_projections({n: getattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj") + norms},
                                    cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim, module.scaling)
        self.layer_idx, self.config, self.is_causal = module.layer_idx, cfg, getattr(module, "is_causal", True)
        self.attention_dropout, self.sliding_window = module.attention_dropout, window
        self.implementation, self.stash_label = implementation, f"layer {module.layer_idx}"
        return self.train(module.training)

    @property
    def group(self):
        return resolve_group(self._group)

    @group.setter
    def group(self, group) -> None:
        self._group = group

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        if past_key_values is not None:
            raise FPDTHFError("fpdt attention keeps no KV cache: call the model with use_cache=False and no "
                              "past_key_values")
        dropout = self.attention_dropout if self.training else 0.0
        _refuse_unhonoured(self, self.implementation, attention_mask, dropout, self.sliding_window, kwargs)
        if position_embeddings is None:
            raise FPDTHFError(f"{type(self).__name__} was called without position_embeddings (cos, sin); the "
                              f"chunked q/k/v projection applies the model's RoPE from them")
        from_stash = self.layer_idx in kwargs.get(O_PROJ_FROM_STASH, ())
        out = super().forward(hidden_states, doc_ids=kwargs.get("doc_ids"), saved=kwargs.get("fpdt_saved"),
                              cos_sin=position_embeddings, o_proj_from_stash=from_stash)
        return out, None


def _mask(name: str):
    def fpdt_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
        if q_offset or kv_offset:
            raise FPDTHFError(f"attention implementation {name!r} does not support a KV cache (generation): "
                              f"call the model with use_cache=False, or generate with another implementation")
        if kv_length != q_length:
            raise FPDTHFError(f"the attention mask covers {kv_length} tokens but this rank holds {q_length}: "
                              f"fpdt attention takes no mask; pass the window's mask to fpdt.hf.prepare_inputs "
                              f"(right padding labelled -100 is checked there) instead of to the model")
        # One host read per forward pass (not per chunk): a mask that hides nothing is dropped.
        if attention_mask is not None and not bool(attention_mask.all()):
            raise FPDTHFError(f"attention implementation {name!r} cannot apply a padding mask: fpdt attention "
                              f"is causal over the whole window; pass the window's right-padding mask to "
                              f"fpdt.hf.prepare_inputs (checked there; padding labelled -100) instead of to the "
                              f"model")
        return None

    return fpdt_mask


def register_settings(settings: FPDTOptions, patches: Patches) -> str:
    """Register fpdt attention and its mask function in Transformers under a new name
    (``fpdt-0``, ``fpdt-1``, ...) and return it; ``patches`` records both entries, so that
    :func:`fpdt.hf.remove_fpdt` takes them out. The attention reads ``group``, ``mesh``,
    ``num_chunks``, ``offload``, ``backend`` and ``runtime`` of ``settings``; a ``group`` may be
    a :class:`fpdt.hf.groups.TrainerGroup`, looked up at each call."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(f"fpdt.hf needs transformers with AttentionInterface and AttentionMaskInterface "
                          f"(tested with 5.23; pip install -U transformers): {e}") from e
    name = f"fpdt-{next(_names)}"
    patches.register(AttentionInterface, name, _attention(settings, name))
    patches.register(AttentionMaskInterface, name, _mask(name))
    return name

"""FPDT attention as a Transformers attention implementation (``AttentionInterface``).

:func:`register_settings` registers an attention function that runs
:func:`fpdt.attention.fpdt_attention` on the rotated ``query`` ``[B, H, S_local, D]`` and
``key``/``value`` ``[B, H_kv, S_local, D]`` and returns ``[B, S_local, H, D]``, and a mask
function that builds none (causal over the global window) and refuses a mask hiding any token;
dropout, sliding windows and a KV cache are refused with the fix. With ``chunked_qkv`` (the
default) known attention classes become :class:`TransformersAttention`, fpdt's own
:class:`fpdt.attention.FPDTAttention` holding the module's projections (``docs/hf.md``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from fpdt.attention import FPDTAttention, fpdt_attention
from fpdt.attention.module import norm_eps
from fpdt.hf.errors import FPDTHFError
from fpdt.hf.groups import resolve_group
from fpdt.hf.patches import Patches
from fpdt.ops.projections import ProjectionError, read_projections
from fpdt.options import FPDTOptions

_names = itertools.count()


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
    from transformers.models.mixtral.modeling_mixtral import MixtralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

    config_window = lambda m: getattr(m.config, "sliding_window", None)  # noqa: E731
    return {LlamaAttention: _no_window, Qwen3MoeAttention: lambda m: m.sliding_window,
            MistralAttention: config_window, MixtralAttention: config_window,
            Qwen2Attention: lambda m: m.sliding_window,
            Qwen3Attention: lambda m: m.sliding_window,
            **dict.fromkeys(_gated_attention_classes(), _no_window)}


def _gated_attention_classes() -> dict[type, type]:
    """Transformers' gated attention classes (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: the same forward) -> their q/k norm class."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeAttention, Qwen3_5MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRMSNorm

    return {Qwen3_5Attention: Qwen3_5RMSNorm, Qwen3_5MoeAttention: Qwen3_5MoeRMSNorm,
            Qwen3NextAttention: Qwen3NextRMSNorm}


def _qk_norm(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of Qwen3's and Qwen3.5's per-head q/k RMSNorms (read directly: refused unless
    Transformers' own class, with one epsilon); none for other classes."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeRMSNorm

    norm_class = {Qwen3Attention: Qwen3RMSNorm, Qwen3MoeAttention: Qwen3MoeRMSNorm,
                  **_gated_attention_classes()}.get(type(module))
    if norm_class is None:
        return ()
    q, k = module.q_norm, module.k_norm
    if not (type(q) is norm_class and type(k) is norm_class):
        raise FPDTHFError(f"the chunked q/k/v projection reads {type(module).__name__}'s q_norm/k_norm weights "
                          f"directly, and they are {type(q).__name__}, {type(k).__name__}: "
                          f"apply_fpdt(..., chunked_qkv=False)")
    if norm_eps(q) != norm_eps(k):
        raise FPDTHFError("q_norm and k_norm have different epsilons: apply_fpdt(..., chunked_qkv=False)")
    return "q_norm", "k_norm"


def _gated_options(module: torch.nn.Module) -> dict:
    """Qwen3.5's attention options of :class:`FPDTAttention` (output gate, partial rotary,
    zero-centred q/k norms); none for other classes."""
    if type(module) not in _gated_attention_classes():
        return {}
    params = getattr(module.config, "rope_parameters", None) or {}
    factor = float(params.get("partial_rotary_factor", getattr(module.config, "partial_rotary_factor", 1.0)))
    rotary = int(module.head_dim * factor)
    return dict(output_gate=True, rotary_dim=rotary if rotary != module.head_dim else None, qk_norm_zero_centred=True)


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


class TransformersAttention(FPDTAttention):
    """:class:`fpdt.attention.FPDTAttention` holding a Transformers attention module's projections
    (and Qwen3's q/k norms) under their names, so ``state_dict`` keys do not change; called as a
    Transformers decoder layer calls its attention, ``(hidden_states, position_embeddings=(cos, sin),
    **kwargs) -> (output, None)``. RoPE is the model's own tables, sliced per chunk. The call's
    ``doc_ids`` and ``fpdt_saved`` keyword arguments come from
    :func:`fpdt.hf.forward.causal_lm_forward` and the layer checkpoint; whatever else would change
    the result is refused. ``group`` may be a :class:`fpdt.hf.groups.TrainerGroup`, resolved per call."""

    projection_fix = "apply_fpdt(..., chunked_qkv=False)"

    @classmethod
    def adopt(cls, module: torch.nn.Module, implementation: str) -> "TransformersAttention":
        """The replacement of ``module`` (refused by :func:`check_chunked_qkv`, naming the fix)."""
        window, norms = check_chunked_qkv(module)
        cfg = module.config
        self = cls.from_projections({n: getattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj") + norms},
                                    cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim, module.scaling,
                                    **_gated_options(module))
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
                past_key_values=None, *, norm: torch.nn.Module | None = None, donate=None, **kwargs):
        """``norm`` and ``donate``: as :meth:`fpdt.attention.FPDTAttention.forward` takes them (fpdt's
        residual branch hands the layer's input RMSNorm in; Transformers' own layer forward does not)."""
        if past_key_values is not None or kwargs.get("cache") is not None:
            raise FPDTHFError("fpdt attention keeps no KV cache: call the model with use_cache=False and no "
                              "past_key_values")
        dropout = self.attention_dropout if self.training else 0.0
        _refuse_unhonoured(self, self.implementation, attention_mask, dropout, self.sliding_window, kwargs)
        if position_embeddings is None:
            raise FPDTHFError(f"{type(self).__name__} was called without position_embeddings (cos, sin); the "
                              f"chunked q/k/v projection applies the model's RoPE from them")
        out = super().forward(hidden_states, doc_ids=kwargs.get("doc_ids"), saved=kwargs.get("fpdt_saved"),
                              cos_sin=position_embeddings, norm=norm, donate=donate)
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

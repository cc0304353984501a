"""The model configuration, parsed from a Hugging Face ``config.json`` and validated.

Only what the FPDT model implements exactly is accepted; anything else (sliding windows, unknown
RoPE scaling, non-SiLU activations, attention dropout, partial rotary outside Qwen3.5, ...) raises
:class:`UnsupportedConfigError` naming the key. Both the Transformers 4.x (``rope_theta`` +
``rope_scaling``) and 5.x (``rope_parameters``) layouts are understood. Hybrid models (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet and gated attention layers, ``layer_types``) and the hub's
vision-language layouts are read by the token-mixer section at the end, experts (Qwen3-MoE,
Qwen3.5-MoE, Qwen3-Next, Mixtral) by :func:`_moe` (``docs/models.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

# model_type -> the Transformers class a saved checkpoint should name in "architectures".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

# Vision-language hub layouts whose text model fpdt trains alone: model_type -> (its class, where
# the text decoder's tensors live in its checkpoints, the text model_type).
CONDITIONAL_LAYOUTS = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "model.language_model", "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "model.language_model", "qwen3_5_moe_text"),
}

# Token mixers of ``layer_types``: softmax attention or Gated DeltaNet (arXiv 2412.06464).
ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"

# Hybrid families refused, each with what fpdt lacks for it (docs/models.md).
REFUSED_HYBRIDS = {
    "olmo_hybrid": "OLMo hybrid needs post-norm decoder layers (a norm after each mixer and MLP, none before), "
                   "q/k RMSNorm over all heads and allow_neg_eigval (beta in [0, 2]), none implemented",
    "kimi_linear": "Kimi Linear's KDA has per-channel gates (fpdt's Gated DeltaNet has one gate per head) "
                   "and MLA attention layers, neither implemented",
}

log = logging.getLogger(__name__)

# RoPE types the model computes exactly (see fpdt.model.rope_scaling).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedConfigError(ValueError):
    """A ``config.json`` asks for something the FPDT model cannot honour."""


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a config (Qwen3-MoE's keys); :meth:`is_moe_layer` says which layers route."""

    num_experts: int
    top_k: int
    """``num_experts_per_tok``."""
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    router_aux_loss_coef: float
    output_router_logits: bool
    shared_expert_intermediate_size: int = 0

    def is_moe_layer(self, i: int) -> bool:
        """Transformers' rule: not in ``mlp_only_layers``, experts exist and ``(i + 1) % decoder_sparse_step == 0``."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family causal LM (Llama 2/3/3.1/3.2, Qwen2/2.5, Mistral), built with
    :meth:`from_hf`; the original dict is kept in ``hf_config`` so saving writes back a config
    ``transformers`` loads unchanged.
    """

    model_type: str
    """A key of :data:`ARCHITECTURES` (``"llama"``, ``"qwen2"``, ``"mistral"``, ...)."""
    vocab_size: int
    """V, rows of the embedding and of the LM head."""
    hidden_size: int
    """Model width (the letter ``hidden`` in shapes)."""
    intermediate_size: int
    """SwiGLU inner width I."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads H."""
    num_kv_heads: int
    """Key/value heads H_kv (GQA when < H); divides H."""
    head_dim: int
    """Per-head width D (may differ from hidden / H, e.g. Mistral-Nemo)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base."""
    rope_scaling: Mapping[str, Any] | None
    """``None`` for plain RoPE, else the scaling dict with a ``rope_type`` in
    :data:`SUPPORTED_ROPE_TYPES` other than ``"default"``."""
    max_position_embeddings: int
    """Context length the checkpoint declares (informational: FPDT trains past it)."""
    tie_word_embeddings: bool
    """LM head shares the embedding matrix."""
    qkv_bias: bool
    """q/k/v projections have biases (Qwen2; Llama with ``attention_bias``)."""
    o_bias: bool
    """Output projection has a bias (Llama with ``attention_bias``)."""
    mlp_bias: bool
    """gate/up/down projections have biases (Llama with ``mlp_bias``)."""
    pad_token_id: int | None = None
    """Embedding row that gets no gradient (``padding_idx``, as in Transformers)."""
    initializer_range: float = 0.02
    """Std of the normal init used by :func:`fpdt.model.from_config`."""
    # -- token mixers (hybrid models, Qwen3.5); the defaults are the Llama family's --
    layer_types: tuple[str, ...] | None = None
    """Per-layer token mixer, ``"full_attention"`` or ``"linear_attention"`` (Gated DeltaNet); None: all attention."""
    linear_num_key_heads: int = 0
    """Gated DeltaNet key heads Hk (0: no such layers)."""
    linear_num_value_heads: int = 0
    """Gated DeltaNet value heads HV (a multiple of Hk)."""
    linear_key_head_dim: int = 0
    """Gated DeltaNet dk."""
    linear_value_head_dim: int = 0
    """Gated DeltaNet dv."""
    linear_conv_kernel_dim: int = 0
    """Gated DeltaNet causal depthwise conv kernel."""
    attn_output_gate: bool = False
    """``q_proj`` also gives a per-head gate: ``o * sigmoid(gate)`` before ``o_proj``."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k (``q_norm`` / ``k_norm``)."""
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first ``rotary_dim = int(head_dim * factor)`` channels of each head."""
    zero_centred_norms: bool = False
    """RMSNorms compute ``x_hat * (1 + weight)`` (weights stored zero-centred)."""
    linear_fused_projections: bool = False
    """Gated DeltaNet projections stored as Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head)."""
    text_prefix: str = "model"
    """Where the decoder's tensors live in the checkpoint read: ``model``, or ``model.language_model``
    for a vision-language layout (its vision tower is left out)."""
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The ``config.json`` dict this was parsed from (written back on save)."""
    moe: MoEConfig | None = None
    """Experts in (some) MLPs (:data:`MOE_TYPES`), else None."""

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(i)

    @property
    def mlp_flop_width(self) -> float:
        """The SwiGLU width whose ``6 h I`` FLOPs per token equal a layer's MLP, averaged over layers:
        ``I`` for a dense layer; ``k I_moe`` + the shared expert's width + ``E / 3`` (the router's
        ``2 h E``) for an MoE layer (k of E experts run per token)."""
        moe = self.moe
        if moe is None:
            return self.intermediate_size
        routed = moe.top_k * moe.moe_intermediate_size + moe.shared_expert_intermediate_size + moe.num_experts / 3
        return sum(routed if self.is_moe_layer(i) else self.intermediate_size
                   for i in range(self.num_layers)) / self.num_layers

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @property
    def rotary_dim(self) -> int:
        """Channels of each head RoPE rotates (``head_dim`` unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i: int) -> str:
        """Layer ``i``'s token mixer (:data:`ATTENTION` or :data:`LINEAR_ATTENTION`)."""
        return ATTENTION if self.layer_types is None else self.layer_types[i]

    @property
    def has_linear_attention(self) -> bool:
        return self.layer_types is not None and LINEAR_ATTENTION in self.layer_types

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any) -> "ModelConfig":
        """Parse and validate a Hugging Face config.

        Args:
            hf: a ``config.json`` dict, a path to a ``config.json`` or to a checkpoint
                directory, or any object with ``to_dict()`` (a ``transformers`` config).
        """
        if isinstance(hf, (str, os.PathLike)):
            path = os.fspath(hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                hf = json.load(f)
        elif not isinstance(hf, Mapping):
            if not hasattr(hf, "to_dict"):
                raise TypeError(f"expected a config dict, path or object with to_dict(), got {type(hf).__name__}")
            hf = hf.to_dict()
        text, prefix = _text_config(dict(hf))
        cfg = _parse(text)
        return cfg if prefix is None else dataclasses.replace(cfg, text_prefix=prefix)

    def to_hf(self, dtype_name: str | None = None) -> dict[str, Any]:
        """The ``config.json`` dict to save (the original one, with architectures/dtype filled in)."""
        out = dict(self.hf_config)
        out["model_type"] = self.model_type
        if not out.get("architectures"):
            out["architectures"] = [ARCHITECTURES[self.model_type]]
        if dtype_name is not None:
            out["dtype"] = dtype_name
            out.pop("torch_dtype", None)
        return out


def _require(hf: Mapping[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise UnsupportedConfigError(f"config.json has no {key!r}; it is required")
    return hf[key]


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise UnsupportedConfigError(message)


def _model_type(hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type is None:
        by_arch = {v: k for k, v in ARCHITECTURES.items()}
        known = [by_arch[a] for a in archs if a in by_arch]
        model_type = known[0] if known else None
    if model_type not in ARCHITECTURES:
        raise UnsupportedConfigError(
            f"model_type={model_type!r} (architectures={archs}) is not supported; "
            f"supported: {sorted(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())})")
    unknown = [a for a in archs if a != ARCHITECTURES[model_type]]
    _refuse(bool(unknown), f"architectures={archs} is not {ARCHITECTURES[model_type]!r}; only causal LMs are supported")
    return model_type


def _rope(hf: Mapping[str, Any], partial_ok: bool = False) -> tuple[float, dict[str, Any] | None]:
    """-> (theta, scaling dict or None). Accepts both the 4.x and the 5.x layout; ``partial_ok``: a
    model whose ``partial_rotary_factor`` and text-only multimodal RoPE are read (:func:`_rotary_fraction`)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    if params is not None and scaling is not None and dict(params) != dict(scaling):
        raise UnsupportedConfigError(
            f"config.json has both rope_parameters={params} and rope_scaling={scaling}; keep one")
    params = dict(params if params is not None else (scaling or {}))
    _refuse(any(isinstance(v, Mapping) for v in params.values()),
            f"per-layer-type rope_parameters={params} are not supported")
    theta = params.pop("rope_theta", None)
    theta = float(theta if theta is not None else hf.get("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial_ok:
        partial = None
        for key in ("mrope_section", "mrope_interleaved"):   # text positions: the same in all three sections
            params.pop(key, None)
    _refuse(partial is not None and float(partial) != 1.0,
            f"partial_rotary_factor={partial} is not supported (only full-width RoPE)")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfigError(
            f"rope scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}); "
            f"it would change the positional encoding, so the model refuses rather than ignoring it")
    if rope_type == "default":
        _refuse(bool(params), f"RoPE type 'default' with extra parameters {params} is not understood")
        return theta, None
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[rope_type]
    missing = [k for k in required if params.get(k) is None]
    _refuse(bool(missing), f"rope_type={rope_type!r} needs {missing} in its parameters, got {params}")
    out = {"rope_type": rope_type}
    for k in required:
        out[k] = float(params.pop(k))
    if rope_type == "llama3":
        # Transformers falls back to max_position_embeddings when the original length is absent.
        orig = params.pop("original_max_position_embeddings", None) or hf.get("max_position_embeddings")
        _refuse(orig is None, "rope_type='llama3' needs original_max_position_embeddings")
        out["original_max_position_embeddings"] = int(orig)
        _refuse(out["high_freq_factor"] == out["low_freq_factor"],
                f"llama3 RoPE needs high_freq_factor != low_freq_factor, got {params}")
    params.pop("original_max_position_embeddings", None)  # harmless for 'linear'
    _refuse(bool(params), f"rope_type={rope_type!r} has parameters this model does not implement: {params}")
    return theta, out


def uses_sliding_window(hf: Mapping[str, Any]) -> bool:
    """Whether a Transformers config (as a dict) makes any layer attend through a sliding window."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or []
    if hf.get("model_type") == "qwen2":
        # Qwen2 only uses the window when use_sliding_window is true (Qwen2.5 configs
        # carry a window value with use_sliding_window=false).
        return (bool(hf.get("use_sliding_window")) and window is not None) or \
            any(t != ATTENTION for t in layer_types)
    if hf.get("model_type") in ("mistral", "mixtral"):
        return window is not None
    return bool(hf.get("use_sliding_window")) or any(t not in (ATTENTION, LINEAR_ATTENTION) for t in layer_types)


def _sliding_window(hf: Mapping[str, Any], model_type: str) -> None:
    _refuse(uses_sliding_window({**hf, "model_type": model_type}),
            f"sliding-window attention (sliding_window={hf.get('sliding_window')}, use_sliding_window="
            f"{hf.get('use_sliding_window')}, layer_types={hf.get('layer_types')}) is not supported: "
            f"FPDT attention is full causal. To train with full attention anyway, set "
            f"\"sliding_window\": null in config.json (this changes the model for sequences "
            f"longer than the window)")


def _parse(hf: dict[str, Any]) -> ModelConfig:
    model_type = _model_type(hf)
    hidden = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    _refuse(hf.get("head_dim") is None and hidden % heads != 0,
            f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and no head_dim is given")
    _refuse(heads % kv_heads != 0, f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
    _refuse(head_dim % 2 != 0, f"head_dim={head_dim} must be even for RoPE")
    act = hf.get("hidden_act", "silu")
    _refuse(act != "silu", f"hidden_act={act!r} is not supported (only 'silu' for SwiGLU)")
    dropout = float(hf.get("attention_dropout") or 0.0)
    _refuse(dropout != 0.0, f"attention_dropout={dropout} is not supported (FPDT attention has no dropout)")
    for key in ("mlp_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
        _refuse(float(hf.get(key) or 0.0) != 0.0, f"{key}={hf.get(key)} is not supported (no dropout)")
    _sliding_window(hf, model_type)
    theta, scaling = _rope(hf, partial_ok=model_type in HYBRID_TYPES)
    if model_type == "llama":
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    elif model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False   # hard-wired in Qwen2's attention
    elif model_type == "qwen3_moe":
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = False
    else:
        qkv_bias = o_bias = mlp_bias = False
    # Qwen3.5-MoE has no dense layers (and no intermediate_size); Mixtral's is the experts' width
    dense = model_type in ("qwen3_5_moe_text", "mixtral")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size") or 0) if dense else int(_require(hf, "intermediate_size")),
        num_layers=int(_require(hf, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        pad_token_id=None if hf.get("pad_token_id") is None else int(hf["pad_token_id"]),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        hf_config=hf,
        moe=_moe(hf, model_type) if model_type in MOE_TYPES else None,
        **(_token_mixers(hf, heads, head_dim, model_type) if model_type in HYBRID_TYPES else
           {"qk_norm": model_type == "qwen3_moe"}),
    )


# ---------------------------------------------------------------- token mixers (hybrid models)

HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
"""Model types with per-layer token mixers (:func:`_token_mixers`)."""
MOE_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "qwen3_next", "mixtral")
"""Model types whose MLPs are (some or all) mixtures of experts (:func:`_moe`)."""


def _text_config(hf: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A vision-language hub layout (:data:`CONDITIONAL_LAYOUTS`) -> (its text config, where its tensors
    live), the vision tower left out (one log line); refused hybrid families (:data:`REFUSED_HYBRIDS`)
    raise; other configs come back unchanged, with None."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    by_arch = {arch: t for t, (arch, _, _) in CONDITIONAL_LAYOUTS.items()}
    model_type = model_type or next((by_arch[a] for a in archs if a in by_arch), None)
    if model_type in REFUSED_HYBRIDS:
        raise UnsupportedConfigError(f"model_type={model_type!r} is not supported: {REFUSED_HYBRIDS[model_type]}")
    if model_type not in CONDITIONAL_LAYOUTS:
        return hf, None
    arch, prefix, text_type = CONDITIONAL_LAYOUTS[model_type]
    text = hf.get("text_config")
    _refuse(not isinstance(text, Mapping), f"model_type={model_type!r} config.json has no text_config")
    text = dict(text)
    _refuse(text.get("model_type", text_type) != text_type,
            f"text_config.model_type={text.get('model_type')!r} is not {text_type!r}")
    unknown = [a for a in archs if a != arch]
    _refuse(bool(unknown), f"architectures={archs} is not {arch!r}")
    _say_vision_left_out(arch, prefix)
    text.update(model_type=text_type, architectures=[ARCHITECTURES[text_type]],
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
    return text, prefix


@functools.cache
def _say_vision_left_out(arch: str, prefix: str) -> None:
    """The one log line (once per process) saying a vision-language checkpoint's tower is not built."""
    log.warning("fpdt: %s: the text model only (the tensors under %s); the vision tower is left out", arch, prefix)


def _token_mixers(hf: Mapping[str, Any], heads: int, head_dim: int, model_type: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text config:
    ``layer_types`` (default: every ``full_attention_interval``-th layer attention, as Transformers),
    Gated DeltaNet sizes (Qwen3-Next: its fused ``in_proj_qkvz`` / ``in_proj_ba``), gated attention
    with per-head q/k norms, partial RoPE, zero-centred norms."""
    layers = int(_require(hf, "num_hidden_layers"))
    types = hf.get("layer_types")
    if types is None:
        every = int(hf.get("full_attention_interval", 4))
        types = [LINEAR_ATTENTION if (i + 1) % every else ATTENTION for i in range(layers)]
    types = tuple(types)
    _refuse(len(types) != layers, f"layer_types has {len(types)} entries for num_hidden_layers={layers}")
    unknown = sorted(set(types) - {ATTENTION, LINEAR_ATTENTION})
    _refuse(bool(unknown), f"layer_types {unknown} are not supported (only {ATTENTION!r} and {LINEAR_ATTENTION!r})")
    _refuse(hf.get("attn_output_gate") is False,
            "attn_output_gate=false: Qwen3.5's attention always gates its output (as Transformers runs it)")
    sizes = {k: int(_require(hf, k)) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                "linear_key_head_dim", "linear_value_head_dim",
                                                "linear_conv_kernel_dim")}
    hk, hv = sizes["linear_num_key_heads"], sizes["linear_num_value_heads"]
    _refuse(hk < 1 or hv % hk != 0, f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
    act = hf.get("hidden_act", "silu")
    _refuse(act != "silu", f"hidden_act={act!r}: Gated DeltaNet's conv activation is SiLU only")
    bias = bool(hf.get("attention_bias", False))
    _refuse(bias, "attention_bias=true is not supported for Qwen3.5's gated attention")
    partial = _rotary_fraction(hf)
    _refuse(int(head_dim * partial) % 2 != 0 or int(head_dim * partial) < 2,
            f"partial_rotary_factor={partial} of head_dim={head_dim} gives an odd or empty rotary width")
    return dict(layer_types=types, attn_output_gate=True, qk_norm=True, partial_rotary_factor=partial,
                zero_centred_norms=True, linear_fused_projections=model_type == "qwen3_next", **sizes)


def _rotary_fraction(hf: Mapping[str, Any]) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` (5.x) or the top level; Qwen3.5's default 0.25."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    return float(value)


def _moe(hf: Mapping[str, Any], model_type: str) -> MoEConfig:
    """The experts of Qwen3-MoE and Qwen3-Next (``mlp_only_layers``, ``decoder_sparse_step``,
    ``norm_topk_prob``; Qwen3-Next: a shared expert), Qwen3.5-MoE (every layer, renormalised top-k,
    a shared expert) and Mixtral (every layer, renormalised top-k, ``intermediate_size`` wide)."""
    # Transformers 5 writes num_experts as num_local_experts (its attribute map); Mixtral's own key
    experts = int(hf["num_local_experts"] if hf.get("num_experts") is None and "num_local_experts" in hf
                  else _require(hf, "num_experts"))
    top_k = int(_require(hf, "num_experts_per_tok"))
    _refuse(experts > 0 and not 1 <= top_k <= experts,
            f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    every_layer = model_type in ("qwen3_5_moe_text", "mixtral")     # Transformers reads no sparsity keys there
    _refuse(every_layer and experts < 1, f"num_experts={experts}: {model_type} needs experts in every layer")
    step = 1 if every_layer or hf.get("decoder_sparse_step") is None else int(hf["decoder_sparse_step"])
    _refuse(step < 1, f"decoder_sparse_step={step} must be >= 1")
    jitter = float(hf.get("router_jitter_noise") or 0.0)
    _refuse(jitter != 0.0, f"router_jitter_noise={jitter} is not supported (the router runs without noise); "
                           f"set it to 0")
    if model_type == "mixtral":
        ffn = int(_require(hf, "intermediate_size"))
    else:
        ffn = int(_require(hf, "moe_intermediate_size"))
    shared = int(_require(hf, "shared_expert_intermediate_size")) if model_type in HYBRID_TYPES else 0
    _refuse(model_type in HYBRID_TYPES and shared < 1,
            f"shared_expert_intermediate_size={shared}: {model_type}'s MoE block always has a shared expert")
    norm_topk = every_layer or bool(hf.get("norm_topk_prob", model_type == "qwen3_next"))
    return MoEConfig(num_experts=experts, top_k=top_k, moe_intermediate_size=ffn, norm_topk_prob=norm_topk,
                     decoder_sparse_step=step,
                     mlp_only_layers=() if every_layer else tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
                     router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                     output_router_logits=bool(hf.get("output_router_logits", False)),
                     shared_expert_intermediate_size=shared)

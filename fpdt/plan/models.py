"""Model presets, the planner's view of each decoder layer, and parameter counts.

Presets (``fpdt/plan/presets/<name>.json``, Hugging Face ``config.json`` files):

* ``llama-3.2-1b``, ``llama-3-8b``, ``llama-3-70b``: the published Llama shapes.
* ``qwen3.5-9b``, ``qwen3-30b-a3b``, ``qwen3.5-35b-a3b``: the hybrid (Gated DeltaNet + gated
  attention) and mixture-of-experts shapes; where each number comes from: ``docs/plan.md``,
  "Hybrid and mixture-of-experts models".
* ``gpt-2.7b``, ``gpt-13b``, ``gpt-30b``: the GPT-style models of FPDT Table 1, written as
  Llama configs with the same parameter and FLOP counts. The paper does not give their
  shapes; these are the GPT-3 family's (Brown et al. 2020, Table 2.1) rounded to
  head-dim multiples:

  ======== ====== ====== ======= ======= ===========
  preset   layers hidden heads   MLP     vocab
  ======== ====== ====== ======= ======= ===========
  gpt-2.7b 32     2560   32 x 80 6912    50304, tied
  gpt-13b  40     5120   40 x128 13824   50304, tied
  gpt-30b  48     7168   56 x128 19200   50304, tied
  ======== ====== ====== ======= ======= ===========

  Multi-head attention (no GQA). GPT's GeLU MLP of width 4h has ``8 h^2`` weights; a
  SwiGLU of width ``~8h/3`` has the same count and FLOPs. The vocabulary is GPT-2's 50257
  padded to 50304 as Megatron does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

from fpdt.model.config import ModelConfig, UnsupportedConfigError

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
PRESETS = tuple(sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json")))
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
"""``model_type``s whose layers mix Gated DeltaNet (``"linear_attention"``) and full attention."""
MOE_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "qwen3_next")
"""``model_type``s whose MLP is a mixture of experts (per layer: :func:`layer_kinds`)."""
GATED_ATTENTION_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
"""``model_type``s whose ``q_proj`` also gives the attention output's sigmoid gate by default."""
QK_NORM_TYPES = ("qwen3", "qwen3_moe") + HYBRID_TYPES
"""``model_type``s with a per-head RMSNorm on q and k."""
_HUB_LAYOUTS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config of a Transformers ``config.json`` (the hub layouts nest it in ``text_config``)."""
    hf = dict(hf)
    if "text_config" in hf and hf.get("model_type") in _HUB_LAYOUTS:
        inner = dict(hf["text_config"])
        inner.setdefault("model_type", _HUB_LAYOUTS[hf["model_type"]])
        inner.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        return inner
    return hf


def _planned_config(hf: dict[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` of a hybrid or MoE ``config.json`` that the model package does not
    parse (yet): its attention and embedding shapes, the dict in ``hf_config`` for :func:`model_spec`."""
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    return ModelConfig(
        model_type=hf["model_type"], vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size") or 0), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)), mlp_bias=False, hf_config=hf)


def parse_config(hf: Mapping[str, Any] | str) -> ModelConfig:
    """:meth:`ModelConfig.from_hf`; a hybrid or MoE config it refuses is planned from its shapes alone."""
    if isinstance(hf, (str, os.PathLike)):
        path = os.path.join(hf, "config.json") if os.path.isdir(hf) else hf
        with open(path) as f:
            hf = json.load(f)
    try:
        return ModelConfig.from_hf(hf)
    except UnsupportedConfigError:
        inner = text_config(hf)
        if inner.get("model_type") in HYBRID_TYPES + MOE_TYPES:
            return _planned_config(inner)
        raise


def load_model_config(model: str | dict | ModelConfig) -> ModelConfig:
    """A preset name, a path to ``config.json`` (or its directory), a dict, or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return parse_config(model)
    if model.lower() in PRESETS:
        return parse_config(os.path.join(PRESET_DIR, model.lower() + ".json"))
    if os.path.exists(model):
        return parse_config(model)
    raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                     f"config.json / checkpoint directory")


@dataclass(frozen=True)
class GDNShape:
    """A Gated DeltaNet token mixer (Transformers' ``Qwen3_5GatedDeltaNet``)."""

    key_heads: int
    """``Hk``: q and k heads."""
    value_heads: int
    """``HV``: v heads, and heads of the recurrent state ``[HV, dk, dv]``."""
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def qkv_width(self) -> int:
        """Channels of ``in_proj_qkv`` (and of the depthwise conv): ``2 Hk dk + HV dv``."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def value_width(self) -> int:
        """``HV dv``: the output gate ``z``, the output, ``out_proj``'s input."""
        return self.value_heads * self.value_dim

    @property
    def projected_width(self) -> int:
        """Channels per token of a chunk's inputs: q/k/v, ``z``, ``b`` and ``a``."""
        return self.qkv_width + self.value_width + 2 * self.value_heads

    def params(self, hidden: int) -> int:
        """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d (no bias), A_log, dt_bias, the gated norm, out_proj."""
        return (hidden * self.projected_width + self.qkv_width * self.conv_kernel + 2 * self.value_heads
                + self.value_dim + self.value_width * hidden)

    def state_bytes(self, heads: int | None = None) -> int:
        """One fp32 recurrent state ``[heads, dk, dv]`` (all ``HV`` heads unless given)."""
        return 4 * (self.value_heads if heads is None else heads) * self.key_dim * self.value_dim


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts MLP: a router over ``E`` experts, ``k`` SwiGLU experts per token, and
    an optional shared expert with a sigmoid gate (Transformers ``Qwen3MoeSparseMoeBlock``,
    ``Qwen3_5MoeSparseMoeBlock``)."""

    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0
    shared_gate: bool = False

    def expert_params(self, hidden: int) -> int:
        """All ``E`` experts' fused ``gate_up_proj`` and ``down_proj``: what ZeRO-3 gathers as one module."""
        return self.num_experts * 3 * hidden * self.expert_ffn

    def params(self, hidden: int) -> int:
        return (self.expert_params(hidden) + self.num_experts * hidden + 3 * hidden * self.shared_ffn
                + (hidden if self.shared_gate else 0))

    def active_params(self, hidden: int) -> int:
        """What one token uses: ``k`` experts, the router, the shared expert and its gate."""
        return self.params(hidden) - (self.num_experts - self.top_k) * 3 * hidden * self.expert_ffn

    @property
    def routed_width(self) -> int:
        """``k * moe_ffn``: the routed intermediate width per token."""
        return self.top_k * self.expert_ffn


@dataclass(frozen=True)
class ModelSpec:
    """What the planner counts per decoder layer: its token mixer (``"attention"`` or ``"gdn"``) and
    its MLP (``"dense"`` or ``"moe"``), the GDN and MoE shapes, and the attention's extras."""

    mixers: tuple[str, ...]
    mlps: tuple[str, ...]
    gdn: GDNShape | None = None
    moe: MoEShape | None = None
    attention_gate: bool = False
    """``q_proj`` also gives a sigmoid gate on the attention output (twice the query width)."""
    qk_norm: bool = False

    @property
    def attention_layers(self) -> int:
        return self.mixers.count("attention")

    @property
    def gdn_layers(self) -> int:
        return self.mixers.count("gdn")

    @property
    def moe_layers(self) -> int:
        return self.mlps.count("moe")

    @property
    def plain(self) -> bool:
        """Every layer attention + dense MLP: the planner's Llama-family model."""
        return not self.gdn_layers and not self.moe_layers

    def kinds(self) -> set[tuple[str, str]]:
        """The distinct ``(mixer, mlp)`` layer kinds."""
        return set(zip(self.mixers, self.mlps))


def _layer_types(hf: Mapping[str, Any], n: int) -> list[str]:
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if len(types) != n or bad:
        raise UnsupportedConfigError(f"layer_types must list {n} entries of 'linear_attention' / 'full_attention'; "
                                     f"got {len(types)} with {bad or 'no other kinds'}")
    return list(types)


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The planner's per-layer view of ``cfg``: the model's own fields where it parses them
    (``layer_types``, ``linear_*``, ``attn_output_gate``, ``qk_norm``, ``moe``), else its
    ``config.json`` keys (Transformers' names)."""
    hf = text_config(cfg.hf_config or {})
    mtype, n = hf.get("model_type", cfg.model_type), cfg.num_layers
    gdn, mixers = None, ["attention"] * n
    if getattr(cfg, "layer_types", None) is not None:        # fpdt.model.config's own fields
        mixers = ["gdn" if t == "linear_attention" else "attention" for t in cfg.layer_types]
        gdn = GDNShape(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    elif mtype in HYBRID_TYPES:
        mixers = ["gdn" if t == "linear_attention" else "attention" for t in _layer_types(hf, n)]
        gdn = GDNShape(int(hf.get("linear_num_key_heads", 16)), int(hf.get("linear_num_value_heads", 32)),
                       int(hf.get("linear_key_head_dim", 128)), int(hf.get("linear_value_head_dim", 128)),
                       int(hf.get("linear_conv_kernel_dim", 4)))
    moe, mlps = None, ["dense"] * n
    own = getattr(cfg, "moe", None)                          # fpdt.model.config's MoEConfig, where parsed
    if own is not None and own.num_experts > 0:
        shared = int(getattr(own, "shared_expert_intermediate_size", 0) or 0)
        moe = MoEShape(own.num_experts, own.top_k, own.moe_intermediate_size, shared, shared > 0)
        mlps = ["moe" if own.is_moe_layer(i) else "dense" for i in range(n)]
    elif mtype in MOE_TYPES and int(hf.get("num_experts") or 0) > 0:
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        moe = MoEShape(int(hf["num_experts"]), int(hf.get("num_experts_per_tok", 8)),
                       int(hf.get("moe_intermediate_size", 768)), shared, shared > 0)
        only = set(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step") or 1)
        mlps = ["dense" if i in only or (i + 1) % step else "moe" for i in range(n)]
    gate = getattr(cfg, "attn_output_gate", False) or bool(hf.get("attn_output_gate", mtype in GATED_ATTENTION_TYPES))
    qk_norm = getattr(cfg, "qk_norm", False) or mtype in QK_NORM_TYPES
    return ModelSpec(tuple(mixers), tuple(mlps), gdn if "gdn" in mixers else None, moe, gate, qk_norm)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements) of a decoder-only model, per layer."""

    layer: int
    """The largest decoder layer (what one ZeRO-3 gather holds): mixer, MLP (every expert), two norms."""
    embedding: int
    """Input embedding ``V x hidden``."""
    head: int
    """Separate LM head ``V x hidden`` (0 when tied), plus the final norm."""
    num_layers: int
    layers: tuple[int, ...] = ()
    """Each decoder layer's count (empty: every layer ``layer``)."""
    active_layers: tuple[int, ...] = ()
    """Each layer's parameters one token uses (``k`` of ``E`` experts; empty: as ``layers``)."""

    @property
    def total(self) -> int:
        return sum(self.layers or (self.layer,) * self.num_layers) + self.embedding + self.head

    @property
    def active(self) -> int:
        """Parameters one token uses: the embedding row aside, ``k`` of ``E`` experts per MoE layer."""
        return sum(self.active_layers or self.layers or (self.layer,) * self.num_layers) + self.embedding + self.head


def attention_params(cfg: ModelConfig, spec: ModelSpec) -> int:
    """One attention mixer: q (and its gate), k, v, o, biases, per-head q/k norms."""
    h, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q_out = qd * (2 if spec.attention_gate else 1)
    return (h * (q_out + 2 * kvd) + qd * h + (q_out + 2 * kvd if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0)
            + (2 * cfg.head_dim if spec.qk_norm else 0))


def mixer_input_width(cfg: ModelConfig, spec: ModelSpec, kind: str) -> int:
    """Output width of a mixer's input projections (the weights each attention chunk adds a ``dW`` partial to)."""
    if kind == "gdn":
        return spec.gdn.projected_width
    return cfg.num_heads * cfg.head_dim * (2 if spec.attention_gate else 1) + 2 * cfg.num_kv_heads * cfg.head_dim


def dense_mlp_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.intermediate_size + ((2 * cfg.intermediate_size + cfg.hidden_size)
                                                          if cfg.mlp_bias else 0)


def lora_param_count(cfg: ModelConfig, rank: int) -> int:
    """Elements of LoRA adapters of ``rank`` on every linear of the decoder layers (q/k/v/o,
    gate/up/down: ``r (in + out)`` each), as ``fpdt.hf`` runs them; 0 for ``rank`` 0.
    Hybrid and MoE models: the attention layers' q/k/v/o, the GDN layers' ``in_proj_*`` and
    ``out_proj``, dense MLPs and the shared expert with its sigmoid gate (routed experts are not adapted)."""
    spec = model_spec(cfg)
    h, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    if spec.plain:
        per_layer = (h + qd) + 2 * (h + kvd) + (qd + h) + 2 * (h + inter) + (inter + h)
        return rank * per_layer * cfg.num_layers
    total = 0
    for mixer, mlp in zip(spec.mixers, spec.mlps):
        if mixer == "gdn":
            g = spec.gdn
            total += (h + g.qkv_width) + (h + g.value_width) + 2 * (h + g.value_heads) + (g.value_width + h)
        else:
            total += (h + qd * (2 if spec.attention_gate else 1)) + 2 * (h + kvd) + (qd + h)
        width = inter if mlp == "dense" else (spec.moe.shared_ffn if spec.moe else 0)
        total += 3 * (h + width) + (h + 1 if mlp != "dense" else 0) if width else 0
    return rank * total


def layer_mlp_params(cfg: ModelConfig, i: int) -> tuple[int, int]:
    """Layer ``i``'s MLP parameters ``(all, used by one token)``: the dense SwiGLU, or the router, the
    ``E`` (``k``) experts and the shared expert with its gate."""
    spec = model_spec(cfg)
    if spec.mlps[i] == "dense":
        return (dense_mlp_params(cfg),) * 2
    return spec.moe.params(cfg.hidden_size), spec.moe.active_params(cfg.hidden_size)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Per-layer, total and active parameter counts (Transformers' modules, norms and biases included)."""
    spec = model_spec(cfg)
    h = cfg.hidden_size
    attn = attention_params(cfg, spec)
    mixer = {"attention": attn, "gdn": spec.gdn.params(h) if spec.gdn else 0}
    mlp = {"dense": dense_mlp_params(cfg), "moe": spec.moe.params(h) if spec.moe else 0}
    active = {"dense": mlp["dense"], "moe": spec.moe.active_params(h) if spec.moe else 0}
    layers = tuple(mixer[a] + mlp[m] + 2 * h for a, m in zip(spec.mixers, spec.mlps))
    active_layers = tuple(mixer[a] + active[m] + 2 * h for a, m in zip(spec.mixers, spec.mlps))
    head = (0 if cfg.tie_word_embeddings else cfg.vocab_size * h) + h
    out = ParamCounts(layer=max(layers), embedding=cfg.vocab_size * h, head=head, num_layers=cfg.num_layers)
    return out if spec.plain else replace(out, layers=layers, active_layers=active_layers)


GDN_CHUNK = 64
"""The chunk length ``c`` of the chunked gated delta rule (fla's ``chunk_gated_delta_rule``)."""


def gdn_core_flops(g: GDNShape) -> float:
    """Forward FLOPs per token of a GDN layer's depthwise conv and chunked delta rule (``docs/plan.md``,
    "Hybrid and mixture-of-experts models"): per value head ``6 dk dv + c (6 dk + 4 dv) + 2 c^2 / 3``, ``c = 64``."""
    c, dk, dv = GDN_CHUNK, g.key_dim, g.value_dim
    return g.value_heads * (6 * dk * dv + c * (6 * dk + 4 * dv) + 2 * c * c / 3) + 2 * g.conv_kernel * g.qkv_width


def layer_matmul_flops(cfg: ModelConfig, spec: ModelSpec) -> tuple[float, ...]:
    """Forward GEMM FLOPs per token of each decoder layer: its mixer's projections and its MLP's
    active weights (``k`` of ``E`` experts, the router, the shared expert and its gate)."""
    h, qd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    mixer = {"attention": 2 * h * mixer_input_width(cfg, spec, "attention") + 2 * qd * h,
             "gdn": 2 * h * spec.gdn.projected_width + 2 * spec.gdn.value_width * h if spec.gdn else 0}
    m = spec.moe
    mlp = {"dense": 6 * h * cfg.intermediate_size,
           "moe": 6 * h * (m.routed_width + m.shared_ffn) + 2 * h * m.num_experts + (2 * h if m.shared_gate else 0)
           if m else 0}
    return tuple(mixer[a] + mlp[b] for a, b in zip(spec.mixers, spec.mlps))


def mlp_recompute_flops(cfg: ModelConfig, spec: ModelSpec) -> tuple[float, ...]:
    """FLOPs per token each layer's chunked MLP recomputes in its backward: the dense gate and up
    projections; a MoE MLP's router, experts' ``gate_up`` and the shared expert's gate and up."""
    h, m = cfg.hidden_size, spec.moe
    per = {"dense": 4 * h * cfg.intermediate_size,
           "moe": 4 * h * (m.routed_width + m.shared_ffn) + 2 * h * m.num_experts if m else 0}
    return tuple(per[b] for b in spec.mlps)


def train_flops_per_token(cfg: ModelConfig, spec: ModelSpec, seq_len: int, causal: bool = True) -> float:
    """The trainer's MFU numerator, ``3 x`` the forward FLOPs per token, per layer kind: the GEMMs of
    :func:`layer_matmul_flops`, attention only in the full-attention layers, the GDN core in the others,
    and the LM head (``fpdt.train.metrics.train_flops_per_token`` for a plain model)."""
    attention = (0.5 if causal else 1.0) * 4 * cfg.num_heads * cfg.head_dim * seq_len
    core = gdn_core_flops(spec.gdn) if spec.gdn else 0.0
    forward = sum(layer_matmul_flops(cfg, spec)) + spec.attention_layers * attention + spec.gdn_layers * core
    return 3 * (forward + 2 * cfg.hidden_size * cfg.vocab_size)

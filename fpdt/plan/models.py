"""Model presets and parameter counts.

Presets (``fpdt/plan/presets/<name>.json``, Hugging Face ``config.json`` files):

* ``llama-3.2-1b``, ``llama-3-8b``, ``llama-3-70b``: the published Llama shapes.
* ``qwen3-30b-a3b``: Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts of width 768, top 8).
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
from dataclasses import dataclass

from fpdt.model.config import ModelConfig

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
PRESETS = tuple(sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json")))


def load_model_config(model: str | dict | ModelConfig) -> ModelConfig:
    """A preset name, a path to ``config.json`` (or its directory), a dict, or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return ModelConfig.from_hf(model)
    if model.lower() in PRESETS:
        with open(os.path.join(PRESET_DIR, model.lower() + ".json")) as f:
            return ModelConfig.from_hf(json.load(f))
    if os.path.exists(model):
        return ModelConfig.from_hf(model)
    raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                     f"config.json / checkpoint directory")


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements) of a Llama-family model, with or without experts."""

    layer: int
    """The largest decoder layer (a ZeRO-3 gather): q/k/v/o, its MLP (every expert), two RMSNorms, biases."""
    embedding: int
    """Input embedding ``V x hidden``."""
    head: int
    """Separate LM head ``V x hidden`` (0 when tied), plus the final norm."""
    num_layers: int
    layers: int = 0
    """All decoder layers together (0: ``num_layers x layer``)."""
    active_layers: int = 0
    """All decoder layers' parameters one token uses (k of E experts; 0: ``layers``)."""

    @property
    def total(self) -> int:
        return (self.layers or self.num_layers * self.layer) + self.embedding + self.head

    @property
    def active(self) -> int:
        """Parameters one token passes through (``total`` for a dense model)."""
        return (self.active_layers or self.layers or self.num_layers * self.layer) + self.embedding + self.head


def layer_mlp_params(cfg: ModelConfig, i: int) -> tuple[int, int]:
    """Layer ``i``'s MLP parameters ``(all, used by one token)``: SwiGLU, or router + E (k) experts + shared expert."""
    h = cfg.hidden_size
    if not cfg.is_moe_layer(i):
        n = 3 * h * cfg.intermediate_size + ((2 * cfg.intermediate_size + h) if cfg.mlp_bias else 0)
        return n, n
    moe = cfg.moe
    expert, shared = 3 * h * moe.moe_intermediate_size, 3 * h * moe.shared_expert_intermediate_size
    fixed = moe.num_experts * h + shared + (h if shared else 0)
    return fixed + moe.num_experts * expert, fixed + moe.top_k * expert


def lora_param_count(cfg: ModelConfig, rank: int) -> int:
    """Elements of LoRA adapters of ``rank`` on every linear of the decoder layers (q/k/v/o,
    gate/up/down: ``r (in + out)`` each), as ``fpdt.hf`` runs them; 0 for ``rank`` 0."""
    h, qd, kvd, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    per_layer = (h + qd) + 2 * (h + kvd) + (qd + h) + 2 * (h + inter) + (inter + h)
    return rank * per_layer * cfg.num_layers


def param_counts(cfg: ModelConfig) -> ParamCounts:
    h, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = h * (qd + 2 * kvd) + qd * h + (qd + 2 * kvd if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0)
    attn += 2 * cfg.head_dim if cfg.qk_norm else 0
    mlps = [layer_mlp_params(cfg, i) for i in range(cfg.num_layers)]
    head = (0 if cfg.tie_word_embeddings else cfg.vocab_size * h) + h
    return ParamCounts(layer=attn + 2 * h + max(a for a, _ in mlps), embedding=cfg.vocab_size * h, head=head,
                       num_layers=cfg.num_layers, layers=sum(attn + 2 * h + a for a, _ in mlps),
                       active_layers=sum(attn + 2 * h + b for _, b in mlps))

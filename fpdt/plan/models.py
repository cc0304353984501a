"""Model presets and parameter counts.

Presets (``fpdt/plan/presets/<name>.json``, Hugging Face ``config.json`` files):

* ``llama-3.2-1b``, ``llama-3-8b``, ``llama-3-70b``: the published Llama shapes.
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
    """Parameter counts (elements) of a Llama-family model."""

    layer: int
    """One decoder layer: q/k/v/o, gate/up/down, two RMSNorms, biases."""
    embedding: int
    """Input embedding ``V x hidden``."""
    head: int
    """Separate LM head ``V x hidden`` (0 when tied), plus the final norm."""
    num_layers: int

    @property
    def total(self) -> int:
        return self.num_layers * self.layer + self.embedding + self.head


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
    mlp = 3 * h * cfg.intermediate_size + ((2 * cfg.intermediate_size + h) if cfg.mlp_bias else 0)
    layer = attn + mlp + 2 * h
    head = (0 if cfg.tie_word_embeddings else cfg.vocab_size * h) + h
    return ParamCounts(layer=layer, embedding=cfg.vocab_size * h, head=head, num_layers=cfg.num_layers)

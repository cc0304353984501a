"""Qwen3.5 configs (text and the hub's vision-language layout) and the refused hybrid families (Qwen3.5-MoE,
Qwen3-Next and Mixtral configs: tests/model/test_hybrid_moe_parity.py, tests/model/test_mixtral.py)."""

import logging

import pytest
import transformers

from fpdt.model import ModelConfig, UnsupportedConfigError
from fpdt.model.config import _say_vision_left_out

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)

HUB_TEXT = {   # the text_config of a hub Qwen3.5 config.json (sizes shrunk), with its extra keys
    "model_type": "qwen3_5_text", "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 32,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 8,
    "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
    "num_attention_heads": 4, "num_hidden_layers": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "vocab_size": 256, "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                           "rope_type": "default", "rope_theta": 10000000,
                                           "partial_rotary_factor": 0.25}}


def test_text_config_fields():
    cfg = ModelConfig.from_hf(transformers.Qwen3_5TextConfig(**TEXT, partial_rotary_factor=0.5))
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert [cfg.layer_type(i) for i in (0, 3)] == ["linear_attention", "full_attention"]
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (2, 4, 16, 8, 4)
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.zero_centred_norms and cfg.has_linear_attention
    assert (cfg.partial_rotary_factor, cfg.rotary_dim, cfg.text_prefix) == (0.5, 16, "model")
    back = transformers.AutoConfig.for_model(**cfg.to_hf("float32"))
    assert type(back) is transformers.Qwen3_5TextConfig and back.layer_types == list(cfg.layer_types)
    assert cfg.to_hf()["architectures"] == ["Qwen3_5ForCausalLM"]


def test_llama_family_unchanged():
    cfg = ModelConfig.from_hf(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4))
    assert cfg.layer_types is None and cfg.layer_type(0) == "full_attention" and not cfg.has_linear_attention
    assert not (cfg.attn_output_gate or cfg.qk_norm or cfg.zero_centred_norms) and cfg.rotary_dim == cfg.head_dim
    with pytest.raises(UnsupportedConfigError, match="partial_rotary_factor"):
        ModelConfig.from_hf({**transformers.LlamaConfig(hidden_size=64).to_dict(), "partial_rotary_factor": 0.5})


def test_hub_layouts(caplog):
    """The hub's text config (mrope keys, MTP sizes) and the vision-language layout around it."""
    text = ModelConfig.from_hf(HUB_TEXT)
    assert text.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    assert (text.rope_theta, text.rotary_dim, text.rope_scaling) == (1e7, 8, None)
    hub = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": HUB_TEXT,
           "vision_config": {"depth": 2, "hidden_size": 32}, "tie_word_embeddings": True, "image_token_id": 3}
    _say_vision_left_out.cache_clear()
    with caplog.at_level(logging.WARNING, logger="fpdt.model.config"):
        cfg = ModelConfig.from_hf(hub)
        ModelConfig.from_hf(hub)            # said once per process
    lines = [r.getMessage() for r in caplog.records if "vision tower is left out" in r.getMessage()]
    assert len(lines) == 1 and "Qwen3_5ForConditionalGeneration" in lines[0]
    assert cfg.text_prefix == "model.language_model" and cfg.tie_word_embeddings
    assert cfg.layer_types == text.layer_types and cfg.to_hf()["model_type"] == "qwen3_5_text"
    assert ModelConfig.from_hf(transformers.Qwen3_5Config(text_config=TEXT)).text_prefix == "model.language_model"


@pytest.mark.parametrize("hf, match", [
    ({"model_type": "olmo_hybrid"}, "OLMo hybrid needs post-norm decoder layers"),
    ({"model_type": "kimi_linear"}, "KDA has per-channel gates"),
    ({**HUB_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 8, "shared_expert_intermediate_size": 0}, "always has a shared expert"),
    ({"model_type": "qwen3_5_moe"}, "has no text_config"),
    ({**HUB_TEXT, "layer_types": ["linear_attention"] * 7 + ["sliding_attention"]}, "sliding-window"),
    ({**HUB_TEXT, "layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries"),
    ({**HUB_TEXT, "linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
    ({**HUB_TEXT, "attn_output_gate": False}, "always gates"),
    ({**HUB_TEXT, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}}, "odd or empty rotary"),
    ({"model_type": "qwen3_5", "text_config": {**HUB_TEXT, "model_type": "llama"}}, "is not 'qwen3_5_text'"),
    ({"model_type": "qwen3_5"}, "has no text_config"),
])
def test_refused(hf, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        ModelConfig.from_hf(hf)

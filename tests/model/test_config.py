"""Config parsing: what is accepted, what is refused, and RoPE frequencies vs Transformers."""

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from fpdt.model import ModelConfig, UnsupportedConfigError
from fpdt.model.rope_scaling import rope_inv_freq
from tests.model.helpers import CONFIGS, hf_config

LLAMA31_STYLE = {  # a Transformers 4.x config.json, as on the Hub for Llama-3.1/3.2
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 128256, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": False,
    "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN25_STYLE = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21, "tie_word_embeddings": True,
    "attention_dropout": 0.0, "rope_scaling": None,
}


def test_llama31_hub_config():
    cfg = ModelConfig.from_hf(LLAMA31_STYLE)
    assert (cfg.model_type, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 32, 8, 64)
    assert cfg.rope_type == "llama3" and cfg.rope_theta == 500000.0 and cfg.tie_word_embeddings
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)


def test_qwen25_hub_config_window_off_is_accepted():
    cfg = ModelConfig.from_hf(QWEN25_STYLE)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.rope_type == "default"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers5_configs_and_files(name, tmp_path):
    hf = hf_config(name)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.hidden_size == hf.hidden_size and cfg.num_kv_heads == hf.num_key_value_heads
    hf.save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path) == cfg  # directory path
    assert ModelConfig.from_hf(tmp_path / "config.json") == cfg
    # written back, it loads in transformers as the same architecture
    back = transformers.AutoConfig.for_model(**cfg.to_hf("float32"))
    assert back.to_dict()["rope_parameters"] == hf.to_dict()["rope_parameters"]


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding-window"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 4096}, "sliding-window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}}, "yarn"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1.0}}, "beta"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "causal"),
    ({"num_key_value_heads": 5}, "divisible"),
])
def test_refuses_what_it_cannot_honour(change, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        ModelConfig.from_hf({**LLAMA31_STYLE, **change})


def _rope_case(scaling, theta=500000.0, head_dim=64, max_pos=131072):
    kw = dict(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
              rope_theta=theta)
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    return transformers.LlamaConfig(**kw)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 1024},
])
def test_rope_inv_freq_matches_transformers(scaling):
    hf = _rope_case(scaling)
    cfg = ModelConfig.from_hf(json.loads(json.dumps(hf.to_dict())))
    ours, attn_scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        theirs, their_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[rope_type](hf)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert attn_scale == their_scale
    if rope_type == "llama3":  # all three bands (kept, blended, divided) are exercised
        base = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)[0]
        ratio = base / ours
        assert (ratio == 1).any() and (ratio == cfg.rope_scaling["factor"]).any()
        assert ((ratio > 1) & (ratio < cfg.rope_scaling["factor"])).any()

"""Parameter counts of hybrid (Gated DeltaNet + gated attention) and mixture-of-experts models
against the Transformers models built from the same config, and the presets' published totals."""

import pytest
import torch

from fpdt.plan.models import PRESETS, layer_mlp_params, load_model_config, model_spec, param_counts

transformers = pytest.importorskip("transformers")

QWEN35 = {"model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80,
          "num_hidden_layers": 5, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16,
          "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 8,
          "linear_value_head_dim": 12, "linear_conv_kernel_dim": 3, "tie_word_embeddings": False,
          "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                          "full_attention"]}
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 40, "intermediate_size": 72,
             "num_hidden_layers": 5, "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 8,
             "num_experts": 7, "num_experts_per_tok": 3, "moe_intermediate_size": 24, "norm_topk_prob": True,
             "decoder_sparse_step": 2, "mlp_only_layers": [3], "tie_word_embeddings": False}
QWEN35_MOE = {"model_type": "qwen3_5_moe_text", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "linear_conv_kernel_dim": 4, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
              "shared_expert_intermediate_size": 20, "tie_word_embeddings": True}

QWEN3_NEXT = {**QWEN35_MOE, "model_type": "qwen3_next", "intermediate_size": 36, "mlp_only_layers": [2],
              "tie_word_embeddings": False}
MIXTRAL = {"model_type": "mixtral", "vocab_size": 96, "hidden_size": 40, "intermediate_size": 24,
           "num_hidden_layers": 3, "num_attention_heads": 5, "num_key_value_heads": 1, "num_local_experts": 4,
           "num_experts_per_tok": 2, "tie_word_embeddings": False}


def _transformers_model(hf: dict):
    cls = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
           "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM")}[hf["model_type"]]
    config = getattr(transformers, cls[0])(**{k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(0)
    return getattr(transformers, cls[1])(config)


def _active(model, spec) -> int:
    """Parameters one token uses: each MoE layer's experts counted ``k`` of ``E``."""
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            total += p.numel() * spec.moe.top_k // spec.moe.num_experts
        else:
            total += p.numel()
    return total


@pytest.mark.parametrize("hf", [QWEN35, QWEN3_MOE, QWEN35_MOE, QWEN3_NEXT, MIXTRAL], ids=lambda h: h["model_type"])
def test_counts_match_transformers(hf):
    model = _transformers_model(hf)
    cfg = load_model_config(dict(hf))
    pc, spec = param_counts(cfg), model_spec(cfg)
    assert pc.total == sum(p.numel() for p in model.parameters())
    assert pc.active == _active(model, spec)
    layers = model.model.layers
    assert list(pc.layers) == [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert pc.layer == max(pc.layers)


def test_layer_kinds_follow_the_config():
    spec = model_spec(load_model_config(dict(QWEN35)))
    assert spec.mixers == ("gdn", "attention", "gdn", "gdn", "attention") and spec.moe is None
    spec = model_spec(load_model_config(dict(QWEN3_MOE)))
    # decoder_sparse_step 2: layers 1 and 3 sparse, but 3 is in mlp_only_layers
    assert spec.mlps == ("dense", "moe", "dense", "dense", "dense") and spec.gdn is None
    spec = model_spec(load_model_config(dict(QWEN35_MOE)))
    assert spec.mixers == ("gdn", "gdn", "gdn", "attention") and spec.mlps == ("moe",) * 4
    assert spec.moe.shared_gate and spec.attention_gate
    spec = model_spec(load_model_config(dict(QWEN3_NEXT)))
    assert spec.mixers == ("gdn", "gdn", "gdn", "attention") and spec.mlps == ("moe", "moe", "dense", "moe")
    spec = model_spec(load_model_config(dict(MIXTRAL)))
    assert spec.mixers == ("attention",) * 3 and spec.mlps == ("moe",) * 3 and not spec.moe.shared_gate


def test_hub_layout_reads_text_config():
    hub = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": dict(QWEN35), "vision_config": {"depth": 2}, "tie_word_embeddings": False}
    assert param_counts(load_model_config(hub)).total == param_counts(load_model_config(dict(QWEN35))).total


@pytest.mark.parametrize("name,total,active", [
    ("qwen3.5-9b", 8.95e9, 8.95e9),          # the GGUF's 8.95B (text model, no MTP layer)
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),        # the model card: 30.5B total, 3.3B activated
    ("qwen3.5-35b-a3b", 35e9, 3e9),          # the name: 35B total, 3B active
    ("llama-3-8b", 8.03e9, 8.03e9),
])
def test_presets_load_with_their_published_sizes(name, total, active):
    assert name in PRESETS
    pc = param_counts(load_model_config(name))
    assert pc.total == pytest.approx(total, rel=0.02)
    assert pc.active == pytest.approx(active, rel=0.16)


def test_qwen3_30b_a3b_non_embedding_count():
    pc = param_counts(load_model_config("qwen3-30b-a3b"))
    assert pc.total - pc.embedding - pc.head == pytest.approx(29.9e9, rel=0.005)   # the model card's 29.9B


def test_layer_mlp_params_dense_and_moe():
    cfg = load_model_config(dict(QWEN3_MOE))
    h = 40
    assert layer_mlp_params(cfg, 0) == (3 * h * 72,) * 2                       # dense (decoder_sparse_step 2)
    assert layer_mlp_params(cfg, 1) == (7 * 3 * h * 24 + 7 * h, 3 * 3 * h * 24 + 7 * h)


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3-30b-a3b", "qwen3.5-9b"])
def test_presets_build_the_model_the_planner_counts(name):
    """The presets parse as fpdt.model's own configs, and the model they build (on meta) has the
    parameters the planner counts."""
    import fpdt.model as fm

    cfg = load_model_config(name)
    model = fm.from_config(cfg, device="meta")
    assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())

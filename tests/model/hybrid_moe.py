"""Tiny hybrid mixture-of-experts models (Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet + gated attention
layers, experts with a shared expert) and Mixtral, Transformers the reference (its PyTorch fallbacks
and eager experts). The hybrids compare fp32 against a float64 Transformers run
(:func:`tests.model.qwen35.reference`, :func:`tests.model.qwen35.compare_hybrid`); Mixtral within 1e-5 of fp32."""

from __future__ import annotations

import torch
import transformers

L, A = "linear_attention", "full_attention"

_HYBRID = dict(vocab_size=256, num_hidden_layers=4, max_position_embeddings=512, linear_conv_kernel_dim=4,
               attn_implementation="eager", initializer_range=0.05, rms_norm_eps=1e-6, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, num_experts=6,
               num_experts_per_tok=3, moe_intermediate_size=13, shared_expert_intermediate_size=11,
               output_router_logits=True, router_aux_loss_coef=0.3)

# name -> (config class, model class, kwargs). "*_odd": 3 query heads on 1 kv head (one rank only);
# "*_sp2": 4 q / 2 kv heads that divide by 2 ranks.
MODELS = {
    "qwen35moe_odd": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        hidden_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.25,
        layer_types=[L, L, A, L])),
    "qwen35moe_sp2": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
        layer_types=[L, A, L, A], tie_word_embeddings=True)),
    # decoder_sparse_step 1 with layer 1 dense (mlp_only_layers), top-k not renormalised
    "qwen3next_odd": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=40, intermediate_size=36, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
        partial_rotary_factor=0.25, layer_types=[L, L, A, L], mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3next_sp2": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=48, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        partial_rotary_factor=0.5, layer_types=[L, A, L, A], decoder_sparse_step=2)),
    # 4 ranks: GDN Hk=4 HV=8 and 4 q heads (the 2 kv heads replicated); Qwen3-Next with a dense layer
    "qwen35moe_sp4": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, layer_types=[L, A, L, A])),
    "qwen3next_sp4": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        partial_rotary_factor=0.5, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
        layer_types=[L, A, L, A], mlp_only_layers=[1])),
}


def hybrid_moe_model(name: str, seed: int = 0, **changes):
    """The fp32 Transformers model with seeded weights; norms, ``A_log`` and ``dt_bias`` perturbed,
    routers spread (top-k far from ties, so float64 and fp32 route alike)."""
    config_cls, model_cls, kwargs = MODELS[name]
    cfg = getattr(transformers, config_cls)(**{**_HYBRID, **kwargs, **changes})
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "A_log")):
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


# GQA 6/2 with head_dim 12, E=5 k=2, expert width 19; "mixtral_sp2": 4/2 heads (also on 4 ranks, the
# kv heads replicated).
MIXTRAL = {
    "mixtral": dict(hidden_size=48, intermediate_size=19, num_attention_heads=6, num_key_value_heads=2, head_dim=12),
    "mixtral_sp2": dict(hidden_size=32, intermediate_size=17, num_attention_heads=4, num_key_value_heads=2,
                        tie_word_embeddings=True),
}


def mixtral_model(name: str = "mixtral", seed: int = 0, **changes):
    kwargs = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=512, attn_implementation="eager",
                  initializer_range=0.05, num_local_experts=5, num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.3, sliding_window=None, rope_theta=1e6)
    cfg = transformers.MixtralConfig(**{**kwargs, **MIXTRAL[name], **changes})
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model

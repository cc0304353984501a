"""fpdt-plan on mixture-of-experts models: total and active parameters, k-of-E FLOPs, the MoE
MLP's chunk, and no streamed layers for a run that fits without them."""

import pytest
import torch

import fpdt.model as fm
from fpdt.plan import GPU_PRESETS, Cluster, load_model_config, param_counts, plan
from fpdt.plan.models import layer_mlp_params
from fpdt.train.metrics import ModelShape, layer_matmul_flops

SMALL = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=12, num_experts=6,
             num_experts_per_tok=2, mlp_only_layers=[2], decoder_sparse_step=1)


def test_counts_match_the_model():
    """Total = the model's parameters; active = the same with k of E experts per MoE layer."""
    cfg = load_model_config(SMALL)
    with torch.device("meta"):
        model = fm.construct(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    pc = param_counts(cfg)
    assert pc.total == total
    assert pc.active == total - experts * (6 - 2) // 6
    assert pc.layer == max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    assert layer_mlp_params(cfg, 2) == (3 * 32 * 40,) * 2


def test_qwen3_30b_a3b_preset():
    pc = param_counts(load_model_config("qwen3-30b-a3b"))
    assert round(pc.total / 1e9, 2) == 30.53 and round(pc.active / 1e9, 2) == 3.35


def test_flops_count_k_of_e():
    cfg = load_model_config(SMALL)
    m = ModelShape.from_config(cfg)
    h, qd, kvd = 32, 32, 16
    attn = 2 * h * (qd + 2 * kvd) + 2 * qd * h
    moe_layer = 6 * h * 2 * 12 + 2 * h * 6           # k = 2 experts of width 12, the router's 2 h E
    want = attn + (3 * moe_layer + 6 * h * 40) / 4   # three MoE layers, one dense, per layer on average
    assert layer_matmul_flops(m) == pytest.approx(want)


def test_plan_does_not_stream_an_moe_run_that_fits_unstreamed():
    cluster = Cluster(GPU_PRESETS["h200"], gpus_per_node=1, host_mem_bytes=1900 * 2 ** 30)
    out = plan("qwen3-30b-a3b", cluster, seq_len=1 << 20)
    assert out["setup"]["stream_layers"] is False

"""FLOPs formulas against the closed forms they should reduce to."""

from __future__ import annotations

import pytest

from fpdt.train.metrics import ModelShape, step_rates, train_flops_per_token


def _mha(h=768, l=12, s=2048, V=50304):
    return ModelShape(num_layers=l, hidden_size=h, num_heads=12, num_kv_heads=12, head_dim=h // 12,
                      intermediate_size=8 * h // 3, vocab_size=V)


def test_full_attention_count_is_megatron_without_recompute():
    # Megatron: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per batch of B sequences, no recompute,
    # for MHA with a 4h GeLU MLP -- a SwiGLU of width 8h/3 has the same FLOPs.
    h, l, s, V = 768, 12, 2048, 50304
    m = _mha(h, l, s, V)
    megatron = 72 * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert train_flops_per_token(m, s, causal=False) * s == pytest.approx(megatron, rel=1e-12)
    causal = 72 * s * l * h * h * (1 + s / (12 * h) + V / (12 * l * h))
    assert train_flops_per_token(m, s, causal=True) * s == pytest.approx(causal, rel=1e-12)


def test_recompute_only_in_hfu_and_gqa_lowers_flops():
    m = _mha()
    r = step_rates(m, 2048, tokens=2048, seconds=1.0, n_devices=2, peak_flops=1e12, recompute=True)
    assert r.tgs == 1024 and r.mfu < r.mfu_full and r.hfu > r.mfu
    assert r.hfu / r.mfu == pytest.approx(1 + (train_flops_per_token(m, 2048, recompute=True)
                                               - train_flops_per_token(m, 2048)) / train_flops_per_token(m, 2048))
    gqa = ModelShape(12, 768, 12, 4, 64, 2048, 50304)
    assert train_flops_per_token(gqa, 2048) < train_flops_per_token(m, 2048)
    assert step_rates(m, 2048, 2048, 1.0, 1, None, False).mfu is None


def test_a_lora_step_counts_no_frozen_weight_gradients():
    """LoRA: the frozen linears' and LM head's weight-gradient GEMMs (one forward's worth each)
    are not counted, the adapters' forward, input- and weight-gradient GEMMs are (3 x 2 r (in +
    out) per targeted projection); without the adapters' term it is fpdt-plan's LoRA count."""
    from fpdt.model import LoraSpec
    from fpdt.plan.planner import _lora_flops_fraction
    from fpdt.train.metrics import adapter_flops, forward_flops_per_token, layer_matmul_flops

    m, s = ModelShape(12, 768, 12, 4, 64, 2048, 50304), 4096
    h, qd, kvd, inter, l, V = 768, 768, 256, 2048, 12, 50304
    spec = LoraSpec(16)
    per_layer = 2 * 16 * ((h + qd) + 2 * (h + kvd) + (qd + h) + 3 * (h + inter))
    assert adapter_flops(m, spec) == per_layer
    full = train_flops_per_token(m, s)
    lora = train_flops_per_token(m, s, lora=spec)
    assert lora == pytest.approx(3 * forward_flops_per_token(m, s) - l * layer_matmul_flops(m) - 2 * h * V
                                 + 3 * l * per_layer, rel=1e-12)
    assert (lora - 3 * l * per_layer) / full == pytest.approx(_lora_flops_fraction(m, s, True), rel=1e-12)
    few = LoraSpec(16, targets=("q_proj", "down_proj"))
    assert adapter_flops(m, few) == 2 * 16 * ((h + qd) + (inter + h))
    assert train_flops_per_token(m, s, lora=few) < lora < full
    r = step_rates(m, s, tokens=s, seconds=1.0, n_devices=1, peak_flops=1e12, recompute=True, lora=spec)
    r0 = step_rates(m, s, tokens=s, seconds=1.0, n_devices=1, peak_flops=1e12, recompute=True)
    assert r.mfu == pytest.approx(r0.mfu * lora / full, rel=1e-12)
    assert (r.hfu - r.mfu) * 1e12 / s == pytest.approx(l * (layer_matmul_flops(m) + 0.5 * 4 * qd * s + per_layer))

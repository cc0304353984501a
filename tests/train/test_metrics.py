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

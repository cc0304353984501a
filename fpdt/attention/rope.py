"""Rotary position embedding (RoPE), Hugging Face "rotate half" convention.

Positions are explicit (``position_ids``), so RoPE can be applied to any chunk of any
layout: FPDT applies it per chunk, before the all-to-all, with the chunk's global
positions, and applies its transpose to the gradients in backward. Partial rotary (Qwen3.5's
``partial_rotary_factor``): a table narrower than the head rotates its first ``rotary_dim``
channels and passes the rest through, as Transformers' ``apply_rotary_pos_emb`` does.
"""

from __future__ import annotations

import torch
from torch import nn


def default_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Standard RoPE inverse frequencies ``base ** (-2i / head_dim)``, fp32 ``[head_dim // 2]``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` and turns position ids into ``(cos, sin)``.

    Args:
        inv_freq: fp32 ``[D / 2]`` inverse frequencies (any scaling already applied).
        attention_scaling: factor applied to cos and sin (1.0 except for some scaled RoPE types).
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(attention_scaling)

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` ``[B, n]`` -> ``(cos, sin)``, each ``[B, n, D]`` in ``dtype``; angles in fp32
        (positions beyond 2**24 would lose precision in bf16/fp16).
        """
        inv = self.inv_freq.to(position_ids.device)
        freqs = position_ids.to(torch.float32)[..., None] * inv  # [B, n, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, n, H, D]`` by ``cos``/``sin`` ``[B, n, R]`` (broadcast over heads): its
    first ``R <= D`` channels (``R < D``: partial rotary), the rest unchanged."""
    R = cos.shape[-1]
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    if R == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot = x[..., :R]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., R:]), dim=-1)


def apply_rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`apply_rotary` w.r.t. ``x``: ``dx = g*c - R(g*s)`` (``R`` =
    ``rotate_half``, whose transpose is ``-R``).
    """
    R = cos.shape[-1]
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    if R == grad.shape[-1]:
        return grad * cos - _rotate_half(grad * sin)
    rot = grad[..., :R]
    return torch.cat((rot * cos - _rotate_half(rot * sin), grad[..., R:]), dim=-1)


def apply_rotary_backward_(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary_backward` in place on ``grad`` (returned), with one half-width
    temporary instead of four full-width ones. By halves (``1`` = first ``R/2``):
    ``dx1 = g1*c1 + g2*s2`` and ``dx2 = g2*c2 - g1*s1``; channels past ``R`` pass through."""
    R = cos.shape[-1]
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    g1, g2 = grad[..., :R].chunk(2, dim=-1)
    g1_in = g1.clone()
    g1.mul_(c1).addcmul_(g2, s2)
    g2.mul_(c2).addcmul_(g1_in, s1, value=-1)
    return grad

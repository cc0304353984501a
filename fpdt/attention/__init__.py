"""Attention: block kernels, the online-softmax merge, the FPDT pipeline and its public entry points."""

from fpdt.attention.fpdt_attention import fpdt_attention
from fpdt.attention.kernels import BACKENDS, AttentionBackend, get_backend
from fpdt.attention.merge import OnlineSoftmax
from fpdt.attention.module import FPDTAttention
from fpdt.attention.rope import RotaryEmbedding, apply_rotary, default_inv_freq

__all__ = [
    "BACKENDS", "AttentionBackend", "FPDTAttention", "OnlineSoftmax", "RotaryEmbedding", "apply_rotary",
    "default_inv_freq", "fpdt_attention", "get_backend",
]

"""RoPE inverse frequencies, fp32 ``[D / 2]``, for ``default`` (``theta ** (-2i / D)``),
``linear`` (divided by ``factor``) and ``llama3`` (wavelengths below ``original / high_freq_factor``
kept, above ``original / low_freq_factor`` divided by ``factor``, blended linearly in between), with
an attention scaling of 1.0. Other types are refused by :mod:`fpdt.model.config`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from fpdt.attention.rope import RotaryEmbedding, default_inv_freq


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama-3.1 frequency scaling of fp32 ``inv_freq`` ``[D / 2]`` -> fp32 ``[D / 2]``."""
    old_len = float(original_max_position_embeddings)
    low_freq_wavelen = old_len / low_freq_factor     # longer than this: fully interpolated
    high_freq_wavelen = old_len / high_freq_factor   # shorter than this: untouched
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: Mapping[str, Any] | None) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32 [head_dim / 2], attention_scaling)`` for a parsed config's RoPE."""
    inv_freq = default_inv_freq(head_dim, theta)
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, scaling["factor"], scaling["low_freq_factor"],
                               scaling["high_freq_factor"],
                               scaling["original_max_position_embeddings"]), 1.0
    raise ValueError(f"unsupported rope_type={rope_type!r}")


def build_rotary(head_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                 device: torch.device | str | None = None) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` on ``device`` for the given RoPE settings."""
    inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
    return RotaryEmbedding(inv_freq.to(device) if device is not None else inv_freq, attention_scaling)

"""RoPE inverse frequencies, fp32 ``[D / 2]``, for ``default`` (``theta ** (-2i / D)``),
``linear`` (divided by ``factor``) and ``llama3`` (wavelengths below ``original / high_freq_factor``
kept, above ``original / low_freq_factor`` divided by ``factor``, blended linearly in between), with
an attention scaling of 1.0. Other types are refused by :mod:`fpdt.model.config`.
``partial_rotary_factor`` (Qwen3.5): the frequencies of ``rotary_dim = int(head_dim * factor)``
channels, ``[rotary_dim / 2]``; the attention rotates the first ``rotary_dim`` channels of a head.

Qwen3.5's text rotary (``Qwen3_5TextRotaryEmbedding``, interleaved MRoPE with ``mrope_section``)
computes one angle table per position row (temporal, height, width) and then overwrites the
interleaved channel slots ``1::3`` / ``2::3`` of the temporal table with the height / width
tables' before duplicating it (``cat((f, f))``). For text-only input the three position rows are
equal, so the three tables are equal, the overwrites copy equal values, and the result is plain
RoPE over ``rotary_dim`` channels at the token positions: this module's tables.
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


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                  partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32 [rotary_dim / 2], attention_scaling)`` for a parsed config's RoPE,
    ``rotary_dim = int(head_dim * partial_rotary_factor)``."""
    inv_freq = default_inv_freq(rotary_dim(head_dim, partial_rotary_factor), theta)
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


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """The rotated channels of a head, as Transformers counts them: ``int(head_dim * factor)``."""
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} must be in (0, 1]")
    return int(head_dim * partial_rotary_factor)


def build_rotary(head_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                 device: torch.device | str | None = None, partial_rotary_factor: float = 1.0) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` on ``device`` for the given RoPE settings (``[rotary_dim / 2]``
    frequencies with ``partial_rotary_factor``)."""
    inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling, partial_rotary_factor)
    return RotaryEmbedding(inv_freq.to(device) if device is not None else inv_freq, attention_scaling)

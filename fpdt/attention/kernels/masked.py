"""Document-masked block attention: a :class:`~fpdt.attention.documents.Block` of kind ``masked``.

* ``masked_forward(backend, q, k, v, block, scale) -> (out, lse)``: as the dense kernels, each
  segment ``(row, q0, q1, k0, k1)`` attending queries ``q0:q1`` to keys ``k0:k1`` (causally on a
  diagonal block); rows in no segment get **out 0, lse -inf**.
* ``masked_backward(backend, dout, q, k, v, out, lse, block, scale) -> (dq, dk, dv)`` from the
  *final merged* out and lse: this block's contribution, zero outside the segments, fp32.

Exact implementations: one dense call per distinct segment; the ``cpu`` flash op once with an
additive mask (many small segments, :data:`MASK_MIN_CALLS`, :data:`MASK_MAX_ELEMENTS`); or torch's
varlen FlashAttention-2 on CUDA (:mod:`fpdt.attention.kernels.varlen`).
"""

from __future__ import annotations

import torch

from fpdt.attention.kernels import torch_cpu, varlen
from fpdt.attention.kernels.common import AttentionBackend
from fpdt.attention.kernels.segments import grouped_segments, segments_backward, segments_forward

__all__ = ["grouped_segments", "masked_backward", "masked_forward", "segments_backward", "segments_forward",
           "uses_mask", "visible_mask"]

MASK_MIN_CALLS = 8
MASK_MAX_ELEMENTS = 1 << 24


def visible_mask(block, batch: int, device=None) -> torch.Tensor:
    """``[B, Sq, Sk]`` bool: which keys each query of the block sees."""
    q_seg = torch.full((batch, block.q_len), -1, dtype=torch.int64)   # segment of each query (-1: none)
    k_seg = torch.full((batch, block.k_len), -2, dtype=torch.int64)
    for n, (row, q0, q1, k0, k1) in enumerate(block.segments):
        q_seg[row, q0:q1] = n
        k_seg[row, k0:k1] = n
    q_seg, k_seg = q_seg.to(device), k_seg.to(device)
    mask = q_seg[:, :, None] == k_seg[:, None, :]
    if block.causal:   # a diagonal block: query t sees keys up to t
        t = torch.arange(block.q_len, device=device)
        mask &= t[:, None] >= t[None, :]
    return mask


def uses_mask(backend: AttentionBackend, block, batch: int) -> bool:
    """Whether :func:`masked_forward` takes the one-call mask path for ``block``."""
    return (backend.name == "cpu" and len(grouped_segments(block, batch)) > MASK_MIN_CALLS
            and batch * block.q_len * block.k_len <= MASK_MAX_ELEMENTS)


def masked_forward(backend: AttentionBackend, q, k, v, block, scale):
    """See the module docstring."""
    if varlen.varlen_for(q.device, q.dtype, q.shape[-1]):
        return varlen.varlen_forward(q, k, v, block, scale)
    if uses_mask(backend, block, q.shape[0]):
        return torch_cpu.cpu_masked_forward(q, k, v, visible_mask(block, q.shape[0], q.device), scale)
    return segments_forward(backend, q, k, v, block, scale)


def masked_backward(backend: AttentionBackend, dout, q, k, v, out, lse, block, scale):
    """See the module docstring."""
    if varlen.varlen_for(q.device, q.dtype, q.shape[-1]):
        return varlen.varlen_backward(dout, q, k, v, out, lse, block, scale)
    if uses_mask(backend, block, q.shape[0]):
        return torch_cpu.cpu_masked_backward(dout, q, k, v, out, lse, visible_mask(block, q.shape[0], q.device),
                                             scale)
    return segments_backward(backend, dout, q, k, v, out, lse, block, scale)

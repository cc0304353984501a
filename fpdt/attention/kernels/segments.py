"""The exact masked path on any backend: a masked block as one dense call per document segment
(rows sharing a segment in one call), on views of q/k/v (contract: :mod:`fpdt.attention.kernels.masked`).
Also the reference :func:`fpdt.attention.kernels.varlen.varlen_self_check` compares against."""

from __future__ import annotations

import torch

from fpdt.attention.kernels.common import AttentionBackend


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped_segments(block, batch: int) -> list[tuple[slice, int, int, int, int]]:
    """Segments merged over rows: ``(rows, q0, q1, k0, k1)`` with ``rows`` a slice (all
    ``batch`` rows share the segment, or one row each)."""
    by_span: dict[tuple[int, int, int, int], list[int]] = {}
    for row, q0, q1, k0, k1 in block.segments:
        by_span.setdefault((q0, q1, k0, k1), []).append(row)
    out = []
    for span, rows in by_span.items():
        if rows == list(range(batch)):
            out.append((slice(None), *span))
        else:
            out.extend((slice(r, r + 1), *span) for r in rows)
    return out


def segments_forward(backend: AttentionBackend, q, k, v, block, scale):
    B, Sq, H, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=_acc(q.dtype), device=q.device)
    for rows, q0, q1, k0, k1 in grouped_segments(block, B):
        o, l = backend.forward(q[rows, q0:q1], k[rows, k0:k1], v[rows, k0:k1], block.causal, scale)
        out[rows, q0:q1] = o
        lse[rows, :, q0:q1] = l
    return out, lse


def segments_backward(backend: AttentionBackend, dout, q, k, v, out, lse, block, scale):
    acc = _acc(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for rows, q0, q1, k0, k1 in grouped_segments(block, q.shape[0]):
        g = backend.backward(dout[rows, q0:q1], q[rows, q0:q1], k[rows, k0:k1], v[rows, k0:k1], out[rows, q0:q1],
                             lse[rows, :, q0:q1].contiguous(), block.causal, scale)
        dq[rows, q0:q1] = g[0]   # each query and each key lies in one document: one segment writes it
        dk[rows, k0:k1] = g[1]
        dv[rows, k0:k1] = g[2]
    return dq, dk, dv

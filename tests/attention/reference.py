"""Plain single-process float64 references for the attention tests (no fpdt code paths)."""

from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, causal=True, scale=None):
    """Full attention in float64; q ``[B, S, H, D]``, k/v ``[B, S, H_kv, D]`` (GQA by repeat_interleave)."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        S = q.shape[1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def reference_lse(q, k, causal=True, scale=None):
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        S = q.shape[1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.logsumexp(s, -1)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference_layer(hidden, position_ids, params, heads, rope_base=10000.0):
    """Llama attention layer in float64: projections, RoPE, causal GQA attention, o_proj.

    ``params`` holds float64 leaf tensors ``wq, bq, wk, bk, wv, bv, wo`` (biases may be None).
    """
    H, H_kv, D = heads
    B, S, _ = hidden.shape
    x = hidden.to(torch.float64)
    lin = lambda t, w, b: t @ w.t() + (0 if b is None else b)  # noqa: E731
    q = lin(x, params["wq"], params["bq"]).view(B, S, H, D)
    k = lin(x, params["wk"], params["bk"]).view(B, S, H_kv, D)
    v = lin(x, params["wv"], params["bv"]).view(B, S, H_kv, D)
    inv = 1.0 / (rope_base ** (torch.arange(0, D, 2, dtype=torch.float64, device=hidden.device) / D))
    ang = position_ids.to(torch.float64)[..., None] * inv
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos()[:, :, None], emb.sin()[:, :, None]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    o = reference_attention(q, k, v)
    return o.reshape(B, S, H * D) @ params["wo"].t()


def assert_rel_close(actual, expected, tol, what=""):
    """max|actual - expected| <= tol * max|expected| (norm-wise relative error)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return err


def reference_document_attention(q, k, v, doc_ids, causal=True, scale=None):
    """Packed documents in float64: each document of each row run alone through
    :func:`reference_attention` (``doc_ids`` ``[B, S]``, contiguous documents). Documents of
    equal length go through it together, as the rows of one batch (each still alone)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    spans: dict[int, list[tuple[int, int]]] = {}
    for b in range(q.shape[0]):
        _, counts = torch.unique_consecutive(doc_ids[b], return_counts=True)
        start = 0
        for n in counts.tolist():
            spans.setdefault(n, []).append((b, start))
            start += n
    for n, where in spans.items():
        parts = [torch.stack([t[b, s:s + n] for b, s in where]) for t in (q, k, v)]
        o = reference_attention(*parts, causal, scale)
        for m, (b, s) in enumerate(where):
            out[b, s:s + n] = o[m]
    return out


def doc_ids_from_lengths(lengths_per_row, device=None):
    """``[[len, ...], ...]`` (each row summing to S) -> doc ids ``[B, S]`` (0, 1, ... per row)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row]
                       ).to(device)


def assert_traffic_matches(got, want, phase: str, context) -> None:
    """``got`` = ``(p2p, all_to_all, h2d, d2h)`` as a traffic counter takes them for one phase
    (``"fwd"`` or ``"bwd"``), against :func:`fpdt.attention.ring_costs.attention_costs`' ``want``."""
    p2p, a2a, h2d, d2h = got
    assert p2p == (getattr(want, f"p2p_sends_{phase}"), getattr(want, f"p2p_bytes_{phase}")), (context, p2p, want)
    assert a2a == (getattr(want, f"all_to_alls_{phase}"), getattr(want, f"all_to_all_bytes_{phase}")), \
        (context, a2a, want)
    assert (h2d, d2h) == (getattr(want, f"h2d_bytes_{phase}"), getattr(want, f"d2h_bytes_{phase}")), \
        (context, h2d, d2h, want)

"""``math``: the float64 reference backend (any device; tests and the self-check compare against it).

Expands KV (:func:`~fpdt.attention.kernels.common.expand_kv`) and materialises the
``[B, H, Sq, Sk]`` scores in float64, so it is for checking, not for long sequences.
"""

from __future__ import annotations

import torch

from fpdt.attention.kernels.common import expand_kv, fold_kv_grad


def _scores(q, k, causal, scale):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        Sq, Sk = s.shape[-2:]
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def math_forward(q, k, v, causal, scale):
    qd, kd, vd = (t.to(torch.float64) for t in (q, k, v))
    kd, vd, _ = expand_kv(kd, vd, q.shape[2])
    s = _scores(qd, kd, causal, scale)
    lse = torch.logsumexp(s, dim=-1)                      # [B, H, Sq]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def math_backward(dout, q, k, v, out, lse, causal, scale):
    qd, kd, vd, od, dod = (t.to(torch.float64) for t in (q, k, v, out, dout))
    kd, vd, group = expand_kv(kd, vd, q.shape[2])
    s = _scores(qd, kd, causal, scale)
    p = torch.exp(s - lse.to(torch.float64)[..., None])   # uses the *final* lse
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dod)
    dp = torch.einsum("bqhd,bkhd->bhqk", dod, vd)
    delta = (dod * od).sum(-1).transpose(1, 2)[..., None]  # [B, H, Sq, 1], from the *final* out
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qd) * scale
    return dq, fold_kv_grad(dk, group), fold_kv_grad(dv, group)

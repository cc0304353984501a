"""CPU stand-ins for torch's variable-length FlashAttention-2 ops, with their exact signatures.

``aten._flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
dropout_p, is_causal, return_debug_mask, *, scale, window_size_left, window_size_right,
seqused_k, alibi_slopes, block_table, num_splits) -> (output, softmax_logsumexp, rng_state,
unused, debug_attn_mask)`` and ``aten._flash_attention_backward(grad_out, query, key, value,
out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused,
*, scale, window_size_left, window_size_right) -> (dq, dk, dv)`` (torch 2.13 schemas).

The kernels are float64 reference math per sequence that honours the given (merged) out
and lse in backward, like the real kernel, and check what the real kernel requires:
packed ``[total, H, D]`` fp16/bf16 inputs, head_dim a multiple of 8 (<= 256), ``H % H_kv ==
0`` with unexpanded KV, int32 cumulative lengths ending at the totals with ``max_q/max_k``
at least every length, lse ``[H, total_q]`` fp32 (the meta kernel's layout), the RNG
tensors as the meta kernel makes them. Causal masks are bottom-right aligned per
sequence (FlashAttention's convention). ``CALLS`` records (which, number of sequences).
"""

from __future__ import annotations

import types

import torch

CALLS: list[tuple[str, int]] = []


def _check(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p):
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "varlen inputs are packed [total, H, D]"
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16"
    assert k.dtype == q.dtype and v.dtype == q.dtype
    assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, f"head_size {q.shape[-1]} must be a multiple of 8, <= 256"
    assert k.shape == v.shape and q.shape[-1] == k.shape[-1] and q.shape[1] % k.shape[1] == 0
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension"
    for cu, total, mx in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == q.device, "cu_seqlens must be int32"
        assert cu[0] == 0 and cu[-1] == total and bool((cu[1:] >= cu[:-1]).all())
        assert int((cu[1:] - cu[:-1]).max()) <= mx, "max_seqlen below a sequence length"
    assert cu_q.numel() == cu_k.numel(), "as many key sequences as query sequences"
    assert dropout_p == 0.0


def _sequences(q, k, cu_q, cu_k, scale, causal):
    """Per sequence: (query slice, key slice, float64 scores [H, n_q, n_k])."""
    g = q.shape[1] // k.shape[1]
    for n in range(cu_q.numel() - 1):
        sq = slice(int(cu_q[n]), int(cu_q[n + 1]))
        sk = slice(int(cu_k[n]), int(cu_k[n + 1]))
        kk = k[sk].double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[sq].double(), kk) * scale
        if causal:
            n_q, n_k = s.shape[-2:]
            s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q + 1), float("-inf"))
        yield sq, sk, s, g


def _rng():
    from fpdt.attention.kernels.varlen import _rng_specs
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in _rng_specs()]


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    _check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
    assert not return_debug_mask and seqused_k is None and alibi_slopes is None and block_table is None
    CALLS.append(("forward", cum_seq_q.numel() - 1))
    total, H, _ = query.shape
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.empty(H, total, dtype=torch.float32)
    for sq, sk, s, g in _sequences(query, key, cum_seq_q, cum_seq_k, scale, is_causal):
        l = torch.logsumexp(s, -1)                                          # [H, n_q]
        lse[:, sq] = l.float()
        vv = value[sk].double().repeat_interleave(g, dim=1)
        out[sq] = torch.einsum("hqk,khd->qhd", torch.exp(s - l[..., None]), vv)
    return (out.to(query.dtype), lse, *_rng(), torch.empty(0, dtype=query.dtype))


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    _check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
    H, total = query.shape[1], query.shape[0]
    assert logsumexp.dtype == torch.float32 and tuple(logsumexp.shape) == (H, total) and logsumexp.is_contiguous(), \
        "logsumexp must be [H, total_q] fp32 as the forward returned it"
    assert grad_out.shape == query.shape and out.shape == query.shape
    for t, (shape, dtype) in zip((rng_state, unused), [(tuple(r.shape), r.dtype) for r in _rng()]):
        assert tuple(t.shape) == shape and t.dtype == dtype, "rng_state / unused as the forward made them"
    CALLS.append(("backward", cum_seq_q.numel() - 1))
    dq = torch.zeros(query.shape, dtype=torch.float64)
    dk = torch.zeros(key.shape, dtype=torch.float64)
    dv = torch.zeros(value.shape, dtype=torch.float64)
    H_kv, D = key.shape[1], key.shape[2]
    for sq, sk, s, g in _sequences(query, key, cum_seq_q, cum_seq_k, scale, is_causal):
        p = torch.exp(s - logsumexp[:, sq].double()[..., None])            # from the given lse
        do, o = grad_out[sq].double(), out[sq].double()
        vv = value[sk].double().repeat_interleave(g, dim=1)
        kk = key[sk].double().repeat_interleave(g, dim=1)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * o).sum(-1).t()[..., None])
        dq[sq] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        n_k = s.shape[-1]
        dk[sk] = (torch.einsum("hqk,qhd->khd", ds, query[sq].double()) * scale).view(n_k, H_kv, g, D).sum(2)
        dv[sk] = torch.einsum("hqk,qhd->khd", p, do).view(n_k, H_kv, g, D).sum(2)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def install(monkeypatch):
    """Route :mod:`fpdt.attention.kernels.varlen` to the stand-ins and let it run on the CPU."""
    from fpdt.attention.kernels import varlen
    CALLS.clear()
    monkeypatch.setattr(varlen, "aten", types.SimpleNamespace(_flash_attention_forward=flash_attention_forward,
                                                              _flash_attention_backward=flash_attention_backward))
    monkeypatch.setattr(varlen, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(varlen, "_CHECKS", {})

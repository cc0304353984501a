"""``cpu``: torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``).

It takes equal head counts only, so KV is expanded to ``H`` heads and the replica
gradients are summed in fp32. Its lse is ``[B, H, Sq]`` fp32, unpadded, in and out.
"""

from __future__ import annotations

import torch

from fpdt.attention.kernels.common import bhsd, expand_kv, fold_kv_grad

aten = torch.ops.aten


def cpu_forward(q, k, v, causal, scale):
    k, v, _ = expand_kv(k, v, q.shape[2])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        bhsd(q), bhsd(k), bhsd(v), 0.0, causal, attn_mask=None, scale=scale)
    return bhsd(out), lse


def cpu_backward(dout, q, k, v, out, lse, causal, scale):
    k, v, group = expand_kv(k, v, q.shape[2])
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.contiguous(), 0.0, causal,
        attn_mask=None, scale=scale)
    return bhsd(dq), fold_kv_grad(bhsd(dk), group), fold_kv_grad(bhsd(dv), group)

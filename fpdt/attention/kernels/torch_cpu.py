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


def _float_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Sq, Sk]`` bool -> the op's additive mask ``[B, 1, Sq, Sk]`` (0 or -inf, q's dtype:
    the op refuses a bool mask)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")).unsqueeze(1)


def cpu_masked_forward(q, k, v, visible, scale):
    """The CPU op with a mask: ``visible`` ``[B, Sq, Sk]`` bool. Rows that see no key get
    out 0 and lse -inf (the op itself returns lse 0 for them)."""
    k, v, _ = expand_kv(k, v, q.shape[2])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        bhsd(q), bhsd(k), bhsd(v), 0.0, False, attn_mask=_float_mask(visible, q.dtype), scale=scale)
    none = ~visible.any(-1)                                 # [B, Sq]
    out = bhsd(out).masked_fill(none[:, :, None, None], 0.0)
    return out, lse.masked_fill(none[:, None, :], float("-inf"))


def cpu_masked_backward(dout, q, k, v, out, lse, visible, scale):
    """Backward of :func:`cpu_masked_forward` from the merged (out, lse): a masked key has
    p = exp(-inf - lse) = 0, so it gets no gradient and gives none."""
    k, v, group = expand_kv(k, v, q.shape[2])
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.contiguous(), 0.0, False,
        attn_mask=_float_mask(visible, q.dtype), scale=scale)
    return bhsd(dq), fold_kv_grad(bhsd(dk), group), fold_kv_grad(bhsd(dv), group)

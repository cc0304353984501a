"""Lean RMSNorm: ``weight * cast(x * rstd)`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` in fp32.

The Llama convention (output dtype ``promote(weight, x)``), or zero-centred (Qwen3.5:
``cast(x * rstd * (1 + weight))`` in the input dtype). :class:`RMSNormFunction` saves only
``x`` (no copy), ``rstd`` fp32 ``[..., 1]`` and the weight, and runs over ``num_chunks`` token
chunks both ways, so fp32 temporaries exist for one chunk at a time (plain autograd keeps three
full-length tensors, 5x the bf16 input). Backward recomputes ``x * rstd`` per chunk with the
formulas of :mod:`fpdt.ops.rmsnorm`, the weight gradient in an fp32 accumulator.
"""

from __future__ import annotations

import torch

from fpdt.model.chunks import chunk_bounds
from fpdt.ops.rmsnorm import effective_weight, norm_backward, normalised, rms_norm_reference

__all__ = ["RMSNormFunction", "rms_norm", "rms_norm_reference"]


class RMSNormFunction(torch.autograd.Function):
    """``x`` ``[..., hidden]``, ``weight`` ``[hidden]``, ``eps``, ``num_chunks``, ``zero_centred``
    -> ``[..., hidden]`` in ``promote(weight.dtype, x.dtype)`` (zero-centred: ``x.dtype``).
    Saved: ``x``, ``weight``, ``rstd`` fp32 ``[T, 1]``; nothing offloaded."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, num_chunks: int, zero_centred: bool = False):
        flat = x.reshape(-1, x.shape[-1])                                      # [T, hidden]
        dtype = x.dtype if zero_centred else torch.promote_types(weight.dtype, x.dtype)
        out = torch.empty(flat.shape, dtype=dtype, device=x.device)
        rstd = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)
        w32 = effective_weight(weight, True) if zero_centred else None
        for s, e in chunk_bounds(flat.shape[0], num_chunks):
            x_hat, rstd[s:e] = normalised(flat[s:e], eps)
            if zero_centred:
                out[s:e] = x_hat.mul_(w32)
            else:
                torch.mul(weight, x_hat.to(x.dtype), out=out[s:e])
            del x_hat
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps, ctx.num_chunks, ctx.zero_centred = eps, num_chunks, zero_centred
        return out.view(*x.shape[:-1], x.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        flat = x.reshape(-1, x.shape[-1])
        gflat = grad_out.reshape(-1, grad_out.shape[-1])
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None   # not a view: the caller
        dx_flat = None if dx is None else dx.view(flat.shape)                            # may own it (in place)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        w32 = effective_weight(weight, ctx.zero_centred)
        dtype = torch.float32 if ctx.zero_centred else x.dtype         # the x_hat the weight multiplied
        for s, e in chunk_bounds(flat.shape[0], ctx.num_chunks):
            x_hat, r = normalised(flat[s:e], ctx.eps, rstd[s:e])
            part = norm_backward(gflat[s:e], x_hat, r, w32, dtype, dw, need_dx)
            if need_dx:
                dx_flat[s:e] = part
            del x_hat, part
        del dx_flat
        return (dx,
                None if dw is None else dw.to(weight.dtype), None, None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_chunks: int = 1,
             zero_centred: bool = False) -> torch.Tensor:
    """:class:`RMSNormFunction` (``num_chunks`` token chunks bound its fp32 temporaries)."""
    return RMSNormFunction.apply(x, weight, eps, max(1, num_chunks), zero_centred)

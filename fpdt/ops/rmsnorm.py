"""RMSNorm's math, Llama convention: ``weight * cast(x * rstd)``, ``rstd = 1 / sqrt(mean(x^2) + eps)``
over the last dimension in fp32, cast back to the input dtype before the weight multiply; or
zero-centred (Qwen3.5, ``zero_centred=True``): ``cast(x * rstd * (1 + weight))``, all in fp32.

Shared by the model's lean, chunked RMSNorm (:mod:`fpdt.model.rmsnorm`) and the per-head q/k
norms (Qwen3) inside the chunked projected attention (:mod:`fpdt.attention.projected_attention`).
The backward, with ``x_hat = x * rstd`` and ``g = dy * weight`` (fp32; ``weight`` is ``1 + w``
zero-centred):

    dx = rstd * (g - x_hat * mean(g * x_hat))
    dweight = sum over tokens of dy * cast(x_hat)     (zero-centred: no cast)
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """The plain autograd form (what Transformers' ``LlamaRMSNorm`` computes; zero-centred:
    ``Qwen3_5RMSNorm``)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def effective_weight(weight: torch.Tensor, zero_centred: bool) -> torch.Tensor:
    """The fp32 factor the normalised input is multiplied by: ``weight``, or ``1 + weight``."""
    return 1.0 + weight.float() if zero_centred else weight.float()


def normalised(x: torch.Tensor, eps: float, rstd: torch.Tensor | None = None):
    """-> (fp32 ``x * rstd`` as a fresh tensor, ``rstd`` ``[..., 1]``); ``rstd`` is computed unless given."""
    x32 = x.to(torch.float32, copy=True)
    if rstd is None:
        rstd = torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + eps)
    return x32.mul_(rstd), rstd


def weight_grad(dy: torch.Tensor, x_hat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum over tokens of dy * cast(x_hat)`` in fp32 (``dy`` fp32 ``[..., hidden]``, ``x_hat``
    fp32, cast to the input ``dtype`` as the forward did): this chunk's share of the weight's
    gradient, for an fp32 accumulator."""
    return (dy * x_hat.to(dtype)).reshape(-1, dy.shape[-1]).sum(0)


def input_grad_(g: torch.Tensor, x_hat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``dx = rstd * (g - x_hat * mean(g * x_hat))`` in fp32, computed in place: ``g`` (fp32
    ``dy * weight``) becomes the result and ``x_hat`` is overwritten, so that no other
    temporary of their size is made."""
    dot = (g * x_hat).mean(-1, keepdim=True)
    return g.sub_(x_hat.mul_(dot)).mul_(rstd)


def norm_backward(grad: torch.Tensor, x_hat: torch.Tensor, rstd: torch.Tensor, weight32: torch.Tensor,
                  dtype: torch.dtype, d_weight: torch.Tensor | None = None,
                  need_dx: bool = True) -> torch.Tensor | None:
    """The backward of ``weight * cast(x_hat)`` for one chunk of tokens, from its output gradient
    ``grad`` (any dtype; left unchanged): adds the weight's share (:func:`weight_grad`, ``dtype``
    the input's) into the fp32 accumulator ``d_weight`` (None: a frozen weight) and returns the
    fp32 input gradient (:func:`input_grad_`; None unless ``need_dx``). ``weight32``: the weight
    in fp32. ``x_hat`` is overwritten."""
    dy = grad.to(torch.float32, copy=True)                 # our fp32 copy, never the caller's gradient
    if d_weight is not None:
        d_weight += weight_grad(dy, x_hat, dtype)
    return input_grad_(dy.mul_(weight32), x_hat, rstd) if need_dx else None

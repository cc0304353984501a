"""Chunked fused LM head + cross-entropy: the ``T x V`` logits are never materialised.

:class:`ChunkedLMHeadLossFunction` cuts the final hidden states ``[B, S_local, hidden]`` into
``N`` token chunks; each chunk's fp32 logits ``[T/N, V]`` live only while its loss and its input
gradient ``dh`` are formed, in forward. ``wgrad`` (:data:`WGRAD_MODES`): ``"accumulate"`` sums
``dW`` in an fp32 ``[V, hidden]`` buffer over the chunks; ``"recompute"`` keeps the fp32 lse and
recomputes the logits in backward a vocabulary slice at a time. The loss is ``scale * sum(CE over
valid local tokens)`` (labels ``-100`` ignored), ``scale`` = 1 / valid tokens of the whole
sequence, so the SP ranks' shares add up to the global token mean. Flow, memory and the two
modes: ``docs/model.md`` (The chunked loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fpdt.model.chunks import budget_chunks, chunk_bounds
from fpdt.options import LM_HEAD_WGRAD_MODES

IGNORE_INDEX = -100
WGRAD_MODES = LM_HEAD_WGRAD_MODES


MIN_LOSS_CHUNK_TOKENS = 128
"""The default count's floor: no default chunk has fewer tokens (``docs/model.md``, The chunked loss)."""


def default_loss_chunks(vocab_size: int, hidden_size: int, num_chunks: int = 1, tokens: int | None = None) -> int:
    """``ceil(2 * u * V / hidden)``: each fp32 ``[n, V]`` logits chunk fits one local attention
    chunk of bf16 hidden states (:mod:`fpdt.model.chunks`): ``2 V / hidden`` at ``u = 1``. Given
    the ``tokens`` to chunk, at most ``ceil(tokens / MIN_LOSS_CHUNK_TOKENS)``."""
    count = budget_chunks(num_chunks, hidden_size, 4 * vocab_size)
    return count if tokens is None else floored_loss_chunks(count, tokens)


def floored_loss_chunks(num_chunks: int, tokens: int) -> int:
    """``num_chunks``, but no more than leaves :data:`MIN_LOSS_CHUNK_TOKENS` tokens a chunk (at least 1)."""
    return max(1, min(num_chunks, -(-tokens // MIN_LOSS_CHUNK_TOKENS)))


def lm_loss_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      scale: torch.Tensor | float) -> torch.Tensor:
    """Unchunked form: ``scale * sum CE(hidden W^T, labels)`` with full fp32 logits ``[T, V]``
    (float64 for float64 inputs); ``labels`` -100 ignored; autograd-tracked.
    """
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="sum")
    return ce * scale


class ChunkedLMHeadLossFunction(torch.autograd.Function):
    """``scale * sum CE`` over ``num_chunks`` token chunks (``docs/model.md``, The chunked loss).

    Inputs: ``hidden`` ``[B, S, hidden]``, ``weight`` ``[V, hidden]``, ``labels`` ``[B, S]`` (-100:
    ignore), ``scale`` fp32 0-dim, ``num_chunks``, ``compute_grad`` (False: loss only), ``wgrad``.
    Output: fp32 0-dim. Saved: ``dh`` ``[B, S, hidden]``; with ``"accumulate"`` ``dW`` ``[V, hidden]``
    fp32; with ``"recompute"`` ``hidden``, ``weight``, ``labels``, ``scale`` and fp32 ``lse`` ``[B * S]``.
    Backward scales ``dh`` (and ``dW``) in place: a second backward raises."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, num_chunks: int, compute_grad: bool,
                wgrad: str = "accumulate"):
        flat_h = hidden.reshape(-1, hidden.shape[-1])                 # [T, hidden]
        flat_y = labels.reshape(-1)                                   # [T]
        if flat_y.shape[0] != flat_h.shape[0]:
            raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}")
        need_dh = compute_grad and ctx.needs_input_grad[0]
        need_dw = compute_grad and ctx.needs_input_grad[1]
        recompute = need_dw and wgrad == "recompute"
        scale = scale.to(device=hidden.device, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(flat_h) if need_dh else None
        accumulate = need_dw and not recompute
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if accumulate else None
        lse_all = torch.empty(flat_h.shape[0], dtype=torch.float32, device=hidden.device) if recompute else None
        for s, e in chunk_bounds(flat_h.shape[0], num_chunks):
            hc, yc = flat_h[s:e], flat_y[s:e]                         # [n, hidden], [n]
            logits = F.linear(hc, weight).float()                     # [n, V] fp32
            lse = torch.logsumexp(logits, dim=-1)                     # [n]
            valid = yc != IGNORE_INDEX                                # [n]
            target = yc.clamp(min=0).unsqueeze(1)                     # [n, 1]
            picked = logits.gather(1, target).squeeze(1)              # [n]
            total += torch.where(valid, lse - picked, 0.0).sum()
            if recompute:
                lse_all[s:e] = lse
            if not (need_dh or accumulate):
                continue
            # dlogits = (softmax - onehot) * valid * scale, built in place in the logits buffer.
            grad = logits.sub_(lse.unsqueeze(1)).exp_()
            grad.scatter_add_(1, target, -valid.to(grad.dtype).unsqueeze(1))
            grad.mul_((valid.to(grad.dtype) * scale).unsqueeze(1))
            grad = grad.to(weight.dtype)
            if need_dh:
                dh[s:e] = grad @ weight                               # [n, hidden]
            if accumulate and dw.dtype == grad.dtype:
                dw.addmm_(grad.t(), hc)                               # [V, hidden]
            elif accumulate:   # a bf16 GEMM, summed in fp32 a vocabulary slice at a time: the
                # partial and its fp32 cast are never [V, hidden] (10 bytes per weight element)
                for vs, ve in chunk_bounds(dw.shape[0], -(-hc.shape[1] // max(1, e - s))):
                    dw[vs:ve] += (grad[:, vs:ve].t() @ hc).to(torch.float32)
            del logits, grad
        dh = dh.view_as(hidden) if dh is not None else None
        if recompute:
            ctx.save_for_backward(dh, hidden, weight, labels, scale, lse_all)
        else:
            ctx.save_for_backward(dh, dw)
        ctx.recompute = recompute
        ctx.num_chunks = num_chunks
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        if getattr(ctx, "consumed", False):
            raise RuntimeError("chunked LM-head loss: a second backward through the same forward "
                               "(retain_graph=True) is not supported, its saved gradients were scaled in place "
                               "by the first; run the forward again, or use loss_chunks=0 (full logits)")
        ctx.consumed = True
        if ctx.recompute:
            dh, hidden, weight, labels, scale, lse = ctx.saved_tensors
            dw = _weight_grad_by_vocab_slices(hidden, weight, labels, scale * grad_out, lse, ctx.num_chunks)
        else:
            dh, dw = ctx.saved_tensors
            dw = None if dw is None else dw.mul_(grad_out).to(ctx.weight_dtype)
        dh = None if dh is None else dh.mul_(grad_out.to(dh.dtype))
        return dh, dw, None, None, None, None, None


def _weight_grad_by_vocab_slices(hidden, weight, labels, scale, lse, num_slices: int) -> torch.Tensor:
    """``dW`` ``[V, hidden]`` (weight dtype) one vocabulary slice at a time from the forward's fp32
    ``lse`` ``[T]``; live beside it: one fp32 ``[T, V / num_slices]`` slice and its cast."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])                     # [T, hidden]
    flat_y = labels.reshape(-1)
    valid = flat_y != IGNORE_INDEX
    row_scale = (valid.to(torch.float32) * scale).unsqueeze(1)        # [T, 1]
    dw = torch.empty_like(weight)
    for s, e in chunk_bounds(weight.shape[0], num_slices):
        grad = F.linear(flat_h, weight[s:e]).float()                  # [T, e - s] fp32
        grad.sub_(lse.unsqueeze(1)).exp_()                            # softmax restricted to the slice
        # - onehot, for the targets inside this slice (a scatter: no host sync for a row list)
        mine = (valid & (flat_y >= s) & (flat_y < e)).to(grad.dtype).unsqueeze(1)
        grad.scatter_add_(1, (flat_y - s).clamp(0, e - s - 1).unsqueeze(1), -mine)
        grad.mul_(row_scale)
        torch.mm(grad.to(weight.dtype).t(), flat_h, out=dw[s:e])      # one GEMM over all T tokens
        del grad
    return dw


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    scale: torch.Tensor | float, num_chunks: int, wgrad: str = "accumulate") -> torch.Tensor:
    """``scale * sum CE(hidden W^T, labels)`` (fp32 scalar) with logits one chunk at a time;
    ``num_chunks == 0`` runs :func:`lm_loss_reference` (full logits). ``wgrad``: :data:`WGRAD_MODES`.
    """
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"wgrad={wgrad!r} must be one of {WGRAD_MODES}")
    if not torch.is_tensor(scale):
        scale = torch.tensor(float(scale), device=hidden.device)
    if num_chunks == 0:
        return lm_loss_reference(hidden, weight, labels, scale)
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return ChunkedLMHeadLossFunction.apply(hidden, weight, labels, scale, num_chunks, compute_grad, wgrad)



def valid_token_scale(labels: torch.Tensor, *, group: dist.ProcessGroup | None, sp: int,
                      num_valid_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``1 / N_valid``: valid labels summed over the SP group (or ``num_valid_tokens``);
    an all-ignored window counts as 1, so its loss is 0 (Transformers would give NaN)."""
    if num_valid_tokens is None:
        count = labels.ne(IGNORE_INDEX).sum()                           # int64, this rank
        if sp > 1:
            dist.all_reduce(count, group=group)                         # global valid tokens
    else:
        count = torch.as_tensor(num_valid_tokens, device=labels.device)
    return 1.0 / count.clamp(min=1).to(device=labels.device, dtype=torch.float32)


def sum_over_group(local: torch.Tensor, *, group: dist.ProcessGroup | None, sp: int) -> torch.Tensor:
    """A scalar share ``local`` -> the group's sum as value, ``local``'s gradient only: every rank
    reports the same loss, and parameter gradients *summed* over the group are those of the sum.
    """
    if sp == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total - local.detach())


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the incoming gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_gradient_over_group(loss: torch.Tensor, *, group: dist.ProcessGroup | None, sp: int) -> torch.Tensor:
    """``loss`` unchanged; backward all-reduces its gradient over the group (for Hugging Face
    Trainer's SP loss aggregation, which weighs each rank's copy of a :func:`sum_over_group` loss)."""
    if sp == 1:
        return loss
    return _SumGradientOverGroup.apply(loss, group)


def sequence_parallel_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                              group: dist.ProcessGroup | None, sp: int, num_chunks: int,
                              wgrad: str = "accumulate",
                              num_valid_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Global token-mean cross-entropy of a sequence split over ``sp`` ranks.

    Args:
        hidden: ``[B, S_local, hidden]``; weight: ``[V, hidden]``; labels: ``[B, S_local]``, shifted
            on the global sequence (-100: ignore). group, sp: the SP group and its size;
            ``num_chunks``, ``wgrad``: as :func:`chunked_lm_loss`; num_valid_tokens: the denominator.

    Returns the same fp32 scalar on every rank; parameter gradients summed over the group are the
    global mean's (``docs/model.md``, gradient convention)."""
    scale = valid_token_scale(labels, group=group, sp=sp, num_valid_tokens=num_valid_tokens)
    local = chunked_lm_loss(hidden, weight, labels, scale.to(hidden.device), num_chunks, wgrad=wgrad)
    return sum_over_group(local, group=group, sp=sp)

"""Online-softmax merge of partial attention results, in fp32.

Block ``j`` gives ``(o_j, lse_j)`` for the same queries; two merge as ``lse = logaddexp(lse_a,
lse_b)``, ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``, with ``logaddexp`` as ``max +
log1p(exp(-|a - b|))`` so a fully masked side (``-inf``) gets weight 0, never nan.
:class:`OnlineSoftmax` merges **in place** (:func:`merge_`): the fp32 running output ``[B, S, H,
D]`` is its only full-size fp32 tensor (2 U for a bf16 chunk of U bytes), blocks are folded in
with ``addcmul_`` from their own dtype, and temporaries are lse-sized ``[B, H, S]``.
"""

from __future__ import annotations

import torch


class OnlineSoftmax:
    """Running ``(out, lse)`` accumulator for one query chunk: ``out`` ``[B, S, H, D]`` and ``lse``
    ``[B, H, S]`` in ``acc_dtype`` (fp32, float64 for float64 inputs). The first block is taken over
    (not copied when already ``acc_dtype``: callers hand over results they do not reuse); later
    blocks are merged in place.
    """

    def __init__(self, acc_dtype: torch.dtype = torch.float32):
        self.acc_dtype = acc_dtype
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def update(self, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
        if self.out is None:
            self.out = out_blk.to(self.acc_dtype, memory_format=torch.contiguous_format)
            self.lse = lse_blk.to(self.acc_dtype, memory_format=torch.contiguous_format)
            return
        merge_(self.out, self.lse, out_blk, lse_blk.to(self.acc_dtype))


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """-> (merged lse, weight of a, weight of b), all ``[B, H, S]``; masked rows get 0 weights."""
    hi = torch.maximum(lse_a, lse_b)
    lo = torch.minimum(lse_a, lse_b)
    both_masked = hi == float("-inf")
    safe_hi = hi.masked_fill(both_masked, 0.0)
    lse = safe_hi + torch.log1p(torch.exp(lo - safe_hi))
    lse = torch.where(both_masked, hi, lse)
    safe_lse = lse.masked_fill(both_masked, 0.0)
    w_a = torch.exp(lse_a - safe_lse).masked_fill_(both_masked, 0.0)
    w_b = torch.exp(lse_b - safe_lse).masked_fill_(both_masked, 0.0)
    return lse, w_a, w_b


def merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In-place :func:`merge`: ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]`` (the
    accumulator dtype) absorb block ``(out_b, lse_b)``; ``out_b`` may have a lower
    precision (it is read, converted element by element, never copied)."""
    new_lse, w_a, w_b = _weights(lse, lse_b)
    out.mul_(w_a.transpose(1, 2).unsqueeze(-1)).addcmul_(out_b, w_b.transpose(1, 2).unsqueeze(-1))
    lse.copy_(new_lse)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results (out ``[B, S, H, D]``, lse ``[B, H, S]``) into new tensors."""
    lse, w_a, w_b = _weights(lse_a, lse_b)
    out = out_a * w_a.transpose(1, 2).unsqueeze(-1) + out_b * w_b.transpose(1, 2).unsqueeze(-1)
    return out, lse

"""Online-softmax merge of partial attention results, in fp32.

Each key block ``j`` gives, for the same queries, ``(o_j, lse_j)``: the softmax-weighted
average over that block and the log of its normaliser. Merging two results::

    lse = logaddexp(lse_a, lse_b)
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

``logaddexp`` is computed as ``max + log1p(exp(-|a - b|))``, which stays finite when one
side is ``-inf`` (a fully masked row) and returns ``-inf`` only when both are; the
weights are then forced to 0 instead of ``exp(-inf - -inf) = nan``.
"""

from __future__ import annotations

import torch


class OnlineSoftmax:
    """Running ``(out, lse)`` accumulator for one query chunk.

    ``out`` is kept ``[B, S, H, D]`` and ``lse`` ``[B, H, S]``, both in ``acc_dtype``
    (fp32, or float64 when the inputs are float64). The first block is copied, not merged.
    """

    def __init__(self, acc_dtype: torch.dtype = torch.float32):
        self.acc_dtype = acc_dtype
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def update(self, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
        out_blk = out_blk.to(self.acc_dtype)
        lse_blk = lse_blk.to(self.acc_dtype)
        if self.out is None:
            self.out, self.lse = out_blk.clone(), lse_blk.clone()
            return
        self.out, self.lse = merge(self.out, self.lse, out_blk, lse_blk)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results (out ``[B, S, H, D]``, lse ``[B, H, S]``, same float dtype).

    Returns new tensors; never writes into its inputs.
    """
    hi = torch.maximum(lse_a, lse_b)
    lo = torch.minimum(lse_a, lse_b)
    both_masked = hi == float("-inf")
    safe_hi = torch.where(both_masked, torch.zeros_like(hi), hi)
    lse = safe_hi + torch.log1p(torch.exp(lo - safe_hi))
    lse = torch.where(both_masked, hi, lse)
    safe_lse = torch.where(both_masked, torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe_lse).masked_fill(both_masked, 0.0)  # [B, H, S]
    w_b = torch.exp(lse_b - safe_lse).masked_fill(both_masked, 0.0)
    out = out_a * w_a.transpose(1, 2).unsqueeze(-1) + out_b * w_b.transpose(1, 2).unsqueeze(-1)
    return out, lse

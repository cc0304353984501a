"""Head bookkeeping for Ulysses: how heads split over ranks, and GQA/MQA KV replication.

The sp degree ``P`` must divide the query heads ``H``. If ``P`` divides ``H_kv`` the KV heads
scatter as they are; otherwise each is replicated ``f = P / gcd(H_kv, P)`` times with
``repeat_interleave`` (never tiling), and the replicas' gradients are summed in backward.
"""

from __future__ import annotations

import math

import torch


def kv_replication_factor(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is repeated for an sp degree of ``sp_size``; ``ValueError``
    naming the fix when the heads cannot be split.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_heads % sp_size:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the sequence-parallel size {sp_size}: "
            f"Ulysses gives each rank H/sp heads; use an sp size that divides {num_heads}"
        )
    if num_kv_heads % sp_size == 0:
        return 1
    # H_kv * factor = lcm(H_kv, sp), which divides H because both H_kv and sp do.
    factor = sp_size // math.gcd(num_kv_heads, sp_size)
    return factor


def replicate_kv(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``[B, n, H_kv, D]`` -> ``[B, n, H_kv * factor, D]``, each head repeated in place."""
    return x if factor == 1 else x.repeat_interleave(factor, dim=2)


def sum_kv_replicas(grad: torch.Tensor, factor: int) -> torch.Tensor:
    """Backward of :func:`replicate_kv`: ``[B, n, H_kv * f, D]`` -> ``[B, n, H_kv, D]``."""
    if factor == 1:
        return grad
    B, n, H, D = grad.shape
    return grad.reshape(B, n, H // factor, factor, D).sum(dim=3)

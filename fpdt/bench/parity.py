"""How far apart two rounding errors may be by chance, for parity checks against a float64 reference."""

from __future__ import annotations

import functools

import torch


@functools.cache
def chance_ratio(n: int, odds: float = 1e-3, draws: int = 100_000) -> float:
    """The ratio of two ``n``-element error norms that chance passes with probability ``odds``, each
    error modelled as ``n`` independent Gaussians: the ``1 - odds`` quantile of ``sqrt(F(n, n))``, by
    seeded sampling (about 7 for n = 4, 3.5 for n = 8, 1.5 for n = 64)."""
    g = torch.Generator().manual_seed(0)
    chi2 = torch.randn(2, draws, n, generator=g, dtype=torch.float64).pow(2).sum(-1)
    return torch.quantile((chi2[0] / chi2[1]).sqrt(), 1 - odds).item()

"""The longest sequence that fits: doubling from the shortest, then bisection."""

from __future__ import annotations

from typing import Callable


def longest_fitting(fits: Callable[[int], bool], step: int, min_len: int, max_len: int, resolution: int) -> int:
    """Longest multiple of ``step`` in ``[min_len, max_len]`` for which ``fits(length)`` (0 if none):
    lengths double from ``min_len`` (at least one step) up to ``max_len``, which is tried too, and
    bisection narrows the last passing and first failing length to ``resolution`` tokens."""
    lo, hi, top = 0, None, max_len // step
    k = max(1, min_len // step)
    while k <= top:
        if not fits(k * step):
            hi = k
            break
        lo = k
        if k == top:
            break
        k = min(2 * k, top)                     # doubling, then max_len itself
    if hi is None:
        return lo * step
    while hi - lo > 1 and (hi - lo) * step >= resolution:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step

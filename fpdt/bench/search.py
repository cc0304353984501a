"""The longest sequence that fits (doubling from the shortest, then bisection), and whether a
measured first step would fit the device in its steady state."""

from __future__ import annotations

from typing import Callable

GIB = 1024 ** 3


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


def over_capacity(device_peak: float, capacity: float | None, device_mem_gib: float | None) -> str | None:
    """Why a completed first step does not fit, or None: its steady-state peak (forward+backward
    beside the optimizer state it created, or the optimizer step) passes ``capacity``, the
    simulated ``--device-mem-gib`` or, on CUDA, the memory free to tensors at the trial's start
    (the smaller). Only a second step would have run out, so the first one alone cannot tell."""
    if capacity is None or device_peak <= capacity:
        return None
    if device_mem_gib and capacity >= device_mem_gib * GIB:
        return f"device tier {device_peak / GIB:.3f} GiB > --device-mem-gib {device_mem_gib}"
    return (f"steady-state step peak {device_peak / GIB:.3f} GiB (first step's forward+backward beside the "
            f"optimizer state) > the {capacity / GIB:.2f} GiB free to tensors on the device")

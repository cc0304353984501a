"""Straight-line fits of measurements against the sequence length."""

from __future__ import annotations


def least_squares(pts: list[tuple[float, float]]) -> tuple[float, float] | None:
    """``(slope, intercept)`` of the least-squares line through ``(x, y)`` points (None with
    fewer than two distinct x)."""
    if len(pts) < 2:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return slope, my - slope * mx


def slope_per_1k(trials: list[dict], key: str = "device_peak_bytes") -> float | None:
    """Least-squares slope of ``key`` against ``seq_len``, in bytes per 1K tokens, over every
    trial whose step completed (``measured``; including those over a simulated capacity)."""
    fit = least_squares([(t["seq_len"], t[key]) for t in trials if t.get("measured") and t.get(key) is not None])
    return None if fit is None else 1024 * fit[0]

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


def growing_peak(t: dict) -> int:
    """The part of a trial's steady-state peak that grows with the length: the forward+backward
    peak with the optimizer state live beside it (older files: the step's device peak)."""
    if t.get("fwd_bwd_peak_bytes") is None:
        return t["device_peak_bytes"]
    return t["fwd_bwd_peak_bytes"] + t.get("optimizer_state_bytes", 0)


def extrapolate(trials: list[dict], cap_bytes: float) -> int | None:
    """Length at which the least-squares line of the completed trials' :func:`growing_peak`
    reaches ``cap_bytes`` (None when it does not grow or the optimizer step alone passes it)."""
    done = [t for t in trials if t.get("measured")]
    line = least_squares([(t["seq_len"], growing_peak(t)) for t in done])
    if line is None or line[0] <= 0:
        return None
    if any(t.get("optimizer_peak_bytes", 0) > cap_bytes for t in done):
        return None
    return round((cap_bytes - line[1]) / line[0])

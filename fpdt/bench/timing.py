"""Wall-clock timing of device work: the host waits for the device before reading the clock."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from fpdt.offload import resolve_runtime


def sync(device: torch.device, runtime: str | None = None) -> None:
    """Block the host until ``device`` is idle: the offload runtime's own wait (``runtime``, e.g.
    ``"sim"``, which covers its copies too; None: the device's default, a CUDA synchronize on CUDA)."""
    rt = resolve_runtime(runtime, device)
    rt.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device, runtime: str | None = None) -> float:
    """Seconds of one ``fn()``, the device idle before and after."""
    sync(device, runtime)
    start = time.perf_counter()
    fn()
    sync(device, runtime)
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, iters: int,
                   runtime: str | None = None) -> float:
    """Median :func:`seconds` of ``fn()`` over ``iters`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn, device, runtime) for _ in range(iters))

"""Deterministic buffer release after an asynchronous collective on gloo.

gloo's worker thread holds a collective's work object (and its tensors) until a moment *after*
``work.wait()`` returns, so a buffer dropped right after ``wait()`` is freed whenever that thread
runs, and live-byte counts would depend on machine load. :func:`finish` waits for the works, drops
them and waits (bounded) until the backend no longer references the buffers, so they are freed
when the caller drops them, as on NCCL. Only CPU tensors are polled.
"""

from __future__ import annotations

import time

import torch

_MAX_WAIT_S = 2.0  # a worker that has finished a collective leaves its loop in microseconds


class _Stats:
    """``timeouts``: releases that gave up waiting (a caller holding extra references to a
    buffer it handed to a collective would cause them; tests assert there are none)."""

    timeouts = 0


stats = _Stats()


def use_counts(tensors: list[torch.Tensor]) -> list[int]:
    """References to each tensor held before a collective is issued (the baseline)."""
    return [t._use_count() for t in tensors]


def finish(works: list, tensors: list[torch.Tensor], baseline: list[int]) -> None:
    """Wait for ``works``, then for the backend to let go of ``tensors``.

    ``baseline`` is :func:`use_counts` of ``tensors`` taken before the collective was
    issued; the caller must drop its own handles to ``works`` before calling (they hold
    references too) -- this function drops the list it is given.
    """
    while works:  # pop, so no loop variable keeps the last work (and its buffers) alive
        works.pop(0).wait()
    pending = [(t, n) for t, n in zip(tensors, baseline) if t.device.type == "cpu"]
    deadline = None
    while any(t._use_count() > n for t, n in pending):
        now = time.monotonic()
        deadline = deadline or now + _MAX_WAIT_S
        if now > deadline:  # never wrong to stop: only the moment of the free changes
            stats.timeouts += 1
            return
        time.sleep(0)

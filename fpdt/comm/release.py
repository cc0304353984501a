"""Deterministic buffer release after an asynchronous collective on gloo.

A gloo collective's work object holds references to its send and receive tensors, and
gloo's worker thread holds that work object until it leaves its loop -- a moment *after*
``work.wait()`` has returned. A buffer the caller drops right after ``wait()`` is then
freed whenever that thread gets scheduled, which makes live-byte counts (and so the
memory budget tests) depend on machine load. :func:`finish` waits for the works, drops
them, and then waits (briefly, bounded) until the backend no longer references the
buffers, so they are freed exactly when the caller drops them, as on NCCL where the
caching allocator's stream semantics decide reuse.

Only CPU tensors are polled; CUDA tensors return right after ``wait()``.
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

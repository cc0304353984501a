"""Buffers handed to a gloo collective are released when the caller drops them, not when
gloo's worker thread next runs (what makes the memory budget tests load-independent)."""

import pytest

import threading

import torch

from fpdt.comm import release, start_seq_to_heads_packed
from fpdt.comm.ring import RingComm
from tests.distributed import run_distributed


def _hog(stop):  # keep a Python thread busy so gloo's workers are scheduled late
    while not stop.is_set():
        sum(range(1000))


def _body(rank, world):
    stop = threading.Event()
    hogs = [threading.Thread(target=_hog, args=(stop,)) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        comm = RingComm(list(range(world)), None)
        for _ in range(20):
            x = torch.randn(1, 8, 4 * world, 16)
            pending = start_seq_to_heads_packed((x,), None)
            send, recv = pending._send, pending._recv
            pending.wait()
            assert send._use_count() == 1 and recv._use_count() == 1, (send._use_count(), recv._use_count())
            a, b = torch.randn(256), torch.empty(256)
            p2p = comm.exchange([(a, (rank + 1) % world, 11)], [(b, (rank - 1) % world, 11)])
            p2p.wait()
            assert a._use_count() == 1 and b._use_count() == 1, (a._use_count(), b._use_count())
            assert torch.isfinite(b).all()
        assert release.stats.timeouts == 0
    finally:
        stop.set()
        for h in hogs:
            h.join()


@pytest.mark.slow
def test_collective_buffers_released_at_wait():
    run_distributed(_body, 2)


class _LateWorker:
    """A work whose 'backend thread' keeps its own reference to the buffer for a while
    after ``wait()`` has returned, as gloo's worker does under load."""

    def __init__(self, t, delay_s):
        # an autograd node that saved ``t`` holds a C++ reference to it, like a gloo work
        self._hold = [torch.ones(1, requires_grad=True) * t]
        threading.Timer(delay_s, self._hold.clear).start()

    def wait(self):
        return True


def test_finish_waits_for_the_backend_to_let_go():
    t = torch.empty(1 << 10)
    base = release.use_counts([t])
    works = [_LateWorker(t, 0.05)]
    assert t._use_count() == 2
    release.finish(works, [t], base)
    assert works == [] and t._use_count() == 1  # without the poll this would still be 2
    assert release.stats.timeouts == 0

"""Ring and double-ring point-to-point exchange over a CP group.

``n = cp / w`` inner rings of ``w`` consecutive CP ranks. A block (one rank's packed K/V chunk)
visits every rank in ``cp`` steps, crossing ``cp - 1`` links; outer transfers (LoongTrain's double
ring, arXiv 2406.18485) carry each inner ring's starting block on, in flight for the whole inner
ring. A block's fp32 dK/dV travel behind it to its owner. :class:`RingComm` issues batched
``isend/irecv`` and counts operations and bytes. Step by step: ``docs/attention.md`` (The mesh
pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fpdt.comm import release

# One tag per logical channel, so gloo never matches a message to the wrong receive when
# two channels connect the same pair of ranks (NCCL matches in issue order; every rank
# issues the channels in the same order).
TAG_INNER, TAG_OUTER, TAG_GRAD = 11, 12, 13


@dataclass(frozen=True)
class RingSchedule:
    """Who holds which block when, for CP rank ``rank`` in a double ring of ``w`` of ``cp``."""

    cp: int
    w: int
    rank: int

    @property
    def n(self) -> int:
        return self.cp // self.w

    def _coords(self, c: int) -> tuple[int, int]:
        return divmod(c, self.w)

    def _rank(self, r: int, p: int) -> int:
        return (r % self.n) * self.w + p % self.w

    def owner(self, step: int) -> int:
        """CP rank whose block this rank holds at ``step``."""
        o, t = divmod(step, self.w)
        r, p = self._coords(self.rank)
        return self._rank(r - o, p - t)

    def inner_peers(self) -> tuple[int, int]:
        """``(send_to, recv_from)`` of the inner ring."""
        r, p = self._coords(self.rank)
        return self._rank(r, p + 1), self._rank(r, p - 1)

    def outer_peers(self) -> tuple[int, int]:
        """``(send_to, recv_from)`` of the outer ring."""
        r, p = self._coords(self.rank)
        return self._rank(r + 1, p), self._rank(r - 1, p)

    def grad_peers(self, step: int) -> tuple[int, int]:
        """``(send_to, recv_from)`` of the gradients that follow the blocks after ``step``."""
        r, p = self._coords(self.rank)
        if (step % self.w) + 1 < self.w:
            return self._rank(r, p + 1), self._rank(r, p - 1)
        return self._rank(r + 1, p + 1), self._rank(r - 1, p - 1)

    def sends_inner(self, step: int) -> bool:
        return (step % self.w) + 1 < self.w

    def sends_outer(self, step: int) -> bool:
        return step % self.w == 0 and step // self.w + 1 < self.n


@dataclass
class P2PStats:
    """Point-to-point traffic issued by this rank (sends only; receives mirror them)."""

    sends: int = 0
    bytes_sent: int = 0

    def reset(self) -> None:
        self.sends = self.bytes_sent = 0


class PendingP2P:
    """Transfers in flight; :meth:`wait` blocks until they are done (on NCCL the current
    stream waits, not the host)."""

    def __init__(self, works: list, tensors: list[torch.Tensor], baseline: list[int]):
        self._works = works
        self._tensors = tensors  # keep send/receive buffers alive until the transfer is done
        self._baseline = baseline

    def wait(self) -> None:
        works, self._works = self._works, []
        release.finish(works, self._tensors, self._baseline)
        self._tensors = []


class RingComm:
    """Batched ``isend/irecv`` among the ranks of one CP group.

    Args:
        cp_ranks: global ranks of the CP group, in CP order (peers are CP indices).
        group: the CP process group.
        outer_group: the same ranks in a second communicator for the outer ring's
            transfers (default ``group``), so they do not queue behind the inner ring's.
    """

    def __init__(self, cp_ranks: list[int], group: dist.ProcessGroup | None,
                 outer_group: dist.ProcessGroup | None = None):
        self.cp_ranks = list(cp_ranks)
        self.group = group
        self.outer_group = group if outer_group is None else outer_group
        self.stats = P2PStats()

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]],
                 recvs: list[tuple[torch.Tensor, int, int]], outer: bool = False) -> PendingP2P:
        """Start ``(tensor, cp_peer, tag)`` sends and receives (in the outer ring's
        communicator with ``outer``); returns the pending batch."""
        group = self.outer_group if outer else self.group
        ops = []
        for t, peer, tag in sends:
            ops.append(dist.P2POp(dist.isend, t, self.cp_ranks[peer], group, tag))
            self.stats.sends += 1
            self.stats.bytes_sent += t.numel() * t.element_size()
        for t, peer, tag in recvs:
            ops.append(dist.P2POp(dist.irecv, t, self.cp_ranks[peer], group, tag))
        tensors = [t for t, _, _ in sends] + [t for t, _, _ in recvs]
        baseline = release.use_counts(tensors)
        return PendingP2P(dist.batch_isend_irecv(ops) if ops else [], tensors, baseline)

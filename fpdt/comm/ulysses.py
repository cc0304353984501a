"""Ulysses all-to-all: swap a sequence shard for a head shard, and back.

``P`` = size of ``group``: sequence layout ``[B, n, H, D]`` (this rank's ``n`` tokens, all heads)
<-> head layout ``[B, P*n, H/P, D]`` (every rank's ``n`` tokens in rank order, this rank's
contiguous ``H/P`` heads). The plain functions are the mechanism (the pipelines call them inside
their own autograd Functions); :class:`SeqToHeads` / :class:`HeadsToSeq` wrap them for autograd.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fpdt.comm import release


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """Rank inside ``group``; 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (equal splits) of a contiguous tensor."""
    out = torch.empty_like(x)
    base = release.use_counts([x, out])
    release.finish([dist.all_to_all_single(out, x, group=group, async_op=True)], [x, out], base)
    return out


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[B, n, H, D]`` (sequence layout) -> ``[B, P*n, H/P, D]`` (head layout)."""
    return start_seq_to_heads_packed((x,), group).wait()[0]


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[B, P*n, H/P, D]`` (head layout) -> ``[B, n, H, D]`` (sequence layout)."""
    P = group_size(group)
    if P == 1:
        return x
    B, Pn, Hl, D = x.shape
    if Pn % P:
        raise ValueError(f"gathered length {Pn} is not divisible by the sp size {P}")
    n = Pn // P
    # [B, P, n, H/P, D] -> [P, B, n, H/P, D]: the tokens of rank p go back to rank p
    send = x.reshape(B, P, n, Hl, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = _all_to_all(send, group)  # block p holds head group p of our tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(B, n, P * Hl, D)


class PendingAllToAll:
    """An all-to-all in flight. :meth:`wait` returns its result; on NCCL the current CUDA
    stream waits for it (the host does not), on gloo the host waits."""

    def __init__(self, work, send: torch.Tensor | None, recv, finish, baseline: list[int] | None = None):
        self._work, self._send, self._recv, self._finish = work, send, recv, finish
        self._baseline = baseline

    def wait(self):
        if self._work is not None:
            works, self._work = [self._work], None
            release.finish(works, [self._send, self._recv], self._baseline)
        self._send = None  # the send buffer may go once the collective is done
        return self._finish(self._recv)


def start_seq_to_heads_packed(xs: list[torch.Tensor] | tuple[torch.Tensor, ...],
                              group: dist.ProcessGroup | None) -> PendingAllToAll:
    """Start :func:`seq_to_heads` of several ``[B, n, H_i, D]`` tensors as one asynchronous
    all-to-all (one message per rank); ``.wait()`` gives ``[B, P*n, H_i/P, D]`` views.
    """
    P = group_size(group)
    if P == 1:
        return PendingAllToAll(None, None, list(xs), lambda recv: recv)
    B, n, _, D = xs[0].shape
    for x in xs:
        if x.shape[2] % P:
            raise ValueError(f"cannot scatter {x.shape[2]} heads over {P} ranks: heads must be divisible by the sp size")
    local = [x.shape[2] // P for x in xs]
    hs = sum(local)
    # [B, n, P, sum h, D] -> [P, B, n, sum h, D]: block p (every tensor's p-th head slice) goes to rank p
    parts = [x.reshape(B, n, P, h, D) for x, h in zip(xs, local)]
    packed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
    send = packed.permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    baseline = release.use_counts([send, recv])
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def finish(recv):  # block p holds rank p's n tokens
        return list(recv.permute(1, 0, 2, 3, 4).reshape(B, P * n, hs, D).split(local, dim=2))

    return PendingAllToAll(work, send, recv, finish, baseline)


def seq_to_heads_packed(xs: list[torch.Tensor] | tuple[torch.Tensor, ...],
                        group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """:func:`seq_to_heads` of several tensors in one (blocking) all-to-all; see
    :func:`start_seq_to_heads_packed`."""
    return start_seq_to_heads_packed(xs, group).wait()


def heads_to_seq_packed(xs: list[torch.Tensor] | tuple[torch.Tensor, ...],
                        group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """:func:`heads_to_seq` of several ``[B, P*n, H_i/P, D]`` tensors in one all-to-all."""
    P = group_size(group)
    if P == 1:
        return list(xs)
    B, Pn, _, D = xs[0].shape
    local = [x.shape[2] for x in xs]
    out = heads_to_seq(torch.cat(list(xs), dim=2), group)  # [B, n, P * sum h, D]
    parts = out.reshape(B, Pn // P, P, sum(local), D).split(local, dim=3)
    return [part.reshape(B, Pn // P, P * h, D) for part, h in zip(parts, local)]


class SeqToHeads(torch.autograd.Function):
    """Autograd all-to-all, sequence layout -> head layout. Saves nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Autograd all-to-all, head layout -> sequence layout. Saves nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return seq_to_heads(grad.contiguous(), ctx.group), None

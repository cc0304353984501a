"""Host<->device bytes moved by one offloaded FPDT attention layer (causal), by formula.

Per layer and rank, training forward + backward (:func:`attention_layer_copy_bytes`), with
packed documents counting only the blocks that run and the output projection's extra fetch of
every ``o_i`` when it reads its input from the stash. :func:`saved_attention_bytes`: host bytes
per layer of ``attention_checkpoint="save"``, ``B S (H D e + 4 H) / P`` (fp32 lse). Notation and
formulas: ``docs/attention.md`` (Host <-> device bytes of one layer); checked against the
runtime's counters in ``tests/offload/test_schedule.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fpdt.comm import kv_replication_factor


@dataclass(frozen=True)
class CopyVolume:
    """Bytes moved each way."""

    d2h: int
    h2d: int


def attention_layer_copy_bytes(*, batch: int, seq_local: int, hidden: int, num_heads: int, num_kv_heads: int,
                               head_dim: int, sp: int, num_chunks: int, dtype: torch.dtype,
                               for_backward: bool = True, doc_ids: torch.Tensor | None = None,
                               o_proj_from_stash: bool = False) -> CopyVolume:
    """The formula of ``docs/attention.md`` for one offloaded, causal FPDT attention layer
    (forward with ``for_backward``, plus its backward; or a no-grad forward); ``doc_ids``
    ``[B, S]``: packed documents of the global sequence (None: one); ``o_proj_from_stash``: the
    output projection's backward reads its input back from the stash (``u o`` more H2D)."""
    u, P = num_chunks, sp
    L = seq_local // u
    C = P * L
    e = torch.empty((), dtype=dtype).element_size()
    a = 8 if dtype == torch.float64 else 4
    Hq = num_heads // P
    Hk = num_kv_heads * kv_replication_factor(num_heads, num_kv_heads, P) // P
    T = batch * L * hidden * e
    q = batch * C * Hq * head_dim * e
    k = batch * C * Hk * head_dim * e
    lse = batch * Hq * C * a
    dq = batch * C * Hq * head_dim * a
    pairs_below = u * (u - 1) // 2      # (i, j) with j < i
    pairs = u * (u + 1) // 2            # (i, j) with j <= i
    multi = u - 1                       # query chunks touched more than once
    if doc_ids is not None:
        from fpdt.attention.ring_costs import document_work
        pairs, multi, _ = document_work(doc_ids, seq_len=seq_local * P, hp=P, num_chunks=u)
        pairs_below = pairs - u
    if not for_backward:
        return CopyVolume(d2h=u * 2 * k, h2d=pairs_below * 2 * k)
    d2h = u * (T + 2 * k + 2 * q + lse) + multi * q + pairs_below * dq
    h2d = u * T + pairs * (2 * k + 2 * q + lse) + pairs_below * (q + dq) + (u * q if o_proj_from_stash else 0)
    return CopyVolume(d2h=d2h, h2d=h2d)


def saved_attention_bytes(*, batch: int, seq_local: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one layer keeps per rank under ``attention_checkpoint="save"``: its attention output
    ``[B, S_local, H, D]`` in ``dtype`` (``S_local = S / P``, in head layout across the chunks)
    and the lse ``[B, H, S_local]`` in fp32 (float64 for float64), i.e. ``B S (H D e + 4 H) / P``."""
    e = torch.empty((), dtype=dtype).element_size()
    a = 8 if dtype == torch.float64 else 4
    return batch * seq_local * num_heads * (head_dim * e + a)


def checkpointed_attention_copy_bytes(*, batch: int, seq_local: int, hidden: int, num_heads: int,
                                      num_kv_heads: int, head_dim: int, sp: int, num_chunks: int,
                                      dtype: torch.dtype, saved: bool) -> CopyVolume:
    """One step of a checkpointed, offloaded causal FPDT attention layer whose saved outputs
    (``saved``: ``attention_checkpoint="save"``) are on the host: the no-grad first forward,
    the recompute's forward and the backward (layer inputs not included)."""
    shape = dict(batch=batch, seq_local=seq_local, hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, sp=sp, num_chunks=num_chunks, dtype=dtype)
    first = attention_layer_copy_bytes(**shape, for_backward=False)
    train = attention_layer_copy_bytes(**shape)
    if not saved:
        return CopyVolume(d2h=first.d2h + train.d2h, h2d=first.h2d + train.h2d)
    u, P = num_chunks, sp
    o = batch * (seq_local // u) * P * (num_heads // P) * head_dim * torch.empty((), dtype=dtype).element_size()
    lse = saved_attention_bytes(batch=batch, seq_local=seq_local, num_heads=num_heads, head_dim=head_dim,
                                dtype=dtype) // u - o
    # first forward: + u (o + lse) out; recompute: - u (o + lse) out (host buffers move), + u o in,
    # and none of the first forward's k/v fetches (no attention)
    return CopyVolume(d2h=first.d2h + u * (o + lse) + train.d2h - u * (o + lse), h2d=train.h2d + u * o)

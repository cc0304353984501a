"""Host<->device bytes moved by one offloaded FPDT attention layer (causal), by formula.

Notation: ``u`` chunks per rank, ``P`` ranks, ``L = S_local / u`` tokens per local chunk,
``C = P * L`` tokens per chunk after the all-to-all, ``H_q = H / P`` and
``H_k = H_kv * f / P`` heads per rank after it (``f``: the GQA replication factor), ``e``
the input's element size and ``a`` the accumulator's (4 for fp32). Per-chunk sizes:
``T = B L hidden e`` (the hidden-state chunk), ``q = o = dô = B C H_q D e``,
``k = v = B C H_k D e``, ``lse = B H_q C a``, ``dq = B C H_q D a``.

A training forward stashes every chunk's T, k̂, v̂, q̂, o, lse and fetches k̂_j, v̂_j for
every j < i; the backward's outer step j pops k̂_j, v̂_j and T_j, its inner steps
i >= j fetch q̂_i, o_i, lse_i, and (for j >= 1) dô_i and dq_i, and stash dô_i (outer step 0,
i >= 1) and dq_i (while not final, i > j)::

    D2H = u (T + 2k + q + o + lse) + (u - 1) dô + u (u - 1) / 2 · dq
    H2D = u T + u (u + 1) / 2 · (2k + q + o + lse) + u (u - 1) / 2 · (dô + dq)

A no-grad forward (the first pass of a checkpointed layer) moves ``D2H = u · 2k`` and
``H2D = u (u - 1) / 2 · 2k``.

Packed documents (``doc_ids``): blocks whose queries see none of their keys are skipped
(:mod:`fpdt.attention.documents`) and fetch nothing. With ``V`` the blocks that run
(``u (u + 1) / 2`` without documents) and ``m`` the query chunks touched more than once
(``u - 1``)::

    D2H = u (T + 2k + q + o + lse) + m dô + (V - u) dq
    H2D = u T + V (2k + q + o + lse) + (V - u) (dô + dq)

and the no-grad forward's ``H2D = (V - u) · 2k``. When the output projection reads its input back
from the stash (``o_proj_input_from_stash``, :mod:`fpdt.attention.output_projection`: no layer
checkpoint), its backward fetches every ``o_i`` once more: ``H2D`` grows by ``u o`` (and ``D2H``
not at all). Layer inputs offloaded by activation checkpointing add
``B S_local hidden e`` each way per layer. ``tests/offload/test_schedule.py`` checks these
against the bytes the runtime counts.

With ``attention_checkpoint="save"`` (:mod:`fpdt.attention.saved_attention`) a checkpointed
layer's first forward also keeps every chunk's ``o`` and ``lse``: **host bytes per saving
layer** ``u (o + lse) = B S_local H (D e + a)``, i.e. ``B S (H D e + 4 H) / P`` for an
fp32 lse (bf16 output: ``(2 S H D + 4 S H) / P`` per sequence; :func:`saved_attention_bytes`).
When they are on the host (``checkpointing="offload"``) and the attention offloads too, the
recompute moves their host buffers into its own stash instead of copying ``o``, ``lse`` out
again, fetches each ``o`` once (for the output projection's input) and fetches no k̂/v̂ (it
runs no attention): per step ``D2H`` is unchanged and ``H2D`` changes by
``u o - u (u - 1) / 2 · 2k`` (:func:`checkpointed_attention_copy_bytes`; both checked by
``tests/offload/test_saved_attention.py``).
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
    """The formula of the module docstring for one offloaded, causal FPDT attention layer
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

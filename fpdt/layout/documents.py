"""Packed documents: which document each token of a window belongs to.

Along each row of the *global* window ``[B, S]``, token ``t > 0`` starts a document exactly when
``position_ids[t] != position_ids[t-1] + 1``, and must then have position 0 (other jumps and
negative positions are refused; Transformers' ``DataCollatorWithFlattening`` convention).
**Document ids** ``[B, S]`` int64: 0 for a row's first document, +1 at each start (what the
attention takes; ``None``: one document per row). **cu_seqlens** ``[n + 1]``: cumulative lengths
over the flattened ``B * S`` tokens, no document crossing a row. Each function reads the device
once (one small ``tolist``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from fpdt.layout.fpdt_layout import unshard

IGNORE_INDEX = -100
"""The label that predicts nothing (Transformers' and :mod:`fpdt.model.loss`'s)."""


class DocumentError(ValueError):
    """Position ids, document ids or cu_seqlens that describe no packing; the message says the fix."""


def _check_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise DocumentError(f"{name} must be a [B, S] tensor, got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise DocumentError(f"{name} must be integers (torch.long), got {t.dtype}")


def _ids_from_starts(starts: torch.Tensor) -> torch.Tensor | None:
    """``starts`` ``[B, S - 1]`` bool (token ``t + 1`` starts a document) -> ids ``[B, S]``, or None
    when no row has a start (the caller has already read that flag)."""
    ids = torch.zeros(starts.shape[0], starts.shape[1] + 1, dtype=torch.long, device=starts.device)
    ids[:, 1:] = starts.long().cumsum(1)
    return ids


def doc_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids ``[B, S]`` (int64) of a global window's ``position_ids`` ``[B, S]`` (global
    token order), or None when every row is one document (positions increase by one throughout).

    Raises :class:`DocumentError` when a position steps to anything but ``previous + 1`` or 0, or
    is negative.
    """
    _check_2d("position_ids", position_ids)
    pos = position_ids.long()
    starts = pos[:, 1:] != pos[:, :-1] + 1
    bad = starts & (pos[:, 1:] != 0)
    neg, garbage, packed = torch.stack([(pos < 0).any(), bad.any(), starts.any()]).tolist()
    if neg:
        raise DocumentError("position_ids has negative values: positions start at 0 (at 0 again at each packed "
                            "document)")
    if garbage:
        b, t = (int(i) for i in bad.nonzero()[0])
        raise DocumentError(f"position_ids step from {int(pos[b, t])} to {int(pos[b, t + 1])} (row {b}, token "
                            f"{t + 1} of the global window): positions must increase by one, or restart at 0 "
                            f"where a packed document starts")
    return _ids_from_starts(starts) if packed else None


def canonical_doc_ids(doc_ids: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor | None:
    """Explicit per-token document ids ``[B, S]`` (any integers, non-decreasing along each row,
    global token order) -> the canonical ids (0 first, steps of 0 or 1; int64), or None when every
    row is one document. ``shape``: the ``[B, S]`` they must have. Raises :class:`DocumentError`."""
    _check_2d("doc_ids", doc_ids)
    if shape is not None and tuple(doc_ids.shape) != tuple(shape):
        raise DocumentError(f"doc_ids {tuple(doc_ids.shape)} must cover the whole global window {tuple(shape)} "
                            f"(global token order, the same on every sequence-parallel rank)")
    d = doc_ids.long()
    step = d[:, 1:] - d[:, :-1]
    decreasing, packed = torch.stack([(step < 0).any(), (step != 0).any()]).tolist()
    if decreasing:
        b, t = (int(i) for i in (step < 0).nonzero()[0])
        raise DocumentError(f"doc_ids decrease from {int(d[b, t])} to {int(d[b, t + 1])} (row {b}, token {t + 1}): "
                            f"document ids must be non-decreasing along the window (documents are contiguous "
                            f"and in order)")
    return _ids_from_starts(step != 0) if packed else None


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], shape: Sequence[int]) -> torch.Tensor | None:
    """Document ids ``[B, S]`` of FlashAttention-style ``cu_seqlens`` ``[n + 1]`` over the
    flattened ``B * S`` tokens of a window of ``shape`` ``[B, S]``, or None when every row is one
    document. Raises :class:`DocumentError` (not 1-D, not from 0 to ``B * S``, not strictly
    increasing, a document crossing rows)."""
    B, S = (int(x) for x in shape)
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise DocumentError(f"cu_seqlens must be a 1-D integer tensor [documents + 1] (0, then cumulative "
                            f"lengths), got {tuple(cu.shape)} {cu.dtype}")
    cu = cu.long().cpu().tolist()
    if cu[0] != 0 or cu[-1] != B * S:
        raise DocumentError(f"cu_seqlens run from {cu[0]} to {cu[-1]}; they must start at 0 and end at the "
                            f"window's B*S = {B}*{S} = {B * S} tokens (the documents' lengths sum to the window)")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise DocumentError(f"cu_seqlens {cu} are not strictly increasing: every document has at least one token")
    cuts = set(cu)
    crossing = [r for r in range(1, B) if r * S not in cuts]
    if crossing:
        raise DocumentError(f"cu_seqlens {cu}: a document crosses from row {crossing[0] - 1} into row "
                            f"{crossing[0]} (each row of [B, S] = [{B}, {S}] must start a document)")
    starts = torch.zeros(B * S, dtype=torch.bool)
    starts[torch.tensor(cu[:-1])] = True
    starts = starts.view(B, S)[:, 1:]
    return _ids_from_starts(starts) if bool(starts.any()) else None


def restarting_position_ids(doc_ids: torch.Tensor | None, shape: Sequence[int],
                            device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids ``[B, S]`` that restart at 0 at every document of ``doc_ids`` (canonical,
    or None: ``arange(S)`` on every row)."""
    B, S = (int(x) for x in shape)
    t = torch.arange(S, device=device if doc_ids is None else doc_ids.device)
    if doc_ids is None:
        return t.expand(B, S).contiguous()
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(first, t.expand(B, S), torch.zeros_like(doc_ids)).cummax(1).values
    return t - start


def mask_cross_document_targets(shifted_labels: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets ``[B, S]`` (global order) with each document's last token's target set to
    ``-100``: it would be the next document's first token, which nothing in its own document
    predicts. ``doc_ids`` None: returned as is."""
    if doc_ids is None:
        return shifted_labels
    last = torch.zeros_like(doc_ids, dtype=torch.bool)
    last[:, :-1] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return shifted_labels.masked_fill(last, IGNORE_INDEX)


def gather_global(local: torch.Tensor, num_chunks: int, *, group: dist.ProcessGroup | None = None,
                  mesh=None) -> torch.Tensor:
    """This rank's ``[B, S_local]`` slice (FPDT layout over ``group``, or the layout of ``mesh``, a
    :class:`fpdt.comm.SequenceMesh`) -> the global ``[B, S]`` tensor in global token order.

    Collective over the sequence-parallel group (every rank of it calls it): one all-gather
    (two on a mesh) of ``local``. Without torch.distributed, or with one rank, returns ``local``.
    """
    if mesh is not None:
        return mesh.unshard(local, num_chunks, dim=1)
    if not dist.is_available() or not dist.is_initialized():
        return local
    size = dist.get_world_size(group)
    if size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return unshard(shards, num_chunks, dim=1)


def sequence_parallel_doc_ids(position_ids: torch.Tensor, num_chunks: int, *,
                              group: dist.ProcessGroup | None = None, mesh=None) -> torch.Tensor | None:
    """Global document ids ``[B, S]`` from this rank's ``position_ids`` ``[B, S_local]`` (in the
    FPDT layout over ``group`` with ``num_chunks`` chunks, or in ``mesh``'s layout), or None for one
    document per row. Collective (:func:`gather_global`); every rank returns the same."""
    if position_ids.dim() != 2:
        raise DocumentError(f"position_ids must be [B, S_local], got {tuple(position_ids.shape)}")
    return doc_ids_from_position_ids(gather_global(position_ids.long(), num_chunks, group=group, mesh=mesh))

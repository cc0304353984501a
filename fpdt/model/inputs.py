"""Turn a global token window into one rank's FPDT inputs.

Labels are shifted on the *global* sequence first, then ids, labels and position ids are sharded
with one layout (:func:`fpdt.layout.shard`). Packed documents (position ids restarting at 0, or
``doc_ids=`` / ``cu_seqlens=``): each document's last token gets the target ``-100``.
"""

from __future__ import annotations

import torch

from fpdt.comm import SequenceMesh
from fpdt.layout import check_layout, check_mesh_layout, shard
from fpdt.layout.documents import (canonical_doc_ids, doc_ids_from_cu_seqlens, doc_ids_from_position_ids,
                                   mask_cross_document_targets, restarting_position_ids)
from fpdt.model.loss import IGNORE_INDEX


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets ``[B, S]``: ``out[:, t] = labels[:, t + 1]``, the last one ``-100``."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    return out


def require_position_ids(position_ids: torch.Tensor | None, sp: int, prepare: str = "fpdt.model.prepare_inputs") -> None:
    """Refuse missing ``position_ids`` at ``sp > 1`` (a rank's tokens are not contiguous), naming
    ``prepare``: the rule of ``fpdt.model``'s and ``fpdt.hf``'s forwards."""
    if position_ids is None and sp > 1:
        raise ValueError(f"position_ids are required with sequence parallelism (sp={sp}): this rank's tokens are "
                         f"not contiguous (the FPDT layout); use {prepare}")


def prepare_inputs(input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None, shift: bool = True,
                   sp_size: int, rank: int, num_chunks: int, mesh: SequenceMesh | None = None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s ``input_ids``, ``labels`` and ``position_ids`` ``[B, S / P]`` (``docs/model.md``, inputs).

    ``labels`` to ``shift`` are every ``prepare_inputs``' keywords (the model's and :func:`fpdt.hf.prepare_inputs`
    take the layout from the model). ``input_ids`` ``[B, S]``: the global window, identical on every
    SP rank of size ``sp_size``; ``num_chunks``: the model's ``u``. ``labels`` ``[B, S]`` (default ``input_ids``; -100 ignores)
    are shifted to next-token targets unless ``shift=False`` (a packed document's last target is
    -100). ``position_ids`` ``[B, S]`` default to ``arange(S)``, restarting per document; restarts at
    0 mark packed documents, other jumps are refused. ``doc_ids`` ``[B, S]`` or ``cu_seqlens``
    ``[n + 1]`` (over the flattened ``B * S``) name the documents instead. ``mesh``: the 2D mesh
    layout instead of FPDT's (``S`` divisible by ``2 * hp * cp * u``; ``sp_size``/``rank`` ignored).
    Returns ``{"input_ids", "labels", "position_ids"}``, each ``[B, S / P]``, and with documents
    ``"doc_ids"``, the canonical ids of the *whole* window ``[B, S]``.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if mesh is not None:
        check_mesh_layout(S, mesh.hp, mesh.cp, num_chunks)
    else:
        check_layout(S, sp_size, num_chunks)
    labels = input_ids if labels is None else labels
    if doc_ids is not None and cu_seqlens is not None:
        raise ValueError("pass doc_ids= or cu_seqlens=, not both")
    explicit = doc_ids is not None or cu_seqlens is not None
    if doc_ids is not None:
        docs = canonical_doc_ids(doc_ids.to(input_ids.device), (B, S))
    elif cu_seqlens is not None:
        docs = doc_ids_from_cu_seqlens(cu_seqlens, (B, S))
        docs = None if docs is None else docs.to(input_ids.device)
    if position_ids is None:
        position_ids = restarting_position_ids(docs if explicit else None, (B, S), device=input_ids.device)
    for name, t in (("labels", labels), ("position_ids", position_ids)):
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if not explicit:
        docs = doc_ids_from_position_ids(position_ids)       # refuses positions that jump
    if shift:
        labels = mask_cross_document_targets(shift_labels(labels), docs)
    take = (lambda t: mesh.shard(t, num_chunks, dim=1)) if mesh is not None else \
        (lambda t: shard(t, sp_size, num_chunks, rank, dim=1))
    out = {name: take(t)
           for name, t in (("input_ids", input_ids), ("labels", labels), ("position_ids", position_ids))}
    if explicit:
        out["doc_ids"] = docs if docs is not None else torch.zeros(B, S, dtype=torch.long, device=input_ids.device)
    return out

"""Packed documents in a Transformers model's inputs, as ``DataCollatorWithFlattening`` makes them.

That collator flattens a batch into one row ``input_ids`` ``[1, total]`` with ``position_ids``
restarting at 0 at each example (and ``labels`` -100 at each example's first token, so no
document's last token predicts the next one's first), optionally with FlashAttention's
``cu_seq_lens_q``/``cu_seq_lens_k`` (``return_flash_attn_kwargs=True``). fpdt reads the documents
from either (:mod:`fpdt.layout.documents`, one convention) and hands the attention their ids
``[B, S]`` for the whole global window (``doc_ids=``, through the model's keyword arguments down to
every attention call); None for one document, which runs the unmasked path as before.
"""

from __future__ import annotations

import torch

from fpdt.hf.errors import FPDTHFError
from fpdt.layout.documents import (DocumentError, canonical_doc_ids, doc_ids_from_cu_seqlens,
                                   doc_ids_from_position_ids)

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""What ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds to a batch."""


def pop_explicit_documents(kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Take ``doc_ids`` and the collator's FlashAttention arguments out of a forward's ``kwargs``
    (the attention must not see them as they are) -> ``(doc_ids, cu_seqlens)``."""
    doc_ids = kwargs.pop("doc_ids", None)
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    kwargs.pop("max_length_q", None)
    kwargs.pop("max_length_k", None)
    if (cu_q is None) != (cu_k is None) or (cu_q is not None and not torch.equal(cu_q.cpu(), cu_k.cpu())):
        raise FPDTHFError("cu_seq_lens_q and cu_seq_lens_k differ: fpdt attention is self-attention over packed "
                          "documents, whose query and key lengths are the same")
    if doc_ids is not None and cu_q is not None:
        raise FPDTHFError("pass doc_ids= or cu_seq_lens_q/k, not both")
    return doc_ids, cu_q


def window_doc_ids(shape, device: torch.device, *, position_ids: torch.Tensor | None = None,
                   doc_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor | None:
    """Document ids ``[B, S]`` of a whole window of ``shape`` ``[B, S]`` (global order), from
    explicit ``doc_ids``, else ``cu_seqlens``, else ``position_ids`` (restarting); None for one
    document per row (or nothing given). Bad input raises :class:`FPDTHFError` naming the fix."""
    try:
        if doc_ids is not None:
            return canonical_doc_ids(doc_ids.to(device), tuple(shape))
        if cu_seqlens is not None:
            ids = doc_ids_from_cu_seqlens(cu_seqlens, tuple(shape))
            return None if ids is None else ids.to(device)
        if position_ids is not None:
            return doc_ids_from_position_ids(position_ids)
    except DocumentError as e:
        raise FPDTHFError(str(e)) from e
    return None

"""Packed batches of any length: Transformers' ``DataCollatorWithFlattening``, padded to fpdt's layout.

:class:`FlatteningCollator` appends one padding document (positions from 0, labels -100) that
brings the flattened row to the next multiple of what fpdt's layout cuts, so the loss and every
gradient are the unpadded batch's (``tests/hf/test_flattening_collator.py``; ``docs/hf.md``)."""

from __future__ import annotations

from typing import Any

from fpdt.hf.errors import FPDTHFError
from fpdt.model.loss import IGNORE_INDEX


def window_multiple(model) -> int:
    """What a window's length must be a multiple of for ``model``: ``sp * num_chunks``, or
    ``2 * hp * cp * num_chunks`` on a 2D mesh, with ``sp`` the model's SP group's size now."""
    settings = getattr(model, "fpdt", None)
    if settings is None:
        raise FPDTHFError("FlatteningCollator(model): call fpdt.hf.apply_fpdt(model, ...) first, or pass "
                          "multiple= (the model's sp * num_chunks)")
    mesh, u = settings.options.mesh, settings.options.num_chunks
    if mesh is not None:
        return 2 * mesh.hp * mesh.cp * u
    return settings.rank_size()[1] * u


def check_window_length(seq_len: int, sp: int, num_chunks: int) -> None:
    """Refuse a window of ``seq_len`` tokens that ``sp * num_chunks`` does not divide, naming the fix
    (:class:`FlatteningCollator` for packed batches)."""
    multiple = sp * num_chunks
    if seq_len % multiple or seq_len == 0:
        raise FPDTHFError(f"a window of {seq_len} tokens is not a multiple of sp*num_chunks={sp}*{num_chunks}="
                          f"{multiple}: fpdt cuts it into that many equal pieces. Packed batches "
                          f"(DataCollatorWithFlattening): collate with fpdt.hf.FlatteningCollator(model), which "
                          f"appends a padding document up to the next multiple (exact); other windows: pad or "
                          f"trim them to a multiple of {multiple}, or pick a num_chunks that divides {seq_len // sp}")


class FlatteningCollator:
    """``DataCollatorWithFlattening`` whose one-row batches are padded to a length fpdt can cut.

    Args:
        model: the model after :func:`fpdt.hf.apply_fpdt` (multiple read at every call), or None.
        multiple: the multiple to pad to instead of the model's.
        pad_token_id: the padding document's token id (any vocabulary id).
        collator: the collator to wrap (default: one made from ``kwargs``).

    Returns the batch with the padding document appended to ``input_ids``, ``labels``,
    ``position_ids`` and, when asked for, ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx``."""

    def __init__(self, model=None, *, multiple: int | None = None, pad_token_id: int = 0, collator=None,
                 **kwargs: Any):
        if (model is None) == (multiple is None):
            raise FPDTHFError("FlatteningCollator takes the model (after fpdt.hf.apply_fpdt) or multiple=, "
                              "exactly one of them")
        if multiple is not None and (not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1):
            raise FPDTHFError(f"multiple={multiple!r} must be a positive integer (the model's sp * num_chunks)")
        if collator is None:
            from transformers import DataCollatorWithFlattening

            collator = DataCollatorWithFlattening(**kwargs)
        elif kwargs:
            raise FPDTHFError(f"pass {sorted(kwargs)} to the collator you give, not to FlatteningCollator")
        if not getattr(collator, "return_position_ids", True):
            raise FPDTHFError("the collator must return position_ids (return_position_ids=True): they mark the "
                              "packed documents, the padding one included")
        self.model, self.multiple, self.pad_token_id, self.collator = model, multiple, pad_token_id, collator

    def __call__(self, features, return_tensors=None, separator_id=None):
        multiple = self.multiple if self.multiple is not None else window_multiple(self.model)
        total = sum(len(f["input_ids"]) for f in features)
        pad = -total % multiple
        if pad:
            padding = {"input_ids": [self.pad_token_id] * pad}
            if features and "labels" in features[0]:
                padding["labels"] = [IGNORE_INDEX] * pad
            features = list(features) + [padding]
        batch = self.collator(features, return_tensors=return_tensors, separator_id=separator_id)
        if pad:
            batch["labels"][..., -pad:] = IGNORE_INDEX    # the first one was the separator; without labels, all
        return batch

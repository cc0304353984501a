"""Right padding, which fpdt computes exactly without a mask: accepted (checked on the whole
window) and dropped; any other mask refused on every rank, naming the fix (``docs/hf.md``,
padding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fpdt.hf.errors import FPDTHFError, refuse_on_every_rank
from fpdt.model.loss import IGNORE_INDEX


def check_right_padding(attention_mask: torch.Tensor, shift_labels: torch.Tensor | None) -> None:
    """Accept ``attention_mask`` ``[B, S]`` (the whole window) if fpdt computes it exactly
    without the mask: all ones, or right padding whose padded queries all have the target
    ``-100`` in ``shift_labels`` ``[B, S]`` (next-token targets, on the same window). One host
    read. Else raise, naming the fix."""
    mask = attention_mask.bool()
    if bool(mask.all()):
        return
    if not bool((mask[:, 1:] <= mask[:, :-1]).all()):
        raise FPDTHFError("the attention_mask is not right padding (ones, then zeros, per row): fpdt attention is "
                          "causal over the whole window and takes no mask; pad on the right (tokenizer "
                          "padding_side='right'), and mark packed documents by position_ids that restart at 0 "
                          "(DataCollatorWithFlattening), not by a mask")
    if shift_labels is None:
        raise FPDTHFError("a padding attention_mask without labels: the padded positions' outputs would not be "
                          "Transformers' (fpdt attention takes no mask); pass labels with -100 at the padding, or "
                          "drop the padding")
    if bool((shift_labels[~mask] != IGNORE_INDEX).any()):
        raise FPDTHFError("padded positions have targets other than -100: fpdt attention takes no mask, so their "
                          "outputs are not Transformers'; give the padding the label -100 (as padding collators do)")


def whole_window_mask(attention_mask, ref: torch.Tensor | None, shift_labels, lockstep: bool,
                      refusal: FPDTHFError | None = None):
    """Without sequence parallelism (this rank holds whole windows): None for an ``attention_mask``
    ``[B, S]`` fpdt computes exactly without it (:func:`check_right_padding`), else refused; a mask
    that is not ``[B, S]`` passes through (the attention refuses what it cannot honour).

    ``lockstep`` (training under the Trainer, where every rank of the job runs this forward each
    step): with more than one process the refusal is collective (:func:`refuse_on_every_rank`,
    one all-reduce of a flag every step, mask or not), so that the data-parallel ranks whose
    windows were fine do not wait for this one in the next collective. ``refusal``: what the caller
    already refuses in this window (its packed documents, :mod:`fpdt.hf.documents`), refused alike."""
    if attention_mask is not None and attention_mask.dim() == 2:
        held = ref.shape[:2]
        try:
            if attention_mask.shape != held:
                raise FPDTHFError(f"the attention mask covers {attention_mask.shape[-1]} tokens but this rank holds "
                                  f"{held[-1]}: pass the mask of these tokens")
            check_right_padding(attention_mask, shift_labels)    # this rank holds the whole window
        except FPDTHFError as e:
            refusal = refusal or e
        attention_mask = None                    # all ones, or right padding the loss never sees
    if lockstep and ref is not None and dist.is_initialized() and dist.get_world_size() > 1:
        refuse_on_every_rank(refusal, group=None, device=ref.device)
    elif refusal is not None:
        raise refusal
    return attention_mask

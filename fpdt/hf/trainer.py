"""FPDT under Hugging Face's ``Trainer`` through its own sequence-parallel route
(``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``, DeepSpeed's ALST setup).

With ``apply_fpdt(model, group="trainer")``: the group is DeepSpeed's, looked up per forward;
the forward moves the adapter's contiguous slices of ids, positions and labels into FPDT's chunk
layout (:func:`contiguous_to_fpdt_layout`, one all-gather of the integer inputs), and what it
refuses it refuses on every rank of the job (:func:`fpdt.hf.errors.refuse_on_every_rank`); the
loss is the global token mean on every rank and its backward sums the Trainer's per-rank weights
over the group. ``chunked_qkv`` is required (DeepSpeed's Ulysses wrapper is never called).
:func:`trainer_parallelism_config` builds the ``ParallelismConfig``. Details: ``docs/hf.md``
("Under Hugging Face's Trainer").
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fpdt.hf.collator import check_window_length
from fpdt.hf.documents import window_doc_ids
from fpdt.hf.errors import FPDTHFError, refuse_on_every_rank
from fpdt.hf.padding import check_right_padding
from fpdt.layout.fpdt_layout import shard

TRAINER_ATTN_NAME = "sdpa"
"""The attention implementation name a model under ``group="trainer"`` keeps: one the Trainer's
sequence-parallel setup accepts. Its function is never called (the attention modules run
fpdt's chunked attention), though DeepSpeed wraps it."""


def contiguous_to_fpdt_layout(input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None,
                              attention_mask: torch.Tensor | None = None, *,
                              group: dist.ProcessGroup | None, job_group: dist.ProcessGroup | None, sp: int,
                              rank: int, num_chunks: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's ``input_ids``, ``position_ids`` and ``labels`` ``[B, S / P]`` in contiguous
    slices (rank ``r`` of ``group`` holds tokens ``[r S / P, (r + 1) S / P)`` of the window) -> the
    same tokens' slices in the FPDT layout (:mod:`fpdt.layout.fpdt_layout`, ``num_chunks`` chunks
    per rank); dtypes kept, ``labels`` may be None; and the window's document ids ``[B, S]`` (int64,
    global order, the same on every rank of ``group``; None for one document per row) from the
    positions, which restart at 0 where a packed document starts (:mod:`fpdt.layout.documents`).

    Refuses slices of different shapes, a window length ``S`` not divisible by ``P * num_chunks``,
    position ids that step to anything but the next position or 0, and an
    ``attention_mask`` ``[B, S / P]`` other than right padding with targets -100
    (:func:`fpdt.hf.padding.check_right_padding`), which fpdt attention cannot honour; the mask
    itself is not returned (the attention needs none).

    Collective over ``job_group``: every rank of it (the default group with None: the whole job,
    every data-parallel replica's sequence-parallel group) must call this in the same step, as
    the Trainer's ranks do. A refusal is never one rank's or one replica's alone, which would
    leave the other replicas waiting in their next collective: when any rank refuses, every rank
    of ``job_group`` raises :class:`FPDTHFError` (:func:`refuse_on_every_rank`), a refusing rank
    with its own message, the others naming the refusing ranks and their messages (the fix).
    The shape checks run before the all-gather over ``group``, which they skip on failure:
    DeepSpeed's data adapter cuts one window into equal slices, so they fail on all of a
    group's ranks alike (the all-gather needs equal shapes anyway).

    Cost: one all-gather over ``group`` and, over ``job_group``, one all-reduce of one int32 on
    ``input_ids``' device with one host read of it; the messages are gathered only on a refusal.
    """
    tensors = [t for t in (input_ids, position_ids, labels, attention_mask) if t is not None]
    refusal: ValueError | None = None
    local, doc_ids = None, None
    try:
        _check_slices(tensors, sp, num_chunks)
    except ValueError as e:         # FPDTHFError, or check_layout's ValueError
        refusal = e
    else:
        # int32 on the wire (ids, positions, labels and mask all fit): 4 n bytes per token of the window
        stacked = torch.stack([t.to(torch.int32) for t in tensors])              # [n, B, S / P]
        slices = [torch.empty_like(stacked) for _ in range(sp)]
        dist.all_gather(slices, stacked.contiguous(), group=group)
        window = torch.cat(slices, dim=-1)                                       # [n, B, S]
        del slices
        try:
            doc_ids = window_doc_ids(window[1].shape, window.device, position_ids=window[1])
            if attention_mask is not None:  # right padding with -100 targets is exact without the mask
                check_right_padding(window[-1], window[2] if labels is not None else None)
        except FPDTHFError as e:
            refusal = e
        else:
            local = [x.to(t.dtype) for x, t in zip(shard(window, sp, num_chunks, rank, dim=-1).unbind(0), tensors)]
    refuse_on_every_rank(refusal, group=job_group, device=input_ids.device)
    return local[0], local[1], (local[2] if labels is not None else None), doc_ids


def _check_slices(tensors: list[torch.Tensor], sp: int, num_chunks: int) -> None:
    """Refuse slices ``[B, S / P]`` of different shapes, or a window ``S`` the layout cannot cut."""
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors):
        raise FPDTHFError(f"input_ids, position_ids and labels of shapes {[tuple(t.shape) for t in tensors]} are not "
                          f"slices of one window")
    check_window_length(shape[-1] * sp, sp, num_chunks)


def trainer_parallelism_config(sp_size: int, **kwargs):
    """accelerate's ``ParallelismConfig`` for training a model under
    ``apply_fpdt(model, group="trainer")`` with ``sp_size``-way sequence parallelism under the
    Trainer: pass it as ``TrainingArguments(parallelism_config=...)`` with a DeepSpeed config.
    It names ``sdpa`` as the attention, the name such a model keeps (:data:`TRAINER_ATTN_NAME`).

    The ranks beyond one sequence-parallel group are data-parallel: unless ``kwargs`` give a
    ``dp_shard_size`` or ``dp_replicate_size``, ``dp_shard_size`` is the world size (that of
    torch.distributed, else ``$WORLD_SIZE``) over ``sp_size``, which DeepSpeed's batch-size
    check needs. Other ``kwargs`` go to ``ParallelismConfig``. The sequence length may change
    from batch to batch; every window's length must be divisible by ``sp_size`` times the
    model's ``num_chunks`` (packed batches: :class:`fpdt.hf.FlatteningCollator` pads them to it).
    """
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise FPDTHFError(f"sp_size={sp_size!r}: trainer_parallelism_config takes the sequence-parallel degree, "
                          f"a positive integer (not a model)")
    try:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    except ImportError as e:
        raise ImportError(f"the Trainer's sequence parallelism needs accelerate (pip install accelerate): {e}") from e
    if "dp_shard_size" not in kwargs and "dp_replicate_size" not in kwargs:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
            int(os.environ.get("WORLD_SIZE", "1"))
        if world % sp_size:
            raise FPDTHFError(f"sp_size={sp_size} does not divide the world of {world} processes: use an sp_size "
                              f"that does (the other factor is data parallelism)")
        kwargs["dp_shard_size"] = world // sp_size
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                              sp_attn_implementation=TRAINER_ATTN_NAME)
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=handler, **kwargs)

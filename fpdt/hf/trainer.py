"""FPDT under Hugging Face's ``Trainer`` through its own sequence-parallel route
(``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``, DeepSpeed's ALST setup), with
``apply_fpdt(model, group="trainer")``: ``docs/hf.md`` ("Under Hugging Face's Trainer")."""

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
"""The attention name a ``group="trainer"`` model keeps, one the Trainer accepts (never called)."""


def contiguous_to_fpdt_layout(input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None,
                              attention_mask: torch.Tensor | None = None, *,
                              group: dist.ProcessGroup | None, job_group: dist.ProcessGroup | None, sp: int,
                              rank: int, num_chunks: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's ``input_ids``, ``position_ids`` and ``labels`` ``[B, S / P]`` in contiguous slices
    -> the same tokens' slices in the FPDT layout (``num_chunks`` chunks per rank; dtypes kept,
    ``labels`` may be None), and the window's document ids ``[B, S]`` (int64, the same on every
    rank; None for one document per row) from the positions' restarts at 0.

    Refuses unequal slices, an ``S`` not divisible by ``P * num_chunks``, positions stepping to
    anything but the next one or 0, and an ``attention_mask`` other than right padding with
    targets -100. Collective over ``job_group`` (None: the whole job): a refusal raises
    :class:`FPDTHFError` on every rank of it. Cost: one all-gather over ``group``, one int32
    all-reduce and one host read."""
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


def trainer_parallelism_config(sp_size: int, *, recurrent_layers: bool = False, **kwargs):
    """accelerate's ``ParallelismConfig`` for ``apply_fpdt(model, group="trainer")`` with
    ``sp_size``-way sequence parallelism, for ``TrainingArguments(parallelism_config=...)``; names
    :data:`TRAINER_ATTN_NAME` as the attention. ``dp_shard_size`` defaults to the world size over
    ``sp_size``; other ``kwargs`` go to ``ParallelismConfig``. Every window's length must be
    divisible by ``sp_size`` times the model's ``num_chunks``. ``recurrent_layers=True`` for a
    hybrid model (Qwen3.5): accelerate refuses linear-attention layers under sequence parallelism
    unless told they pass their state between ranks, as the Gated DeltaNet layers ``apply_fpdt``
    puts in do (Transformers' own would restart it on every rank: apply fpdt first)."""
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
    extra = {}
    if recurrent_layers:
        if "sp_allow_recurrent_layers" not in getattr(DeepSpeedSequenceParallelConfig, "__dataclass_fields__", {}):
            raise FPDTHFError("recurrent_layers=True needs an accelerate whose DeepSpeedSequenceParallelConfig has "
                              "sp_allow_recurrent_layers: upgrade accelerate")
        extra["sp_allow_recurrent_layers"] = True
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                              sp_attn_implementation=TRAINER_ATTN_NAME, **extra)
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=handler, **kwargs)

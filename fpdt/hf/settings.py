"""What :func:`fpdt.hf.apply_fpdt` set on a model, kept as ``model.fpdt``."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from fpdt.comm import sp_group_of, sp_rank_size
from fpdt.hf.groups import TrainerGroup, resolve_group
from fpdt.model.layer_checkpoints import LayerCheckpoints
from fpdt.options import FPDTOptions


@dataclass(frozen=True)
class HFSettings:
    """What :func:`fpdt.hf.apply_fpdt` set on a model (``model.fpdt``): the options and what it resolved."""

    attn_implementation: str
    """The name fpdt's attention is registered under (the model's own, except under the Trainer)."""
    options: FPDTOptions
    """The FPDT options (``group`` may be a :class:`fpdt.hf.groups.TrainerGroup`)."""
    mlp_chunks: int
    """The MLP's token chunks (:func:`fpdt.model.apply.mlp_chunks_for`)."""
    loss_chunks: int
    """The loss's token chunks (:func:`fpdt.model.apply.loss_chunks_for`)."""
    chunked_qkv: bool = True
    lean_norms: bool = True

    def __deepcopy__(self, memo) -> "HFSettings":
        return self     # immutable, and a copied model stays in the same process group

    def rank_size(self) -> tuple[int, int]:
        """``(rank, size)`` in the sequence-parallel group."""
        return sp_rank_size(resolve_group(self.options.group), self.options.mesh)

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return sp_group_of(resolve_group(self.options.group), self.options.mesh)

    @property
    def under_trainer(self) -> bool:
        """Set up for the Hugging Face Trainer's sequence parallelism (:mod:`fpdt.hf.trainer`)."""
        return isinstance(self.options.group, TrainerGroup)


def layer_checkpoints_of(layers: list) -> LayerCheckpoints | None:
    """The LayerCheckpoints the apply step set on decoder ``layers`` (None: no fpdt checkpoint)."""
    return getattr(layers[0], "_fpdt_checkpoints", None) if layers else None

"""The sequence-parallel group of a Transformers model under :mod:`fpdt.hf`, fixed or deferred.

A user's own loop passes a :class:`torch.distributed.ProcessGroup` (or None: the default
group). Under Hugging Face's ``Trainer`` with ``ParallelismConfig(sp_backend="deepspeed")``
the group does not exist yet when :func:`fpdt.hf.apply_fpdt` runs: DeepSpeed creates it while
the Trainer prepares the model. :class:`TrainerGroup` stands for that group and is looked up
at every forward (:func:`resolve_group`).
"""

from __future__ import annotations

import sys

import torch.distributed as dist


class TrainerGroup:
    """The sequence-parallel group DeepSpeed creates when Hugging Face's ``Trainer`` prepares
    the model under ``ParallelismConfig(sp_backend="deepspeed", sp_size=...)``.

    Resolved at each forward: DeepSpeed's Ulysses group once it exists; otherwise (the Trainer
    without sequence parallelism: data parallelism only, or one process) no sequence
    parallelism: a group of this rank alone.
    """

    def __init__(self):
        self._own_world: object = None                       # the default group the one below was made in
        self._own_group: dist.ProcessGroup | None = None     # this rank's group of one

    def __repr__(self) -> str:
        return "TrainerGroup()"

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainerGroup)

    def __hash__(self) -> int:
        return hash(TrainerGroup)

    def resolve(self) -> dist.ProcessGroup | None:
        group = _deepspeed_sequence_parallel_group()
        if group is not None:
            return group
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return self._own_rank_group()

    def _own_rank_group(self) -> dist.ProcessGroup:
        """A group of this rank alone, created once per default group (only this rank takes part)."""
        world = dist.group.WORLD
        if self._own_group is None or self._own_world is not world:
            self._own_world = world
            self._own_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return self._own_group


def _deepspeed_sequence_parallel_group() -> dist.ProcessGroup | None:
    """DeepSpeed's Ulysses group if one was set up, without importing DeepSpeed otherwise: the
    one ``register_with_transformers`` creates (``parallel_state_sp``), or the one the Trainer's
    loss aggregation reads (``deepspeed.utils.groups``: the engine's mpu or device mesh)."""
    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    group = getattr(state, "_SEQUENCE_PARALLEL_GROUP", None)
    if group is not None:
        return group
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and (getattr(groups, "mpu", None) is not None or
                               getattr(groups, "mesh_device", None) is not None):
        try:
            return groups._get_sequence_parallel_group()
        except (KeyError, AttributeError, AssertionError):
            return None
    return None


def resolve_group(group) -> dist.ProcessGroup | None:
    """``group`` itself, or what a :class:`TrainerGroup` stands for now."""
    return group.resolve() if isinstance(group, TrainerGroup) else group

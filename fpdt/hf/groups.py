"""The sequence-parallel group of a Transformers model under :mod:`fpdt.hf`, fixed or deferred.

A user's own loop passes a :class:`torch.distributed.ProcessGroup` (or None: the default
group). Under Hugging Face's ``Trainer`` with ``ParallelismConfig(sp_backend="deepspeed")``
the group does not exist yet when :func:`fpdt.hf.apply_fpdt` runs: DeepSpeed creates it while
the Trainer prepares the model. :class:`TrainerGroup` stands for that group and is looked up
at every forward (:func:`resolve_group`).
"""

from __future__ import annotations

import torch.distributed as dist


class TrainerGroup:
    """The sequence-parallel group DeepSpeed creates when Hugging Face's ``Trainer`` prepares
    the model under ``ParallelismConfig(sp_backend="deepspeed", sp_size=...)``.

    Resolved at each forward: DeepSpeed's Ulysses group once it exists; otherwise (the Trainer
    without sequence parallelism: data parallelism only, or one process) no sequence
    parallelism: a group of this rank alone.
    """

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
        return _own_rank_group()


_own_rank_groups: dict[int, dist.ProcessGroup] = {}   # id(default group) -> this rank's group of one


def _own_rank_group() -> dist.ProcessGroup:
    """A group of this rank alone, created once per default group. Creating groups is collective
    over the world; every rank gets here in the same forward (data parallelism runs in lockstep)."""
    key = id(dist.group.WORLD)
    if key not in _own_rank_groups:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _own_rank_groups[key] = groups[dist.get_rank()]
    return _own_rank_groups[key]


def _deepspeed_sequence_parallel_group() -> dist.ProcessGroup | None:
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
    except ImportError:
        return None
    return getattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", None)


def resolve_group(group) -> dist.ProcessGroup | None:
    """``group`` itself, or what a :class:`TrainerGroup` stands for now."""
    return group.resolve() if isinstance(group, TrainerGroup) else group

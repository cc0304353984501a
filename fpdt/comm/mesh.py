"""``SequenceMesh``: the dp x hp x cp process groups of 2D (Ulysses x ring) attention.

The parent group's ``W`` ranks form ``dp = W / (hp * cp)`` replicas; with ``base = dp_rank * hp *
cp`` and coordinates ``(c, h)``, ``placement="head_first"`` puts rank ``base + c * hp + h`` there
(HP groups adjacent: all-to-all inside a node), ``"context_first"`` rank ``base + h * cp + c``.
``inner_ring=w`` splits each CP group into double-ring inner rings of ``w``. Every member of the
parent group must build the mesh with the same arguments; the token layout is
:mod:`fpdt.layout.mesh_layout`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from fpdt.layout.mesh_layout import mesh_shard, mesh_token_index, mesh_unshard

PLACEMENTS = ("head_first", "context_first")


def check_mesh_shape(world: int, hp: int, cp: int, placement: str, inner_ring: int | None) -> int:
    """Validate a mesh over ``world`` ranks; return the data-parallel degree ``dp``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} must be one of {PLACEMENTS}")
    if not isinstance(hp, int) or not isinstance(cp, int) or hp < 1 or cp < 1:
        raise ValueError(f"hp={hp!r} and cp={cp!r} must be positive integers")
    if world % (hp * cp):
        raise ValueError(f"hp*cp={hp}*{cp}={hp * cp} does not divide the {world} ranks of the group; "
                         f"choose hp and cp whose product divides {world}")
    w = cp if inner_ring is None else inner_ring
    if not isinstance(w, int) or w < 1 or cp % w:
        raise ValueError(f"inner_ring={inner_ring!r} must be a positive divisor of cp={cp} (ranks per inner "
                         f"ring; None = one ring of {cp})")
    return world // (hp * cp)


def mesh_ranks(ranks: list[int], hp: int, cp: int, placement: str) -> torch.Tensor:
    """``[dp, cp, hp]`` tensor of the ranks at each mesh coordinate (see the module docstring)."""
    t = torch.tensor(ranks, dtype=torch.long)
    dp = len(ranks) // (hp * cp)
    if placement == "head_first":
        return t.reshape(dp, cp, hp)
    return t.reshape(dp, hp, cp).transpose(1, 2).contiguous()


class SequenceMesh:
    """The 2D sequence-parallel mesh of one rank.

    ``hp`` (Ulysses, dividing the query heads) x ``cp`` (ring; ``inner_ring`` ``w`` dividing it for
    a double ring) in ``placement`` order over ``group``'s ``dp * hp * cp`` ranks (None: default).
    Attributes: the degrees, ``*_rank``, ``hp_group``, ``cp_group``, ``sp_group`` (the replica's
    ``hp * cp`` ranks), ``cp_outer_group`` (outer-ring transfers), ``cp_ranks``, ``device_mesh``.
    """

    def __init__(self, hp: int = 1, cp: int = 1, placement: str = "head_first", inner_ring: int | None = None,
                 group: dist.ProcessGroup | None = None, timeout: timedelta | None = None):
        self.hp, self.cp, self.placement = hp, cp, placement
        self.inner_ring = cp if inner_ring is None else inner_ring
        self.device_mesh = None
        if not (dist.is_available() and dist.is_initialized()):
            self.dp = check_mesh_shape(1, hp, cp, placement, inner_ring)
            self.hp_rank = self.cp_rank = self.dp_rank = 0
            self.hp_group = self.cp_group = self.sp_group = self.cp_outer_group = None
            self.cp_ranks = [0]
            return
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        self.dp = check_mesh_shape(len(ranks), hp, cp, placement, inner_ring)
        grid = mesh_ranks(ranks, hp, cp, placement)
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of the group given to SequenceMesh")
        self.dp_rank, self.cp_rank, self.hp_rank = (int(x) for x in (grid == me).nonzero()[0])
        self.cp_ranks = grid[self.dp_rank, :, self.hp_rank].tolist()
        hp_ranks = grid[self.dp_rank, self.cp_rank, :].tolist()
        if group is None and timeout is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
            from torch.distributed.device_mesh import DeviceMesh
            self.device_mesh = DeviceMesh(device_type, grid, mesh_dim_names=("dp", "cp", "hp"))
            self.hp_group = self.device_mesh.get_group("hp")
            self.cp_group = self.device_mesh.get_group("cp")
            for d in range(self.dp):  # every rank creates every replica's SP group, in order
                sp_group = dist.new_group(sorted(grid[d].reshape(-1).tolist()))
                if d == self.dp_rank:
                    self.sp_group = sp_group
            self.cp_outer_group = self.cp_group
            if self.inner_ring < cp:  # a second communicator over each CP group, for the outer ring
                for d in range(self.dp):
                    for h in range(hp):
                        outer = dist.new_group(grid[d, :, h].tolist())
                        if (d, h) == (self.dp_rank, self.hp_rank):
                            self.cp_outer_group = outer
        elif group is None:  # every rank creates every group, in the same order
            def mine(rank_lists):
                chosen = None
                for rs in rank_lists:
                    g = dist.new_group(rs, timeout=timeout)
                    if me in rs:
                        chosen = g
                return chosen
            cp_lists = [grid[d, :, h].tolist() for d in range(self.dp) for h in range(hp)]
            self.hp_group = mine([grid[d, c, :].tolist() for d in range(self.dp) for c in range(cp)])
            self.cp_group = mine(cp_lists)
            self.sp_group = mine([sorted(grid[d].reshape(-1).tolist()) for d in range(self.dp)])
            self.cp_outer_group = mine(cp_lists) if self.inner_ring < cp else self.cp_group
        else:
            local = dict(use_local_synchronization=True, timeout=timeout)
            self.hp_group = dist.new_group(hp_ranks, **local)
            self.cp_group = dist.new_group(self.cp_ranks, **local)
            self.sp_group = dist.new_group(sorted(grid[self.dp_rank].reshape(-1).tolist()), **local)
            self.cp_outer_group = dist.new_group(self.cp_ranks, **local) if self.inner_ring < cp else self.cp_group

    # ------------------------------------------------------------------ ranks
    @property
    def sp(self) -> int:
        """Sequence-parallel degree ``hp * cp``."""
        return self.hp * self.cp

    @property
    def sp_rank(self) -> int:
        """Index of this rank's shard in :meth:`unshard`'s list: ``cp_rank * hp + hp_rank``."""
        return self.cp_rank * self.hp + self.hp_rank

    def __repr__(self) -> str:
        return (f"SequenceMesh(hp={self.hp}, cp={self.cp}, placement={self.placement!r}, "
                f"inner_ring={self.inner_ring}, dp={self.dp}, coords(dp,cp,hp)=({self.dp_rank},{self.cp_rank},"
                f"{self.hp_rank}))")

    # ----------------------------------------------------------------- layout
    def global_token_index(self, seq_len: int, num_chunks: int = 1,
                           device: torch.device | str | None = None) -> torch.Tensor:
        """``LongTensor [S / (hp * cp)]``: global positions of this rank's tokens, in local order."""
        return mesh_token_index(seq_len, self.hp, self.cp, num_chunks, self.cp_rank, self.hp_rank, device=device)

    def shard(self, x: torch.Tensor, num_chunks: int = 1, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a global tensor (ids, labels, position ids, activations) along ``dim``."""
        return mesh_shard(x, self.hp, self.cp, num_chunks, self.cp_rank, self.hp_rank, dim=dim)

    def unshard(self, x: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...], num_chunks: int = 1,
                dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`.

        ``x`` is either the list of every rank's shard indexed by :attr:`sp_rank` (no
        communication), or this rank's shard, which is all-gathered over the mesh's
        ``hp * cp`` ranks (a collective: every rank of the replica must call it).
        """
        if isinstance(x, (list, tuple)):
            return mesh_unshard(x, self.hp, self.cp, num_chunks, dim=dim)
        if self.sp == 1:
            return x
        by_cp = [torch.empty_like(x) for _ in range(self.hp)]
        dist.all_gather(by_cp, x.contiguous(), group=self.hp_group)
        hp_block = torch.stack(by_cp)                                    # [hp, ...]: rank (c, h) at h
        gathered = [torch.empty_like(hp_block) for _ in range(self.cp)]
        dist.all_gather(gathered, hp_block, group=self.cp_group)         # [cp][hp, ...]
        shards = [gathered[c][h] for c in range(self.cp) for h in range(self.hp)]
        return mesh_unshard(shards, self.hp, self.cp, num_chunks, dim=dim)


def sp_group_of(group: dist.ProcessGroup | None, mesh: SequenceMesh | None) -> dist.ProcessGroup | None:
    """The sequence-parallel group of a model set up with ``group`` or ``mesh`` (the mesh's ``sp_group``)."""
    return mesh.sp_group if mesh is not None else group


def sp_rank_size(group: dist.ProcessGroup | None, mesh: SequenceMesh | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in the sequence-parallel group of ``group`` or ``mesh``;
    ``(0, 1)`` without torch.distributed; with a mesh ``(mesh.sp_rank, hp * cp)``."""
    if mesh is not None:
        return mesh.sp_rank, mesh.sp
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)

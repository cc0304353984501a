"""SequenceMesh: groups, coordinates, placements, errors; the double-ring schedule."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fpdt.comm import RingSchedule, SequenceMesh
from fpdt.comm.mesh import check_mesh_shape, mesh_ranks
from tests.distributed import run_distributed


def test_mesh_ranks_placements():
    assert mesh_ranks(list(range(8)), 2, 2, "head_first").tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # context_first: CP groups are adjacent ranks
    assert mesh_ranks(list(range(4)), 2, 2, "context_first")[0].tolist() == [[0, 2], [1, 3]]


def test_shape_errors():
    with pytest.raises(ValueError, match=r"hp\*cp=2\*3=6 does not divide the 4 ranks"):
        check_mesh_shape(4, 2, 3, "head_first", None)
    with pytest.raises(ValueError, match="inner_ring=3 must be a positive divisor of cp=4"):
        check_mesh_shape(4, 1, 4, "head_first", 3)
    with pytest.raises(ValueError, match="placement='rows' must be one of"):
        check_mesh_shape(4, 2, 2, "rows", None)
    with pytest.raises(ValueError, match="hp\\*cp=1\\*2=2 does not divide the 1 ranks"):
        SequenceMesh(hp=1, cp=2)  # no process group: a world of 1


@pytest.mark.parametrize("cp,w", [(1, 1), (4, 4), (4, 2), (4, 1), (6, 3), (6, 2), (3, 3)])
def test_ring_schedule_moves_every_block_to_every_rank(cp, w):
    sched = [RingSchedule(cp, w, c) for c in range(cp)]
    for c in range(cp):
        assert sorted(sched[c].owner(s) for s in range(cp)) == list(range(cp))
        assert sched[c].owner(0) == c
    for s in range(cp - 1):
        for c in range(cp):
            held_next = sched[c].owner(s + 1)
            t = s % w
            if t + 1 < w:  # arrives by the inner ring from the inner predecessor's current block
                src = sched[c].inner_peers()[1]
                assert sched[c].sends_inner(s) and sched[src].inner_peers()[0] == c
                assert sched[src].owner(s) == held_next
            else:  # arrives by the outer ring: the block the outer predecessor STARTED this outer step with
                src = sched[c].outer_peers()[1]
                assert sched[src].outer_peers()[0] == c
                assert sched[src].owner(s - t) == held_next and sched[src].sends_outer(s - t)
    for s in range(cp):  # gradients follow their block, and come home after the last step
        for c in range(cp):
            dst, src = sched[c].grad_peers(s)
            want = sched[dst].owner(s + 1) if s + 1 < cp else dst
            assert sched[c].owner(s) == want
            assert sched[src].grad_peers(s)[0] == c


def _mesh_body(rank, world, explicit_group):
    for hp, cp, placement, w in ((2, 2, "head_first", None), (2, 2, "context_first", 1), (1, 4, "head_first", 2),
                                 (4, 1, "context_first", None), (1, 2, "head_first", None)):
        group = dist.new_group(list(range(world))) if explicit_group else None
        mesh = SequenceMesh(hp=hp, cp=cp, placement=placement, inner_ring=w, group=group)
        outer_ranks = dist.get_process_group_ranks(mesh.cp_outer_group)
        assert outer_ranks == dist.get_process_group_ranks(mesh.cp_group) == mesh.cp_ranks
        assert (mesh.cp_outer_group is mesh.cp_group) == (w is None or w == cp)
        assert mesh.dp == world // (hp * cp)
        grid = mesh_ranks(list(range(world)), hp, cp, placement)
        assert grid[mesh.dp_rank, mesh.cp_rank, mesh.hp_rank] == rank
        assert dist.get_world_size(mesh.hp_group) == hp and dist.get_world_size(mesh.cp_group) == cp
        assert dist.get_rank(mesh.hp_group) == mesh.hp_rank and dist.get_rank(mesh.cp_group) == mesh.cp_rank
        assert mesh.cp_ranks[mesh.cp_rank] == rank
        assert sorted(dist.get_process_group_ranks(mesh.sp_group)) == sorted(grid[mesh.dp_rank].reshape(-1).tolist())
        # the layout round-trips through a collective unshard
        S, u = 2 * hp * cp * 2 * 2, 2
        x = torch.arange(S * 3, dtype=torch.float32).reshape(1, S, 3)
        local = mesh.shard(x, u)
        assert torch.equal(local[0, :, 0] / 3, mesh.global_token_index(S, u).float())
        assert torch.equal(mesh.unshard(local, u), x)


@pytest.mark.slow
@pytest.mark.parametrize("explicit_group", [False, True])
def test_mesh_groups(explicit_group):
    run_distributed(_mesh_body, 4, args=(explicit_group,))


def _timeout_body(rank, world):
    def backend_timeout(g):
        return g._get_backend(torch.device("cpu")).options._timeout

    for kw in (dict(hp=2, cp=2), dict(hp=1, cp=4, inner_ring=2), dict(hp=2, cp=1)):
        plain = SequenceMesh(**kw)
        timed = SequenceMesh(**kw, timeout=timedelta(seconds=77))
        for name in ("hp_group", "cp_group", "sp_group", "cp_outer_group"):
            a, b = getattr(plain, name), getattr(timed, name)
            assert dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b), (kw, name)
            assert backend_timeout(b) == timedelta(seconds=77), (kw, name, backend_timeout(b))
        if timed.inner_ring < timed.cp:
            assert timed.cp_outer_group is not timed.cp_group   # its own communicator
        assert (timed.hp_rank, timed.cp_rank, timed.dp_rank, timed.cp_ranks) == \
               (plain.hp_rank, plain.cp_rank, plain.dp_rank, plain.cp_ranks)


@pytest.mark.slow
def test_mesh_groups_take_the_run_timeout():
    """``SequenceMesh(timeout=)`` (the trainer's --dist-timeout-min) builds the same groups
    as the DeviceMesh path, each with that timeout."""
    run_distributed(_timeout_body, 4)

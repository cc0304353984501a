import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits here forever: the harness must not hang


def _hang(rank, world_size):
    if rank == 1:
        time.sleep(600)  # never reaches the collective
    dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collective_runs(world_size):
    run_distributed(_sum_ranks, world_size)


@pytest.mark.slow
def test_failing_rank_reports_traceback():
    with pytest.raises(AssertionError, match=r"of 2 failed(.|\n)*----- rank 1 -----(.|\n)*boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)


@pytest.mark.slow
def test_hang_times_out():
    with pytest.raises(AssertionError, match=r"did not finish within 5s"):
        run_distributed(_hang, 2, timeout=5)

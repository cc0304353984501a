import pytest
import torch

from fpdt.comm import (HeadsToSeq, SeqToHeads, heads_to_seq, heads_to_seq_packed, kv_replication_factor,
                       replicate_kv, seq_to_heads, seq_to_heads_packed, sum_kv_replicas)
from fpdt.layout import shard
from tests.distributed import run_distributed


def _body(rank, world):
    torch.manual_seed(0)
    B, n, H, D = 2, 3, 4 * world, 5
    full = torch.randn(B, world * n, H, D)          # the gathered sequence (one chunk)
    local = shard(full, world, 1, rank).requires_grad_()
    heads = SeqToHeads.apply(local, None)
    Hl = H // world
    torch.testing.assert_close(heads, full[:, :, rank * Hl:(rank + 1) * Hl], rtol=0, atol=0)
    back = HeadsToSeq.apply(heads, None)
    torch.testing.assert_close(back, local, rtol=0, atol=0)
    g = torch.randn_like(back)
    back.backward(g)
    torch.testing.assert_close(local.grad, g, rtol=0, atol=0)  # the two ops are each other's adjoint


def _packed_body(rank, world):
    torch.manual_seed(rank)
    xs = [torch.randn(2, 3, h * world, 5) for h in (3, 1, 1)]   # q, k, v with different head counts
    packed = seq_to_heads_packed(xs, None)
    for x, p in zip(xs, packed):
        torch.testing.assert_close(p, seq_to_heads(x, None), rtol=0, atol=0)
    for x, back in zip(xs, heads_to_seq_packed(packed, None)):
        torch.testing.assert_close(back, x, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_roundtrip_and_autograd(world):
    run_distributed(_body, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_packed_all_to_all_equals_one_per_tensor(world):
    run_distributed(_packed_body, world)


def test_world_of_one_is_identity():
    x = torch.randn(1, 4, 2, 3)
    assert seq_to_heads(x, None) is x and heads_to_seq(x, None) is x


def test_kv_replication_rule():
    assert kv_replication_factor(32, 8, 4) == 1
    assert kv_replication_factor(32, 8, 16) == 2
    assert kv_replication_factor(32, 1, 8) == 8
    assert kv_replication_factor(12, 6, 4) == 2      # lcm(6, 4) = 12 replicated heads
    x = torch.arange(2.0).view(1, 1, 2, 1)
    assert replicate_kv(x, 3).view(-1).tolist() == [0, 0, 0, 1, 1, 1]  # repeat_interleave, not tile
    g = torch.ones(1, 1, 6, 1)
    assert sum_kv_replicas(g, 3).view(-1).tolist() == [3, 3]
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by the sequence-parallel size 4"):
        kv_replication_factor(6, 2, 4)

"""prepare_inputs: labels shifted on the global sequence, then everything sharded alike."""

import pytest
import torch

from fpdt.layout import local_position_ids, shard, unshard
from fpdt.model import prepare_inputs, shift_labels


@pytest.mark.parametrize("P, u", [(1, 1), (2, 2), (4, 1), (2, 3)])
def test_shift_then_shard(P, u):
    B, S = 2, 24
    ids = torch.arange(B * S).view(B, S) + 1000
    labels = ids.clone()
    labels[1, 5] = -100
    parts = [prepare_inputs(ids, labels=labels, sp_size=P, rank=r, num_chunks=u) for r in range(P)]
    for r, p in enumerate(parts):
        assert p["input_ids"].shape == (B, S // P)
        assert torch.equal(p["position_ids"], local_position_ids(S, P, u, r, B))
        # each local label is the global successor of the local token (across rank boundaries)
        nxt = p["input_ids"] + 1
        is_last = p["position_ids"] == S - 1
        expect = torch.where(is_last, torch.full_like(nxt, -100), nxt)
        expect[(p["position_ids"] == 4) & (torch.arange(B)[:, None] == 1)] = -100
        assert torch.equal(p["labels"], expect)
    assert torch.equal(unshard([p["labels"] for p in parts], u), shift_labels(labels))
    assert torch.equal(unshard([p["input_ids"] for p in parts], u), ids)


def test_custom_positions_and_preshifted_labels():
    ids = torch.randint(0, 9, (1, 8))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # packed documents
    out = prepare_inputs(ids, labels=ids, position_ids=pos, sp_size=2, rank=1, num_chunks=2, shift=False)
    assert torch.equal(out["position_ids"], shard(pos, 2, 2, 1))
    assert torch.equal(out["labels"], shard(ids, 2, 2, 1))


def test_rejects_indivisible_length():
    with pytest.raises(ValueError, match="not divisible"):
        prepare_inputs(torch.zeros(1, 10, dtype=torch.long), sp_size=4, rank=0, num_chunks=1)

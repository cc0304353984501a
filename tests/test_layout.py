import pytest
import torch

from fpdt.layout import check_layout, global_token_index, local_position_ids, shard, unshard


@pytest.mark.parametrize("sp,u", [(1, 1), (1, 4), (2, 1), (2, 3), (4, 2)])
def test_shard_unshard_roundtrip(sp, u):
    S = sp * u * 5
    x = torch.randn(2, S, 3)
    parts = [shard(x, sp, u, r) for r in range(sp)]
    assert all(p.shape == (2, S // sp, 3) for p in parts)
    torch.testing.assert_close(unshard(parts, u), x, rtol=0, atol=0)


def test_layout_matches_definition():
    # P=2, u=2, S=8 -> L=2: rank 0 holds pieces 0, 2 = tokens 0,1,4,5; rank 1 pieces 1, 3.
    assert global_token_index(8, 2, 2, 0).tolist() == [0, 1, 4, 5]
    assert global_token_index(8, 2, 2, 1).tolist() == [2, 3, 6, 7]
    pos = local_position_ids(8, 2, 2, 1, batch_size=3)
    assert pos.shape == (3, 4) and pos[2].tolist() == [2, 3, 6, 7]


def test_chunk_i_gathers_a_contiguous_span():
    # After the chunk-i all-to-all, ranks in order hold [i*P*L, (i+1)*P*L).
    S, P, u = 24, 3, 2
    L = S // (P * u)
    idx = [global_token_index(S, P, u, r).view(u, L) for r in range(P)]
    for i in range(u):
        gathered = torch.cat([idx[r][i] for r in range(P)])
        assert gathered.tolist() == list(range(i * P * L, (i + 1) * P * L))


def test_shard_other_dims_and_dtypes():
    ids = torch.arange(12).view(1, 12)
    assert shard(ids, 2, 3, 1).tolist() == [[2, 3, 6, 7, 10, 11]]
    x = torch.arange(12).view(12, 1)
    assert shard(x, 2, 3, 0, dim=0).view(-1).tolist() == [0, 1, 4, 5, 8, 9]


def test_bad_layout_names_the_fix():
    with pytest.raises(ValueError, match=r"S=10 is not divisible by sp_size\*num_chunks=2\*2=4"):
        check_layout(10, 2, 2)
    with pytest.raises(ValueError, match="rank=2 outside"):
        global_token_index(8, 2, 1, 2)

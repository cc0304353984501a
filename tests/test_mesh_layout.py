"""The 2D mesh token layout (FPDT chunk order x zigzag over CP x Ulysses slices over HP)."""

import pytest
import torch

from fpdt.layout import check_mesh_layout, global_token_index, mesh_shard, mesh_token_index, mesh_unshard


@pytest.mark.parametrize("hp,cp,u", [(1, 1, 1), (2, 1, 3), (1, 2, 1), (1, 3, 2), (2, 2, 2), (4, 1, 2), (1, 4, 3),
                                     (3, 2, 1)])
def test_roundtrip_and_partition(hp, cp, u):
    S = 2 * hp * cp * u * 3
    x = torch.randn(2, S, 3)
    parts = [mesh_shard(x, hp, cp, u, c, h) for c in range(cp) for h in range(hp)]
    assert all(p.shape == (2, S // (hp * cp), 3) for p in parts)
    torch.testing.assert_close(mesh_unshard(parts, hp, cp, u), x, rtol=0, atol=0)
    idx = torch.cat([mesh_token_index(S, hp, cp, u, c, h) for c in range(cp) for h in range(hp)])
    assert sorted(idx.tolist()) == list(range(S))  # every token exactly once


def test_matches_definition():
    # S=16, u=2, cp=2, hp=2: spans of 8, pieces of 2. CP rank 0 takes pieces 0, 3 of each span,
    # CP rank 1 pieces 1, 2; HP rank h takes half h of the CP chunk.
    idx = {(c, h): mesh_token_index(16, 2, 2, 2, c, h).tolist() for c in range(2) for h in range(2)}
    assert idx[(0, 0)] == [0, 1, 8, 9]
    assert idx[(0, 1)] == [6, 7, 14, 15]
    assert idx[(1, 0)] == [2, 3, 10, 11]
    assert idx[(1, 1)] == [4, 5, 12, 13]


@pytest.mark.parametrize("hp,u", [(1, 1), (2, 3), (4, 2)])
def test_cp1_is_the_fpdt_layout(hp, u):
    S = 2 * hp * u * 5
    for h in range(hp):
        assert torch.equal(mesh_token_index(S, hp, 1, u, 0, h), global_token_index(S, hp, u, h))


def test_after_all_to_all_each_cp_rank_sees_its_zigzag_chunk():
    hp, cp, u, S = 2, 3, 2, 2 * 2 * 3 * 2 * 2
    L, span = S // (hp * cp * u), S // u
    piece = span // (2 * cp)
    for c in range(cp):
        for i in range(u):  # the all-to-all concatenates the HP ranks' local chunk i in rank order
            got = torch.cat([mesh_token_index(S, hp, cp, u, c, h)[i * L:(i + 1) * L] for h in range(hp)])
            want = torch.cat([torch.arange(piece) + i * span + c * piece,
                              torch.arange(piece) + i * span + (2 * cp - 1 - c) * piece])
            assert torch.equal(got, want)


def test_bad_length_names_the_multiple():
    with pytest.raises(ValueError, match=r"not divisible by 2\*hp\*cp\*num_chunks=2\*2\*2\*3=24"):
        check_mesh_layout(36, 2, 2, 3)
    with pytest.raises(ValueError, match="outside"):
        mesh_token_index(16, 2, 2, 1, 2, 0)

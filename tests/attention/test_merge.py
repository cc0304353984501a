"""The in-place online-softmax merge equals the out-of-place one, and allocates no output-sized copy."""

import torch

from fpdt.attention.merge import OnlineSoftmax, merge, merge_
from fpdt.memory.accountant import MemoryAccountant


def _blocks(n, B=2, S=5, H=3, D=8, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(n)]
    lses = [torch.randn(B, H, S, generator=g) for _ in range(n)]
    lses[1][0, 0, :2] = float("-inf")                     # masked rows on one side
    lses[0][0, 0, 0] = float("-inf")                      # ... and on both
    return outs, lses


def test_in_place_merge_matches_merge():
    outs, lses = _blocks(3)
    ref_o, ref_l = outs[0].float(), lses[0].clone()
    acc = OnlineSoftmax(torch.float32)
    for o, l in zip(outs, lses):
        acc.update(o, l)
    for o, l in zip(outs[1:], lses[1:]):
        ref_o, ref_l = merge(ref_o, ref_l, o.float(), l)
    torch.testing.assert_close(acc.out, ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc.lse, ref_l)
    assert torch.isfinite(acc.out).all()


def test_merge_allocates_only_lse_sized_temporaries():
    outs, lses = _blocks(2, B=1, S=64, H=4, D=64)
    out, lse = outs[0].float(), lses[0].clone()
    with MemoryAccountant("cpu") as acct:
        merge_(out, lse, outs[1], lses[1])
    lse_bytes = lse.numel() * 4
    assert acct.device_peak <= 12 * lse_bytes < out.numel() * 4   # far below one fp32 output copy


def test_rows_that_see_no_key_contribute_nothing():
    """Packed documents: a block row that sees no key (lse -inf, out 0) gets no weight and
    makes no NaN, whichever block comes first; rows masked in every block stay out 0, lse -inf."""
    torch.manual_seed(0)
    B, S, H, D = 2, 5, 3, 4
    blocks = [(torch.randn(B, S, H, D), torch.randn(B, H, S)) for _ in range(3)]
    seen = torch.rand(3, B, S) < 0.5
    seen[:, 0, 0] = False                  # row (0, 0) sees no key anywhere
    seen[0, 1, :] = False                  # the first block hides every row of batch 1
    masked = []
    for (o, lse), s in zip(blocks, seen):
        o = torch.where(s[..., None, None], o, 0.0)
        lse = torch.where(s[:, None, :], lse, float("-inf"))
        masked.append((o, lse))
    acc = OnlineSoftmax()
    for o, lse in masked:
        acc.update(o.clone(), lse.clone())   # the accumulator takes its first block over
    # the expected: softmax weights over the blocks that see the row
    lses = torch.stack([lse for _, lse in masked])                      # [3, B, H, S]
    total = torch.logsumexp(lses, 0)
    w = torch.exp(lses - total).nan_to_num(0.0)                          # all -inf rows: 0 weights
    expect = sum(wi.transpose(1, 2)[..., None] * o for wi, (o, _) in zip(w, masked))
    assert not acc.out.isnan().any() and not acc.lse.isnan().any()
    torch.testing.assert_close(acc.out, expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(acc.lse), torch.isneginf(total))
    torch.testing.assert_close(acc.lse[~torch.isneginf(total)], total[~torch.isneginf(total)])
    assert (acc.out[0, 0] == 0).all() and torch.isneginf(acc.lse[0, :, 0]).all()
    o, lse = merge(*masked[0], *masked[1])
    assert not o.isnan().any() and not lse.isnan().any()

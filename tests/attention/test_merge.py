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

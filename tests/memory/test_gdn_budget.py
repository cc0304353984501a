"""Device working set of the Gated DeltaNet layer (fpdt.model.gated_deltanet), counted exactly on the
CPU: with offload it is a constant number of chunks whatever ``u``; without, each chunk adds exactly
what the stash keeps of it. ``U`` = one bf16 chunk of hidden states (``C * hidden * 2`` bytes, ``C``
the chunk's tokens). ``fwd`` = forward peak beyond the output; ``bwd`` = backward peak beyond its start,
the input gradient and the weights' fp32 gradient accumulators. What makes up
the numbers: ``docs/memory.md`` (The Gated DeltaNet layer)."""

import gc

import pytest
import torch

from fpdt.memory.accountant import MemoryAccountant, chunk_unit
from fpdt.model.gated_deltanet import GatedDeltaNet

HIDDEN, SHAPE = 256, (2, 4, 64, 64)     # Qwen3.5's proportions: conv channels 2 x hidden, HV = 2 Hk
CHUNK = 256
# measured (docs/memory.md itemises them); a buffer of one more chunk anywhere fails the test
FWD_BUDGET, BWD_BUDGET = 20.8, 48.1


def stash_bytes_per_chunk(chunk: int) -> int:
    """What the stash keeps of one chunk: pre-conv channels, gates, core output (bf16), the fp32
    boundary state and the conv window; the input chunk is a view of the layer's input."""
    hk, hv, dk, dv = SHAPE
    conv = 2 * hk * dk + hv * dv
    return 2 * chunk * (conv + 2 * hv + hv * dv) + 4 * hv * dk * dv + 2 * 3 * conv


def working_set(chunk: int, u: int, offload: bool) -> dict[str, float]:
    gc.collect()
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, *SHAPE).to(torch.bfloat16)
    layer.num_chunks, layer.offload = u, offload
    x = (torch.randn(1, chunk * u, HIDDEN) * 0.5).to(torch.bfloat16).requires_grad_()
    dout = torch.randn(1, chunk * u, HIDDEN).to(torch.bfloat16)
    with MemoryAccountant("cpu") as acct:
        with acct.phase("fwd"):
            out = layer(x)
        with acct.phase("bwd"):
            out.backward(dout)
    U = chunk_unit(chunk, HIDDEN)
    accumulators = sum(p.numel() * 4 for p in layer.parameters())
    return {"fwd": (acct.phases["fwd"].peak - out.numel() * 2) / U,
            "bwd": (acct.phases["bwd"].peak_above_start - x.numel() * 2 - accumulators) / U,
            "fwd_bytes": acct.phases["fwd"].peak - out.numel() * 2}


@pytest.mark.slow
def test_offload_working_set_is_flat_in_u():
    """u = 4, 8, 32 (8K tokens): the same bytes, within the budget."""
    sizes = {u: working_set(CHUNK, u, offload=True) for u in (4, 8, 32)}
    for u, r in sizes.items():
        assert r["fwd"] <= FWD_BUDGET and r["bwd"] <= BWD_BUDGET, (u, r)
        assert r["fwd"] == sizes[4]["fwd"] and r["bwd"] == sizes[4]["bwd"], sizes


@pytest.mark.parametrize("u", [4, 8])
def test_without_offload_each_chunk_adds_its_stash(u):
    grow = working_set(CHUNK, 2 * u, offload=False)["fwd_bytes"] - working_set(CHUNK, u, offload=False)["fwd_bytes"]
    assert grow == u * stash_bytes_per_chunk(CHUNK)

"""The chunked MoE MLP's device budget in chunk units, counted by the accountant: its backward
holds at most two local attention chunks of bf16 hidden states beyond its outputs (input gradient,
fp32 weight gradients) at the default MoE chunk count, whatever the sequence length."""

import pytest
import torch

from fpdt.memory.accountant import MemoryAccountant, chunk_unit
from fpdt.model.chunks import chunk_bounds
from fpdt.model.llama import RMSNorm
from fpdt.model.moe import ChunkedMoE, RouterStatistics, default_moe_chunks, moe_elements_per_token

HIDDEN, FFN, E, K = 64, 48, 16, 4


def _working_set(L: int, u: int, kernel: str, shared: int = 0):
    """Forward peak beyond the output and the fp32 ``rstd``, backward peak beyond its start, the
    input gradient and the fp32 weight-gradient accumulators, in bytes, and the largest token
    chunk, at ``u`` chunks of ``L`` tokens."""
    torch.manual_seed(0)
    chunks = default_moe_chunks(HIDDEN, FFN, E, K, u, shared)
    m = ChunkedMoE(HIDDEN, FFN, E, K, True, shared_intermediate_size=shared, num_chunks=chunks).bfloat16()
    m.kernel = kernel
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    norm = RMSNorm(HIDDEN, 1e-6).bfloat16()
    T = L * u
    x = torch.randn(1, T, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, T, HIDDEN, dtype=torch.bfloat16)
    grads = sum(p.numel() * 4 for p in (*m.parameters(), *norm.parameters())) + x.numel() * 2
    with MemoryAccountant("cpu") as acct:
        with acct.phase("fwd"):
            y = m(x, norm=norm, stats=RouterStatistics(E, K))
        with acct.phase("bwd"):
            y.backward(dy)
    fwd = acct.phases["fwd"].peak - y.numel() * 2 - T * 4
    bwd = acct.phases["bwd"].peak_above_start - grads
    n = max(e - s for s, e in chunk_bounds(T, chunks))
    return fwd, bwd, n


@pytest.mark.parametrize("kernel,u", [("grouped_mm", 1), pytest.param("loop", 1, marks=pytest.mark.slow),
                                      pytest.param("loop", 4, marks=pytest.mark.slow),
                                      pytest.param("grouped_mm", 4, marks=pytest.mark.slow)])
def test_backward_within_two_chunk_units(kernel, u):
    L = 2048                                     # the chunk's set outweighs the weights' bf16 gradients
    fwd, bwd, n = _working_set(L, u, kernel)
    U = chunk_unit(L, HIDDEN)                    # one local attention chunk, bf16 [L, hidden]
    per_token = moe_elements_per_token(HIDDEN, FFN, E, K) * 2
    assert (n - 1) * per_token <= 2 * U          # up to the rounding of the chunk length
    routed = n * per_token
    weight_grad = E * 2 * FFN * HIDDEN * 2 if kernel == "grouped_mm" else 0   # one bf16 gate_up gradient
    assert 0.85 * routed <= bwd <= routed + weight_grad, (bwd / U, routed / U)   # the formula counts what is there
    per_chunk = routed
    assert fwd <= per_chunk, (fwd / U, per_chunk / U)


@pytest.mark.slow
def test_flat_in_sequence_length():
    """The same token chunk at 2x and 4x the tokens: the same peaks (no [T, k] or [T, E] tensor stays)."""
    a = _working_set(2048, 2, "loop")
    b = _working_set(2048, 4, "loop")             # a [T, k] int64 tensor would be 64 KiB more
    assert a[2] == b[2] and abs(a[1] - b[1]) <= 1024 and abs(a[0] - b[0]) <= 1024, (a, b)


@pytest.mark.slow
def test_shared_expert_within_budget():
    fwd, bwd, n = _working_set(2048, 2, "loop", shared=96)
    per_chunk = n * moe_elements_per_token(HIDDEN, FFN, E, K, 96) * 2
    assert bwd <= per_chunk and fwd <= per_chunk, (bwd, fwd, per_chunk)

"""Device-memory budget of the 2D mesh attention path, counted with fpdt.memory.accountant.

4 gloo ranks, bf16, GQA 4:1, offload on, chunk length fixed (C = 128 after the all-to-all):
the attention core's forward working set beyond its output, and its backward working set
beyond the dq/dk/dv outputs and one bf16 gradient buffer, must stay within the estimate
of :func:`fpdt.attention.ring_costs.attention_costs` (independent of u) plus 1 U of slack
(lse and index temporaries), at u = 4 and u = 8.
"""

import pytest

import torch

from fpdt.attention import fpdt_attention
from fpdt.attention.ring_costs import attention_costs
from fpdt.comm import SequenceMesh
from fpdt.memory.accountant import MemoryAccountant, chunk_unit
from tests.distributed import run_distributed

H, H_KV, D, C = 8, 2, 64, 128


def _measure(mesh, u):
    L = C // mesh.hp
    S = mesh.sp * u * L
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, D, generator=g).bfloat16() for h in (H, H_KV, H_KV, H))
    ql, kl, vl = (mesh.shard(t, u).requires_grad_() for t in (q, k, v))
    dol = mesh.shard(do, u)
    for _ in range(2):  # the first call also runs the kernel self-check: measure the second
        with MemoryAccountant() as acct:
            with acct.phase("fwd"):
                out = fpdt_attention(ql, kl, vl, mesh=mesh, num_chunks=u, offload=True)
            with acct.phase("bwd"):
                out.backward(dol)
        del out
        ql.grad = kl.grad = vl.grad = None
    U = chunk_unit(C, H * D)
    Nd = ql.numel() * 2
    fwd = (acct.phases["fwd"].peak_above_start - Nd) / U                  # beyond the output
    bwd = (acct.phases["bwd"].peak_above_start - 2 * Nd - 2 * kl.numel() * 2) / U  # beyond dq/dk/dv + grad buffer
    est = attention_costs(seq_len=S, num_heads=H, num_kv_heads=H_KV, head_dim=D, hp=mesh.hp, cp=mesh.cp,
                          inner_ring=mesh.inner_ring, num_chunks=u)
    return fwd, bwd, est


def _body(rank, world):
    for kw, chunks in ((dict(hp=2, cp=2), (4, 8)), (dict(hp=1, cp=4, inner_ring=2), (4,))):
        mesh = SequenceMesh(**kw)
        for u in chunks:
            fwd, bwd, est = _measure(mesh, u)
            assert fwd <= est.peak_fwd_U + 1, (kw, u, fwd, est.peak_fwd_U)
            assert bwd <= est.peak_bwd_U + 1, (kw, u, bwd, est.peak_bwd_U)
        # the bound does not depend on u, so u = 4 and u = 8 both holding it is the no-growth check
        # (a tighter step-to-step comparison was flaky by +0.5 U on one rank under load)


@pytest.mark.slow
def test_mesh_attention_memory_budget():
    run_distributed(_body, 4, timeout=300)

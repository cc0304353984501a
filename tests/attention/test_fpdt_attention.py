"""fpdt_attention vs a single-process float64 reference, on 1, 2 and 4 gloo ranks.

Every case draws fresh inputs, shards them with fpdt.layout, runs forward and backward
on each rank, and compares the rank's output and dq/dk/dv with the reference's slice.
Tolerance is norm-wise relative: 1e-5 in fp32, 2e-2 in bf16.
"""

import pytest
import torch

from fpdt.attention import fpdt_attention
from fpdt.layout import shard
from tests.attention.reference import assert_rel_close, reference_attention
from tests.distributed import run_distributed

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def check_case(rank, world, *, B, H, H_kv, D, u, offload, dtype=torch.float32, causal=True, piece=3, seed=0,
               runtime=None):
    g = torch.Generator().manual_seed(seed)
    S = world * u * piece
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g).to(dtype) for h in (H, H_kv, H_kv, H))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal)
    ref.backward(dout.double())

    ql, kl, vl = (shard(t, world, u, rank).requires_grad_() for t in (q, k, v))
    out = fpdt_attention(ql, kl, vl, num_chunks=u, offload=offload, causal=causal, runtime=runtime)
    assert out.dtype == dtype and out.shape == ql.shape
    out.backward(shard(dout, world, u, rank))
    what = f"rank {rank}/{world} B={B} H={H} H_kv={H_kv} D={D} u={u} offload={offload} {dtype} causal={causal}"
    errs = [assert_rel_close(a, shard(b, world, u, rank), TOL[dtype], f"{name} [{what}]")
            for name, a, b in (("out", out, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                               ("dv", vl.grad, vr.grad))]
    return max(errs)


def _cases(world):
    H = 6 if world < 4 else 8
    kv_options = {1: (1, 2, 6), 2: (1, 2, 3, 6), 4: (1, 2, 8)}[world]
    chunk_options = (1, 2, 4, 8) if world == 1 else (1, 2, 4)
    cases = []
    for u in chunk_options:
        for H_kv in kv_options:
            for offload in (False, True):
                cases.append(dict(B=2, H=H, H_kv=H_kv, D=40, u=u, offload=offload, seed=len(cases)))
    for offload in (False, True):  # bf16, GQA, several chunks
        cases.append(dict(B=2, H=H, H_kv=2, D=40, u=2, offload=offload, dtype=torch.bfloat16, seed=len(cases)))
    cases.append(dict(B=1, H=H, H_kv=H, D=16, u=2, offload=True, causal=False, seed=len(cases)))
    return cases


def _parity_body(rank, world):
    for case in _cases(world):
        check_case(rank, world, **case)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_reference(world):
    if world == 1:
        _parity_body(0, 1)  # no process group: a world of 1
    else:
        run_distributed(_parity_body, world, timeout=240)


def _world1_group_body(rank, world):
    # an explicit one-rank group inside an initialised world also works
    check_case(0, 1, B=1, H=4, H_kv=2, D=8, u=2, offload=True)


@pytest.mark.slow
def test_explicit_default_group_of_one():
    run_distributed(_world1_group_body, 1)


def test_float64_pipeline_is_exact():
    """With the math backend in float64 the chunked/offloaded algorithm itself is exact; a
    random output gradient (not out.sum()'s all-ones) sees a misplaced gradient chunk."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = fpdt_attention(q, k, v, num_chunks=4, offload=True, backend="math")
    ref = reference_attention(q, k, v)
    assert_rel_close(out, ref, 1e-12, "out")
    dout = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), dout)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in ((gq, rq), (gk, rk), (gv, rv)):
        assert_rel_close(a, b, 1e-12, "grad")


def test_bad_sequence_length_names_the_fix():
    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(ValueError, match=r"S=6 .* not divisible by sp\*num_chunks=1\*4=4"):
        fpdt_attention(q, q, q, num_chunks=4)
    with pytest.raises(ValueError, match="a chunk cannot be larger than the sequence"):
        fpdt_attention(q, q, q, num_chunks=12)


def test_bad_heads_and_backend():
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        fpdt_attention(q, k, k)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        fpdt_attention(q, q, q, backend="fast")


def _heads_not_divisible_body(rank, world):
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="num_heads=5 is not divisible by the sequence-parallel size 2"):
        fpdt_attention(q, q, q)


@pytest.mark.slow
def test_heads_not_divisible_by_sp():
    run_distributed(_heads_not_divisible_body, 2)

"""The CUDA varlen adapter for document-masked blocks (:mod:`fpdt.attention.kernels.varlen`),
run on the CPU against stand-ins with the exact signatures of torch's varlen
FlashAttention-2 ops (:mod:`tests.attention.varlen_standins`)."""

import pytest
import torch

from fpdt.attention import fpdt_attention
from fpdt.attention.documents import MASKED, Documents
from fpdt.attention.kernels import BACKENDS, varlen
from fpdt.attention.kernels.masked import masked_backward, masked_forward, segments_backward, segments_forward
from fpdt.layout import shard
from tests.attention import varlen_standins as standins
from tests.attention.reference import assert_rel_close, doc_ids_from_lengths, reference_document_attention
from tests.distributed import run_distributed


def _blocks():
    ids = doc_ids_from_lengths([[5, 1, 1, 20, 13, 8, 1, 15], [3, 37, 2, 22]])    # 64 tokens, two rows
    docs = Documents(ids, causal=True)
    docs.add_side("k", torch.arange(24))
    docs.add_side("q", torch.arange(24, 64))
    return docs.block("q", "q"), docs.block("q", "k")


def test_not_used_off_cuda_or_in_fp32():
    assert not varlen.varlen_for(torch.device("cpu"), torch.bfloat16, 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 36])
def test_self_check_passes_and_matches_the_segment_path(monkeypatch, dtype, head_dim):
    standins.install(monkeypatch)
    assert varlen.varlen_self_check(torch.device("cpu"), dtype, head_dim) is None
    assert varlen.varlen_for(torch.device("cpu"), dtype, head_dim)
    assert not varlen.varlen_for(torch.device("cpu"), torch.float32, head_dim)
    math = BACKENDS["math"]
    g = torch.Generator().manual_seed(0)
    for blk in _blocks():
        assert blk.kind == MASKED
        B, S = 2, blk.q_len
        q, dout = (torch.randn(B, S, 6, head_dim, generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(B, blk.k_len, 2, head_dim, generator=g).to(dtype) for _ in range(2))
        standins.CALLS.clear()
        out, lse = masked_forward(math, q, k, v, blk, 0.2)            # dispatches to varlen
        assert standins.CALLS == [("forward", len(blk.segments))]
        ro, rl = segments_forward(math, q, k, v, blk, 0.2)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)) and not out.isnan().any()
        assert (out[torch.isneginf(lse).transpose(1, 2)] == 0).all()
        assert_rel_close(out, ro, 1e-2, "out")
        fin = torch.isfinite(rl)
        assert_rel_close(lse[fin], rl[fin], 1e-5, "lse")
        merged = torch.where(fin, rl, torch.full_like(rl, 0.3))
        got = masked_backward(math, dout, q, k, v, ro, merged, blk, 0.2)
        ref = segments_backward(math, dout, q, k, v, ro, merged, blk, 0.2)
        for name, a, b in zip(("dq", "dk", "dv"), got, ref):
            assert a.dtype == torch.float32
            assert_rel_close(a, b, 1e-2, name)


def test_a_kernel_that_fails_the_self_check_is_not_used(monkeypatch):
    standins.install(monkeypatch)
    real = standins.flash_attention_forward

    def wrong_lse(*args, **kwargs):        # lse off by one: the merge would weigh blocks wrongly
        out, lse, *rest = real(*args, **kwargs)
        return (out, lse + 1, *rest)

    monkeypatch.setattr(varlen.aten, "_flash_attention_forward", wrong_lse)
    with pytest.warns(RuntimeWarning, match="varlen attention kernel failed its self-check"):
        assert not varlen.varlen_for(torch.device("cpu"), torch.bfloat16, 8)
    assert not varlen.varlen_for(torch.device("cpu"), torch.bfloat16, 8)   # decided once, warned once


def _pipeline_body(rank, world, monkeypatch=None):
    if monkeypatch is None:
        mp = pytest.MonkeyPatch()
        standins.install(mp)
    lengths = [[5, 1, 1, 17, 7, 1, 16], [1, 1, 1, 45]]
    doc = doc_ids_from_lengths(lengths)
    for u, H_kv, offload in ((2, 2, True), (3, 4, False), (4, 1, True)):
        if 48 % (world * u):
            continue
        g = torch.Generator().manual_seed(u)
        q, k, v, dout = (torch.randn(2, 48, h, 8, generator=g).to(torch.bfloat16) for h in (4, H_kv, H_kv, 4))
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference_document_attention(qr, kr, vr, doc)
        ref.backward(dout.double())
        ql, kl, vl = (shard(t, world, u, rank).requires_grad_() for t in (q, k, v))
        standins.CALLS.clear()
        out = fpdt_attention(ql, kl, vl, num_chunks=u, offload=offload, doc_ids=doc)
        out.backward(shard(dout, world, u, rank))
        assert {c for c, _ in standins.CALLS} == {"forward", "backward"}
        for name, a, b in (("out", out, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                           ("dv", vl.grad, vr.grad)):
            assert_rel_close(a, shard(b, world, u, rank), 2e-2, f"{name} u={u} H_kv={H_kv} rank {rank}")


def test_pipeline_through_the_standins(monkeypatch):
    """bf16 (what the real kernel takes): the masked blocks run through varlen, within 2e-2."""
    standins.install(monkeypatch)
    _pipeline_body(0, 1, monkeypatch)


@pytest.mark.slow
def test_pipeline_through_the_standins_two_ranks():
    run_distributed(_pipeline_body, 2, timeout=240)

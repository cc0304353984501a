"""Lean RMSNorm (fpdt.model.rmsnorm) against the plain autograd RMSNorm, forward and backward."""

import pytest
import torch

from fpdt.model.rmsnorm import RMSNormFunction, rms_norm, rms_norm_reference
from fpdt.memory.accountant import MemoryAccountant
from tests.model.helpers import assert_no_worse_than_bf16

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("num_chunks", [1, 3, 8])
def test_parity_forward_and_backward(dtype, wdtype, num_chunks):
    torch.manual_seed(num_chunks)
    x = (torch.randn(2, 37, 24) * 3 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(24) + 0.5).to(wdtype).requires_grad_()
    g = torch.randn(2, 37, 24).to(torch.promote_types(dtype, wdtype))
    ref = rms_norm_reference(x, w, 1e-5)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x, w), g)
    out = rms_norm(x, w, 1e-5, num_chunks)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    assert out.dtype == ref.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    tol = TOL[dtype]
    assert _rel(out, ref) <= tol and _rel(dx, dx_ref) <= tol and _rel(dw, dw_ref) <= tol, \
        (_rel(out, ref), _rel(dx, dx_ref), _rel(dw, dw_ref))
    if dtype == torch.bfloat16:      # and no further from float64 than the plain bf16 computation
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
        for name, a, b, e in zip(("out", "dx", "dw"), (out, dx, dw), (ref, dx_ref, dw_ref),
                                 (exact, *torch.autograd.grad(exact, (x64, w64), g.double()))):
            assert_no_worse_than_bf16(a, b, e, name)


def test_float64_inputs_match_the_reference_convention():
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 16, dtype=torch.float64)
    ref = rms_norm_reference(x, w, 1e-6)
    out = rms_norm(x, w, 1e-6, 2)
    torch.testing.assert_close(out, ref)                  # both normalise in fp32 (Llama convention)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        assert _rel(a, b) <= 1e-5


def test_saves_input_and_fp32_rstd_only_and_no_full_sequence_fp32_temporaries():
    T, hidden, chunks = 512, 64, 8
    x = torch.randn(1, T, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(hidden, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, T, hidden, dtype=torch.bfloat16)
    with MemoryAccountant("cpu") as acct:
        with acct.phase("fwd"):
            out = RMSNormFunction.apply(x, w, 1e-5, chunks)
        saved = out.grad_fn.saved_tensors
        with acct.phase("bwd"):
            out.backward(g)
    assert [t.shape for t in saved] == [x.shape, w.shape, (T, 1)] and saved[0] is x and saved[2].dtype == torch.float32
    full_bf16, chunk_fp32 = T * hidden * 2, T // chunks * hidden * 4
    # forward: output + rstd + two fp32 chunk temporaries (x32, x32 * x32) and one chunk of rstd
    assert acct.phases["fwd"].peak <= full_bf16 + T * 4 + 2 * chunk_fp32 + T // chunks * 4
    # backward: dx + a handful of fp32 chunk temporaries, never a full-sequence fp32 tensor
    assert acct.phases["bwd"].peak_above_start <= full_bf16 + 5 * chunk_fp32 + hidden * 8


def test_backward_leaves_the_incoming_gradient_alone():
    """fp32: the incoming gradient may be shared with another consumer (an add passes one
    tensor to both its inputs); the norm's backward must not change it in place."""
    torch.manual_seed(0)
    x, other = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    tripled = other * 3                       # created first: its backward runs after the norm's
    r = torch.randn(8, 16)
    ((rms_norm(x, w, 1e-5, 2) + tripled) * r).sum().backward()
    torch.testing.assert_close(other.grad, 3 * r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_zero_centred_matches_qwen3_5(dtype, num_chunks):
    """``zero_centred=True``: Transformers' ``Qwen3_5RMSNorm`` (``x_hat * (1 + w)`` in fp32, cast
    once), forward and backward, fp32 within 1e-5 and bf16 no worse than its own bf16 run."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    torch.manual_seed(num_chunks)
    ref_norm = Qwen3_5RMSNorm(24, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref_norm.weight.copy_(torch.randn(24) * 0.3)
    x = (torch.randn(2, 37, 24) * 3 + 0.5).to(dtype).requires_grad_()
    g = torch.randn(2, 37, 24).to(dtype)
    ref = ref_norm(x)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x, ref_norm.weight), g)
    w = ref_norm.weight.detach().clone().requires_grad_()
    out = rms_norm(x, w, 1e-6, num_chunks, zero_centred=True)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    if dtype == torch.float32:
        assert _rel(out, ref) <= 1e-5 and _rel(dx, dx_ref) <= 1e-5 and _rel(dw, dw_ref) <= 1e-5, \
            (_rel(out, ref), _rel(dx, dx_ref), _rel(dw, dw_ref))
        assert _rel(rms_norm_reference(x, w, 1e-6, zero_centred=True), ref) <= 1e-6
        return
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w64)
    for name, a, b, e in zip(("out", "dx", "dw"), (out, dx, dw), (ref, dx_ref, dw_ref),
                             (exact, *torch.autograd.grad(exact, (x64, w64), g.double()))):
        assert_no_worse_than_bf16(a, b, e, name)

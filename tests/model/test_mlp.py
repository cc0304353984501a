"""Chunked SwiGLU == plain SwiGLU (output and all gradients), with O(chunk) saved state."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fpdt.model.mlp import ChunkedSwiGLU, ChunkedSwiGLUFunction, swiglu_reference
from fpdt.ops.rmsnorm import rms_norm_reference
from tests.model.helpers import assert_no_worse_than_bf16, rel_err


def _setup(bias, dtype, T=(2, 13), hidden=24, inter=40, seed=0):
    torch.manual_seed(seed)
    mlp = ChunkedSwiGLU(hidden, inter, bias=bias).to(dtype)
    if bias:
        with torch.no_grad():
            for p in (mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias):
                p.normal_()
    x = torch.randn(*T, hidden, dtype=dtype)
    dy = torch.randn(*T, hidden, dtype=dtype)
    return mlp, x, dy


def _run(mlp, x, dy, num_chunks):
    mlp.zero_grad(set_to_none=True)
    mlp.num_chunks = num_chunks
    xr = x.clone().requires_grad_()
    y = mlp(xr)
    y.backward(dy)
    return y.detach(), xr.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 2, 5, 26, 100])  # 26 tokens: even, uneven, one per token, > tokens
def test_matches_unchunked_fp32(bias, num_chunks):
    mlp, x, dy = _setup(bias, torch.float32)
    y0, dx0, g0 = _run(mlp, x, dy, 0)  # plain autograd
    y, dx, g = _run(mlp, x, dy, num_chunks)
    assert rel_err(y, y0) < 1e-6 and rel_err(dx, dx0) < 1e-6
    for n in g0:
        assert rel_err(g[n], g0[n]) < 1e-6, n


def test_matches_unchunked_bf16():
    """Within 2e-2 of plain bf16 autograd, and no further from float64 than it is."""
    mlp, x, dy = _setup(True, torch.bfloat16)
    y0, dx0, g0 = _run(mlp, x, dy, 0)
    y, dx, g = _run(mlp, x, dy, 4)
    exact = _run(copy.deepcopy(mlp).double(), x.double(), dy.double(), 0)
    assert rel_err(y, y0) < 2e-2 and rel_err(dx, dx0) < 2e-2
    assert_no_worse_than_bf16(y, y0, exact[0], "y")
    assert_no_worse_than_bf16(dx, dx0, exact[1], "dx")
    for n in g0:
        assert g[n].dtype == torch.bfloat16 and rel_err(g[n], g0[n]) < 2e-2, n
        assert_no_worse_than_bf16(g[n], g0[n], exact[2][n], n)


def test_gradcheck_float64():
    torch.manual_seed(0)
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in ((6, 4), (6, 4), (4, 6), (6,), (6,), (4,))]
    torch.autograd.gradcheck(lambda *a: ChunkedSwiGLUFunction.apply(*a, 3), (x, *ws))


def test_saves_only_input_and_weights():
    """Nothing of width I (the intermediate) is kept between forward and backward."""
    mlp, x, _ = _setup(False, torch.float32, T=(1, 64), inter=40)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        mlp.num_chunks = 8
        mlp(x.requires_grad_())
    expected = [x.shape, mlp.gate_proj.weight.shape, mlp.up_proj.weight.shape, mlp.down_proj.weight.shape]
    assert saved == expected
    # the plain MLP, by contrast, keeps [T, I] tensors
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        swiglu_reference(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    assert any(s[-1] == 40 and s[-2] == 64 for s in saved)


def test_no_grad_forward():
    mlp, x, _ = _setup(False, torch.float32)
    mlp.num_chunks = 3
    with torch.no_grad():
        y = mlp(x)
    assert not y.requires_grad
    ref = F.linear(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight)
    assert rel_err(y, ref) < 1e-6


def _norm(hidden, dtype, seed=1):
    from fpdt.model.llama import RMSNorm
    torch.manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def _run_fused(mlp, norm, x, dy, num_chunks, fused):
    mlp.zero_grad(set_to_none=True)
    norm.zero_grad(set_to_none=True)
    mlp.num_chunks = num_chunks
    xr = x.clone().requires_grad_()
    y = mlp(xr, norm=norm) if fused else mlp(rms_norm_reference(xr, norm.weight, norm.eps))
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    grads["norm"] = norm.weight.grad.clone()
    return y.detach(), xr.grad, grads


# fp64 inputs too are normalised in fp32 (the Llama convention, as the reference does): ~1e-7
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_chunks", [1, 3, 26])
def test_norm_inside_matches_norm_then_mlp(dtype, tol, num_chunks):
    """The RMSNorm run inside the chunked function: output and every gradient (input, MLP
    weights and biases, norm weight) as the plain autograd norm followed by the plain MLP."""
    mlp, x, dy = _setup(True, dtype)
    norm = _norm(x.shape[-1], dtype)
    y0, dx0, g0 = _run_fused(mlp, norm, x, dy, 0, fused=False)
    y, dx, g = _run_fused(mlp, norm, x, dy, num_chunks, fused=True)
    assert y.dtype == dtype and rel_err(y, y0) < tol and rel_err(dx, dx0) < tol
    for n in g0:
        assert g[n].dtype == dtype and rel_err(g[n], g0[n]) < tol, n


def _residual_mlp_layer(hidden=32, inter=48, dtype=torch.float32):
    from fpdt.model.checkpointing import checkpointed_residual
    mlp, _, _ = _setup(False, dtype, hidden=hidden, inter=inter)
    norm = _norm(hidden, dtype)
    lin = torch.nn.Linear(hidden, hidden).to(dtype)
    params = [*mlp.parameters(), *norm.parameters(), *lin.parameters()]
    branches = (lin, lambda h: mlp(h, norm=norm))
    return (lambda x: checkpointed_residual(branches, x, params)), (lambda x: (lambda h: h + mlp(norm(h)))(x + lin(x))), params


def test_donated_gradient_sum_is_exact():
    """Inside the residual checkpoint the chunked MLP adds its input gradient into the layer's
    gradient in place: the same input and parameter gradients as plain autograd."""
    torch.manual_seed(0)
    ckpt, plain, params = _residual_mlp_layer()
    x = torch.randn(2, 9, 32)
    got = []
    for f in (plain, ckpt):
        for p in params:
            p.grad = None
        xr = x.clone().requires_grad_()
        (f(xr) * 3).sum().backward()                   # (y * 3): the layer's gradient is its own
        got.append((xr.grad, [p.grad.clone() for p in params]))
    assert rel_err(got[1][0], got[0][0]) < 1e-6
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(got[1][1], got[0][1]))


def test_donated_gradient_holds_no_input_gradient(monkeypatch):
    """Counted: with the layer's gradient donated, the MLP branch's backward holds no
    full-length input gradient of its own: one ``[T, hidden]`` tensor less at its peak than
    when the function returns that gradient for the checkpoint to add."""
    import fpdt.model.mlp as mlp_module
    from fpdt.memory.accountant import MemoryAccountant
    torch.manual_seed(0)
    ckpt, _, params = _residual_mlp_layer(hidden=64, inter=64)
    x = torch.randn(1, 4096, 64, requires_grad=True)
    peaks = {}
    for donated in (True, False):
        if not donated:
            monkeypatch.setattr(mlp_module, "donated_gradient", lambda *a: False)
        for p in params:
            p.grad = torch.zeros_like(p)
        loss = (ckpt(x * 1) * 2).sum()
        with MemoryAccountant("cpu") as acct:
            loss.backward()
        peaks[donated] = acct.device_peak
    assert peaks[False] - peaks[True] >= x.numel() * 4, peaks


def test_recompute_of_the_last_branch_skips_the_mlp_forward(monkeypatch):
    """In the residual checkpoint's recompute the MLP branch's output is a backward root only:
    the chunked MLP computes no forward chunk there (its backward recomputes each), and a branch
    that would read the skipped values fails loudly."""
    import fpdt.model.mlp as mlp_module
    from fpdt.model.checkpointing import checkpointed_residual
    calls = []
    real = mlp_module.with_lora
    monkeypatch.setattr(mlp_module, "with_lora", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    ckpt, plain, params = _residual_mlp_layer()
    loss = (ckpt(torch.randn(2, 9, 32, requires_grad=True)) * 2).sum()
    forward_calls = len(calls)                    # 3 GEMMs per chunk in forward
    calls.clear()
    loss.backward()
    assert forward_calls > 0 and len(calls) == 2 * forward_calls // 3   # backward's gate/up recompute only
    mlp, _, _ = _setup(False, torch.float32, hidden=32, inter=48)
    norm = _norm(32, torch.float32)
    branches = (torch.nn.Linear(32, 32), lambda h: torch.tanh(mlp(h, norm=norm)))
    y = checkpointed_residual(branches, torch.randn(2, 9, 32, requires_grad=True), [*mlp.parameters()])
    with pytest.raises(RuntimeError, match="must end with it"):
        y.sum().backward()


def test_under_autocast():
    """fp32 weights under bf16 autocast (as a Trainer with bf16=True runs): the chunk products are
    bf16 and land in the fp32 input's gradient; the norm inside and the residual checkpoint's
    donated sum as the norm module followed by the chunked MLP."""
    from fpdt.model.checkpointing import checkpointed_residual
    torch.manual_seed(0)
    mlp, x, _ = _setup(True, torch.float32, hidden=16, inter=24)
    mlp.num_chunks = 3
    norm = _norm(16, torch.float32)
    lin = torch.nn.Linear(16, 16)
    params = [*mlp.parameters(), *norm.parameters(), *lin.parameters()]
    got = []
    for form in ("modules", "fused", "checkpointed"):
        for p in params:
            p.grad = None
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if form == "checkpointed":
                y = checkpointed_residual((lin, lambda h: mlp(h, norm=norm)), xr * 1, params)
            else:
                h = xr * 1 + lin(xr * 1)
                y = h + (mlp(h, norm=norm) if form == "fused" else mlp(norm(h)))
            (y.float() * 2).sum().backward()
        got.append((xr.grad, [p.grad.clone() for p in params]))
    for dx, grads in got[1:]:
        assert dx.dtype == torch.float32 and rel_err(dx, got[0][0]) < 2e-2
        assert all(rel_err(a, b) < 2e-2 for a, b in zip(grads, got[0][1]))

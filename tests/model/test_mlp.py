"""Chunked SwiGLU == plain SwiGLU (output and all gradients), with O(chunk) saved state."""

import pytest
import torch
import torch.nn.functional as F

from fpdt.model.mlp import ChunkedSwiGLU, ChunkedSwiGLUFunction, swiglu_reference
from tests.model.helpers import rel_err


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
    mlp, x, dy = _setup(True, torch.bfloat16)
    y0, dx0, g0 = _run(mlp, x, dy, 0)
    y, dx, g = _run(mlp, x, dy, 4)
    assert rel_err(y, y0) < 2e-2 and rel_err(dx, dx0) < 2e-2
    for n in g0:
        assert g[n].dtype == torch.bfloat16 and rel_err(g[n], g0[n]) < 2e-2, n


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

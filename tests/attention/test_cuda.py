"""The attention parity checks on a CUDA device (skipped without one).

Covers every CUDA backend that is available and supports the dtype, with and without
offload (offload here exercises pinned buffers, the copy streams and their events).
"""

import pytest
import torch

from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq, fpdt_attention
from fpdt.attention.kernels import BACKENDS
from fpdt.offload import host_pool
from tests.attention.reference import assert_rel_close, reference_attention, reference_layer

pytestmark = pytest.mark.cuda
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _backends(dtype):
    dev = torch.device("cuda")
    return [n for n, b in BACKENDS.items() if n != "math" and b.available() and b.supports(dev, dtype, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("u", [1, 4])
@pytest.mark.parametrize("chunk", [256, 80])  # 80: not a multiple of the efficient kernel's lse padding (32)
def test_cuda_parity(dtype, offload, u, chunk):
    for backend in _backends(dtype):
        torch.manual_seed(0)
        S = chunk * u
        q = torch.randn(2, S, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(2, S, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(2, S, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
        out = fpdt_attention(q, k, v, num_chunks=u, offload=offload, backend=backend)
        g = torch.randn_like(out)
        out.backward(g)
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qr, kr, vr)
        ref.backward(g.double())
        for name, a, b in (("out", out, ref), ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad),
                           ("dv", v.grad, vr.grad)):
            assert_rel_close(a, b, TOL[dtype],
                             f"{name} backend={backend} u={u} chunk={chunk} offload={offload} {dtype}")


def test_cuda_offload_uses_pinned_pool():
    fpdt_attention(*(torch.randn(1, 512, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                     for _ in range(3)), num_chunks=4, offload=True).sum().backward()
    pool = host_pool("cuda")
    assert pool.pin_memory
    before = pool.stats.allocations
    fpdt_attention(*(torch.randn(1, 512, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                     for _ in range(3)), num_chunks=4, offload=True).sum().backward()
    assert pool.stats.allocations == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_layer_parity(dtype):
    torch.manual_seed(0)
    H, H_kv, D, hidden, S = 8, 2, 64, 256, 1024
    layer = FPDTAttention(hidden, H, H_kv, D, qkv_bias=True, num_chunks=4, offload=True).to("cuda", dtype)
    x = torch.randn(1, S, hidden, device="cuda", dtype=dtype, requires_grad=True)
    pos = torch.arange(S, device="cuda")[None]
    out = layer(x, pos, RotaryEmbedding(default_inv_freq(D)).cuda())
    g = torch.randn_like(out)
    out.backward(g)
    names = {"wq": "q_proj.weight", "bq": "q_proj.bias", "wk": "k_proj.weight", "bk": "k_proj.bias",
             "wv": "v_proj.weight", "bv": "v_proj.bias", "wo": "o_proj.weight"}
    params = {k: layer.get_parameter(n).detach().double().requires_grad_() for k, n in names.items()}
    xr = x.detach().double().requires_grad_()
    ref = reference_layer(xr, pos, params, (H, H_kv, D))
    ref.backward(g.double())
    assert_rel_close(out, ref, TOL[dtype], "out")
    assert_rel_close(x.grad, xr.grad, TOL[dtype], "d_hidden")
    for k, n in names.items():
        assert_rel_close(layer.get_parameter(n).grad, params[k].grad, TOL[dtype], n)

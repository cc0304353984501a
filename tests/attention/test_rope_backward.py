"""The hand-written RoPE backward (used when delivering dq/dk) against autograd."""

import pytest
import torch

from fpdt.attention.rope import apply_rotary, apply_rotary_backward, apply_rotary_backward_


@pytest.mark.parametrize("shape", [(1, 5, 3, 8), (2, 7, 1, 16)])
def test_rotary_backward_matches_autograd(shape):
    g = torch.Generator().manual_seed(sum(shape))
    B, n, H, D = shape
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    # arbitrary (not cos/sin-shaped, halves differ) coefficients: the formulas must hold for any
    cos, sin = (torch.randn(B, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(shape, generator=g, dtype=torch.float64)
    apply_rotary(x, cos, sin).backward(grad)
    torch.testing.assert_close(apply_rotary_backward(grad, cos, sin), x.grad, rtol=1e-12, atol=1e-12)
    inplace = grad.clone()
    out = apply_rotary_backward_(inplace, cos, sin)
    assert out.data_ptr() == inplace.data_ptr()
    torch.testing.assert_close(out, x.grad, rtol=1e-12, atol=1e-12)


def test_in_place_backward_fp32_matches_out_of_place():
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(1, 64, 4, 32, generator=g)
    cos, sin = (torch.randn(1, 64, 32, generator=g) for _ in range(2))
    want = apply_rotary_backward(grad.double(), cos.double(), sin.double()).float()
    torch.testing.assert_close(apply_rotary_backward_(grad.clone(), cos, sin), want, rtol=1e-5, atol=1e-6)

"""Chunked fused LM head + cross-entropy == the unchunked form, -100 handling, memory."""

import pytest
import torch
import torch.nn.functional as F

from fpdt.model.loss import chunked_lm_loss, default_loss_chunks, lm_loss_reference
from tests.model.helpers import rel_err


def _setup(dtype=torch.float32, B=2, S=11, hidden=16, V=50, seed=0, ignore=True):
    torch.manual_seed(seed)
    h = torch.randn(B, S, hidden, dtype=dtype)
    w = (torch.randn(V, hidden) * 0.3).to(dtype)
    y = torch.randint(0, V, (B, S))
    if ignore:
        y[0, :4] = -100
        y[1, -1] = -100
    return h, w, y


def _loss_and_grads(h, w, y, scale, num_chunks):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_lm_loss(h, w, y, scale, num_chunks)
    (loss * 3.0).backward()  # a non-unit upstream gradient must be honoured
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("num_chunks", [1, 3, 7, 22, 50])
def test_matches_unchunked_and_torch_cross_entropy(num_chunks):
    h, w, y = _setup()
    n_valid = (y != -100).sum()
    ref = _loss_and_grads(h, w, y, 1.0 / n_valid, 0)
    got = _loss_and_grads(h, w, y, 1.0 / n_valid, num_chunks)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-6
    # and the reference is the token mean of torch's cross-entropy (ignore_index=-100)
    mean = F.cross_entropy((h @ w.t()).reshape(-1, w.shape[0]), y.reshape(-1), ignore_index=-100)
    assert rel_err(got[0], mean) < 1e-6


def test_ignored_tokens_get_no_gradient():
    h, w, y = _setup()
    y[1] = -100
    _, dh, _ = _loss_and_grads(h, w, y, 0.1, 4)
    assert (dh[1] == 0).all() and (dh[0, :4] == 0).all() and (dh[0, 4:] != 0).any()


def test_all_ignored_gives_zero():
    h, w, y = _setup()
    y.fill_(-100)
    loss, dh, dw = _loss_and_grads(h, w, y, 1.0, 3)
    assert loss.item() == 0.0 and not dh.any() and not dw.any()


def test_bf16_logits_in_fp32():
    h, w, y = _setup(torch.bfloat16, V=300)
    scale = 1.0 / (y != -100).sum()
    ref = _loss_and_grads(h, w, y, scale, 0)
    got = _loss_and_grads(h, w, y, scale, 6)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel_err(got[0], ref[0]) < 1e-3
    assert rel_err(got[1], ref[1]) < 2e-2 and rel_err(got[2], ref[2]) < 2e-2


def test_no_logits_kept_for_backward():
    h, w, y = _setup(S=64, V=200)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        chunked_lm_loss(h.requires_grad_(), w.requires_grad_(), y, 0.5, 8)
    assert sorted(map(tuple, saved)) == sorted([tuple(h.shape), tuple(w.shape)])  # dh and dW only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_backward_allocates_only_the_cast(dtype):
    """The backward scales the saved dh and fp32 dW in place: in fp32 it allocates nothing
    (both are handed to autograd as they are), in bf16 only dW's cast to the weight dtype."""
    from fpdt.profiling.memory import MemoryAccountant
    h, w, y = _setup(dtype, S=64, V=300)
    h.requires_grad_(), w.requires_grad_()
    loss = chunked_lm_loss(h, w, y, 0.5, 4) * 3.0        # a non-unit incoming gradient
    with MemoryAccountant("cpu") as acct:
        loss.backward()
    cast = 0 if dtype == torch.float32 else w.numel() * w.element_size()
    assert acct.device_peak - cast < 1024, acct.device_peak     # scalars only beside the cast
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (lm_loss_reference(ref_h, ref_w, y, 0.5) * 3.0).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(h.grad, ref_h.grad) < tol and rel_err(w.grad, ref_w.grad) < tol


def test_second_backward_through_one_forward_raises():
    h, w, y = _setup(S=32, V=100)
    h.requires_grad_(), w.requires_grad_()
    loss = chunked_lm_loss(h, w, y, 1.0, 4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_no_grad_forward_and_frozen_head():
    h, w, y = _setup()
    with torch.no_grad():
        loss = chunked_lm_loss(h, w, y, 0.25, 3)
    assert rel_err(loss, lm_loss_reference(h, w, y, 0.25)) < 1e-6
    hr = h.clone().requires_grad_()
    chunked_lm_loss(hr, w, y, 0.25, 3).backward()  # weight without grad: only dh
    h2 = h.clone().requires_grad_()
    lm_loss_reference(h2, w, y, 0.25).backward()
    assert rel_err(hr.grad, h2.grad) < 1e-6


def test_default_chunks_rule():
    assert default_loss_chunks(128256, 2048) == 126  # ceil(128256 / 2048 * 2)
    assert default_loss_chunks(32000, 4096) == 16
    assert default_loss_chunks(10, 4096) == 1

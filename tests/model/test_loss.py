"""Chunked fused LM head + cross-entropy == the unchunked form, -100 handling, memory."""

import pytest
import torch
import torch.nn.functional as F

from fpdt.model.loss import MIN_LOSS_CHUNK_TOKENS, WGRAD_MODES, chunked_lm_loss, default_loss_chunks, lm_loss_reference
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


def _loss_and_grads(h, w, y, scale, num_chunks, wgrad="accumulate"):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_lm_loss(h, w, y, scale, num_chunks, wgrad=wgrad)
    (loss * 3.0).backward()  # a non-unit upstream gradient must be honoured
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("wgrad", WGRAD_MODES)
@pytest.mark.parametrize("num_chunks", [1, 3, 7, 22, 50, 64])
def test_matches_unchunked_and_torch_cross_entropy(num_chunks, wgrad):
    h, w, y = _setup()
    n_valid = (y != -100).sum()
    ref = _loss_and_grads(h, w, y, 1.0 / n_valid, 0)
    got = _loss_and_grads(h, w, y, 1.0 / n_valid, num_chunks, wgrad)
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


@pytest.mark.parametrize("wgrad", WGRAD_MODES)
def test_bf16_logits_in_fp32(wgrad):
    h, w, y = _setup(torch.bfloat16, V=300)
    scale = 1.0 / (y != -100).sum()
    ref = _loss_and_grads(h, w, y, scale, 0)
    got = _loss_and_grads(h, w, y, scale, 6, wgrad)
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
    from fpdt.memory.accountant import MemoryAccountant
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


@pytest.mark.parametrize("wgrad", WGRAD_MODES)
def test_second_backward_through_one_forward_raises(wgrad):
    h, w, y = _setup(S=32, V=100)
    h.requires_grad_(), w.requires_grad_()
    loss = chunked_lm_loss(h, w, y, 1.0, 4, wgrad=wgrad)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("wgrad", WGRAD_MODES)
def test_no_grad_forward_and_frozen_head(wgrad):
    h, w, y = _setup()
    with torch.no_grad():
        loss = chunked_lm_loss(h, w, y, 0.25, 3, wgrad=wgrad)
    assert rel_err(loss, lm_loss_reference(h, w, y, 0.25)) < 1e-6
    hr = h.clone().requires_grad_()
    chunked_lm_loss(hr, w, y, 0.25, 3, wgrad=wgrad).backward()  # weight without grad: only dh
    h2 = h.clone().requires_grad_()
    lm_loss_reference(h2, w, y, 0.25).backward()
    assert rel_err(hr.grad, h2.grad) < 1e-6


def test_default_chunks_rule():
    assert default_loss_chunks(128256, 2048) == 126  # ceil(128256 / 2048 * 2)
    assert default_loss_chunks(32000, 4096) == 16
    assert default_loss_chunks(10, 4096) == 1


def test_default_chunks_keep_a_floor_of_tokens():
    """hidden 512, vocabulary 32K, u = 4: the budget rule alone gives 500 chunks, 8 tokens each at 4K."""
    assert default_loss_chunks(32000, 512, 4) == 500
    assert default_loss_chunks(32000, 512, 4, tokens=4096) == 4096 // MIN_LOSS_CHUNK_TOKENS == 32
    assert default_loss_chunks(32000, 512, 4, tokens=4097) == 33
    assert default_loss_chunks(32000, 512, 4, tokens=1 << 20) == 500        # long sequences: the budget rule
    assert default_loss_chunks(32000, 512, 4, tokens=5) == 1


def test_forward_floors_the_default_count_but_not_an_explicit_one(monkeypatch):
    import fpdt.model.llama as llama
    from fpdt.model import from_config
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=4000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    seen, real = [], llama.sequence_parallel_lm_loss
    monkeypatch.setattr(llama, "sequence_parallel_lm_loss", lambda *a, **k: seen.append(k["num_chunks"]) or real(*a, **k))
    ids = torch.randint(0, 4000, (1, 512))
    for loss_chunks in (None, 250):
        model = from_config(cfg, dtype=torch.float32, num_chunks=2, loss_chunks=loss_chunks)
        model(**model.prepare_inputs(ids, labels=ids))
    assert seen == [4, 250]          # 511 tokens: ceil(511 / 128); the budget rule alone: ceil(2 * 2 * 4000 / 32) = 500


def test_frozen_hidden_recompute_gives_the_weight_gradient_only():
    h, w, y = _setup(V=120)
    wr, wa = w.clone().requires_grad_(), w.clone().requires_grad_()
    chunked_lm_loss(h, wr, y, 0.5, 5, wgrad="recompute").backward()
    lm_loss_reference(h, wa, y, 0.5).backward()
    assert rel_err(wr.grad, wa.grad) < 1e-6


def test_recompute_keeps_no_weight_sized_buffer_for_backward():
    """Saved by the "recompute" mode: dh, the hidden states and the fp32 lse per token; the
    weight and labels are the caller's own tensors (no copies)."""
    h, w, y = _setup(S=64, V=200)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_lm_loss(h.requires_grad_(), w.requires_grad_(), y, 0.5, 8, wgrad="recompute")
    new = sorted(tuple(t.shape) for t in saved if t.data_ptr() not in (h.data_ptr(), w.data_ptr(), y.data_ptr()))
    assert new == sorted([tuple(h.shape), (), (h.shape[0] * h.shape[1],)])    # dh, scale, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_budget_forward_and_backward(dtype):
    """Counted by the accountant, per phase (``t = T / n`` tokens per chunk, ``e`` weight bytes):

    * forward: ``dh``, the fp32 lse, one fp32 ``[t, V]`` logits chunk and its cast to the
      weight dtype -- and at least the "accumulate" mode's fp32 ``[V, hidden]`` less;
    * backward: the gradient ``[V, hidden]`` in the weight dtype, one fp32 ``[T, V / n]``
      logits slice and its cast -- no fp32 ``[V, hidden]``.

    Beside those, per-token temporaries only (masks, indices, row scales: 8 x 4 B per token).
    """
    from fpdt.memory.accountant import MemoryAccountant
    B, S, hid, V, n = 2, 64, 16, 300, 4
    h, w, y = _setup(dtype, B=B, S=S, hidden=hid, V=V)
    peaks = {}
    for wgrad in WGRAD_MODES:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with MemoryAccountant("cpu") as fwd:
            loss = chunked_lm_loss(hh, ww, y, 0.5, n, wgrad=wgrad) * 3.0
        with MemoryAccountant("cpu") as bwd:
            loss.backward()
        peaks[wgrad] = fwd.device_peak, bwd.device_peak
    T, e = B * S, w.element_size()
    cast = 0 if dtype == torch.float32 else e / 4         # a cast to the weight dtype, per fp32 byte
    per_token = 8 * T * 4
    logits_chunk = T // n * V * 4
    assert peaks["recompute"][0] <= T * hid * e + T * 4 + logits_chunk * (1 + cast) + per_token, peaks
    assert peaks["accumulate"][0] - peaks["recompute"][0] >= V * hid * 4 - T * 4, peaks
    logits_slice = T * (-(-V // n)) * 4
    assert peaks["recompute"][1] <= V * hid * e + logits_slice * (1 + cast) + per_token, peaks


@pytest.mark.parametrize("tokens, hidden", [(8, 64), (64, 8)])
def test_accumulate_bf16_partial_is_summed_a_vocabulary_slice_at_a_time(tokens, hidden):
    """Beside ``dh``, the fp32 ``dW`` and the logits chunk with its bf16 cast, the bf16 ``dW``
    partial of a chunk and its fp32 cast (6 B per weight element) stay within 1.5 fp32 logits
    chunks: not ``6 V hidden`` bytes (8 x that when tokens << hidden, as at 64 x 8)."""
    from fpdt.memory.accountant import MemoryAccountant
    V = 512
    h, w, y = _setup(torch.bfloat16, B=2, S=tokens // 2, hidden=hidden, V=V)
    with MemoryAccountant("cpu") as fwd:
        chunked_lm_loss(h.requires_grad_(), w.requires_grad_(), y, 0.5, 1)
    logits = tokens * V * 4
    held = tokens * hidden * 2 + V * hidden * 4 + logits * 1.5
    assert fwd.device_peak - held <= 1.5 * logits + 8 * tokens * 4, (fwd.device_peak, held)

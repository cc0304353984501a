"""The chunked gated delta rule against a float64 token-by-token recurrence and Transformers'
``torch_chunk_gated_delta_rule``, forward and backward, state in and out; the fla dispatch by stub."""

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from fpdt.ops import delta_rule
from fpdt.ops.delta_rule import chunked_delta_rule, delta_rule_kernel, gated_delta_rule, gated_delta_rule_backward


def token_recurrence(q, k, v, g, beta, h0, scale):
    """float64 reference: S <- e^g S; S += beta k (v - S^T k)^T; o = scale S^T q, one token at a time."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    B, T, H, dk = q.shape
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=torch.float64) if h0 is None else h0.double()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale)
    return torch.stack(outs, 1), S


def inputs(B, T, H, dk, dv, seed, dtype=torch.float32, strong_decay=False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -F.softplus(torch.randn(B, T, H, generator=gen)) * (8.0 if strong_decay else 0.5)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, dk, dv, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)], h0


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T", [1, 37, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_forward_and_backward_match_float64_recurrence(T, with_state):
    (q, k, v, g, beta), h0 = inputs(2, T, 3, 8, 5, seed=T)
    h0 = h0 if with_state else None
    scale = 8 ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0_leaf = None if h0 is None else h0.clone().requires_grad_()
    o, ht = gated_delta_rule(*leaves, initial_state=h0_leaf, scale=scale, kernel="torch")
    assert ht.dtype == torch.float32 and ht.shape == (2, 3, 8, 5)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
    ref_h0 = None if h0 is None else h0.double().requires_grad_()
    o_ref, ht_ref = token_recurrence(*ref_leaves, ref_h0, scale)
    assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    torch.autograd.backward([o, ht], [do, dht])
    torch.autograd.backward([o_ref, ht_ref], [do.double(), dht.double()])
    for a, b in zip(leaves + ([h0_leaf] if h0 is not None else []), ref_leaves + ([ref_h0] if h0 is not None else [])):
        assert rel(a.grad, b.grad) < 1e-5


def test_strong_decay_and_float64_inputs():
    """Decays near e^-40 per token underflow in the cumulative product; nothing divides by it."""
    (q, k, v, g, beta), h0 = inputs(1, 130, 2, 4, 4, seed=3, dtype=torch.float64, strong_decay=True)
    o, ht = chunked_delta_rule(q, k, v, g, beta, h0.double(), scale=0.5)
    o_ref, ht_ref = token_recurrence(q, k, v, g, beta, h0, 0.5)
    assert o.dtype == torch.float64 and rel(o, o_ref) < 1e-12 and rel(ht, ht_ref) < 1e-12
    assert torch.isfinite(o).all()


def test_state_carried_across_calls_is_one_call():
    """Splitting the sequence at any point and carrying the state is the same rule."""
    (q, k, v, g, beta), h0 = inputs(1, 100, 2, 6, 3, seed=5)
    whole, ht = chunked_delta_rule(q, k, v, g, beta, h0, 0.4)
    a, mid = chunked_delta_rule(*(x[:, :29] for x in (q, k, v, g, beta)), h0, 0.4)
    b, end = chunked_delta_rule(*(x[:, 29:] for x in (q, k, v, g, beta)), mid, 0.4)
    assert rel(torch.cat([a, b], 1), whole) < 1e-6 and rel(end, ht) < 1e-6


def test_matches_transformers_chunk_rule_forward_and_backward():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    (q, k, v, g, beta), h0 = inputs(2, 90, 4, 16, 8, seed=7)
    ours = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    theirs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = gated_delta_rule(*ours[:5], initial_state=ours[5], kernel="torch")
    o_hf, ht_hf = torch_chunk_gated_delta_rule(*theirs[:5], initial_state=theirs[5], output_final_state=True)
    assert rel(o, o_hf) < 1e-5 and rel(ht, ht_hf) < 1e-5
    gen = torch.Generator().manual_seed(2)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    torch.autograd.backward([o, ht], [do, dht])
    torch.autograd.backward([o_hf, ht_hf], [do, dht])
    for a, b in zip(ours, theirs):
        assert rel(a.grad, b.grad) < 1e-5


def test_explicit_backward_returns_dh0_from_dht():
    (q, k, v, g, beta), h0 = inputs(1, 70, 2, 4, 6, seed=11)
    gen = torch.Generator().manual_seed(4)
    do, dht = torch.randn(1, 70, 2, 6, generator=gen), torch.randn(1, 2, 4, 6, generator=gen)
    dq, dk, dv, dg, dbeta, dh0 = gated_delta_rule_backward(q, k, v, g, beta, h0, do, dht, scale=0.5, kernel="torch")
    ref = [x.double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o_ref, ht_ref = token_recurrence(*ref[:5], ref[5], 0.5)
    torch.autograd.backward([o_ref, ht_ref], [do.double(), dht.double()])
    for a, b in zip((dq, dk, dv, dg, dbeta, dh0), ref):
        assert rel(a, b.grad) < 1e-5
    # without dht only the output's gradient reaches the initial state
    *_, dh0_only_o = gated_delta_rule_backward(q, k, v, g, beta, h0, do, None, scale=0.5, kernel="torch")
    ref2 = h0.double().requires_grad_()
    o2, _ = token_recurrence(q, k, v, g, beta, ref2, 0.5)
    o2.backward(do.double())
    assert rel(dh0_only_o, ref2.grad) < 1e-5
    assert gated_delta_rule_backward(q, k, v, g, beta, None, do, dht, scale=0.5, kernel="torch")[5] is None


def test_kernel_choice_is_named():
    assert delta_rule_kernel("cpu") == "torch"
    with pytest.raises(ValueError, match="unknown delta-rule kernel"):
        gated_delta_rule(*inputs(1, 4, 1, 2, 2, seed=0)[0], kernel="triton")


def _stub_fla(monkeypatch, calls):
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        calls.append(dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, g_dtype=g.dtype))
        if use_qk_l2norm_in_kernel:
            q, k = delta_rule.l2norm(q), delta_rule.l2norm(k)
        return chunked_delta_rule(q, k, v, g, beta, initial_state, scale)
    fla = types.ModuleType("fla")
    ops = types.ModuleType("fla.ops")
    gdr = types.ModuleType("fla.ops.gated_delta_rule")
    gdr.chunk_gated_delta_rule = chunk_gated_delta_rule
    fla.ops, ops.gated_delta_rule = ops, gdr
    for name, mod in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr)):
        mod.__spec__ = importlib_spec(name)
        monkeypatch.setitem(sys.modules, name, mod)


def importlib_spec(name):
    import importlib.machinery
    return importlib.machinery.ModuleSpec(name, loader=None)


def test_fla_dispatch_by_stub(monkeypatch):
    """On CUDA with fla importable the rule goes to fla's chunk_gated_delta_rule with the state in and out."""
    calls = []
    _stub_fla(monkeypatch, calls)
    assert delta_rule.fla_available()
    assert delta_rule_kernel("cuda") == "fla" and delta_rule_kernel("cpu") == "torch"
    (q, k, v, g, beta), h0 = inputs(1, 20, 2, 4, 4, seed=1)
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, kernel="fla")
    ref_o, ref_ht = chunked_delta_rule(q, k, v, g, beta, h0, 0.5)
    assert calls == [dict(scale=0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
                          g_dtype=torch.float32)]
    assert torch.equal(o, ref_o) and torch.equal(ht, ref_ht)
    gated_delta_rule(q, k, v, g, beta, initial_state=h0, kernel="fla", qk_l2norm=True)
    assert calls[-1]["use_qk_l2norm_in_kernel"] is True


def test_qk_l2norm_in_the_torch_kernel():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    (q, k, v, g, beta), h0 = inputs(1, 40, 2, 8, 4, seed=21)
    q, k = q * 3, k * 0.2                                     # not unit vectors
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, kernel="torch", qk_l2norm=True)
    o_hf, ht_hf = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    assert rel(o, o_hf) < 1e-5 and rel(ht, ht_hf) < 1e-5


def test_fla_signature_when_installed():
    """The keywords the dispatch passes exist in the installed fla (skipped without it)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    params = inspect.signature(chunk_gated_delta_rule).parameters
    for name in ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel"):
        assert name in params


def test_bf16_output_dtype_and_error():
    """bf16 in: bf16 out, fp32 state; no worse against float64 than rounding the float64 answer to bf16 x 4."""
    (q, k, v, g, beta), h0 = inputs(1, 80, 2, 8, 8, seed=13)
    o, ht = gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)), initial_state=h0, kernel="torch")
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref, _ = token_recurrence(*(x.bfloat16() for x in (q, k, v, g, beta)), h0, 8 ** -0.5)
    assert rel(o, o_ref) <= 4 * rel(o_ref.bfloat16(), o_ref)

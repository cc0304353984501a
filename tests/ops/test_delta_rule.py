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


def _fla_source(relative: str):
    """The installed fla-core's ``fla/<relative>`` parsed (``ast``), found with ``importlib.util.find_spec``
    and never imported: its ops import Triton, absent on a CPU machine. Skips without fla-core."""
    import ast
    import importlib.util
    import pathlib
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install --no-deps fla-core)")
    path = pathlib.Path(next(iter(spec.submodule_search_locations)), relative)
    return ast.parse(path.read_text(), str(path))


def _named(tree, kind, name: str):
    import ast
    found = [n for n in ast.walk(tree) if isinstance(n, kind) and n.name == name]
    assert found, f"fla-core: no {kind.__name__} {name}"
    return found[0]


def test_our_fla_call_matches_the_installed_signature():
    """fpdt's call of fla-core's ``chunk_gated_delta_rule`` (``fpdt/ops/delta_rule.py``) against the
    installed fla's source (tested with fla-core 0.6.0): the five positional inputs are ``q, k, v, g,
    beta``; every keyword fpdt passes is a named parameter (fla's ``**kwargs`` would swallow a renamed
    one silently); none without a default is left out; inputs ``[B, T, H, K]``, the state ``[N, HV, K,
    V]`` (``state_v_first`` False by default), ``(o, final_state)`` returned; its autograd Function's
    backward takes the final state's gradient ``dht`` and returns ``dh0`` as ``initial_state``'s."""
    import ast
    init = _fla_source("ops/gated_delta_rule/__init__.py")
    origin = [n.module for n in init.body if isinstance(n, ast.ImportFrom)
              and any(a.name == "chunk_gated_delta_rule" for a in n.names)]
    assert origin, "fla.ops.gated_delta_rule no longer exports chunk_gated_delta_rule"
    chunk = _fla_source(f"ops/gated_delta_rule/{origin[0].replace('.', '/')}.py")
    fn = [n for n in chunk.body if isinstance(n, ast.FunctionDef) and n.name == "chunk_gated_delta_rule"][0]
    a = fn.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    defaults = dict(zip(positional[len(positional) - len(a.defaults):], a.defaults))
    defaults.update((x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)
    named = positional + [x.arg for x in a.kwonlyargs]
    ours = _named(ast.parse(inspect.getsource(delta_rule)), ast.FunctionDef, "gated_delta_rule")
    call = [n for n in ast.walk(ours) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "chunk_gated_delta_rule"]
    assert len(call) == 1
    passed = [kw.arg for kw in call[0].keywords]
    assert positional[:len(call[0].args)] == ["q", "k", "v", "g", "beta"]
    assert set(passed) <= set(named), f"keywords fla does not name: {set(passed) - set(named)}"
    assert set(passed) >= {"scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel"}
    missing = [n for n in named[len(call[0].args):] if n not in defaults and n not in passed]
    assert not missing, f"fla parameters without a default that fpdt leaves out: {missing}"
    if "state_v_first" in defaults:
        assert ast.literal_eval(defaults["state_v_first"]) is False
    doc = ast.get_docstring(fn)
    assert "queries of shape `[B, T, H, K]`" in doc and "values of shape `[B, T, HV, V]`" in doc
    assert "Initial state of shape `[N, HV, K, V]`" in doc
    returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)]
    assert returns and all(isinstance(r, ast.Tuple) and len(r.elts) == 2 for r in returns), "(o, final_state)"
    function = _named(chunk, ast.ClassDef, "ChunkGatedDeltaRuleFunction")
    forward, backward = (_named(function, ast.FunctionDef, n) for n in ("forward", "backward"))
    assert [x.arg for x in backward.args.args] == ["ctx", "do", "dht"]
    inputs_ = [x.arg for x in forward.args.args][1:]
    back = [n.value for n in ast.walk(backward) if isinstance(n, ast.Return)][-1]
    assert isinstance(back, ast.Tuple) and len(back.elts) == len(inputs_)
    assert getattr(back.elts[inputs_.index("initial_state")], "id", None) == "dh0"


def test_fla_signature_when_importable():
    """Where fla imports (CUDA machines, with Triton): the same keywords in ``inspect.signature``."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        pytest.skip(f"fla.ops does not import here ({e}); the source check above covers it")
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

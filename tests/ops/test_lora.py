"""LoRA terms inside the chunked functions (``fpdt.ops.lora``), against plain autograd.

The chunked SwiGLU MLP and the chunked q/k/v projection + FPDT attention, with LoRA adapters
on their projections, are checked forward and backward (input, adapters, unfrozen base
weights) against a plain float64 autograd computation of ``base + B A dropout(x) * s`` on the
whole sequence, with the dropout masks the function drew (rebuilt from its seed). Awkward
shapes: uneven MLP chunks, GQA with odd head counts, several adapters on one projection,
adapters with a bias, frozen and trainable base weights; world sizes 1 and 2 for attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fpdt.attention.projected_attention import projected_fpdt_attention
from fpdt.layout.fpdt_layout import global_token_index, shard
from fpdt.model.chunks import chunk_bounds
from fpdt.model.mlp import swiglu_of_linears
from fpdt.ops.lora import LoraAdapters, LoraLayout, LoraTerm, _bounds, keep_scale, lora_linear, rank_seed
from tests.attention.reference import reference_attention
from tests.distributed import run_distributed

SEED = 1234


def _seed_drawn(seed: int, rank: int = 0) -> int:
    """The dropout seed a function draws on ``rank`` right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return rank_seed(int(torch.randint(0, 2 ** 62, (), dtype=torch.int64)), rank)


def _adapters(projections, ranks, bias, dropout, dtype, gen):
    """A layout with ``len(ranks[n])`` terms on projection n (``projections[n] = (in, out)``) and
    random tensors (B nonzero, unlike PEFT's initialisation, so every gradient is exercised)."""
    terms, tensors, stream = [], [], 0
    for (fan_in, fan_out), rs in zip(projections, ranks):
        row = []
        for r in rs:
            row.append(LoraTerm(scaling=0.5 + 0.25 * stream, dropout=dropout, stream=stream))
            stream += 1
            tensors += [torch.randn(r, fan_in, generator=gen, dtype=torch.float64).div_(fan_in ** 0.5),
                        torch.randn(fan_out, r, generator=gen, dtype=torch.float64).div_(r ** 0.5),
                        torch.randn(fan_out, generator=gen, dtype=torch.float64) if bias else None]
        terms.append(tuple(row))
    tensors = [None if t is None else t.to(dtype).requires_grad_() for t in tensors]
    return LoraAdapters(LoraLayout(tuple(terms)), tuple(tensors))


def _reference_proj(x, w, b, terms, scales):
    """float64 ``x W^T + b + sum (x * scale) A^T B^T + b_B) * s``; ``scales`` per term (or None)."""
    x = x.double()
    out = F.linear(x, w.double(), None if b is None else b.double())
    for (term, a, bm, bias), scale in zip(terms, scales):
        xd = x if scale is None else x * scale.double()
        out = out + F.linear(F.linear(xd, a.double()), bm.double(), None if bias is None else bias.double()) \
            * term.scaling
    return out


def _grads(tensors):
    return [None if t is None or t.grad is None else t.grad.detach().clone() for t in tensors]


def _close(got, want, tol, what):
    assert (got is None) == (want is None), what
    if got is None:
        return
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


MLP_CASES = [  # (dtype, adapter dtype, chunks, dropout, frozen base, adapter bias, ranks per projection)
    (torch.float64, torch.float64, 1, 0.0, True, False, [[4], [4], [4]]),
    (torch.float64, torch.float64, 3, 0.3, True, True, [[2, 3], [], [5]]),       # 2 adapters on gate, none on up
    (torch.float64, torch.float64, 4, 0.1, False, False, [[], [3], [2]]),         # base trained too
    (torch.float32, torch.float32, 2, 0.0, False, True, [[4], [4], [4]]),
    (torch.bfloat16, torch.float32, 3, 0.2, True, False, [[4], [4], [4]]),        # PEFT's fp32 adapters on bf16
]


@pytest.mark.parametrize("case", MLP_CASES, ids=lambda c: f"{c[0]}-{c[1]}-u{c[2]}-p{c[3]}-frozen{c[4]}-bias{c[5]}")
def test_chunked_mlp_with_lora_matches_autograd(case):
    dtype, lora_dtype, chunks, p, frozen, bias, ranks = case
    gen = torch.Generator().manual_seed(0)
    B, S, hidden, inter = 2, 13, 24, 40                   # 26 tokens: uneven chunks
    gate, up, down = (torch.nn.Linear(i, o, bias=True, dtype=torch.float64)
                      for i, o in ((hidden, inter), (hidden, inter), (inter, hidden)))
    for m in (gate, up, down):
        m.to(dtype).requires_grad_(not frozen)
    ad = _adapters([(hidden, inter), (hidden, inter), (inter, hidden)], ranks, bias, p, lora_dtype, gen)
    x = torch.randn(B, S, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    dy = torch.randn(B, S, hidden, generator=gen, dtype=torch.float64).to(dtype)

    torch.manual_seed(SEED)
    y = swiglu_of_linears(x, gate, up, down, chunks, adapters=ad)
    y.backward(dy)
    tensors = [x, *(t for m in (gate, up, down) for t in (m.weight, m.bias)), *ad.tensors]
    got = _grads(tensors)

    seed = _seed_drawn(SEED)
    bounds = chunk_bounds(B * S, chunks)

    def scales(term, width):
        if not term.dropout:
            return None
        return torch.cat([keep_scale(torch.Size([e - s, width]), torch.float64, torch.device("cpu"), term.dropout,
                                     seed, term.stream, k) for k, (s, e) in enumerate(bounds)]).view(B, S, width)

    ref = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
    xr, (wg, bg, wu, bu, wd, bd) = ref[0], ref[1:7]
    tg, tu, td = ad.layout.split(ref[7:])
    g = _reference_proj(xr, wg, bg, tg, [scales(t[0], hidden) for t in tg])
    u = _reference_proj(xr, wu, bu, tu, [scales(t[0], hidden) for t in tu])
    h = F.silu(g) * u
    yr = _reference_proj(h, wd, bd, td, [scales(t[0], inter) for t in td])
    yr.backward(dy.double())
    want = _grads(ref)
    tol = 2e-2 if dtype == torch.bfloat16 else (1e-5 if dtype == torch.float32 else 1e-10)
    _close(y, yr, tol, "output")
    names = ["x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"] + \
        [f"lora[{i}]" for i in range(len(ad.tensors))]
    for n, gt, wt in zip(names, got, want):
        _close(gt, wt, tol, n)
    if frozen:
        assert all(got[i] is None for i in range(1, 7))    # no accumulator, no GEMM for a frozen base
    if p:      # the masks really dropped something
        y_eval = swiglu_of_linears(x, gate, up, down, chunks,
                                   adapters=LoraAdapters(_no_dropout(ad.layout), ad.tensors))
        assert not torch.allclose(y_eval, y)


def _no_dropout(layout: LoraLayout) -> LoraLayout:
    return LoraLayout(tuple(tuple(LoraTerm(t.scaling, 0.0, t.stream) for t in row) for row in layout.terms))


def test_dropout_masks_are_reproducible_and_scaled():
    shape = torch.Size([64, 512])
    a = keep_scale(shape, torch.float32, torch.device("cpu"), 0.25, 7, 1, 3)
    assert torch.equal(a, keep_scale(shape, torch.float32, torch.device("cpu"), 0.25, 7, 1, 3))
    assert set(a.unique().tolist()) == {0.0, torch.tensor(1 / 0.75, dtype=torch.float32).item()}
    assert abs((a == 0).float().mean().item() - 0.25) < 0.01
    for other in ((8, 1, 3), (7, 2, 3), (7, 1, 4)):            # seed, stream, chunk each change it
        assert not torch.equal(a, keep_scale(shape, torch.float32, torch.device("cpu"), 0.25, *other))
    with pytest.raises(ValueError, match="dropout"):
        LoraTerm(1.0, 1.0, 0)


def test_layout_checks_its_tensor_count():
    layout = LoraLayout(((LoraTerm(1.0, 0.0, 0),), (), ()))
    with pytest.raises(ValueError, match="3 tensors, got 2"):
        LoraAdapters(layout, (torch.zeros(1), torch.zeros(1)))


def _global_keep_scales(term, B: int, S: int, hidden: int, world: int, u: int):
    """The dropout keep-scales ``[B, S, hidden]`` of ``term`` over the whole sequence: every rank's
    masks (each from its own seed) put at its tokens' global positions; None without dropout."""
    if not term.dropout:
        return None
    L = S // world // u
    full = torch.empty(B, S, hidden, dtype=torch.float64)
    for r in range(world):
        index, seed = global_token_index(S, world, u, r), _seed_drawn(SEED, r)
        for i in range(u):
            full[:, index[i * L:(i + 1) * L]] = keep_scale(torch.Size([B, L, hidden]), torch.float64,
                                                           torch.device("cpu"), term.dropout, seed, term.stream, i)
    return full


def _check_against(got_t, want_t, yard_t, what: str, tol: float) -> None:
    """``got_t`` against the float64 ``want_t``: within ``tol``, or (bf16, ``yard_t`` the plain bf16
    computation) within ``tol`` or no worse than 1.25x the plain computation's own error."""
    if yard_t is None:
        _close(got_t, want_t, tol, what)
        return
    err = lambda t: ((t.double() - want_t.double()).norm() / want_t.double().norm()).item()  # noqa: E731
    assert (got_t is None) == (want_t is None), what
    if got_t is not None:
        assert err(got_t) <= max(tol, 1.25 * err(yard_t)), f"{what}: {err(got_t):.3g} vs bf16's {err(yard_t):.3g}"


def _attention_case(rank, world, dtype, u, p, heads, frozen):
    gen = torch.Generator().manual_seed(5)
    H, H_kv, D = heads
    B, hidden, S = 2, 20, (32 if dtype == torch.bfloat16 else 8) * world * u   # bf16: enough tokens that its noise averages
    projs = [torch.nn.Linear(hidden, n * D, bias=True, dtype=torch.float64) for n in (H, H_kv, H_kv)]
    for m in projs:
        m.to(dtype).requires_grad_(not frozen)
    ad = _adapters([(hidden, H * D), (hidden, H_kv * D), (hidden, H_kv * D)], [[3], [2, 2], [4]], True, p,
                   torch.float32 if dtype == torch.bfloat16 else dtype, gen)
    x_full = torch.randn(B, S, hidden, generator=gen, dtype=torch.float64).to(dtype)
    dy_full = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64).to(dtype)
    pos = torch.arange(S).expand(B, S)
    ang = pos[..., None].double() / (100.0 ** (torch.arange(0, D, 2).double() / D))
    cos_full, sin_full = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x = shard(x_full, world, u, rank).requires_grad_()
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(SEED)     # the same seed on every rank, as in a seeded training run
    out = projected_fpdt_attention(x, *projs, heads=heads, cos=shard(cos_full, world, u, rank).to(dtype),
                                   sin=shard(sin_full, world, u, rank).to(dtype), group=group, num_chunks=u,
                                   adapters=ad)
    out.backward(shard(dy_full, world, u, rank))
    tensors = [x, *(t for m in projs for t in (m.weight, m.bias)), *ad.tensors]
    got = _grads(tensors)
    if world > 1:
        for g in got[1:]:
            if g is not None:
                dist.all_reduce(g)

    def scales(term):
        return _global_keep_scales(term, B, S, hidden, world, u)

    def reference(exact: bool):
        """float64 throughout, or (``exact=False``, the bf16 yardstick) the plain computation in the
        run's dtypes: bf16 projections plus fp32 adapters cast back (as PEFT does), bf16 SDPA."""
        ref = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None
               for t in (x_full, *tensors[1:])]
        ref[0].requires_grad_()
        split = ad.layout.split(ref[7:])
        qkv = []
        for n in range(3):
            masks = [scales(t[0]) for t in split[n]]
            if exact:
                qkv.append(_reference_proj(ref[0], ref[1 + 2 * n], ref[2 + 2 * n], split[n], masks))
            else:
                y = F.linear(ref[0], ref[1 + 2 * n], ref[2 + 2 * n])
                for (term, a, bm, bias), m in zip(split[n], masks):
                    xd = ref[0].to(a.dtype) * (1 if m is None else m.to(a.dtype))
                    y = y + F.linear(F.linear(xd, a), bm, bias) * term.scaling
                qkv.append(y.to(dtype))
        qkv = [t.view(B, S, -1, D) for t in qkv]
        c, s_ = (cos_full, sin_full) if exact else (cos_full.to(dtype), sin_full.to(dtype))
        rot = lambda t: t * c[:, :, None] + torch.cat((-t[..., D // 2:], t[..., :D // 2]), -1) \
            * s_[:, :, None]  # noqa: E731
        if exact:
            o = reference_attention(rot(qkv[0]), rot(qkv[1]), qkv[2])
        else:
            q, k, v = (t.transpose(1, 2) for t in (rot(qkv[0]), rot(qkv[1]), qkv[2]))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        o.backward(dy_full.to(o.dtype))
        return o.detach(), _grads(ref)

    if dtype == torch.bfloat16:
        tensors_f64 = tensors
        tensors = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None
                   for t in tensors_f64]
        o, want = reference(True)
        tensors = tensors_f64
        o_bf16, yard = reference(False)
    else:
        tensors = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
        (o, want), yard, o_bf16 = reference(True), None, None
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5

    def check(got_t, want_t, yard_t, what):
        _check_against(got_t, want_t, yard_t, what, tol)

    yard = yard or [None] * len(want)
    check(out, shard(o, world, u, rank), None if o_bf16 is None else shard(o_bf16, world, u, rank),
          f"rank {rank} output")
    check(got[0], shard(want[0], world, u, rank), None if yard[0] is None else shard(yard[0], world, u, rank),
          f"rank {rank} d_hidden")
    names = ["wq", "bq", "wk", "bk", "wv", "bv"] + [f"lora[{i}]" for i in range(len(ad.tensors))]
    for n, gt, wt, yt in zip(names, got[1:], want[1:], yard[1:]):
        check(gt, wt, yt, f"rank {rank} {n}")
    if frozen:
        assert all(g is None for g in got[1:7])


ATTENTION_CASES = [  # (dtype, u, dropout, (H, H_kv, D), frozen base)
    (torch.float32, 1, 0.0, (3, 1, 8), True),
    (torch.float32, 4, 0.25, (6, 2, 8), True),
    (torch.float32, 2, 0.1, (5, 5, 4), False),
    (torch.bfloat16, 2, 0.25, (3, 1, 8), True),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}-u{c[1]}-p{c[2]}-h{c[3]}-frozen{c[4]}")
def test_projected_attention_with_lora_matches_autograd(case):
    _attention_case(0, 1, *case)


TWO_RANK_CASES = [
    (torch.float32, 4, 0.25, (6, 2, 8), True),
    (torch.float32, 2, 0.1, (6, 1, 4), False),     # one KV head, replicated over the two ranks
    (torch.bfloat16, 1, 0.25, (2, 2, 8), True),
]


def _two_ranks(rank, world):
    for case in TWO_RANK_CASES:
        _attention_case(rank, world, *case)


@pytest.mark.slow
def test_projected_attention_with_lora_on_two_ranks():
    run_distributed(_two_ranks, 2)


LINEAR_CASES = [  # (dtype, adapter dtype, chunks, dropout, frozen base)
    (torch.float64, torch.float64, 3, 0.3, True),
    (torch.float64, torch.float64, 1, 0.0, False),
    (torch.bfloat16, torch.float32, 4, 0.2, True),
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: f"{c[0]}-u{c[2]}-p{c[3]}-frozen{c[4]}")
def test_lean_lora_linear_matches_autograd(case):
    """``lora_linear`` (a PEFT LoRA o_proj, computed by fpdt): two adapters, one with a bias."""
    dtype, lora_dtype, chunks, p, frozen = case
    gen = torch.Generator().manual_seed(2)
    B, S, fan_in, fan_out = 2, 11, 24, 20
    base = torch.nn.Linear(fan_in, fan_out, bias=True, dtype=torch.float64).to(dtype).requires_grad_(not frozen)
    ad = _adapters([(fan_in, fan_out)], [[3, 2]], True, p, lora_dtype, gen)
    x = torch.randn(B, S, fan_in, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    dy = torch.randn(B, S, fan_out, generator=gen, dtype=torch.float64).to(dtype)
    torch.manual_seed(SEED)
    y = lora_linear(x, base.weight, base.bias, ad, chunks)
    y.backward(dy)
    tensors = [x, base.weight, base.bias, *ad.tensors]
    got = _grads(tensors)
    seed = _seed_drawn(SEED)

    def scales(term):
        if not term.dropout:
            return None
        return torch.cat([keep_scale(torch.Size([e - s, fan_in]), torch.float64, torch.device("cpu"), term.dropout,
                                     seed, term.stream, k)
                          for k, (s, e) in enumerate(_bounds(B * S, chunks))]).view(B, S, fan_in)

    ref = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in tensors]
    (terms,) = ad.layout.split(ref[3:])
    yr = _reference_proj(ref[0], ref[1], ref[2], terms, [scales(t[0]) for t in terms])
    yr.backward(dy.double())
    want = _grads(ref)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-10
    _close(y, yr, tol, "output")
    for n, gt, wt in zip(["x", "weight", "bias"] + [f"lora[{i}]" for i in range(len(ad.tensors))], got, want):
        _close(gt, wt, tol, n)
    if frozen:
        assert got[1] is None and got[2] is None


def test_ranks_seeded_alike_draw_different_masks():
    seeds = {rank_seed(_seed_drawn(SEED), r) for r in range(8)}
    assert len(seeds) == 8
    masks = [keep_scale(torch.Size([16, 64]), torch.float32, torch.device("cpu"), 0.5, s, 0, 0) for s in seeds]
    assert all(not torch.equal(masks[0], m) for m in masks[1:])

"""FPDTAttention (chunked projection + RoPE + FPDT attention) vs a float64 reference layer.

Checks the output, the input gradient (each rank's slice) and every weight/bias gradient
(summed over the sequence-parallel ranks) on 1, 2 and 4 gloo ranks.
"""

import pytest
import torch
import torch.distributed as dist

from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq
from fpdt.layout import local_position_ids, shard
from tests.attention.reference import assert_rel_close, reference_layer
from tests.distributed import run_distributed

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NAMES = {"wq": "q_proj.weight", "bq": "q_proj.bias", "wk": "k_proj.weight", "bk": "k_proj.bias",
         "wv": "v_proj.weight", "bv": "v_proj.bias", "wo": "o_proj.weight"}


def check_layer(rank, world, *, B, hidden, H, H_kv, D, u, offload, bias, dtype=torch.float32, seed=0, runtime=None):
    torch.manual_seed(seed)
    S = world * u * 2
    layer = FPDTAttention(hidden, H, H_kv, D, qkv_bias=bias, num_chunks=u, offload=offload, runtime=runtime).to(dtype)
    rope = RotaryEmbedding(default_inv_freq(D))
    x = torch.randn(B, S, hidden).to(dtype)
    dout = torch.randn(B, S, hidden).to(dtype)
    pos = torch.arange(S).expand(B, S)

    params = {k: (None if getattr(layer, n.split(".")[0]).bias is None and n.endswith("bias")
                  else layer.get_parameter(n).detach().double().requires_grad_()) for k, n in NAMES.items()}
    xr = x.double().requires_grad_()
    ref = reference_layer(xr, pos, params, (H, H_kv, D))
    ref.backward(dout.double())

    xl = shard(x, world, u, rank).requires_grad_()
    out = layer(xl, local_position_ids(S, world, u, rank, B), rope)
    out.backward(shard(dout, world, u, rank))
    tol = TOL[dtype]
    what = f"rank {rank}/{world} u={u} offload={offload} bias={bias} {dtype} H={H} H_kv={H_kv}"
    assert_rel_close(out, shard(ref, world, u, rank), tol, f"out [{what}]")
    assert_rel_close(xl.grad, shard(xr.grad, world, u, rank), tol, f"d_hidden [{what}]")
    for key, name in NAMES.items():
        if params[key] is None:
            continue
        grad = layer.get_parameter(name).grad.detach().double()
        if world > 1:
            dist.all_reduce(grad)  # each rank holds its tokens' contribution
        assert_rel_close(grad, params[key].grad, tol, f"{name}.grad [{what}]")


def _cases(world):
    H, H_kv, hidden = (6, 2, 96) if world < 4 else (8, 2, 64)
    cases = []
    for u in ((1, 2, 4) if world < 4 else (1, 2)):
        for offload in (False, True):
            cases.append(dict(B=2, hidden=hidden, H=H, H_kv=H_kv, D=16, u=u, offload=offload, bias=u == 2))
    cases.append(dict(B=1, hidden=hidden, H=H, H_kv=1, D=16, u=2, offload=True, bias=True))
    cases.append(dict(B=2, hidden=hidden, H=H, H_kv=H_kv, D=16, u=2, offload=True, bias=True, dtype=torch.bfloat16))
    return cases


def _body(rank, world):
    for n, case in enumerate(_cases(world)):
        check_layer(rank, world, seed=n, **case)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer_parity(world):
    if world == 1:
        _body(0, 1)
    else:
        run_distributed(_body, world, timeout=240)


def test_position_ids_shape_is_checked():
    layer = FPDTAttention(32, 4, 2)
    with pytest.raises(ValueError, match=r"position_ids must be \[B, S_local\]=\[1, 8\]"):
        layer(torch.randn(1, 8, 32), torch.arange(4)[None])


@pytest.mark.parametrize("zero_centred,gate", [(False, False), (True, True)])
@pytest.mark.parametrize("u,offload", [(1, False), (3, True)])
def test_input_norm_inside_matches_the_norm_apart(u, offload, zero_centred, gate):
    """``FPDTAttention(x, norm=)`` (the norm a chunk at a time inside the Function) against the
    same layer after the norm module: output, input gradient, the norm's and the projections'
    weight gradients (fp32, 1e-5). With ``donate`` the input gradient is added into the output
    gradient in place and ``x`` gets none."""
    from fpdt.model.llama import RMSNorm

    torch.manual_seed(u)
    B, S, hidden, H, H_kv, D = 2, 6 * u, 96, 6, 2, 16
    layer = FPDTAttention(hidden, H, H_kv, D, num_chunks=u, offload=offload, output_gate=gate)
    norm = RMSNorm(hidden, 1e-5, zero_centred=zero_centred)
    with torch.no_grad():
        norm.weight.normal_(0.5 if not zero_centred else 0.0, 0.3)
    rope, pos = RotaryEmbedding(default_inv_freq(D)), torch.arange(S).expand(B, S)
    x, dout = torch.randn(B, S, hidden), torch.randn(B, S, hidden)

    def run(fused: bool, donate=None, grad=None):
        for p in (*layer.parameters(), *norm.parameters()):
            p.grad = None
        xl = x.clone().requires_grad_()
        out = layer(xl, pos, rope, norm=norm, donate=donate) if fused else layer(norm(xl), pos, rope)
        out.backward(dout if grad is None else grad)
        return out, xl.grad, norm.weight.grad.clone(), layer.q_proj.weight.grad.clone()

    want = run(False)
    for got, ref, name in zip(run(True), want, ("out", "d_hidden", "norm.weight.grad", "q_proj.weight.grad")):
        assert_rel_close(got, ref, 1e-5, f"{name} u={u} offload={offload} zero_centred={zero_centred}")
    grad = dout.clone()
    _, dx, dw, _ = run(True, donate=lambda g: g.data_ptr() == grad.data_ptr(), grad=grad)
    assert dx is None
    assert_rel_close(grad, dout + want[1], 1e-5, "donated")
    assert_rel_close(dw, want[2], 1e-5, "norm.weight.grad, donated")

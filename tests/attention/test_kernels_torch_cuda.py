"""torch's CUDA attention adapters, called on meta tensors (runs on the CPU).

torch ships meta kernels for its flash, cuDNN and memory-efficient attention ops, so the
adapters' calls can be recorded without a GPU. What the forward op returns is what its
backward expects back (autograd's derivatives pass the forward's lse and RNG outputs
straight through), so each backward call is checked against the outputs of the same
op's forward on the same shapes: lse shape (the efficient kernel pads the query dim),
dtype and contiguity, and the RNG tensors' dtype and shape. Values need a GPU:
tests/attention/test_cuda.py.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fpdt.attention.kernels import BACKENDS

aten = torch.ops.aten

# backend -> (forward op, backward op, index of lse among the forward's outputs,
#             forward outputs that backward takes as (philox_seed, philox_offset))
OPS = {
    "cuda_flash": (aten._scaled_dot_product_flash_attention.default,
                   aten._scaled_dot_product_flash_attention_backward.default, 1, (6, 7)),
    "cuda_cudnn": (aten._scaled_dot_product_cudnn_attention.default,
                   aten._scaled_dot_product_cudnn_attention_backward.default, 1, (6, 7)),
    "cuda_efficient": (aten._scaled_dot_product_efficient_attention.default,
                       aten._scaled_dot_product_efficient_attention_backward.default, 1, (2, 3)),
}


class Recorder(TorchDispatchMode):
    """Records every aten call as (op, {argument name: value}, outputs)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        named = {a.name: v for a, v in zip(func._schema.arguments, args)}
        named.update(kwargs)
        self.calls.append((func, named, out))
        return out

    def only(self, op):
        found = [(named, out) for f, named, out in self.calls if f == op]
        assert len(found) == 1, f"{op} called {len(found)} times"
        return found[0]


def _spec(t):
    return tuple(t.shape), t.dtype


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("seq", [37, 64, 100])
@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_torch_cuda_adapter_calls(name, seq, h_kv):
    be = BACKENDS[name]
    fwd_op, bwd_op, lse_index, rng_index = OPS[name]
    B, H, D, dt = 2, 4, 64, torch.bfloat16
    q, dout = (torch.empty(B, seq, H, D, device="meta", dtype=dt) for _ in range(2))
    k, v = (torch.empty(B, seq, h_kv, D, device="meta", dtype=dt) for _ in range(2))

    with Recorder() as rec:
        out, lse = be.forward(q, k, v, True, 0.125)
    assert out.shape == q.shape and out.dtype == dt
    assert lse.shape == (B, H, seq) and lse.dtype == torch.float32  # what the merge works with
    fwd_args, fwd_out = rec.only(fwd_op)
    kv_heads = h_kv if be.native_gqa else H
    assert fwd_args["key"].shape == (B, kv_heads, seq, D) and fwd_args["value"].shape == (B, kv_heads, seq, D)

    # the pipeline hands backward the merged out [B, S, H, D] and lse [B, H, S] fp32, contiguous
    merged_out = torch.empty(B, seq, H, D, device="meta", dtype=dt)
    merged_lse = torch.empty(B, H, seq, device="meta", dtype=torch.float32)
    with Recorder() as rec:
        dq, dk, dv = be.backward(dout, q, k, v, merged_out, merged_lse, True, 0.125)
    bwd_args, _ = rec.only(bwd_op)
    lse_arg = bwd_args["logsumexp"]
    assert _spec(lse_arg) == _spec(fwd_out[lse_index]), f"{name}: backward lse vs the forward's"
    assert lse_arg.is_contiguous()
    for arg, i in zip(("philox_seed", "philox_offset"), rng_index):
        assert _spec(bwd_args[arg]) == _spec(fwd_out[i]), f"{name}: {arg} vs forward output {i}"
    assert bwd_args["key"].shape == (B, kv_heads, seq, D)
    assert bwd_args["is_causal"] is True and bwd_args["scale"] == 0.125 and bwd_args["dropout_p"] == 0.0
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    if kv_heads != h_kv:  # expanded here: replica gradients summed in fp32
        assert dk.dtype == dv.dtype == torch.float32


def test_efficient_lse_padding_is_the_kernels():
    """The efficient kernel's lse is padded along the query dim (to a multiple of 32 in
    torch today); the adapter must give its backward exactly that length."""
    fwd_op = OPS["cuda_efficient"][0]
    q = torch.empty(1, 2, 37, 64, device="meta", dtype=torch.bfloat16)
    lse = fwd_op(q, q, q, None, True, 0.0, False)[1]
    assert lse.shape[-1] > 37  # the case test_torch_cuda_adapter_calls covers


@pytest.mark.parametrize("name", ["cuda_efficient", "cuda_cudnn"])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_backward_gets_out_and_dout_in_qs_layout(name, h_kv):
    """The efficient kernel's half-precision backward reads ``out`` and ``grad_out`` with the
    query's strides (on an H100 with torch 2.11, another layout gave dq and dk off by 100%+;
    benchmarks/results/nvidia-h100-80gb-hbm3/2026-11-24/efficient_bf16_probe.log), and cuDNN
    reads all five with one layout: whatever layouts the pipeline hands over, the op must get
    q, k, v, out and grad_out with the same strides."""
    B, S, H, D, dt = 1, 48, 4, 64, torch.bfloat16
    q = torch.empty(B, S, H, D, device="meta", dtype=dt)
    k, v = (torch.empty(B, S, h_kv, D, device="meta", dtype=dt) for _ in range(2))
    out = torch.empty(B, H, S, D, device="meta", dtype=dt).transpose(1, 2)     # a BHSD-contiguous view
    dout = torch.empty(B, S, H, D, device="meta", dtype=dt)
    lse = torch.empty(B, H, S, device="meta", dtype=torch.float32)
    with Recorder() as rec:
        BACKENDS[name].backward(dout, q, k, v, out, lse, True, 0.125)
    args, _ = rec.only(OPS[name][1])
    args["grad_out"] = args.get("grad_out", args.get("grad_out_"))      # the efficient op's name for it
    # one layout for all five, BSHD-contiguous (the op gets [B, H, S, D] views of them; with
    # native GQA key and value have H_kv heads, so equal strides would be the wrong test)
    names = ("query", "key", "value", "out", "grad_out")
    assert all(args[a].transpose(1, 2).is_contiguous() for a in names), {a: args[a].stride() for a in names}
    assert args["key"].shape[1] == (h_kv if BACKENDS[name].native_gqa else H)

"""Device bytes of ``o_proj``'s backward when it reads its input from the attention's stash,
counted exactly on the CPU (:mod:`fpdt.attention.output_projection`).

One :class:`fpdt.attention.FPDTAttention` layer, bf16, the issue's GQA shape (hidden 256 = 4
query heads of 64, one KV head), ``offload=True``, ``o_proj_input_from_stash=True`` (what the
model sets under ``checkpointing="off"``). ``X`` = one local chunk of o_proj's input,
``B L H D * 2`` bytes; ``W`` = ``o_proj``'s weight, ``hidden * H D`` elements. The phase is
o_proj's backward node alone (from the gradient reaching it to its input gradient leaving
it); beyond its start it holds, at its peak:

* the input gradient ``dx = g W`` ``[B, S_local, H D]`` (its output, full-length in any case:
  it is the attention backward's incoming gradient);
* the fp32 weight-gradient accumulator (4 W bytes), and during each chunk's ``g_i^T x_i`` its
  bf16 result and fp32 copy (2 W + 4 W);
* the chunk in use and the next one, prefetched (2 X); with two ranks the all-to-all of the
  chunk back to sequence layout adds its receive buffer and the sequence-layout copy (2 X
  more, while the weight-gradient temporaries are not live).

With LoRA (base frozen, fp32 adapters) the weight-gradient temporaries give way to the terms'
fp32 temporaries of half a chunk (:func:`_lora_budget`).

Never the full-length input: before, the backward rebuilt it (``dx`` + 1 full-length + 2 X),
and before that every layer kept it from forward to backward. The same bytes at u = 4 and
u = 32 (at the same chunk size).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq
from fpdt.attention.output_projection import OutputProjectionFunction
from fpdt.layout import local_position_ids
from fpdt.memory.accountant import MemoryAccountant
from tests.distributed import run_distributed

H, H_KV, D = 4, 1, 64
HIDDEN = H * D
CHUNK = 64          # local chunk L, tokens
DETAIL = False
RANK = 8


def o_proj_backward_bytes(u: int, from_stash: bool = True, chunk: int = CHUNK, lora: float | None = None) -> dict:
    """One layer's forward + backward; returns the o_proj backward phase's ``peak_above_start``,
    the bytes of ``dx``, ``X`` and the device bytes live after the forward."""
    P = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    layer = FPDTAttention(HIDDEN, H, H_KV, D, num_chunks=u, offload=True).to(torch.bfloat16)
    if lora is not None:        # as fpdt.model.add_lora: the base frozen, fp32 rank-8 adapters, dropout ``lora``
        layer.requires_grad_(False)
        for linear in (layer.q_proj, layer.o_proj):
            linear.lora_A = nn.Linear(linear.in_features, RANK, bias=False)
            linear.lora_B = nn.Linear(RANK, linear.out_features, bias=False)
            linear.lora_scaling, linear.lora_dropout = 2.0, lora
        layer.train()
    if from_stash is not None:          # None: the module's default
        layer.o_proj_input_from_stash = from_stash
    from_stash = layer.o_proj_input_from_stash
    S_local = chunk * u
    x = torch.randn(1, S_local, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    pos = local_position_ids(S_local * P, P, u, rank, 1)
    rope = RotaryEmbedding(default_inv_freq(D))
    dout = torch.randn(1, S_local, HIDDEN, dtype=torch.bfloat16)
    layer(x, pos, rope).backward(dout)             # the kernel's first-use self-check, outside the count
    for p in (*layer.parameters(), x):
        p.grad = None if p.grad is None else torch.zeros_like(p.grad)   # pre-allocated: the baseline
    phase = contextlib.ExitStack()
    with MemoryAccountant("cpu", detail=DETAIL) as acct:
        with acct.phase("forward"):
            out = layer(x, pos, rope)
        after_forward = acct.device_live
        node = out.grad_fn
        assert from_stash == (node.name() == f"{OutputProjectionFunction.__name__}Backward"), node.name()
        node.register_prehook(lambda grads: phase.enter_context(acct.phase("o_proj")) and None)
        node.register_hook(lambda grads_in, grads_out: phase.close())
        out.backward(dout)
    X = 1 * chunk * H * D * 2
    return {"peak": acct.phases["o_proj"].peak_above_start if from_stash else None,
            "dx": S_local * H * D * 2, "X": X, "after_forward": after_forward,
            "forward_peak": acct.phases["forward"].peak_above_start}


W = HIDDEN * H * D                          # elements of o_proj's weight


def _budget(r: dict, P: int) -> int:
    """The derived peak of the module docstring, in bytes."""
    # the fp32 accumulator (4 W), g_i^T x_i in bf16 (2 W) and its fp32 copy (4 W), the chunk in
    # use and the next one in flight (2 X)
    weight_grad = 10 * W + 2 * r["X"]
    # two ranks, at the end of the chunk's all-to-all: the accumulator, the two chunks, the
    # receive buffer and the sequence-layout copy (the send buffer is released when the
    # collective completes, fpdt.comm.release)
    all_to_all = 4 * W + 4 * r["X"] if P > 1 else 0
    return r["dx"] + max(weight_grad, all_to_all)


@pytest.mark.parametrize("u", [4, 32])
def test_o_proj_backward_holds_two_chunks_not_its_input(u):
    r = o_proj_backward_bytes(u)
    assert r["peak"] == _budget(r, 1), (u, r["peak"], _budget(r, 1), r)


def _lora_budget(r: dict, dropout: float) -> int:
    """LoRA (the base frozen: no weight gradient), fp32 rank-``RANK`` adapters, in bytes: the
    chunk in use and the next (2 X); on one of the chunk's two pieces (``n = L / 2`` tokens), its
    input and its output gradient in fp32 (2 n H D * 4 = 2 X at H D = hidden), ``z = x A^T``
    (n r * 4) and with dropout the piece's bool mask (n H D); the fp32 accumulators of A and B
    (2 r H D * 4) and ``g^T z`` (hidden r * 4)."""
    n = CHUNK // 2
    piece = 2 * n * H * D * 4 + n * RANK * 4 + (n * H * D if dropout else 0)
    return r["dx"] + 2 * r["X"] + piece + 2 * RANK * H * D * 4 + HIDDEN * RANK * 4


@pytest.mark.parametrize("u,dropout", [(4, 0.0), (4, 0.1), (32, 0.1)])
def test_lora_o_proj_backward_holds_two_chunks_and_a_piece(u, dropout):
    r = o_proj_backward_bytes(u, lora=dropout)
    assert r["peak"] == _lora_budget(r, dropout), (u, dropout, r["peak"], _lora_budget(r, dropout), r)


def test_the_input_is_not_held_from_forward_to_backward():
    """Reading the input back saves the full-length input held per layer after the forward."""
    held = o_proj_backward_bytes(4, from_stash=False)["after_forward"]
    r = o_proj_backward_bytes(4)
    assert held - r["after_forward"] == r["dx"], (held, r["after_forward"], r["dx"])


@pytest.mark.parametrize("u", [4, 32])
def test_the_standalone_module_keeps_no_full_length_tensor_by_default(u):
    """``FPDTAttention(..., offload=True)`` as built keeps nothing for backward: after its forward only
    its output is live (o_proj's input is read back from the stash). While o_proj runs, its input (the
    attention output) and its output are full-length; beyond them the forward's peak is at most 4
    chunks (the pipeline's, u = 4; none left by u = 32)."""
    r = o_proj_backward_bytes(u, from_stash=None)
    assert r["after_forward"] == r["dx"], r
    assert r["forward_peak"] - 2 * r["dx"] <= 4 * r["X"], (u, (r["forward_peak"] - 2 * r["dx"]) / r["X"])


def _sp2_body(rank, world):
    # at a 512-token chunk (X = 4 W) the all-to-all sets the peak, at 64 tokens (X = W / 2) the GEMM
    for u, chunk in ((4, 512), (16, CHUNK)):
        r = o_proj_backward_bytes(u, chunk=chunk)
        assert r["peak"] == _budget(r, world), (rank, u, r["peak"], _budget(r, world), r)


@pytest.mark.slow
def test_two_ranks_add_only_the_chunk_all_to_all():
    run_distributed(_sp2_body, 2, timeout=240)

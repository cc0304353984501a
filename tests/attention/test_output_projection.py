"""``o_proj`` applied a chunk at a time inside the attention's pipeline, its backward reading
its input back from the attention's stash (:mod:`fpdt.attention.output_projection`).

One :class:`FPDTAttention` layer with q/k/v and o biases, LoRA adapters on ``o_proj`` and
``q_proj`` (random ``B``, so every adapter gradient is nonzero), on 1 and 2 gloo ranks:

* offloaded against the same layer without offload: the output and every gradient (input,
  weights, biases, adapters) within 1e-6 relative (fp32), with LoRA dropout (the same masks);
* against the float64 reference layer (adapters folded into the weights, no dropout);
* without adapters, against ``o_proj`` run as its module on the full-length attention output;
* under the ``sync`` runtime and the simulated one, lazy and threaded;
* the injected faults (``drop_wait``, ``drop_record_stream``) are caught on the whole layer (a
  hazard naming the chunk).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq
import fpdt.attention.module
from fpdt.attention.projected_attention import ProjectedFPDTAttentionFunction
from fpdt.layout import local_position_ids, shard
from fpdt.offload import StreamHazardError, fresh_runtime
from tests.attention.reference import assert_rel_close, reference_layer
from tests.distributed import run_distributed

HIDDEN, H, H_KV, D = 48, 6, 2, 8
RANK, SCALING = 3, 0.5
EXACT = 1e-6
REFERENCE = 1e-5        # fp32 against float64, as the layer's own parity suite (tests/attention/test_module.py)
RUNTIMES = {"sync": None, "sim-lazy": dict(mode="lazy"), "sim-threaded": dict(mode="threaded", seed=1)}


def _runtime(name: str):
    """A context yielding the runtime to pass as ``runtime=`` (None: the automatic sync one)."""
    opts = RUNTIMES[name]
    return contextlib.nullcontext() if opts is None else fresh_runtime("sim", **opts)


def _attach_lora(linear: nn.Linear, dropout: float, gen: torch.Generator) -> None:
    """An adapter as :func:`fpdt.model.add_lora` attaches it, with a random ``B``."""
    linear.lora_A = nn.Linear(linear.in_features, RANK, bias=False)
    linear.lora_B = nn.Linear(RANK, linear.out_features, bias=False)
    with torch.no_grad():
        linear.lora_A.weight.copy_(torch.randn(linear.lora_A.weight.shape, generator=gen) * 0.3)
        linear.lora_B.weight.copy_(torch.randn(linear.lora_B.weight.shape, generator=gen) * 0.3)
    linear.lora_scaling, linear.lora_dropout = SCALING, dropout


def run_layer(rank, world, *, u, offload, lora, as_module=False, dropout=0.0, B=2, piece=3, seed=0, runtime=None):
    """Forward + backward of one layer on this rank's shard: ``(out, {name: grad})``, the
    parameter gradients summed over the ranks and the input's as this rank's shard."""
    torch.manual_seed(seed)
    layer = FPDTAttention(HIDDEN, H, H_KV, D, qkv_bias=True, o_bias=True, num_chunks=u, offload=offload,
                          runtime=runtime)
    if lora:
        gen = torch.Generator().manual_seed(seed + 1)
        _attach_lora(layer.o_proj, dropout, gen)
        _attach_lora(layer.q_proj, dropout, gen)
    layer.stash_label = "layer 0"
    layer.train()
    S = world * u * piece
    x = torch.randn(B, S, HIDDEN)
    dout = torch.randn(B, S, HIDDEN)
    xl = shard(x, world, u, rank).requires_grad_()
    torch.manual_seed(seed + 2)                            # the dropout seed's draw
    with _as_module(as_module):
        out = layer(xl, local_position_ids(S, world, u, rank, B), RotaryEmbedding(default_inv_freq(D)))
    assert (out.grad_fn.name() == f"{ProjectedFPDTAttentionFunction.__name__}Backward") != as_module
    out.backward(shard(dout, world, u, rank))
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    grads["input"] = xl.grad.detach().clone()
    return out.detach(), grads, (x, dout, layer)


@contextlib.contextmanager
def _as_module(on: bool):
    """``o_proj`` run as its module on the full-length attention output (a projection the
    attention cannot read), when ``on``."""
    original = fpdt.attention.module.read_output_projection
    if on:
        fpdt.attention.module.read_output_projection = lambda module, owner, training=True: None
    try:
        yield
    finally:
        fpdt.attention.module.read_output_projection = original


def _compare(got, want, tol, what):
    (out, grads), (ref_out, ref_grads) = got, want
    assert set(grads) == set(ref_grads), (sorted(grads), sorted(ref_grads))
    assert_rel_close(out, ref_out, tol, f"output [{what}]")
    for name, g in grads.items():
        assert g.abs().max() > 0, f"{name}: zero gradient [{what}]"
        assert_rel_close(g, ref_grads[name], tol, f"{name} [{what}]")


def _reference(rank, world, u, x, dout, layer, B):
    """The float64 layer with the adapters folded into the weights (no dropout)."""
    def folded(linear):
        w = linear.weight.detach().double().requires_grad_()
        a = linear.lora_A.weight.detach().double().requires_grad_()
        b = linear.lora_B.weight.detach().double().requires_grad_()
        return w, a, b, w + SCALING * b @ a
    leaves = {}
    wq, aq, bq_, wq_eff = folded(layer.q_proj)
    wo, ao, bo_, wo_eff = folded(layer.o_proj)
    params = {"wq": wq_eff, "wk": layer.k_proj.weight, "wv": layer.v_proj.weight,
              "bq": layer.q_proj.bias, "bk": layer.k_proj.bias, "bv": layer.v_proj.bias, "wo": wo_eff}
    for key in ("wk", "wv", "bq", "bk", "bv"):
        params[key] = leaves[key] = params[key].detach().double().requires_grad_()
    bo = layer.o_proj.bias.detach().double().requires_grad_()
    xr = x.double().requires_grad_()
    S = x.shape[1]
    ref = reference_layer(xr, torch.arange(S).expand(B, S), params, (H, H_KV, D)) + bo
    ref.backward(dout.double())
    names = {"q_proj.weight": wq, "q_proj.lora_A.weight": aq, "q_proj.lora_B.weight": bq_,
             "o_proj.weight": wo, "o_proj.lora_A.weight": ao, "o_proj.lora_B.weight": bo_, "o_proj.bias": bo,
             "k_proj.weight": leaves["wk"], "v_proj.weight": leaves["wv"], "q_proj.bias": leaves["bq"],
             "k_proj.bias": leaves["bk"], "v_proj.bias": leaves["bv"]}
    grads = {n: t.grad for n, t in names.items()}
    grads["input"] = shard(xr.grad, world, u, rank)
    return shard(ref.detach(), world, u, rank), grads


def _parity(rank, world, runtime, cases):
    for u, B in cases:
        with _runtime(runtime) as rt:
            *stash, (x, dout, layer) = run_layer(rank, world, u=u, offload=True, lora=True,
                                                 dropout=0.2, B=B, runtime=rt)
        *kept, _ = run_layer(rank, world, u=u, offload=False, lora=True, dropout=0.2, B=B)
        _compare(stash, kept, EXACT, f"rank {rank}/{world} {runtime} u={u} B={B}: stash vs kept, dropout")
        with _runtime(runtime) as rt:
            *stash, (x, dout, layer) = run_layer(rank, world, u=u, offload=True, lora=True, B=B,
                                                 runtime=rt)
        _compare(stash, _reference(rank, world, u, x, dout, layer, B), REFERENCE,
                 f"rank {rank}/{world} {runtime} u={u} B={B}: stash vs float64 reference")
        # no adapter: o_proj inside, against the plain nn.Linear on the full-length attention output
        with _runtime(runtime) as rt:
            *stash, _ = run_layer(rank, world, u=u, offload=True, lora=False, B=B, runtime=rt)
        *kept, _ = run_layer(rank, world, u=u, offload=True, lora=False, as_module=True, B=B)
        _compare(stash, kept, EXACT, f"rank {rank}/{world} {runtime} u={u} B={B}: stash vs nn.Linear")


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_single_rank_parity(runtime):
    _parity(0, 1, runtime, [(1, 2), (3, 2), (4, 1)])


@pytest.mark.slow
def test_two_rank_parity():
    for runtime in RUNTIMES:
        run_distributed(_parity, 2, args=(runtime, [(2, 2), (3, 1)]), timeout=240)


@pytest.mark.parametrize("mode", ["lazy", "threaded"])
@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_injected_faults_are_caught_on_the_layer(mode, fault):
    with pytest.raises(StreamHazardError, match=r"chunk \d+, layer 0"):
        with fresh_runtime("sim", mode=mode, fault=fault, checks=True, seed=3) as rt:
            run_layer(0, 1, u=3, offload=True, lora=True, dropout=0.2, runtime=rt)

"""End-to-end parity with Transformers: loss and every parameter gradient.

The FPDT model runs on 1, 2 and 4 gloo ranks with its inputs from
``fpdt.model.prepare_inputs``; per-rank gradients are summed over the SP group (the
documented convention) and compared with the Transformers model's gradients on the same
weights and tokens, within 1e-5 relative (fp32).
"""


import pytest
import torch
import torch.distributed as dist

import fpdt.model as fm
from fpdt.layout import global_token_index
from tests.distributed import run_distributed
from tests.model.helpers import compare, compare_bf16, fpdt_from_hf, hf_loss_and_grads, hf_model, tokens

# (num_chunks, mlp_chunks, loss_chunks, offload): defaults, uneven, unchunked (0), many.
CHUNKINGS = [(1, None, None, False), (2, 3, 5, True), (4, 0, 0, False), (2, 1, 1, False)]


def run_case(name, rank, world, *, num_chunks, mlp_chunks, loss_chunks, offload, checkpointing,
             B=2, S=None, ignore=True, lm_head_wgrad="accumulate", checkpoint_device_layers=0, runtime=None):
    """Build both models, run one step, assert parity; returns the relative errors."""
    ref = hf_model(name)
    S = S or 4 * world * num_chunks
    ids, labels = tokens(ref.config.vocab_size, B, S, ignore=ignore)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model = fpdt_from_hf(ref, num_chunks=num_chunks, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks,
                         offload=offload, checkpointing=checkpointing, lm_head_wgrad=lm_head_wgrad,
                         checkpoint_device_layers=checkpoint_device_layers, runtime=runtime)
    inputs = fm.prepare_inputs(ids, labels=labels, sp_size=world, rank=rank, num_chunks=num_chunks)
    loss = model(**inputs)
    if checkpointing == "offload":   # the first layers' inputs on the host, the last ones' on the device
        assert len(model._stash._host) == ref.config.num_hidden_layers - checkpoint_device_layers
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)  # the convention: gradients summed over SP ranks = reference gradient
    what = (f"{name} rank {rank}/{world} u={num_chunks} mlp={mlp_chunks} loss={loss_chunks} "
            f"offload={offload} ckpt={checkpointing} wgrad={lm_head_wgrad} device_layers={checkpoint_device_layers}")
    return compare(loss, grads, ref_loss, ref_grads, what)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied", "llama_bias", "mistral"])
@pytest.mark.parametrize("checkpointing", ["off", "on", "offload"])
def test_single_rank(name, checkpointing):
    for num_chunks, mlp_chunks, loss_chunks, offload in CHUNKINGS:
        run_case(name, 0, 1, num_chunks=num_chunks, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks,
                 offload=offload, checkpointing=checkpointing)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied"])
def test_single_rank_lm_head_wgrad_recompute(name):
    """The recomputed LM-head weight gradient (tied and untied heads) across chunkings."""
    for num_chunks, mlp_chunks, loss_chunks, offload in CHUNKINGS:
        if loss_chunks != 0:   # 0 = the plain full-logits loss, which has no weight-gradient mode
            run_case(name, 0, 1, num_chunks=num_chunks, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks,
                     offload=offload, checkpointing="offload", lm_head_wgrad="recompute")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied"])
def test_single_rank_checkpoint_device_layers(name):
    """Offloaded checkpointing with the last layers' inputs kept on the device (1 layer, and
    all of them): the same loss and gradients, across chunkings."""
    layers = hf_model(name).config.num_hidden_layers
    for device_layers in sorted({1, layers}):
        for num_chunks, mlp_chunks, loss_chunks, offload in CHUNKINGS[:2]:
            run_case(name, 0, 1, num_chunks=num_chunks, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks,
                     offload=offload, checkpointing="offload", checkpoint_device_layers=device_layers)


def test_checkpoint_device_layers_needs_offload():
    with pytest.raises(ValueError, match="checkpoint_device_layers=1 .* needs checkpointing='offload'"):
        fpdt_from_hf(hf_model("llama_gqa"), checkpointing="on", checkpoint_device_layers=1)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        fpdt_from_hf(hf_model("llama_gqa"), checkpointing="offload", checkpoint_device_layers=-1)
    layers = hf_model("llama_gqa").config.num_hidden_layers
    with pytest.raises(ValueError, match=f"checkpoint_device_layers={layers + 1} is more than the model's {layers}"):
        fpdt_from_hf(hf_model("llama_gqa"), checkpointing="offload", checkpoint_device_layers=layers + 1)


def _multi_rank(rank, world, cases, weighted_mean_check=False):
    if weighted_mean_check:
        _all_ignored_on_one_rank(rank, world)
    for name, num_chunks, mlp_chunks, loss_chunks, offload, checkpointing, *extra in cases:
        run_case(name, rank, world, num_chunks=num_chunks, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks,
                 offload=offload, checkpointing=checkpointing, lm_head_wgrad=(extra or ["accumulate"])[0],
                 checkpoint_device_layers=(extra[1:] or [0])[0])


@pytest.mark.slow
def test_two_ranks():
    cases = [("llama_gqa", 1, None, None, False, "off"),
             ("llama_gqa", 2, 3, 5, True, "offload"),
             ("qwen2_tied", 2, None, 0, False, "on"),
             ("llama_bias", 4, 0, 3, True, "offload"),
             ("mistral", 1, 2, None, False, "on"),
             ("qwen2_tied", 2, None, 3, True, "offload", "recompute"),
             ("llama_gqa", 2, 3, 5, True, "offload", "accumulate", 1),
             ("llama_bias", 2, 3, 5, True, "off")]     # o_proj reads its input back from the stash
    run_distributed(_multi_rank, 2, args=(cases, True), timeout=240)


@pytest.mark.slow
def test_four_ranks():
    cases = [("llama_sp4", 1, None, None, False, "off"),
             ("llama_sp4", 2, 3, 5, True, "offload"),
             ("qwen2_tied", 1, 2, 0, False, "on")]
    run_distributed(_multi_rank, 4, args=(cases,), timeout=240)


def _all_ignored_on_one_rank(rank, world):
    """Rank 1's tokens all have label -100 (run inside test_two_ranks)."""
    # Rank 1's tokens all have label -100: the token-weighted global mean must ignore them,
    # not average per-rank means.
    ref = hf_model("llama_gqa")
    ids, labels = tokens(256, 1, 16, ignore=False)
    u = 2
    target = global_token_index(16, world, u, 1) + 1  # +1: prepare_inputs shifts labels left
    labels[0, target[target < 16]] = -100
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model = fpdt_from_hf(ref, num_chunks=u, checkpointing="on")
    inputs = model.prepare_inputs(ids, labels=labels)  # rank and size from the default group
    if rank == 1:
        assert (inputs["labels"] == -100).all()
    loss = model(**inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    compare(loss, grads, ref_loss, ref_grads, f"rank {rank}: all labels ignored on rank 1")



def test_bf16_no_worse_than_transformers_bf16():
    """bf16 end to end against float64, with Transformers' own bf16 error as the yardstick
    (:func:`tests.model.helpers.compare_bf16`; RoPE stays fp32 here)."""
    ref = hf_model("llama_gqa").to(torch.bfloat16)
    ids, labels = tokens(256, 2, 32)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    exact_loss, exact_grads = hf_loss_and_grads(hf_model("llama_gqa").to(torch.float64), ids, labels)
    model = fpdt_from_hf(ref, num_chunks=2, offload=True, checkpointing="offload")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    loss = model(**model.prepare_inputs(ids, labels=labels))
    loss.backward()
    assert loss.dtype == torch.float32
    compare_bf16(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads, exact_loss, exact_grads,
                 "bf16")


@pytest.mark.slow
def test_checkpoint_offload_moves_every_layer_input_to_host():
    ref = hf_model("llama_gqa")
    model = fpdt_from_hf(ref, num_chunks=2, checkpointing="offload")
    ids, labels = tokens(256, 1, 16)
    loss = model(**model.prepare_inputs(ids, labels=labels))
    stash = model._stash
    assert len(stash._host) == ref.config.num_hidden_layers  # one input per decoder layer
    loss.backward()
    assert len(stash._host) == 0 and not stash._inflight
    with torch.no_grad():  # no backward coming: nothing is stashed
        model(**model.prepare_inputs(ids, labels=labels))
    assert len(stash._host) == 0

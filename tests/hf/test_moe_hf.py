"""fpdt.hf.apply_fpdt on Transformers' Qwen3MoeForCausalLM: loss with the balancing loss and every
gradient against Transformers (fp32, 1e-5) on 1 and 2 ranks, with and without layer checkpoints."""

import copy

import pytest
import torch.distributed as dist

import fpdt.hf
from fpdt.model.moe import ChunkedMoE
from tests.distributed import run_distributed
from tests.model.helpers import compare, hf_loss_and_grads, tokens
from tests.model.test_moe_model import hf_moe


def run_case(rank, world, *, num_chunks=2, mlp_chunks=None, checkpointing="off", offload=False, **overrides):
    ref = hf_moe(**overrides)
    model = copy.deepcopy(ref)
    ids, labels = tokens(ref.config.vocab_size, 2, 16 * world)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    fpdt.hf.apply_fpdt(model, num_chunks=num_chunks, mlp_chunks=mlp_chunks, checkpointing=checkpointing,
                       offload=offload)
    model.train()
    assert [type(layer.mlp) is ChunkedMoE for layer in model.model.layers] == [True, False, True]
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    compare(loss, grads, ref_loss, ref_grads, f"hf qwen3_moe rank {rank}/{world} ckpt={checkpointing} {overrides}")
    return model


@pytest.mark.parametrize("checkpointing,mlp_chunks", [("off", None), ("on", 3)])
def test_single_process_matches_transformers(checkpointing, mlp_chunks):
    model = run_case(0, 1, checkpointing=checkpointing, mlp_chunks=mlp_chunks)
    assert sorted(model.router_stats.expert_load()) == [0, 2]
    fpdt.hf.remove_fpdt(model)
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"


def test_without_router_logits():
    run_case(0, 1, output_router_logits=False)


def test_refusals():
    with pytest.raises(fpdt.hf.FPDTHFError, match="run chunked only"):
        fpdt.hf.apply_fpdt(hf_moe().train(), num_chunks=2, mlp_chunks=0)
    model = hf_moe().train()
    fpdt.hf.apply_fpdt(model, num_chunks=2)
    model.gradient_checkpointing_enable()
    ids, labels = tokens(256, 1, 8)
    with pytest.raises(fpdt.hf.FPDTHFError, match="record the experts' statistics twice"):
        model(**fpdt.hf.prepare_inputs(model, ids, labels=labels))


def _two_ranks(rank, world):
    run_case(rank, world)
    run_case(rank, world, checkpointing="offload", offload=True, mlp_chunks=3)


@pytest.mark.slow
def test_two_ranks():
    run_distributed(_two_ranks, 2, timeout=240)

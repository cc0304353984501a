"""fpdt.hf.apply_fpdt on Transformers' Qwen3MoeForCausalLM: loss with the balancing loss and every
gradient against Transformers (fp32, 1e-5) on 1 and 2 ranks, with and without layer checkpoints."""

import copy

import pytest
import torch
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


def _peft_moe_case(rank, world, *, num_chunks=2, checkpointing="off", offload=False, peft_first=True, router=False):
    """PEFT LoRA on the attention (target_modules) and on the fused experts (target_parameters,
    ``experts.gate_up_proj`` and ``experts.down_proj``), the dense layer's MLP too, with ``router`` on
    the routers (``mlp.gate``, which PEFT adapts as a parameter): loss with the balancing loss and every
    adapter gradient against the PEFT model run by Transformers (fp32, 1e-5); PEFT applied before
    apply_fpdt or after."""
    import peft

    ref = hf_moe()
    config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]
                             + (["mlp.gate"] if router else []),
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    torch.manual_seed(4)
    ref = peft.get_peft_model(ref, config)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    model = copy.deepcopy(ref)
    ids, labels = tokens(256, 2, 16 * world)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    assert any("experts.lora_A" in n for n in ref_grads) and any("experts.base_layer.lora_B" in n for n in ref_grads)
    assert any(".mlp.gate.lora_A" in n for n in ref_grads) == router
    target = model.base_model.model
    if not peft_first:       # the same adapters put into the apply_fpdt'd model's modules
        target = hf_moe()
        fpdt.hf.apply_fpdt(target, num_chunks=num_chunks, checkpointing=checkpointing, offload=offload,
                           runtime="sim", group=dist.group.WORLD if world > 1 else None)
        torch.manual_seed(4)
        model = peft.get_peft_model(target, config)
        model.load_state_dict(ref.state_dict())
    else:
        fpdt.hf.apply_fpdt(model, num_chunks=num_chunks, checkpointing=checkpointing, offload=offload, runtime="sim",
                           group=dist.group.WORLD if world > 1 else None)
    assert type(model.base_model.model.model.layers[0].mlp) is ChunkedMoE
    model.train()
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    compare(loss, grads, ref_loss, ref_grads, f"hf qwen3_moe PEFT rank {rank}/{world} ckpt={checkpointing} "
                                              f"peft_first={peft_first}")


@pytest.mark.parametrize("checkpointing,peft_first", [("off", True), ("on", False)])
def test_peft_lora_on_attention_and_experts(checkpointing, peft_first):
    _peft_moe_case(0, 1, checkpointing=checkpointing, peft_first=peft_first)


def _peft_two_ranks(rank, world):
    _peft_moe_case(rank, world, checkpointing="offload", offload=True, num_chunks=1)


@pytest.mark.slow
def test_peft_lora_two_ranks():
    run_distributed(_peft_two_ranks, 2, timeout=300)


@pytest.mark.parametrize("peft_first", [True, False])
def test_peft_lora_on_the_router(peft_first):
    """The router's adapter (PEFT's ParamWrapper around ``mlp.gate``) read as its weight plus the
    delta: its gradients, the balancing loss's share included, as PEFT's."""
    _peft_moe_case(0, 1, checkpointing="on", router=True, peft_first=peft_first)

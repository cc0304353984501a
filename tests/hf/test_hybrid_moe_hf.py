"""fpdt.hf.apply_fpdt on Transformers' Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM: their Gated
DeltaNet modules (Qwen3-Next's fused projections) swapped for fpdt's, their experts for fpdt's chunked
ones with the shared expert; loss with the balancing loss and every gradient against plain
Transformers (fp32 vs a float64 run, ``tests/model/qwen35.py``) on plain windows, packed documents and
layer checkpoints; 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fpdt.hf
from fpdt.hf.gated_deltanet import TransformersFusedGatedDeltaNet, TransformersGatedDeltaNet
from fpdt.model.llama import RMSNorm
from fpdt.model.moe import ChunkedMoE
from tests.distributed import run_distributed
from tests.model.helpers import tokens
from tests.model.hybrid_moe import hybrid_moe_model
from tests.model.qwen35 import compare_hybrid, reference

ROWS = ([5, 1, 13, 1, 1, 20, 7], [16, 16, 16])


def run_case(name, rank, world, *, num_chunks, offload=False, checkpointing="off", rows=None):
    ref = hybrid_moe_model(name)
    if rows is None:
        ids, labels = tokens(ref.config.vocab_size, 2, 4 * world * num_chunks)
        pos = None
    else:
        ids, labels = tokens(ref.config.vocab_size, len(rows), sum(rows[0]), seed=5)
        pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    model = copy.deepcopy(ref).train()
    refs = reference(ref, ids, labels, rows)
    runtime = "sim" if offload or checkpointing == "offload" else None
    fpdt.hf.apply_fpdt(model, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing, runtime=runtime,
                       group=dist.group.WORLD if world > 1 else None)
    layers = model.model.layers
    gdn = TransformersFusedGatedDeltaNet if name.startswith("qwen3next") else TransformersGatedDeltaNet
    assert all(type(layer.linear_attn) is gdn for layer in layers if getattr(layer, "self_attn", None) is None)
    assert all(isinstance(layer.mlp, ChunkedMoE) for layer in layers if hasattr(layer.mlp, "experts"))
    assert isinstance(layers[0].input_layernorm, RMSNorm) and layers[0].input_layernorm.zero_centred
    out = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels, position_ids=pos))
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"hf {name} rank {rank}/{world} u={num_chunks} offload={offload} ckpt={checkpointing} rows={rows}"
    compare_hybrid(out.loss, grads, refs, what)
    return model


@pytest.mark.parametrize("name", ["qwen35moe_odd", "qwen3next_odd"])
@pytest.mark.parametrize("num_chunks,offload,checkpointing", [(1, False, "off"), (2, True, "offload")])
def test_single_process_matches_transformers(name, num_chunks, offload, checkpointing):
    model = run_case(name, 0, 1, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing)
    fpdt.hf.remove_fpdt(model)
    assert type(model.model.layers[0].mlp).__name__.endswith("SparseMoeBlock")
    assert type(model.model.layers[0].linear_attn).__name__.endswith("GatedDeltaNet")
    assert not isinstance(model.model.layers[0].linear_attn, TransformersGatedDeltaNet)


@pytest.mark.parametrize("name", ["qwen35moe_odd", pytest.param("qwen3next_odd", marks=pytest.mark.slow)])
def test_packed_documents(name):
    run_case(name, 0, 1, num_chunks=3, checkpointing="on", rows=ROWS)


def _two_ranks(rank, world):
    for name in ("qwen35moe_sp2", "qwen3next_sp2"):
        run_case(name, rank, world, num_chunks=2, offload=True, checkpointing="offload")
        run_case(name, rank, world, num_chunks=1, checkpointing="on", rows=ROWS)


@pytest.mark.slow
def test_two_ranks():
    run_distributed(_two_ranks, 2, timeout=600)


@pytest.mark.parametrize("stream", [False, True])
def test_peft_lora_on_shared_expert_and_router(stream):
    """Qwen3.5-MoE under apply_fpdt with PEFT's LoRA on the shared expert's projections and sigmoid
    gate, the routers (``target_parameters``: ``mlp.gate.weight``) and a Gated DeltaNet and an attention
    projection, 2 chunks with offloaded layer checkpoints, or streamed: the loss and every adapter
    gradient against the PEFT model (float64 reference, ``tests/model/qwen35.py``'s criterion: 1e-5, or
    twice PEFT's own fp32 error)."""
    peft = pytest.importorskip("peft")
    from tests.model.test_lora_hybrid import peft_references
    targets = ["q_proj", "in_proj_qkv", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
               "shared_expert_gate"]
    torch.manual_seed(3)
    ref = peft.get_peft_model(hybrid_moe_model("qwen35moe_odd"), peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=targets, target_parameters=["mlp.gate.weight"]))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    model = copy.deepcopy(ref).train()
    ids, labels = tokens(ref.config.vocab_size, 2, 16)
    refs = peft_references(ref, ids, labels)
    fpdt.hf.apply_fpdt(model, num_chunks=2, offload=True, checkpointing="offload", runtime="sim", stream_layers=stream)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for part in ("shared_expert.gate_proj", "shared_expert.down_proj", "shared_expert_gate", "mlp.gate"):
        assert any(f".{part}.lora_B" in n for n in grads), part
    compare_hybrid(loss, grads, refs, f"hf qwen35moe PEFT LoRA on the shared expert and router, stream={stream}")

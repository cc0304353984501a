"""Mixtral (Llama attention, experts in every layer, softmax top-k renormalised, no shared expert)
through fpdt.model and fpdt.hf.apply_fpdt: the loss with the balancing loss and every gradient
against Transformers' ``MixtralForCausalLM`` in fp32 (1e-5), 1 and 2 ranks; the hub's checkpoint
names in and out; what is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
import transformers

import fpdt.hf
import fpdt.model as fm
from fpdt.model.config import ModelConfig, UnsupportedConfigError
from fpdt.model.moe import ChunkedMoE
from tests.distributed import run_distributed
from tests.model.helpers import compare, hf_loss_and_grads, tokens
from tests.model.hybrid_moe import mixtral_model


def run_case(rank, world, *, name="mixtral", num_chunks=1, mlp_chunks=None, checkpointing="off", offload=False,
             attention_checkpoint="recompute", **overrides):
    ref = mixtral_model(name, **overrides)
    ids, labels = tokens(ref.config.vocab_size, 2, 4 * world * num_chunks)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    runtime = "sim" if offload or checkpointing == "offload" else None
    model = fm.from_config(ref.config, num_chunks=num_chunks, mlp_chunks=mlp_chunks, checkpointing=checkpointing,
                           offload=offload, attention_checkpoint=attention_checkpoint, runtime=runtime,
                           group=dist.group.WORLD if world > 1 else None)
    fm.load_hf_state_dict(model, ref.state_dict())
    loss = model(**model.prepare_inputs(ids, labels=labels))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    compare(loss, grads, ref_loss, ref_grads, f"{name} rank {rank}/{world} u={num_chunks} ckpt={checkpointing} {overrides}")
    return model


@pytest.mark.parametrize("num_chunks,mlp_chunks,checkpointing", [(1, None, "off"), (3, 2, "offload")])
def test_single_rank(num_chunks, mlp_chunks, checkpointing):
    model = run_case(0, 1, num_chunks=num_chunks, mlp_chunks=mlp_chunks, checkpointing=checkpointing,
                     offload=checkpointing == "offload",
                     attention_checkpoint="save" if checkpointing == "offload" else "recompute")
    assert all(isinstance(layer.mlp, ChunkedMoE) and not hasattr(layer.mlp, "shared_expert")
               for layer in model.model.layers)
    load = model.router_stats.expert_load()
    assert sorted(load) == [0, 1] and all(v["mean"] == pytest.approx(2 * 4 * num_chunks * 2 / 5) for v in load.values())


def test_without_router_logits():
    run_case(0, 1, num_chunks=2, output_router_logits=False)


def _two_ranks(rank, world):
    run_case(rank, world, name="mixtral_sp2", num_chunks=2)
    run_case(rank, world, name="mixtral_sp2", num_chunks=2, mlp_chunks=3, checkpointing="offload", offload=True)
    _hf_case(rank, world, name="mixtral_sp2", checkpointing="on")


@pytest.mark.slow
def test_two_ranks():
    run_distributed(_two_ranks, 2, timeout=300)


def _hf_case(rank, world, *, name="mixtral", checkpointing="off", **overrides):
    ref = mixtral_model(name, **overrides)
    model = copy.deepcopy(ref).train()
    ids, labels = tokens(ref.config.vocab_size, 2, 8 * world)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    fpdt.hf.apply_fpdt(model, num_chunks=2, checkpointing=checkpointing,
                       group=dist.group.WORLD if world > 1 else None)
    assert all(isinstance(layer.mlp, ChunkedMoE) for layer in model.model.layers)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    compare(loss, grads, ref_loss, ref_grads, f"hf {name} rank {rank}/{world} ckpt={checkpointing}")
    return model


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_apply_fpdt_matches_transformers(checkpointing):
    model = _hf_case(0, 1, checkpointing=checkpointing)
    assert sorted(model.router_stats.expert_load()) == [0, 1]
    fpdt.hf.remove_fpdt(model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_checkpoint_round_trip(tmp_path):
    """fpdt saves the hub's names (``block_sparse_moe``, ``experts.{e}.w1/w2/w3``); Transformers
    loads them as MixtralForCausalLM, and fpdt loads them and Transformers' own save back."""
    ref = mixtral_model()
    model = fm.from_config(ref.config)
    fm.load_hf_state_dict(model, ref.state_dict())
    model.save_pretrained(tmp_path / "ours", max_shard_size=30_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.layers.1.block_sparse_moe.experts.4.w3.weight", "model.layers.0.block_sparse_moe.gate.weight"} \
        <= set(index) and not any(".mlp." in n for n in index)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == "MixtralForCausalLM"
    theirs = back.state_dict()
    for n, p in ref.state_dict().items():
        assert torch.equal(theirs[n], p), n
    back.save_pretrained(tmp_path / "hf")
    for src in (tmp_path / "ours", tmp_path / "hf"):
        again = fm.from_pretrained(src)
        for n, p in model.state_dict().items():
            assert torch.equal(again.state_dict()[n], p), (src, n)


def test_refusals():
    cfg = mixtral_model().config.to_dict()
    with pytest.raises(UnsupportedConfigError, match="router_jitter_noise=0.1"):
        ModelConfig.from_hf({**cfg, "router_jitter_noise": 0.1})
    with pytest.raises(UnsupportedConfigError, match="sliding-window"):
        ModelConfig.from_hf({**cfg, "sliding_window": 4096})
    with pytest.raises(fpdt.hf.FPDTHFError, match="router_jitter_noise"):
        fpdt.hf.apply_fpdt(mixtral_model(router_jitter_noise=0.1).train(), num_chunks=2)

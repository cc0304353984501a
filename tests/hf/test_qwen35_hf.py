"""fpdt.hf.apply_fpdt on Transformers' Qwen3_5ForCausalLM: its Gated DeltaNet modules swapped for fpdt's
(holding their parameters), its attention for fpdt's gated one, its zero-centred norms for fpdt's; loss
and every gradient against plain Transformers (fp32 vs a float64 run, ``tests/model/qwen35.py``), on
plain windows, packed documents, layer checkpoints, 1, 2 and 4 ranks; what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fpdt.hf
from fpdt.hf.errors import FPDTHFError
from fpdt.hf.gated_deltanet import TransformersGatedDeltaNet
from fpdt.model.llama import RMSNorm
from tests.distributed import run_distributed
from tests.model.helpers import tokens
from tests.model.qwen35 import compare_hybrid, qwen35_model, reference

ROWS = ([5, 1, 13, 1, 1, 20, 7], [16, 16, 16])


def run_case(name, rank, world, *, num_chunks, offload=False, checkpointing="off", rows=None,
             attention_checkpoint="recompute"):
    ref = qwen35_model(name)
    if rows is None:
        S = 4 * world * num_chunks * (1 + 3 // (world * num_chunks))
        ids, labels = tokens(ref.config.vocab_size, 2, S)
        pos = None
    else:
        S = sum(rows[0])
        ids, labels = tokens(ref.config.vocab_size, len(rows), S, seed=5)
        pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    model = copy.deepcopy(ref).train()
    refs = reference(ref, ids, labels, rows)
    runtime = "sim" if offload or checkpointing == "offload" else None
    fpdt.hf.apply_fpdt(model, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing, runtime=runtime,
                       attention_checkpoint=attention_checkpoint,
                       group=dist.group.WORLD if world > 1 else None)
    layers = model.model.layers
    assert all(isinstance(layer.linear_attn, TransformersGatedDeltaNet) for layer in layers
               if getattr(layer, "self_attn", None) is None)
    assert isinstance(layers[0].input_layernorm, RMSNorm) and layers[0].input_layernorm.zero_centred
    out = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels, position_ids=pos))
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"hf {name} rank {rank}/{world} u={num_chunks} offload={offload} ckpt={checkpointing} rows={rows}"
    return compare_hybrid(out.loss, grads, refs, what)


@pytest.mark.parametrize("num_chunks,offload,checkpointing", [(1, False, "off"), (2, True, "off"),
                                                              (2, False, "on"), (3, True, "offload")])
def test_single_process_matches_transformers(num_chunks, offload, checkpointing):
    run_case("qwen35", 0, 1, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing)


def test_packed_documents_and_saved_attention():
    run_case("qwen35", 0, 1, num_chunks=3, checkpointing="on", rows=ROWS)
    run_case("qwen35", 0, 1, num_chunks=2, offload=True, checkpointing="offload", attention_checkpoint="save")


def _multi_rank(rank, world, cases):
    for name, kwargs in cases:
        run_case(name, rank, world, **kwargs)


@pytest.mark.slow
def test_two_and_four_ranks():
    run_distributed(_multi_rank, 2, args=([("qwen35", dict(num_chunks=2, offload=True, checkpointing="offload")),
                                           ("qwen35", dict(num_chunks=1, checkpointing="on", rows=ROWS))],),
                    timeout=600)
    run_distributed(_multi_rank, 4, args=([("qwen35_sp4", dict(num_chunks=1, checkpointing="on")),
                                           ("qwen35_sp4", dict(num_chunks=1, rows=ROWS[1:]))],), timeout=600)


def test_refused():
    model = qwen35_model()
    fpdt.hf.apply_fpdt(model, num_chunks=1)
    with pytest.raises(FPDTHFError, match="no recurrent cache"):
        model.model.layers[0].linear_attn(torch.zeros(1, 4, 64), cache=object())


def test_peft_lora_on_attention_and_mlp():
    """PEFT LoRA on the attention and MLP projections (the Gated DeltaNet layers frozen, their input
    frozen too: layer 0's mixer branch has nothing to back-propagate under the layer checkpoint): the
    adapters' gradients and the loss against the PEFT model run by Transformers."""
    import peft

    from tests.model.qwen35 import float64_delta_rule
    from tests.model.helpers import rel_err

    lora = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    torch.manual_seed(1)
    model = peft.get_peft_model(qwen35_model(), lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    ids, labels = tokens(256, 2, 16)
    results = []
    for dtype in (torch.float32, torch.float64):
        plain = copy.deepcopy(model).to(dtype)
        with float64_delta_rule():
            loss = plain(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}))
    fpdt.hf.apply_fpdt(model, num_chunks=2, checkpointing="on")
    out = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n for n in grads)
    errs = compare_hybrid(out.loss, grads, results, "hf qwen35 PEFT LoRA")
    assert max(e for e, _ in errs.values()) <= 1e-5, errs
    assert rel_err(out.loss, results[1][0]) <= 1e-5


def _peft_gdn_case(rank, world, num_chunks, checkpointing, peft_first=True):
    """PEFT LoRA on every Gated DeltaNet projection and the gated attention's q/o, through apply_fpdt:
    the loss and adapter gradients (summed over the ranks) against PEFT run by Transformers
    (``tests/model/test_lora_hybrid.py`` says how they are judged)."""
    import peft

    from tests.model.helpers import TOL
    from tests.model.test_lora_hybrid import peft_references

    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                                "out_proj", "q_proj", "o_proj"])
    torch.manual_seed(2)
    model = peft.get_peft_model(qwen35_model(), config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    ids, labels = tokens(256, 2, 8 * world * num_chunks)
    refs = peft_references(model, ids, labels)
    options = dict(num_chunks=num_chunks, checkpointing=checkpointing, offload=checkpointing == "offload",
                   runtime="sim", group=dist.group.WORLD if world > 1 else None)
    if peft_first:
        fpdt.hf.apply_fpdt(model, **options)
    else:                  # PEFT puts its layers into fpdt's modules; the same adapter weights
        state = model.state_dict()
        model = peft.get_peft_model(fpdt.hf.apply_fpdt(qwen35_model(), **options), config)
        model.load_state_dict(state)
    assert isinstance(model.base_model.model.model.layers[0].linear_attn, TransformersGatedDeltaNet)
    out = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * (5 * 3 + 2) and all(".lora_" in n for n in grads)
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"hf qwen35 PEFT LoRA on GDN rank {rank}/{world} u={num_chunks} {checkpointing}"
    errs = compare_hybrid(out.loss, grads, refs, what)
    worst = max(((n, e) for n, e in errs.items() if ".in_proj_a." not in n), key=lambda kv: kv[1][0])
    assert worst[1][0] <= TOL, f"{what}: {worst}"


@pytest.mark.parametrize("num_chunks,checkpointing,peft_first", [(3, "offload", True), (2, "off", False)])
def test_peft_lora_on_gated_deltanet(num_chunks, checkpointing, peft_first):
    _peft_gdn_case(0, 1, num_chunks, checkpointing, peft_first)


@pytest.mark.slow
def test_peft_lora_on_gated_deltanet_two_ranks():
    run_distributed(_peft_gdn_case, 2, args=(2, "on"), timeout=600)

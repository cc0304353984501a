"""Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet + gated attention layers, experts with a shared expert)
through fpdt.model against Transformers: the loss with the balancing loss and every gradient, fp32
against a float64 Transformers run (``tests/model/qwen35.py``), on plain windows, packed documents,
layer checkpoints, 1 and 2 ranks; one decoder layer of each kind with random output gradients;
checkpoints out (Transformers loads them) and back, the hub's vision-language layout in."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import transformers

import fpdt.model as fm
from fpdt.model.gated_deltanet import FusedGatedDeltaNet, GatedDeltaNet
from fpdt.model.moe import ChunkedMoE
from tests.distributed import run_distributed
from tests.model.helpers import tokens
from tests.model.hybrid_moe import hybrid_moe_model
from tests.model.qwen35 import check_decoder_layer, compare_hybrid, reference

ROWS = ([5, 1, 13, 1, 1, 20, 7], [16, 16, 16], [2, 30, 9, 7])    # 48 tokens: across chunk and rank edges


def run_case(name, rank, world, *, num_chunks, offload=False, checkpointing="off", attention_checkpoint="recompute",
             rows=None, B=2, **changes):
    """One step of ``name`` on this rank; parity of the loss and of the SP-summed gradients."""
    ref = hybrid_moe_model(name, **changes)
    if rows is None:
        ids, labels = tokens(ref.config.vocab_size, B, 4 * world * num_chunks)
        pos = None
    else:
        ids, labels = tokens(ref.config.vocab_size, len(rows), sum(rows[0]), seed=5)
        pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    refs = reference(ref, ids, labels, rows)
    runtime = "sim" if offload or checkpointing == "offload" else None
    model = fm.from_config(ref.config, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing,
                           attention_checkpoint=attention_checkpoint, runtime=runtime,
                           group=dist.group.WORLD if world > 1 else None)
    fm.load_hf_state_dict(model, ref.state_dict())
    loss = model(**model.prepare_inputs(ids, labels=labels, position_ids=pos))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"{name} rank {rank}/{world} u={num_chunks} offload={offload} ckpt={checkpointing} rows={rows} {changes}"
    return model, compare_hybrid(loss, grads, refs, what)


def test_layers_follow_the_config():
    """Qwen3.5-MoE: experts with a shared expert in every layer; Qwen3-Next: its fused projections,
    a dense layer where ``mlp_only_layers`` says; the parameter names are Transformers'."""
    for name, gdn, mlps in (("qwen35moe_odd", GatedDeltaNet, [True] * 4),
                            ("qwen3next_odd", FusedGatedDeltaNet, [True, False, True, True])):
        ref = hybrid_moe_model(name)
        model = fm.from_config(ref.config)
        layers = model.model.layers
        assert [isinstance(layer.mlp, ChunkedMoE) for layer in layers] == mlps
        assert all(hasattr(layer.mlp, "shared_expert") for layer in layers if isinstance(layer.mlp, ChunkedMoE))
        assert type(layers[0].linear_attn) is gdn and layers[2].self_attn.output_gate
        assert set(dict(model.named_parameters())) == set(dict(ref.named_parameters()))


@pytest.mark.parametrize("name", ["qwen35moe_odd", "qwen3next_odd"])
@pytest.mark.parametrize("num_chunks,offload,checkpointing,attention_checkpoint",
                         [(1, False, "off", "recompute"), (3, True, "offload", "save")])
def test_single_rank(name, num_chunks, offload, checkpointing, attention_checkpoint):
    """fp32 against float64, the balancing loss (coefficient 0.3) included; the expert load."""
    model, _ = run_case(name, 0, 1, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing,
                        attention_checkpoint=attention_checkpoint)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, ChunkedMoE)]
    load = model.router_stats.expert_load()
    assert sorted(load) == moe_layers and all(v["mean"] == 2 * 4 * num_chunks * 3 / 6 for v in load.values())


@pytest.mark.slow
def test_checkpoints_on_and_without_router_logits():
    run_case("qwen35moe_odd", 0, 1, num_chunks=2, checkpointing="on", output_router_logits=False)
    run_case("qwen3next_odd", 0, 1, num_chunks=2, checkpointing="on", decoder_sparse_step=2, mlp_only_layers=[])


@pytest.mark.parametrize("name", ["qwen35moe_odd", pytest.param("qwen3next_odd", marks=pytest.mark.slow)])
def test_packed_documents_equal_each_alone(name):
    """Each document alone in Transformers (the balancing loss over all their tokens) = the packed window."""
    run_case(name, 0, 1, num_chunks=3, offload=True, checkpointing="offload", rows=ROWS)


def _two_ranks(rank, world):
    for name in ("qwen35moe_sp2", "qwen3next_sp2"):
        run_case(name, rank, world, num_chunks=1)
        run_case(name, rank, world, num_chunks=2, offload=True, checkpointing="offload", attention_checkpoint="save",
                 rows=ROWS)


@pytest.mark.slow
def test_two_ranks():
    """The Gated DeltaNet heads split over 2 ranks, the router statistics all-reduced: the global balancing loss."""
    run_distributed(_two_ranks, 2, timeout=600)


@pytest.mark.parametrize("name,layer", [("qwen3next_odd", 0), ("qwen35moe_odd", 2)])
def test_decoder_layer_random_output_gradient(name, layer):
    """One layer (0: fused Gated DeltaNet + experts; 2: gated attention + experts), u = 2 chunks
    with offload, against Transformers' decoder layer with a causal mask: output, input gradient and
    parameter gradients for a random output gradient, fp32 against float64."""
    ref_model = hybrid_moe_model(name)
    ours_model = fm.from_config(ref_model.config, num_chunks=2, offload=True, runtime="sim")
    fm.load_hf_state_dict(ours_model, ref_model.state_dict())
    check_decoder_layer(ref_model, ours_model, layer)


def _conditional(ref, path):
    """A Qwen3.5-MoE text model saved in the hub's vision-language layout (a tiny vision tower beside it)."""
    cfg = transformers.Qwen3_5MoeConfig(text_config=ref.config.to_dict(),
                                        tie_word_embeddings=ref.config.tie_word_embeddings,
                                        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                                                           out_hidden_size=ref.config.hidden_size))
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    model.model.language_model.load_state_dict(ref.model.state_dict())
    model.lm_head.load_state_dict(ref.lm_head.state_dict())
    model.save_pretrained(path)


@pytest.mark.parametrize("name,cls", [("qwen35moe_sp2", "Qwen3_5MoeForCausalLM"),
                                      ("qwen3next_odd", "Qwen3NextForCausalLM")])
def test_checkpoint_round_trip(name, cls, tmp_path):
    """fpdt saves what Transformers loads as the causal LM (the same tensors), and loads it and
    Transformers' own save back; Qwen3.5-MoE also from the hub's Qwen3_5MoeForConditionalGeneration layout."""
    ref = hybrid_moe_model(name)
    model = fm.from_config(ref.config)
    fm.load_hf_state_dict(model, ref.state_dict())
    model.save_pretrained(tmp_path / "ours", max_shard_size=60_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == cls
    theirs = back.state_dict()
    for n, p in ref.state_dict().items():
        assert torch.equal(theirs[n], p), n
    back.save_pretrained(tmp_path / "hf")
    sources = [tmp_path / "ours", tmp_path / "hf"]
    if cls == "Qwen3_5MoeForCausalLM":
        _conditional(ref, tmp_path / "vl")
        sources.append(tmp_path / "vl")
    for src in sources:
        again = fm.from_pretrained(src)
        for n, p in model.state_dict().items():
            assert torch.equal(again.state_dict()[n], p), (src, n)

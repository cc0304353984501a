"""Qwen3-MoE through ``fpdt.model``: loss (with the balancing loss) and every gradient against
Transformers' ``Qwen3MoeForCausalLM`` in fp32; weights in and out."""

import json

import pytest
import torch
import torch.distributed as dist
import transformers

import fpdt.model as fm
from fpdt.model.moe import ChunkedMoE
from tests.distributed import run_distributed
from tests.model.helpers import compare, hf_loss_and_grads, tokens

# GQA 4/2, head_dim 12 with q/k norms, E=8 k=2 with odd expert width 13, layer 1 dense (mlp_only_layers).
MOE = dict(vocab_size=256, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=12, max_position_embeddings=512, moe_intermediate_size=13, num_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], output_router_logits=True,
           router_aux_loss_coef=0.3, initializer_range=0.05, attn_implementation="eager")


def hf_moe(seed: int = 0, **overrides):
    cfg = transformers.Qwen3MoeConfig(**{**MOE, **overrides})
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("gate.weight"):          # routers spread enough that top-k is not a near tie
                p.normal_(0.0, 0.5)
    return model


def run_case(rank, world, *, num_chunks=1, mlp_chunks=None, checkpointing="off", offload=False,
             attention_checkpoint="recompute", B=2, **overrides):
    ref = hf_moe(**overrides)
    ids, labels = tokens(ref.config.vocab_size, B, 4 * world * num_chunks)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model = fm.from_config(ref.config, num_chunks=num_chunks, mlp_chunks=mlp_chunks, checkpointing=checkpointing,
                           offload=offload, attention_checkpoint=attention_checkpoint)
    fm.load_hf_state_dict(model, ref.state_dict())
    inputs = fm.prepare_inputs(ids, labels=labels, sp_size=world, rank=rank, num_chunks=num_chunks)
    loss = model(**inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"qwen3_moe rank {rank}/{world} u={num_chunks} mlp={mlp_chunks} ckpt={checkpointing} {overrides}"
    errs = compare(loss, grads, ref_loss, ref_grads, what)
    return model, errs


def test_layers_follow_the_config():
    model = fm.from_config(hf_moe().config)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["ChunkedMoE", "ChunkedSwiGLU", "ChunkedMoE"]
    assert model.model.layers[0].self_attn.q_norm is not None
    assert [m.layer_index for m in model.modules() if isinstance(m, ChunkedMoE)] == [0, 2]


@pytest.mark.parametrize("num_chunks,mlp_chunks", [(1, None), (2, 3), (4, 1)])
def test_single_rank(num_chunks, mlp_chunks):
    """fp32 within 1e-5, the balancing loss (coefficient 0.3) included; the metrics' expert load."""
    model, _ = run_case(0, 1, num_chunks=num_chunks, mlp_chunks=mlp_chunks)
    load = model.router_stats.expert_load()
    assert sorted(load) == [0, 2] and all(v["mean"] == 2 * 4 * num_chunks * 2 / 8 for v in load.values())


def test_without_router_logits_and_sparse_step():
    """``output_router_logits`` off (no balancing loss), and ``decoder_sparse_step`` 2 (layer 1 routes)."""
    run_case(0, 1, num_chunks=2, output_router_logits=False)
    model, _ = run_case(0, 1, num_chunks=2, mlp_only_layers=[], decoder_sparse_step=2)
    assert sorted(model.router_stats.expert_load()) == [1]


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing,attention_checkpoint", [("on", "recompute"), ("offload", "save")])
def test_checkpointing(checkpointing, attention_checkpoint):
    """Layer checkpoints recompute the MoE MLP without recording its statistics twice."""
    run_case(0, 1, num_chunks=2, mlp_chunks=3, checkpointing=checkpointing, offload=True,
             attention_checkpoint=attention_checkpoint)


def _two_ranks(rank, world):
    run_case(rank, world, num_chunks=1)
    run_case(rank, world, num_chunks=2, mlp_chunks=3, checkpointing="offload", offload=True,
             attention_checkpoint="save")


@pytest.mark.slow
def test_two_ranks():
    """The statistics all-reduced over the SP group: the global balancing loss on every rank."""
    run_distributed(_two_ranks, 2, timeout=240)


def test_checkpoint_round_trip(tmp_path):
    """fpdt saves the hub's per-expert layout; Transformers loads it as Qwen3MoeForCausalLM, and
    fpdt loads it back (and Transformers' own save)."""
    ref = hf_moe()
    model = fm.from_config(ref.config)
    fm.load_hf_state_dict(model, ref.state_dict())
    model.save_pretrained(tmp_path / "ours", max_shard_size=40_000)     # experts split across shards
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in index and "model.layers.0.mlp.experts.down_proj" not in index
    assert len({index[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(8)}) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    theirs = back.state_dict()
    for n, p in ref.state_dict().items():
        assert torch.equal(theirs[n], p), n
    again = fm.from_pretrained(tmp_path / "ours")
    for n, p in model.state_dict().items():
        assert torch.equal(again.state_dict()[n], p), n
    back.save_pretrained(tmp_path / "hf")
    third = fm.from_pretrained(tmp_path / "hf")
    for n, p in model.state_dict().items():
        assert torch.equal(third.state_dict()[n], p), n



@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_lora_against_peft(checkpointing):
    """LoRA on the attention: loss with the balancing loss (its gradient reaches the adapters through
    the hidden states) and adapter gradients vs PEFT."""
    peft = pytest.importorskip("peft")
    from fpdt.model.lora import PEFT_PREFIX, LoraSpec
    spec = LoraSpec(4, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    torch.manual_seed(3)
    ref = peft.get_peft_model(hf_moe(), peft.LoraConfig(r=4, lora_alpha=spec.lora_alpha,
                                                         target_modules=list(spec.targets), init_lora_weights=False))
    ours = fm.from_config(ref.config, num_chunks=2, mlp_chunks=3, checkpointing=checkpointing)
    fm.load_hf_state_dict(ours, hf_moe().state_dict())
    fm.add_lora(ours, spec)
    params = dict(ref.named_parameters())

    def peft_name(n):
        head, kind = n.rpartition(".lora_")[0], n.rpartition(".lora_")[2].split(".")[0]
        return f"{PEFT_PREFIX}{head}.lora_{kind}.default.weight"
    with torch.no_grad():
        for n, p in fm.adapter_state_dict(ours).items():
            p.copy_(params[peft_name(n)])
    ids, labels = tokens(ref.config.vocab_size, 2, 16)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    loss = ours(**ours.prepare_inputs(ids, labels=labels))
    loss.backward()
    grads = {peft_name(n): p.grad for n, p in fm.adapter_state_dict(ours).items()}
    assert len(grads) == 3 * 4 * 2
    compare(loss, grads, ref_loss.detach(), ref_grads, f"qwen3_moe LoRA ckpt={checkpointing}")


def test_hf_peft_mlp_targets_reach_the_experts():
    """PEFT 0.21 maps target_modules gate_proj/up_proj/down_proj onto the fused experts (ParamWrapper on
    ``experts.gate_up_proj`` and ``experts.down_proj``): read with their deltas, loss and every adapter
    gradient as PEFT's own forward gives them (fp32, 1e-5)."""
    import copy

    peft = pytest.importorskip("peft")
    import fpdt.hf
    torch.manual_seed(6)
    ref = peft.get_peft_model(hf_moe(), peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "up_proj",
                                                                              "down_proj"]))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    model = copy.deepcopy(ref)
    fpdt.hf.apply_fpdt(model, num_chunks=2)
    ids, labels = tokens(256, 2, 8)
    results = []
    for m, inputs in ((ref, dict(input_ids=ids, labels=labels)), (model, fpdt.hf.prepare_inputs(model, ids, labels=labels))):
        loss = m(**inputs).loss
        loss.backward()
        results.append((loss, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert any("experts.base_layer.lora_A" in n for n in results[1][1])
    compare(*results[1], *results[0], "hf qwen3_moe PEFT gate/up/down on the experts")


"""``fpdt-plan --lora-rank``: LoRA fine-tuning (``fpdt.hf`` with PEFT) planned like full training,
with the frozen base's model states, no weight-gradient GEMMs and the same activations."""

import json

import pytest
import torch

from fpdt.plan import GPU_PRESETS, Choice, Cluster, load_model_config, plan
from fpdt.plan.cli import main
from fpdt.plan.memory_model import estimate_memory
from fpdt.plan.models import lora_param_count, param_counts
from fpdt.plan.setup import Setup
from fpdt.plan.time_model import estimate_time

K, M = 1024, 1024 * 1024


@pytest.mark.slow
def test_adapter_count_is_what_peft_makes():
    """PEFT's trainable parameters for rank 16 on every decoder linear of Llama-3-8B (built on
    the meta device: shapes only)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from fpdt.plan.models import PRESET_DIR

    hf_cfg = transformers.AutoConfig.from_pretrained(f"{PRESET_DIR}/llama-3-8b.json")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(load_model_config("llama-3-8b"), 16) == trainable
    assert lora_param_count(load_model_config("llama-3-8b"), 0) == 0


def test_model_states_are_the_frozen_base_and_fp32_adapters():
    cfg, world = load_model_config("llama-3-8b"), 8
    s = Setup.build(seq_len=256 * K, chunk_size=64 * K, hp=8, lora_rank=16)
    psi, psi_l = param_counts(cfg).total, lora_param_count(cfg, 16)
    b = estimate_memory(cfg, s, world, 8).breakdown
    assert b["parameters"] == pytest.approx((2 * psi + 4 * psi_l) / world)
    assert b["gradients"] == pytest.approx(4 * psi_l / world)
    assert b["optimizer_state"] == pytest.approx(8 * psi_l / world)
    full = estimate_memory(cfg, Setup.build(seq_len=256 * K, chunk_size=64 * K, hp=8), world, 8).breakdown
    assert full["gradients"] == pytest.approx(2 * psi / world)


def test_same_layer_activations_no_head_gradient_and_no_weight_gradient_gemms():
    """Activations as full training's (counted: tests/memory/test_hf_budget.py), less the LM head's
    gradient; GEMM time one pass less per layer; no weight-gradient accumulation traffic."""
    cfg, cluster = load_model_config("llama-3-8b"), Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8)
    for wgrad in ("accumulate", "recompute"):
        full = Setup.build(seq_len=512 * K, chunk_size=64 * K, hp=8, lm_head_wgrad=wgrad)
        lora = Setup.build(seq_len=512 * K, chunk_size=64 * K, hp=8, lm_head_wgrad=wgrad, lora_rank=16)
        mf, ml = estimate_memory(cfg, full, 8, 8), estimate_memory(cfg, lora, 8, 8)
        for phase in ("layer_attention_phase", "layer_mlp_phase", "layer_norm_phase", "attention"):
            assert ml.working_sets[phase] == mf.working_sets[phase], phase
        assert ml.working_sets["loss"] < mf.working_sets["loss"]
        tf, tl = estimate_time(cfg, full, cluster), estimate_time(cfg, lora, cluster)
        assert tl["attention"] == tf["attention"]
        assert tl["gemms"] < 0.8 * tf["gemms"]
        assert tl["wgrad_accumulation"] == 0 < tf["wgrad_accumulation"]


def test_seventy_b_lora_fits_where_full_training_does_not():
    """Llama-3-70B on one node of 8 x H100-80G: its full-training states (16 B per parameter,
    141 GB per GPU) fit at no length; LoRA's (the bf16 base, 17.6 GB per GPU) leave room for
    long sequences."""
    cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8)
    assert plan("llama-3-70b", cluster, search_max=True)["max_seq_len"] == 0
    lora = plan("llama-3-70b", cluster, search_max=True, choice=Choice(lora_rank=16))
    assert lora["max_seq_len"] >= 768 * K and lora["fits"]
    assert lora["setup"]["lora_rank"] == 16 and lora["recommended"]["lora_rank"] == 16
    assert lora["setup"]["checkpoint_device_layers"] > 0     # host-bound: fpdt-train keeps the last inputs on the GPU
    assert 0 < lora["mfu"] < lora["mfu_full"] < 1
    host_only = plan("llama-3-70b", cluster, search_max=True, choice=Choice().fix(lora_rank=16, checkpoint_device_layers=0))
    assert 512 * K <= host_only["max_seq_len"] < lora["max_seq_len"]


def test_cli_flag(capsys):
    assert main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(M), "--lora-rank", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["lora_rank"] == 8 and out["fits"]
    assert main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(M), "--lora-rank", "8"]) == 0
    assert "LoRA rank 8 (base frozen)" in capsys.readouterr().out
    main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(M), "--lora-rank", "-1"])
    assert "cannot run: lora_rank=-1 must be >= 0" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(256, 4, 2, 704), (512, 8, 8, 768)], ids=["h256-gqa", "h512-mha"])
def test_adapter_traffic_bounds_a_count_of_the_ops(shape):
    """The adapters' memory-bound traffic the time model adds (``LORA_ELEMENTWISE_BYTES``, rank 16)
    against the bytes fpdt.hf's ops move with and without LoRA (bf16 model, fp32 adapters,
    checkpointing on), counted by the elementwise-traffic counter: never under the count (the
    step time errs long), at most 1.7x it."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import fpdt.hf
    from fpdt.plan.time_model import elementwise_bytes
    from tests.plan.test_elementwise_traffic import _ElementwiseTraffic

    (h, heads, kv, inter), d, vocab, T, u = shape, 64, 1000, 512, 2
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": d, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "rope_theta": 10000.0}
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))
    counted = {}
    for lora in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{k: v for k, v in cfg.items() if k != "architectures"})).to(torch.bfloat16)
        if lora:       # PEFT makes the adapters fp32 on a bf16 model
            model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        fpdt.hf.apply_fpdt(model, num_chunks=u, checkpointing="on", lm_head_wgrad="accumulate", mlp_chunks=2 * u)
        model.train()
        counter = _ElementwiseTraffic([(inter, h), (h, inter), (heads * d, h), (kv * d, h), (vocab, h)])
        with counter:
            model(**fpdt.hf.prepare_inputs(model, ids)).loss.backward()
        counted[lora] = counter.bytes
    plan_cfg = load_model_config(cfg)
    setups = [Setup.build(seq_len=T, chunk_size=T // u, checkpointing="on", offload=False, lm_head_wgrad="accumulate",
                    mlp_chunks=2 * u, lora_rank=r) for r in (0, 16)]
    modelled = elementwise_bytes(plan_cfg, setups[1]) - elementwise_bytes(plan_cfg, setups[0])
    count = counted[True] - counted[False]
    assert count <= modelled <= 1.7 * count, f"modelled {modelled:.3g} B, counted {count:.3g} B"

"""Hugging Face checkpoints in and out; meta-device construction."""

import json
import os

import pytest
import torch
import transformers

import fpdt.model as fm
from fpdt.model.rope_scaling import rope_inv_freq
from tests.model.helpers import hf_model, rel_err, tokens


@pytest.mark.parametrize("name, shard", [("llama_gqa", None), ("qwen2_tied", "40KB"), ("llama_bias", "1KB")])
def test_save_then_transformers_loads_identical_logits(name, shard, tmp_path):
    ref = hf_model(name)
    ids, _ = tokens(ref.config.vocab_size, 2, 16)
    ours = fm.from_config(ref.config, num_chunks=2)
    fm.load_hf_state_dict(ours, ref.state_dict())
    ours.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    files = sorted(os.listdir(tmp_path))
    if shard:
        assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    else:
        assert "model.safetensors" in files
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                               dtype=torch.float32)
    assert type(loaded) is type(ref)
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits
        _, logits = ours(ids, return_logits=True)
        original = ref(input_ids=ids).logits
    assert torch.equal(theirs, original)  # the saved weights are exactly the original ones
    assert rel_err(logits, theirs) < 1e-5
    # ... and loading our own save back gives the same parameters
    again = fm.from_pretrained(tmp_path, num_chunks=2)
    for (n, p), (m, q) in zip(ours.named_parameters(), again.named_parameters()):
        assert n == m and torch.equal(p, q)
    assert again.lm_head.weight is again.model.embed_tokens.weight if ref.config.tie_word_embeddings \
        else again.lm_head.weight is not again.model.embed_tokens.weight


def test_from_pretrained_of_transformers_save(tmp_path):
    ref = hf_model("qwen2_tied")
    ref.save_pretrained(tmp_path, max_shard_size="30KB")
    ours = fm.from_pretrained(tmp_path, dtype="bfloat16")
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE stays fp32
    ours = fm.from_pretrained(tmp_path)
    ids, labels = tokens(256, 1, 8)
    with torch.no_grad():
        inputs = fm.prepare_inputs(ids, labels=labels, sp_size=1, rank=0, num_chunks=1)
        assert rel_err(ours(**inputs), ref(input_ids=ids, labels=labels).loss) < 1e-6


def test_meta_construction_and_deferred_init():
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4)
    model = fm.from_config(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match="meta"):
        model(torch.zeros(1, 4, dtype=torch.long))
    model.to_empty(device="cpu")
    model.init_weights()
    assert not any(p.is_meta for p in model.parameters())
    assert model.model.layers[0].input_layernorm.weight.eq(1).all()
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, rope_inv_freq(16, 10000.0, None)[0])
    assert torch.isfinite(model(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)))


def test_from_config_ties_and_options():
    cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = fm.from_config(cfg, dtype=torch.bfloat16, num_chunks=2, checkpointing="offload")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.mlp_chunks == 8 and model.loss_chunks == 13  # ceil(2 * u * I / hidden); ceil(2 * u * V / hidden)
    assert model.model.layers[0].self_attn.num_chunks == 2
    model.configure(num_chunks=4, mlp_chunks=0, offload=True)
    assert model.model.layers[0].self_attn.num_chunks == 4 and model.model.layers[0].self_attn.offload
    assert model.model.layers[0].mlp.num_chunks == 0
    with pytest.raises(TypeError, match="unknown FPDT options"):
        fm.from_config(cfg, chunks=2)
    with pytest.raises(ValueError, match="checkpointing"):
        model.configure(checkpointing="yes")


def test_rejects_mismatched_checkpoints(tmp_path):
    ref = hf_model("llama_gqa")
    ours = fm.from_config(ref.config)
    sd = dict(ref.state_dict())
    extra = {**sd, "model.layers.0.mlp.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="does not have"):
        fm.load_hf_state_dict(ours, extra)
    missing = {k: v for k, v in sd.items() if "layers.1" not in k}
    with pytest.raises(ValueError, match="lacks"):
        fm.load_hf_state_dict(fm.from_config(ref.config), missing)
    wrong = {**sd, "model.norm.weight": torch.ones(7)}
    with pytest.raises(ValueError, match="shape"):
        fm.load_hf_state_dict(fm.from_config(ref.config), wrong)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        (tmp_path / "config.json").write_text(json.dumps(ref.config.to_dict()))
        fm.from_pretrained(tmp_path)

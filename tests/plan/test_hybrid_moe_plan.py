"""The planner on hybrid (Gated DeltaNet + attention) and mixture-of-experts models: per-layer-kind
memory and time, their limits against plain models, and the meshes a hybrid refuses."""

import json
import os

import pytest

from fpdt.plan import Choice, Cluster, GPU_PRESETS, Setup, load_model_config, param_counts, plan
from fpdt.plan.cli import main
from fpdt.plan.memory_model import (communication, estimate_memory, gdn_stash_bytes, moe_working_set,
                                    saved_attention_bytes, saving_split)
from fpdt.plan.models import PRESET_DIR, gdn_core_flops, layer_matmul_flops, model_spec
from fpdt.plan.time_model import estimate_time

GIB = 1024 ** 3
H100x8 = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, host_mem_bytes=1024 * GIB)


def _preset(name: str) -> dict:
    with open(os.path.join(PRESET_DIR, name + ".json")) as f:
        return json.load(f)


def _setup(seq_len=2 ** 20, chunk=2 ** 16, hp=8, **kw):
    return Setup.build(seq_len, chunk, hp=hp, cp=1, **kw)


def test_gdn_core_flops_formula():
    """Qwen3.5-9B: per value head 6 dk dv + c (6 dk + 4 dv) + 2 c^2 / 3 (c = 64), and the conv's 2 K per channel."""
    g = model_spec(load_model_config("qwen3.5-9b")).gdn
    per_head = 6 * 128 * 128 + 64 * (6 * 128 + 4 * 128) + 2 * 64 * 64 / 3
    assert gdn_core_flops(g) == pytest.approx(32 * per_head + 2 * 4 * (2 * 16 * 128 + 32 * 128))


def test_gdn_stash_is_chunk_inputs_and_boundary_states():
    cfg = load_model_config("qwen3.5-9b")
    s = _setup()
    tokens, u = 2 ** 20 // 8, 16
    expected = tokens * (4096 + 8192 + 4096 + 64) * 2 + u * (4 * (32 // 8) * 128 * 128 + 3 * 8192 // 8 * 2)
    assert gdn_stash_bytes(cfg, model_spec(cfg), s) == pytest.approx(expected)


def test_attention_time_only_in_full_attention_layers():
    """The same shapes with every layer full attention: 4x the attention time of the 3:1 hybrid."""
    hybrid = load_model_config("qwen3.5-9b")
    dense = load_model_config({**_preset("qwen3.5-9b"), "layer_types": ["full_attention"] * 32})
    s = _setup(attention_checkpoint="recompute")
    t_h, t_d = estimate_time(hybrid, s, H100x8), estimate_time(dense, s, H100x8)
    assert t_d["attention"] == pytest.approx(4 * t_h["attention"])
    assert "gdn_core" not in t_d and 0 < t_h["gdn_core"] < 0.01 * t_h["attention"]


def test_gdn_layers_hold_no_kv_stash():
    """Without layer checkpoints every layer's stash is on the host: a GDN layer's is its chunk inputs."""
    hybrid = load_model_config("qwen3.5-9b")
    dense = load_model_config({**_preset("qwen3.5-9b"), "layer_types": ["full_attention"] * 32})
    s = _setup(checkpointing="off")
    m_h, m_d = estimate_memory(hybrid, s, 8, 8), estimate_memory(dense, s, 8, 8)
    per_gdn = gdn_stash_bytes(hybrid, model_spec(hybrid), s) * 8
    per_attention = m_d.breakdown["attention_stash_host"] / 32
    assert m_h.breakdown["attention_stash_host"] == pytest.approx(8 * per_attention + 24 * per_gdn)


@pytest.mark.parametrize("name", ["qwen3.5-9b", "qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_memory_grows_with_the_sequence(name):
    cfg = load_model_config(name)
    peaks = [estimate_memory(cfg, _setup(2 ** k), 8, 8) for k in (18, 19, 20, 21)]
    for a, b in zip(peaks, peaks[1:]):
        assert b.device_peak_bytes > a.device_peak_bytes and b.host_peak_bytes > a.host_peak_bytes


def test_one_expert_moe_is_the_dense_mlp_plus_its_router():
    """A one-expert top-1 MoE of width I is the dense SwiGLU of width I (every layer in ``mlp_only_layers``)
    plus a ``[1, hidden]`` router: the same memory, one router GEMM more."""
    base = {**_preset("qwen3-30b-a3b"), "num_hidden_layers": 4}
    moe = load_model_config({**base, "num_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 6144})
    dense = load_model_config({**base, "mlp_only_layers": [0, 1, 2, 3]})
    h = 2048
    assert model_spec(dense).mlps == ("dense",) * 4 and model_spec(moe).mlps == ("moe",) * 4
    assert param_counts(moe).total == param_counts(dense).total + 4 * h
    flops = 2 * h * (32 * 128 + 2 * 4 * 128) + 2 * 32 * 128 * h + 6 * h * 6144
    assert layer_matmul_flops(dense, model_spec(dense)) == (flops,) * 4
    assert layer_matmul_flops(moe, model_spec(moe)) == (flops + 2 * h,) * 4


def test_gemms_follow_k_and_the_zero_gather_follows_e():
    """Active FLOPs grow with the experts per token; the ZeRO-3 gather holds all E experts of a layer."""
    base = _preset("qwen3-30b-a3b")
    s = _setup(2 ** 19)
    t = {k: estimate_time(load_model_config({**base, "num_experts_per_tok": k}), s, H100x8)["gemms"] for k in (4, 8)}
    assert t[8] > t[4]
    cfg_e = {e: load_model_config({**base, "num_experts": e}) for e in (64, 128)}
    experts = 64 * 3 * 2048 * 768
    assert param_counts(cfg_e[128]).layer - param_counts(cfg_e[64]).layer == experts + 64 * 2048
    gathered = communication(cfg_e[128], s) - communication(cfg_e[64], s)
    assert gathered == pytest.approx(3 * (experts + 64 * 2048) * 2)      # two layers gathered, one's gradients
    ws = moe_working_set(cfg_e[128], model_spec(cfg_e[128]), s) - moe_working_set(cfg_e[64], model_spec(cfg_e[64]), s)
    assert ws >= 4 * experts                                             # the experts' fp32 gradient accumulators


def test_hybrid_refuses_context_parallel_meshes():
    out = plan("qwen3.5-9b", H100x8, seq_len=2 ** 20, choice=Choice(hp=4, cp=2))
    assert not out["fits"] and "Gated DeltaNet" in out["reason"] and "cp 1" in out["reason"]
    chosen = plan("qwen3.5-9b", H100x8, seq_len=2 ** 20)
    assert chosen["fits"] and chosen["setup"]["cp"] == 1
    # MoE attention is the dense model's: the ring is allowed
    assert plan("qwen3-30b-a3b", H100x8, seq_len=2 ** 20, choice=Choice(hp=4, cp=2))["setup"]["cp"] == 2


def test_hybrid_refuses_head_splits_that_do_not_divide_its_gdn_heads():
    tiny = {"model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 384, "intermediate_size": 1024,
            "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32}
    out = plan(tiny, Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=6), seq_len=6 * 2 ** 13,
               choice=Choice(hp=6, cp=1))
    assert "must divide the Gated DeltaNet's 2 key and 4 value heads" in out["reason"]


def test_saved_attention_counts_full_attention_layers_only():
    """``save_attention_layers`` K counts layers, as the model's checkpoints do: the full-attention
    layers among the first K save (GDN layers have no attention output)."""
    cfg = load_model_config("qwen3.5-9b")
    for k, saving in ((3, 0), (4, 1), (13, 3), (32, 8)):
        s = _setup(attention_checkpoint="save", save_attention_layers=k)
        assert sum(saving_split(cfg, s)) == saving
    out = plan("qwen3.5-9b", H100x8, seq_len=2 ** 20)
    assert out["setup"]["attention_checkpoint"] == "save"
    saved = out["breakdown"]["attention_saved_host"] + 8 * out["breakdown"]["attention_saved_device"]
    assert saved <= 8 * 8 * saved_attention_bytes(cfg, Setup.build(2 ** 20, out["setup"]["chunk_size"], hp=8, cp=1))


def test_cli_plans_the_presets(capsys):
    for name in ("qwen3.5-9b", "qwen3-30b-a3b", "qwen3.5-35b-a3b"):
        assert main(["--model", name, "--gpu", "h100-80g", "--seq-len", "1048576", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["fits"] and out["mfu"] > 0


H200_1 = (Cluster(GPU_PRESETS["h200"], gpus_per_node=1, host_mem_bytes=1900 * GIB),
          Choice(offload_optimizer=True, offload_param=True))
H100_8 = (H100x8, Choice())


@pytest.mark.slow
@pytest.mark.parametrize("model,where,stream,longest", [
    ("llama-3-8b", H200_1, None, 5_439_488), ("llama-3-8b", H200_1, False, 3_735_552),
    ("llama-3-8b", H200_1, True, 5_439_488),
    ("qwen3.5-9b", H200_1, None, 5_373_952), ("qwen3.5-9b", H200_1, False, 2_949_120),
    ("qwen3.5-9b", H200_1, True, 5_373_952),
    ("qwen3-30b-a3b", H200_1, None, 6_619_136), ("qwen3-30b-a3b", H200_1, False, 6_619_136),
    ("qwen3-30b-a3b", H200_1, True, 5_898_240),
    ("qwen3.5-35b-a3b", H200_1, None, 6_488_064), ("qwen3.5-35b-a3b", H200_1, False, 5_832_704),
    ("qwen3.5-35b-a3b", H200_1, True, 6_488_064),
    ("llama-3-8b", H100_8, None, 4_521_984), ("llama-3-8b", H100_8, False, 4_521_984),
    ("llama-3-8b", H100_8, True, 3_014_656),
    ("qwen3.5-9b", H100_8, None, 4_325_376), ("qwen3.5-9b", H100_8, False, 4_325_376),
    ("qwen3.5-9b", H100_8, True, 3_014_656),
    ("qwen3-30b-a3b", H100_8, None, 4_718_592), ("qwen3-30b-a3b", H100_8, False, 4_718_592),
    ("qwen3-30b-a3b", H100_8, True, 4_063_232),
    ("qwen3.5-35b-a3b", H100_8, None, 4_521_984), ("qwen3.5-35b-a3b", H100_8, False, 1_048_576),
    ("qwen3.5-35b-a3b", H100_8, True, 4_521_984),
], ids=lambda v: v if isinstance(v, str) else None)
def test_docs_longest_sequences(model, where, stream, longest):
    """docs/plan.md's "Predicted longest sequences": the length fits and one 64K granule more does not
    (``stream``: ``--stream-layers`` / ``--no-stream-layers``; None: the planner's choice)."""
    cluster, choice = where
    choice = choice.fix(stream_layers=stream)
    at = plan(model, cluster, seq_len=longest, choice=choice)
    assert at["fits"] and "note" not in at
    assert not plan(model, cluster, seq_len=longest + 2 ** 16, choice=choice)["fits"]


def test_streamed_layers_of_hybrid_models_when_nothing_unstreamed_fits():
    """fpdt.model streams Gated DeltaNet and MoE layers: the planner chooses it for a hybrid model
    past the longest unstreamed run, with no note."""
    cluster, choice = H200_1
    chosen = plan("qwen3.5-9b", cluster, seq_len=3 * 2 ** 20, choice=choice)
    assert chosen["fits"] and chosen["setup"]["stream_layers"] and "note" not in chosen
    assert not plan("qwen3.5-9b", cluster, seq_len=3 * 2 ** 20, choice=choice.fix(stream_layers=False))["fits"]


@pytest.mark.slow
@pytest.mark.parametrize("u", [2, 4])
def test_gdn_working_set_bounds_the_counted_backward(u):
    """The GDN layer's device set the planner counts (:func:`gdn_working_set`) holds what the
    accountant counts in ``fpdt.model.gated_deltanet``'s backward with offload (CPU kernel, bf16),
    within 15%; its host stash is the planner's :func:`gdn_stash_bytes` within 2%."""
    import torch

    from fpdt.memory.accountant import MemoryAccountant
    from fpdt.model.gated_deltanet import GatedDeltaNet
    from fpdt.plan.memory_model import gdn_working_set

    hidden, L = 256, 512
    cfg = load_model_config({"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": hidden,
                             "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 2,
                             "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                             "linear_conv_kernel_dim": 4})
    s = Setup.build(L * u, L, hp=1, cp=1, offload=True)
    torch.manual_seed(0)
    m = GatedDeltaNet(hidden, 2, 4, 64, 64, 4).bfloat16()
    m.num_chunks, m.offload, m.runtime = u, True, "sim"
    x = torch.randn(1, L * u, hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, L * u, hidden, dtype=torch.bfloat16)
    m(x).backward(dy)                                   # warm-up: lazily built buffers
    x.grad = None
    m.zero_grad(set_to_none=True)
    grads = sum(p.numel() * 4 for p in m.parameters()) + x.numel() * 2      # fp32 weight grads, dx
    with MemoryAccountant("cpu") as acct:
        with acct.phase("fwd"):
            y = m(x)
        with acct.phase("bwd"):
            y.backward(dy)
    counted = acct.phases["bwd"].peak_above_start - grads
    planned = gdn_working_set(cfg, model_spec(cfg), s)
    assert 0.85 * planned <= counted <= planned, (counted, planned)
    assert acct.phases["fwd"].host_peak == pytest.approx(gdn_stash_bytes(cfg, model_spec(cfg), s), rel=0.02)

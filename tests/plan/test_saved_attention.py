"""fpdt-plan with saved attention outputs (attention_checkpoint="save"): bytes, passes, choice."""

import dataclasses

import pytest

from fpdt.plan import GPU_PRESETS, Choice, Cluster, load_model_config, plan
from fpdt.plan.cli import main
from fpdt.plan.memory_model import FRAGMENTATION, saved_attention_bytes
from fpdt.plan.planner import evaluate
from fpdt.plan.setup import Setup
from fpdt.plan.time_model import estimate_time

S = 2 ** 21
CFG = load_model_config("llama-3-8b")
NODE = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, host_mem_bytes=1024 * 2 ** 30)
BASE = Setup.build(seq_len=S, chunk_size=65536, hp=8, mlp_chunks=64, lm_head_wgrad="recompute")


def saving(s: Setup, n: int | None = None, **kw) -> Setup:
    return s.updated(attention_checkpoint="save", save_attention_layers=n, **kw)


def test_saved_bytes_are_the_output_in_bf16_and_the_lse_in_fp32_per_rank():
    h, d, p = CFG.num_heads, CFG.head_dim, 8
    assert saved_attention_bytes(CFG, BASE) == (2 * S * h * d + 4 * S * h) // p == 262144 * 32 * 260
    fp32 = dataclasses.replace(BASE, dtype="fp32", batch=2)
    assert saved_attention_bytes(CFG, fp32) == 2 * (4 * S * h * d + 4 * S * h) // p
    mesh = dataclasses.replace(BASE, hp=4, cp=2)
    assert saved_attention_bytes(CFG, mesh) == saved_attention_bytes(CFG, BASE)


@pytest.mark.parametrize("checkpoint,device_layers,n,host_layers,dev_layers", [
    ("offload", 0, None, 32, 0),        # every layer, all offloaded
    ("offload", 0, 20, 20, 0),
    ("offload", 4, None, 28, 4),        # the last 4 layers' outputs stay beside their inputs on the GPU
    ("offload", 4, 29, 28, 1),
    ("offload", 4, 12, 12, 0),          # the first 12 save: all of them offloaded layers
    ("on", 0, 7, 0, 7),
    ("off", 0, None, 0, 0),             # no recompute, nothing to save
])
def test_saved_bytes_go_where_the_layer_inputs_are(checkpoint, device_layers, n, host_layers, dev_layers):
    base = BASE.updated(seq_len=2 ** 20, mlp_chunks=32, checkpointing=checkpoint,
                        checkpoint_device_layers=device_layers)
    s = saving(base, n)
    assert s.saving_layers(CFG.num_layers) == (host_layers, dev_layers)
    ref, out = evaluate(CFG, base, NODE), evaluate(CFG, s, NODE)
    per = saved_attention_bytes(CFG, s)
    assert out["breakdown"]["attention_saved_host"] == 8 * host_layers * per
    assert out["host_peak_bytes"] - ref["host_peak_bytes"] == pytest.approx(8 * host_layers * per, rel=1e-12)
    assert out["breakdown"]["attention_saved_device"] == dev_layers * per
    assert out["device_peak_bytes"] - ref["device_peak_bytes"] == pytest.approx(FRAGMENTATION * dev_layers * per,
                                                                                rel=1e-9, abs=1)


@pytest.mark.parametrize("n", [None, 1, 20])
def test_a_saving_layer_runs_three_attention_passes_and_the_others_four(n):
    ref, out = estimate_time(CFG, BASE, NODE), estimate_time(CFG, saving(BASE, n), NODE)
    k = CFG.num_layers if n is None else n
    assert out["attention"] == pytest.approx(ref["attention"] * (4 * 32 - k) / (4 * 32), rel=1e-12)
    assert out["gemms"] == ref["gemms"] and out["elementwise"] == ref["elementwise"]
    assert out["all_to_all"] == pytest.approx(ref["all_to_all"], rel=1e-12)   # the output crosses once more
    assert estimate_time(CFG, saving(BASE, n, checkpointing="off"), NODE) == estimate_time(
        CFG, BASE.updated(checkpointing="off"), NODE)


def test_all_to_all_of_the_saved_output_is_a_parameter():
    # both layouts pay one all-to-all of the output per saving layer; 0 would keep both layouts
    s = saving(BASE, None, chunk_size=2 ** 21, mlp_chunks=2)       # one chunk: the all-to-all is not hidden
    with_one, with_none = estimate_time(CFG, s, NODE), estimate_time(CFG, s, NODE, saved_output_all_to_alls=0)
    o_bytes = 32 * s.local_tokens * CFG.num_heads * CFG.head_dim * 2 * 7 // 8
    link = NODE.rates().intra_node_bytes_s
    assert with_one["all_to_all"] - with_none["all_to_all"] == pytest.approx(o_bytes / link, rel=1e-9)


def test_planner_saves_every_layer_at_2m_on_8_h100_moving_4_layer_inputs_to_the_gpus():
    choice = Choice(chunk_size=65536, hp=8)
    out = plan("llama-3-8b", NODE, seq_len=S, choice=choice)
    s = out["setup"]
    assert out["fits"] and (s["attention_checkpoint"], s["save_attention_layers"]) == ("save", 32)
    assert s["checkpoint_device_layers"] == 4         # the fewest that free the host for all 32 outputs
    rec = out["recommended"]
    assert (rec["attention_checkpoint"], rec["save_attention_layers"]) == ("save", 32)
    old = plan("llama-3-8b", NODE, seq_len=S, choice=choice.fix(attention_checkpoint="recompute"))
    assert old["setup"]["attention_checkpoint"] == "recompute"
    assert out["step_time_s"] < 0.8 * old["step_time_s"] and out["mfu"] > old["mfu"]
    assert out["step_time_split_s"]["attention"] == pytest.approx(0.75 * old["step_time_split_s"]["attention"])


def test_with_the_layer_inputs_all_on_the_host_the_planner_saves_as_many_layers_as_the_host_holds():
    choice = Choice().fix(chunk_size=65536, hp=8, checkpoint_device_layers=0)
    out = plan("llama-3-8b", NODE, seq_len=S, choice=choice)
    n = out["setup"]["save_attention_layers"]
    assert out["fits"] and out["setup"]["attention_checkpoint"] == "save" and n == 24
    over = plan("llama-3-8b", NODE, seq_len=S, choice=choice.fix(save_attention_layers=n + 1))
    assert not over["fits"] and over["limited_by"] == "host"


def test_cli_shows_the_choice_and_refuses_bad_counts(capsys):
    args = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(S), "--chunk-size", "65536",
            "--hp", "8"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "attention saved by the first 32 layers" in text and "attention_saved_host" in text
    assert "--attention-checkpoint save --save-attention-layers 32" in text
    assert main([*args, "--attention-checkpoint", "recompute"]) == 0
    assert "attention recomputed" in capsys.readouterr().out
    assert main([*args, "--save-attention-layers", "33"]) == 2
    assert "--save-attention-layers 33 is more than the model's 32 decoder layers" in capsys.readouterr().err
    assert main([*args, "--attention-checkpoint", "recompute", "--save-attention-layers", "3"]) == 2
    assert "needs --attention-checkpoint save (now recompute)" in capsys.readouterr().err


def test_deepspeed_json_section_sets_the_saving_layers(tmp_path, capsys):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "fpdt": {"sp": 8, "chunk_size": 65536, "attention_checkpoint": "save",
                                         "save_attention_layers": 10}}))
    assert main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(S), "--deepspeed", str(path),
                 "--json"]) == 0
    import json as j
    out = j.loads(capsys.readouterr().out)
    assert (out["setup"]["attention_checkpoint"], out["setup"]["save_attention_layers"]) == ("save", 10)
    assert out["breakdown"]["attention_saved_host"] == 8 * 10 * saved_attention_bytes(CFG, BASE)

"""fpdt-plan: output fields, errors that name the fix, calibration, consistency of the search."""

import json

import pytest

from fpdt.plan import GPU_PRESETS, Choice, Cluster, load_model_config, plan
from fpdt.plan.cli import main
from fpdt.plan.planner import evaluate
from fpdt.plan.setup import Setup

BREAKDOWN = {"parameters", "gradients", "optimizer_state", "checkpoints_device", "checkpoints_host",
             "in_flight_layer", "attention_working_set", "loss_chunk", "communication_buffers"}
TIME_SPLIT = {"gemms", "attention", "all_to_all", "p2p", "h2d_d2h", "zero_collectives", "elementwise",
              "wgrad_accumulation", "nvme_io"}
RECOMMENDED = {"chunk_size", "hp", "cp", "placement", "checkpoint"}


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_fields(capsys):
    out = run_json(capsys, "--model", "llama-3-8b", "--gpu", "h100-80g", "--gpus-per-node", "8",
                   "--host-mem-gib", "1024", "--seq-len", str(2 ** 20))
    assert out["fits"] is True
    assert BREAKDOWN <= set(out["breakdown"])
    assert TIME_SPLIT == set(out["step_time_split_s"])
    assert RECOMMENDED <= set(out["recommended"])
    assert out["step_time_s"] == pytest.approx(sum(out["step_time_split_s"].values()))
    assert 0 < out["mfu"] < 1 and out["device_peak_bytes"] > 0 and out["host_peak_bytes"] > 0
    s = out["setup"]   # defaults follow fpdt-train's
    assert (s["zero_stage"], s["checkpoint"], s["offload"], s["dtype"]) == (3, "offload", True, "bf16")
    device = sum(v for k, v in out["breakdown"].items() if not k.endswith("_host"))
    host = sum(v for k, v in out["breakdown"].items() if k.endswith("_host"))
    assert device == pytest.approx(out["device_peak_bytes"]) and host == pytest.approx(out["host_peak_bytes"])


def test_max_seq_len_is_the_boundary(capsys):
    args = ("--model", "llama-3.2-1b", "--gpu", "a100-80g", "--gpus-per-node", "1", "--host-mem-gib", "256")
    out = run_json(capsys, *args, "--max-seq-len")
    best = out["max_seq_len"]
    assert best > 0 and best % 65536 == 0 and out["fits"] and out["seq_len"] == best
    assert not run_json(capsys, *args, "--seq-len", str(best + 65536))["fits"]


def test_readable_table(capsys):
    assert main(["--model", "gpt-2.7b", "--gpu", "a100-40g", "--gpus-per-node", "4", "--seq-len", "524288"]) == 0
    text = capsys.readouterr().out
    for word in ("fits", "device peak", "host peak", "checkpoints_host", "step time", "MFU", "recommended"):
        assert word in text


@pytest.mark.parametrize("argv,fix", [
    (["--model", "no-such-model", "--gpu", "h100-80g", "--seq-len", "65536"], "preset"),
    (["--model", "llama-3-8b", "--gpu", "v100", "--seq-len", "65536"], "a100-40g"),
    (["--model", "llama-3-8b", "--gpu-mem-gib", "80", "--seq-len", "65536"], "--gpu-tflops"),
    (["--model", "llama-3-8b", "--gpu", "h100-80g", "--nodes", "0", "--seq-len", "65536"], "nodes"),
])
def test_bad_input_names_the_fix(capsys, argv, fix):
    assert main(argv) == 2
    assert fix in capsys.readouterr().err


def test_impossible_mesh_says_why(capsys):
    out = run_json(capsys, "--model", "llama-3-8b", "--gpu", "h100-80g", "--gpus-per-node", "8",
                   "--hp", "3", "--seq-len", "65536")
    assert out["fits"] is False and "hp" in out["reason"]


def test_explicit_gpu_and_calibration(tmp_path, capsys):
    base = ("--model", "llama-3.2-1b", "--gpu-mem-gib", "80", "--gpu-tflops", "989", "--pcie-gbps", "64",
            "--gpus-per-node", "1", "--seq-len", str(2 ** 18), "--chunk-size", "65536")
    slow = tmp_path / "cal.json"
    slow.write_text(json.dumps({"device": "test", "gemm_flops": 1e12, "attention_flops": 1e12}))
    fast = run_json(capsys, *base)
    calibrated = run_json(capsys, *base, "--calibration", str(slow))
    assert calibrated["cluster"]["rates"]["source"] == str(slow)
    assert calibrated["step_time_split_s"]["gemms"] > 100 * fast["step_time_split_s"]["gemms"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gemm_flops": -1}))
    assert main([*base, "--calibration", str(bad)]) == 2
    assert "positive" in capsys.readouterr().err


def test_more_gpus_longer_sequences():
    cfg = load_model_config("llama-3-8b")
    lengths = []
    for n in (8, 16, 32):
        cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, nodes=n // 8)
        lengths.append(plan(cfg, cluster, choice=Choice(chunk_size=65536), search_max=True)["max_seq_len"])
    assert lengths[0] < lengths[1] < lengths[2]


def test_offload_and_checkpointing_trade_device_for_host():
    cfg = load_model_config("llama-3.2-1b")
    cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1)
    runs = {(ck, off): evaluate(cfg, Setup.build(seq_len=2 ** 18, chunk_size=2 ** 16, checkpointing=ck, offload=off), cluster)
            for ck in ("off", "on", "offload") for off in (False, True)}
    dev = {k: r["device_peak_bytes"] for k, r in runs.items()}
    host = {k: r["host_peak_bytes"] for k, r in runs.items()}
    assert dev[("offload", True)] < dev[("on", True)] < dev[("off", True)]
    assert dev[("offload", True)] < dev[("offload", False)]
    assert host[("offload", True)] > host[("on", True)] and host[("on", True)] > host[("on", False)]
    # recompute costs time: checkpointing off is the fastest when it fits
    assert runs[("off", False)]["step_time_s"] < runs[("on", False)]["step_time_s"]


def test_small_chunks_expose_copies():
    """FPDT Fig. 10: a block's copies grow with C, its attention with C^2, so short chunks
    leave PCIe copies exposed and long ones hide them."""
    cfg = load_model_config("llama-3-8b")
    cluster = Cluster(GPU_PRESETS["a100-80g"], gpus_per_node=4)
    split = {c: evaluate(cfg, Setup.build(seq_len=2 ** 20, chunk_size=c, hp=4), cluster)["step_time_split_s"]
             for c in (4096, 65536)}
    assert split[4096]["h2d_d2h"] > 0.1 * split[4096]["attention"]
    assert split[65536]["h2d_d2h"] < 0.01 * split[65536]["attention"]


def test_setup_problems_name_the_fix():
    cfg = load_model_config("llama-3-8b")
    assert any("not divisible by chunk_size=" in p for p in Setup.build(seq_len=100_000, chunk_size=65536).problems(cfg, 1))
    assert any("query heads" in p for p in Setup.build(seq_len=2 ** 20, chunk_size=2 ** 16, hp=5).problems(cfg, 5))
    assert any("multiple of" in p for p in Setup.build(seq_len=2 ** 20, chunk_size=2 ** 16, hp=3).problems(cfg, 3))


def test_plan_worked_example_is_current(capsys):
    """docs/plan.md's worked example, the README's summary of it and docs/train.md's 4M launch
    line quote the planner; a model change must update them."""
    import os
    root = os.path.join(os.path.dirname(__file__), "..", "..")

    def text(*path):
        with open(os.path.join(root, *path)) as f:
            return " ".join(f.read().split())          # line breaks do not matter

    readme, train = text("docs", "plan.md"), text("docs", "train.md")
    gib = lambda b: b / 2 ** 30                         # noqa: E731
    node = ("--model", "llama-3-8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--host-mem-gib", "1024")
    out = run_json(capsys, *node, "--max-seq-len")
    longest = f"{out['max_seq_len'] / 2 ** 20:.2f}M tokens"      # M = 2^20, as fpdt-plan's K = 1024
    assert f"**{longest}** ({out['max_seq_len']:,}), in {out['setup']['chunk_size'] // 1024}K chunks" in readme
    assert f"(here {longest}, host-bound)" in text("README.md") and out["limited_by"] is None
    b = {k: gib(v) for k, v in out["breakdown"].items()}
    assert f"the node's 1 TiB holds {gib(out['host_peak_bytes']):.0f} GiB, of which {b['checkpoints_host']:.0f} GiB" in readme
    assert f"{b['attention_stash_host']:.0f} GiB the attention stash" in readme
    assert f"{b['process_host']:.0f} GiB process memory" in readme
    assert f"Each GPU peaks at {gib(out['device_peak_bytes']):.0f} GiB" in readme
    states = b["parameters"] + b["gradients"] + b["optimizer_state"]
    assert f"{states:.0f} GiB of ZeRO-3 model states, {b['checkpoints_device']:.1f} GiB of layer-input" in readme
    assert b["in_flight_layer"] == 0 and f"{b['loss_chunk']:.1f} GiB for the loss chunk" in readme   # the loss peaks
    layer = max(v for k, v in out["working_sets"].items() if k.startswith("layer_"))
    assert layer == out["working_sets"]["layer_mlp_phase"]
    assert f"{gib(layer):.1f} GiB for the layer in flight in the chunked MLP's backward" in readme
    assert f"the MLP's own chunk, {gib(out['working_sets']['mlp_chunk']):.1f} GiB" in readme
    assert f"{b['communication_buffers']:.1f} GiB of ZeRO gathers" in readme
    assert f"{b['runtime_reserve']:.1f} GiB of runtime reserve" in readme
    k = out["setup"]["checkpoint_device_layers"]      # the layer inputs kept on the GPUs so that the host fits
    assert k > 0 and f"`--checkpoint-device-layers {k}`" in readme and f"other {k} layers' inputs" in readme
    untiered = run_json(capsys, *node, "--max-seq-len", "--checkpoint-device-layers", "0")
    assert untiered["max_seq_len"] < out["max_seq_len"]
    assert f"with none it would stop at {untiered['max_seq_len'] / 2 ** 20:.2f}M" in readme
    # what stops it: one granule more does not fit the host
    longer = run_json(capsys, *node, "--seq-len", str(out["max_seq_len"] + 2 ** 16))
    assert longer["fits"] is False and longer["limited_by"] == "host" and "the host is what stops it" in readme

    # at 2M: every layer's attention recomputed, then the planner's choice (saved attention outputs)
    recomputed = run_json(capsys, *node, "--seq-len", str(2 ** 21), "--attention-checkpoint", "recompute")
    split = recomputed["step_time_split_s"]
    assert f"about {recomputed['step_time_s'] / 60:.0f} minutes ({recomputed['step_time_s']:.0f} s)" in readme
    assert f"MFU {recomputed['mfu']:.0%} ({recomputed['mfu_full']:.0%} counting full attention" in readme
    assert f"attention dominates ({split['attention']:.0f} s: four attention passes" in readme
    assert f"GEMMs take {split['gemms']:.0f} s" in readme
    assert f"memory-bound ops {split['elementwise']:.1f} s" in readme
    assert f"weight-gradient accumulation {split['wgrad_accumulation']:.1f} s" in readme
    assert recomputed["recommended"]["chunk_size"] == 65536 and "the planner picks the paper's 64K chunks" in readme
    at_2m = run_json(capsys, *node, "--seq-len", str(2 ** 21))
    assert at_2m["recommended"]["attention_checkpoint"] == at_2m["setup"]["attention_checkpoint"] == "save"
    saved, kept = at_2m["setup"]["save_attention_layers"], at_2m["setup"]["checkpoint_device_layers"]
    assert f"**{at_2m['step_time_s']:.0f} s per step, MFU {at_2m['mfu']:.0%}**" in readme
    assert f"{at_2m['step_time_split_s']['attention']:.0f} s of attention" in readme
    assert at_2m["recommended"]["chunk_size"] == 131072 and "MFU 49%**, with 128K chunks" in readme
    assert f"per node for all {saved} layers" in readme and f"keeps the last {kept} layer inputs" in readme
    assert f"`--checkpoint-device-layers {kept}`, {gib(at_2m['device_peak_bytes']):.0f} GiB per GPU" in readme
    host_only = run_json(capsys, *node, "--seq-len", str(2 ** 21), "--checkpoint-device-layers", "0")
    assert (f"{host_only['setup']['save_attention_layers']} layers fit their outputs "
            f"({host_only['step_time_s']:.0f} s, MFU {host_only['mfu']:.0%})") in readme
    assert out["setup"]["attention_checkpoint"] == "recompute"     # nothing left to save at the longest length
    assert at_2m["recommended"]["lm_head_wgrad"] == recomputed["recommended"]["lm_head_wgrad"] == "recompute"

    # docs/train.md's 4M launch line on 8 GPUs, as its JSON configures the run
    ds = os.path.join(root, "examples", "llama-3-8b", "ds_zero3_8gpu.json")
    at_4m = ("--deepspeed", ds, "--seq-len", str(2 ** 22))
    untiered_4m = run_json(capsys, *node, *at_4m, "--checkpoint-device-layers", "0")
    assert untiered_4m["limited_by"] == "host"
    assert f"fpdt-plan puts the host at {gib(untiered_4m['host_peak_bytes']) / 1024:.1f} TiB per node" in train
    tiered_4m = run_json(capsys, *node, *at_4m)
    k4 = tiered_4m["setup"]["checkpoint_device_layers"]
    assert tiered_4m["fits"] and f"with 1 TiB add --checkpoint-device-layers {k4} (the last {k4} layers'" in train


def test_near_ties_go_to_the_trainers_lm_head_mode():
    """Where both LM-head modes fit within 1% of the same step time and device peak, the
    recommendation is fpdt-train's default (recompute), so its out-of-memory advice never
    tells a run to leave the default for a mode the H100 measured slower."""
    from fpdt.plan import GPU_PRESETS, Choice, Cluster, evaluate, load_model_config, plan
    from fpdt.plan.setup import Setup
    from fpdt.train.config import TrainerOptions
    cfg, cluster = load_model_config("llama-3.2-1b"), Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1)
    seq, chunk = 1 << 20, 1 << 18     # 256K chunks: the attention's backward, the same in both modes, is the peak
    modes = {m: evaluate(cfg, Setup.build(seq_len=seq, chunk_size=chunk, lm_head_wgrad=m), cluster)
             for m in ("accumulate", "recompute")}
    assert modes["accumulate"]["device_peak_bytes"] == modes["recompute"]["device_peak_bytes"]   # a tie
    assert abs(modes["accumulate"]["step_time_s"] / modes["recompute"]["step_time_s"] - 1) < 0.01
    out = plan(cfg, cluster, seq_len=seq, choice=Choice(chunk_size=chunk))
    assert out["recommended"]["lm_head_wgrad"] == TrainerOptions().lm_head_wgrad == "recompute"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_lm_head_seconds_are_the_step_models_head_terms(dtype):
    """profiling/lm_head_wgrad.py sets lm_head_seconds beside its measurement: its difference
    between the two modes is exactly the step model's (estimate_time) for the same run."""
    from fpdt.plan.memory_model import loss_chunks
    from fpdt.plan.time_model import estimate_time, lm_head_seconds
    cfg = load_model_config("llama-3-8b")
    cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8)
    setups = {m: Setup.build(seq_len=1 << 20, chunk_size=1 << 16, hp=8, dtype=dtype, lm_head_wgrad=m)
              for m in ("accumulate", "recompute")}
    step = {m: estimate_time(cfg, s, cluster)["total"] for m, s in setups.items()}
    s = setups["accumulate"]
    head = {m: lm_head_seconds(cfg.hidden_size, cfg.vocab_size, s.rank_tokens, loss_chunks(cfg, s), m,
                               s.elem_bytes, cluster.rates())["total"] for m in setups}
    assert step["recompute"] - step["accumulate"] == pytest.approx(head["recompute"] - head["accumulate"], rel=1e-9)
    assert head["accumulate"] > head["recompute"] > 0      # Llama-3's vocabulary: the adds cost more than a GEMM


def test_attention_kernel_gqa_expansion(capsys, tmp_path):
    """fpdt-plan models the attention kernel fpdt-train would run: automatic is native GQA in
    bf16 (FlashAttention-2 or cuDNN) and repeats the KV heads in fp32 (the efficient kernel);
    --attention-backend (or the JSON's "fpdt" attention_backend) names one. Repeated KV heads
    cost attention working set, nothing else."""
    # 256K chunks: the attention core's backward is the peak (at 128K the loss chunk is)
    base = ("--model", "llama-3-8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--seq-len", str(2 ** 20),
            "--chunk-size", "262144", "--hp", "8", "--lm-head-wgrad", "recompute")
    auto, fp32 = run_json(capsys, *base), run_json(capsys, *base, "--dtype", "fp32")
    named = {k: run_json(capsys, *base, "--attention-backend", k) for k in ("cuda_efficient", "cuda_cudnn", "cuda_flash")}
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "fpdt": {"attention_backend": "cuda_efficient"}}))
    from_json = run_json(capsys, *base, "--deepspeed", str(ds))
    assert not auto["setup"]["kernel_expands_gqa"] and fp32["setup"]["kernel_expands_gqa"]
    assert [named[k]["setup"]["kernel_expands_gqa"] for k in named] == [True, False, False]
    assert from_json["setup"]["kernel_expands_gqa"]
    more = named["cuda_efficient"]["breakdown"]["attention_working_set"] - auto["breakdown"]["attention_working_set"]
    changed = {k for k, v in named["cuda_efficient"]["breakdown"].items() if v != auto["breakdown"][k]}
    assert more > 0 and changed == {"attention_working_set", "runtime_reserve"}     # the reserve's fragmentation share
    assert named["cuda_cudnn"]["breakdown"] == named["cuda_flash"]["breakdown"] == auto["breakdown"]


def test_attention_kernel_unknown_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", "65536", "--attention-backend", "flash4"])
    assert exc.value.code == 2 and "invalid choice: 'flash4'" in capsys.readouterr().err


def test_a_named_kernel_is_timed_at_its_own_calibrated_rate(tmp_path, capsys):
    """A calibration from op_latency.py --backends holds each kernel's attention rate: a named
    kernel's step is planned at its own rate, the automatic one at the file's own; a kernel
    the file did not time falls back to that one rate."""
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"attention_flops": 4e14, "attention_backend": "cuda_cudnn",
                               "attention_flops_by_kernel": {"cuda_cudnn": 4e14, "cuda_flash": 2e14}}))
    base = ("--model", "llama-3.2-1b", "--gpu", "h100-80g", "--gpus-per-node", "1", "--seq-len", "131072",
            "--chunk-size", "65536", "--lm-head-wgrad", "recompute", "--calibration", str(cal))
    t = {k: run_json(capsys, *base, *(("--attention-backend", k) if k else ())) for k in (None, "cuda_cudnn",
                                                                                         "cuda_flash", "flash_attn")}
    attn = {k: v["step_time_split_s"]["attention"] for k, v in t.items()}
    assert attn[None] == attn["cuda_cudnn"] == attn["flash_attn"] and attn["cuda_flash"] == pytest.approx(2 * attn[None])
    assert t["cuda_flash"]["cluster"]["rates"]["attention_flops"] == 2e14


@pytest.mark.parametrize("argv, fix", [
    (["--checkpoint-device-layers", "40"], "--checkpoint-device-layers 40 is more than the model's 32 decoder layers"),
    (["--checkpoint-device-layers", "-1"], "--checkpoint-device-layers -1 must be an integer >= 0"),
    (["--checkpoint", "on", "--checkpoint-device-layers", "4"], "it needs --checkpoint offload (now on)"),
])
def test_bad_device_layers_name_the_fix(capsys, argv, fix):
    assert main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", "1048576", *argv]) == 2
    assert fix in capsys.readouterr().err


def test_a_json_section_fpdt_train_would_refuse_is_refused(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "fpdt": {"checkpoint_device_layers": "8"}}))
    assert main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", "1048576", "--deepspeed", str(ds)]) == 2
    assert "--checkpoint-device-layers '8' must be an integer >= 0" in capsys.readouterr().err


def test_recommended_flags_always_name_the_device_layers(capsys):
    """Flags win over the JSON: advice that leaves a setting out would keep the JSON's, which
    may not fit it (device layers with --checkpoint on is refused)."""
    assert main(["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", "1048576"]) == 0
    assert "--checkpoint-device-layers 0 " in capsys.readouterr().out


def test_device_layers_copy_no_checkpoint_to_the_host():
    """The layers whose inputs stay on the GPU copy nothing to the host and back: with all of
    them there, offloaded checkpointing costs no checkpoint copy time."""
    cfg, cluster = load_model_config("llama-3-8b"), Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8)
    s = Setup.build(seq_len=2 ** 21, chunk_size=2 ** 16, hp=8, checkpointing="offload", offload=False)
    copy = {k: evaluate(cfg, s.updated(checkpoint_device_layers=k), cluster)["step_time_split_s"]["h2d_d2h"]
            for k in (0, 16, 32)}
    assert copy[0] >= copy[16] > copy[32] == 0.0     # (hidden behind compute but the first fetch, here)


def test_the_table_prints_the_mlp_chunks_the_model_runs_and_doc_len_packs(capsys):
    """``MLP chunks`` is the resolved count (the setup's option is None: the model's default), and
    with ``--doc-len`` the recommended fpdt-train flags pack the documents the plan counted."""
    from fpdt.plan.memory_model import mlp_chunks

    argv = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(2 ** 21)]
    out = run_json(capsys, *argv, "--doc-len", "8192")
    cfg = load_model_config("llama-3-8b")
    s = out["setup"]
    setup = Setup.build(seq_len=s["seq_len"], chunk_size=s["chunk_size"], hp=s["hp"], cp=s["cp"])
    assert s["mlp_chunks"] is None and out["mlp_chunks"] == mlp_chunks(cfg, setup) > 1
    assert out["recommended"]["pack_documents"] == "best-fit"
    assert main([*argv, "--doc-len", "8192"]) == 0
    text = capsys.readouterr().out
    assert f"MLP chunks {out['mlp_chunks']}, " in text and "MLP chunks None" not in text
    assert text.splitlines()[-1].endswith(" --pack-documents best-fit")
    assert main(argv) == 0
    assert "--pack-documents" not in capsys.readouterr().out

"""DeepSpeed's own ZeRO allocations in the planner: the contiguous-gradient bucket and the
optimizer step's fp32 sub-group, with their sizes taken from DeepSpeed's defaults."""

import glob
import json
import os

import pytest

from fpdt.plan import GPU_PRESETS, Cluster, evaluate, load_model_config
from fpdt.plan.models import param_counts
from fpdt.plan.setup import ZERO_REDUCE_BUCKET, ZERO_SUB_GROUP, Setup

K = 1024
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_constants_are_deepspeeds_defaults_and_fpdt_train_keeps_them():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from fpdt.train.config import DEFAULT_DS_CONFIG
    zc = DeepSpeedZeroConfig()
    assert (zc.reduce_bucket_size, zc.sub_group_size, zc.contiguous_gradients) == (ZERO_REDUCE_BUCKET,
                                                                                    ZERO_SUB_GROUP, True)
    zero = DEFAULT_DS_CONFIG.get("zero_optimization", {})
    assert not {"reduce_bucket_size", "sub_group_size", "contiguous_gradients"} & set(zero), zero


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "**", "ds_*.json"), recursive=True)),
                         ids=os.path.basename)
def test_planning_with_a_shipped_deepspeed_config_reads_its_zero_settings(path, capsys):
    """``fpdt-plan --deepspeed`` takes stage, offload, bucket sizes and precision from the file."""
    from fpdt.plan import Choice
    from fpdt.plan.cli import main
    from fpdt.plan.deepspeed_config import apply_deepspeed_config
    with open(path) as f:
        cfg = json.load(f)
    zero = cfg.get("zero_optimization", {})
    choice = apply_deepspeed_config(path, Choice())
    assert choice.zero_stage == zero.get("stage", 0)
    assert choice.reduce_bucket_size == zero.get("reduce_bucket_size", ZERO_REDUCE_BUCKET)
    assert choice.offload_optimizer == (zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"))
    enabled = cfg.get("bf16", {}).get("enabled")
    assert choice.dtype == (Choice().dtype if enabled == "auto" else "bf16" if enabled else "fp32")
    assert main(["--model", "llama-3.2-1b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--seq-len", str(256 * K),
                 "--deepspeed", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    bucket = choice.reduce_bucket_size * (2 if choice.dtype == "bf16" else 4) if choice.zero_stage >= 2 else 0
    assert out["setup"]["reduce_bucket_size"] == choice.reduce_bucket_size
    assert out["breakdown"]["communication_buffers"] >= bucket


def _evaluate(model, seq_len, gpus, zero_stage=3, **kw):
    s = Setup.build(seq_len=seq_len, chunk_size=min(seq_len, 64 * K), hp=gpus, zero_stage=zero_stage, **kw)
    return evaluate(load_model_config(model), s, Cluster(GPU_PRESETS["a100-80g"], gpus_per_node=gpus))


@pytest.mark.parametrize("stage, bucket", [(0, 0), (1, 0), (2, ZERO_REDUCE_BUCKET * 2), (3, ZERO_REDUCE_BUCKET * 2)])
def test_gradient_bucket_in_communication_buffers(stage, bucket):
    with_bucket = _evaluate("llama-3.2-1b", 256 * K, 8, zero_stage=stage)
    pc = param_counts(load_model_config("llama-3.2-1b"))
    gathers = {0: 0, 1: 0, 2: pc.layer * 2,
               3: (max(2 * pc.layer, pc.layer + max(pc.embedding, pc.head)) + pc.layer) * 2}[stage]
    assert with_bucket["breakdown"]["communication_buffers"] == pytest.approx(gathers + bucket)


def test_optimizer_step_sets_the_peak_when_activations_are_small():
    """Llama-3-8B at 8K tokens on one GPU: the step flattens one sub-group of 1e9 bf16
    gradient elements and casts it to fp32 (6 GB) beside the bucket, more than the
    gathers and the activations of 8K tokens."""
    out = _evaluate("llama-3-8b", 8 * K, 1)
    b = out["breakdown"]
    assert b["optimizer_step"] == pytest.approx(ZERO_SUB_GROUP * (4 + 2))
    assert b["communication_buffers"] == pytest.approx(ZERO_REDUCE_BUCKET * 2)
    assert b["in_flight_layer"] == b["loss_chunk"] == b["checkpoints_device"] == 0
    device = sum(v for k, v in b.items() if not k.endswith("_host"))
    assert device == pytest.approx(out["device_peak_bytes"])
    # long sequences: the layer is the peak again, and the step is listed as a working set only
    long = _evaluate("llama-3-8b", 256 * K, 1)
    assert long["breakdown"]["optimizer_step"] == 0 and long["breakdown"]["in_flight_layer"] > 0
    assert long["working_sets"]["optimizer_step"] == pytest.approx(ZERO_SUB_GROUP * 6 + ZERO_REDUCE_BUCKET * 2)


def test_no_step_transient_with_the_optimizer_on_the_host():
    out = _evaluate("llama-3-8b", 8 * K, 1, offload_optimizer=True)
    assert out["breakdown"]["optimizer_step"] == 0


def test_deepspeed_json_fpdt_section_is_planned_and_flags_win(capsys):
    """The "fpdt" section fixes what the run will use (as fpdt-train reads it); flags win."""
    from fpdt.plan.cli import main
    path = os.path.join(ROOT, "examples", "llama-3-8b", "ds_zero3_8gpu.json")
    base = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--seq-len", str(1024 * K),
            "--deepspeed", path, "--json"]
    assert main(base) == 0
    s = json.loads(capsys.readouterr().out)["setup"]
    assert (s["chunk_size"], s["hp"], s["cp"], s["offload"], s["checkpoint"]) == (64 * K, 8, 1, True, "offload")
    assert (s["zero_stage"], s["dtype"], s["reduce_bucket_size"], s["batch"]) == (3, "bf16", 5e7, 1)
    assert s["lm_head_wgrad"] == "recompute"
    assert main(base + ["--chunk-size", str(16 * K), "--checkpoint", "on", "--zero-stage", "2"]) == 0
    s = json.loads(capsys.readouterr().out)["setup"]
    assert (s["chunk_size"], s["checkpoint"], s["zero_stage"]) == (16 * K, "on", 2)
    # without --deepspeed the planner chooses the chunk size
    assert main(base[:-3] + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["dtype"] == "bf16"


def test_mlp_chunks_default_is_the_trainers():
    """fpdt-train leaves the MLP chunk count to the options' default (the model's rule,
    ceil(2 u I / hidden): 56 for Llama-3-8B at u = 8); the planner plans that, and takes the
    count from --mlp-chunks or the JSON's "fpdt" section."""
    from fpdt.plan.memory_model import mlp_chunks
    from fpdt.plan.models import load_model_config as load_model
    from fpdt.plan import Choice, Cluster, GPU_PRESETS, plan
    from fpdt.train.config import TrainerOptions, validate
    cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8)
    out = plan("llama-3-8b", cluster, seq_len=256 * K, choice=Choice(chunk_size=32 * K))
    trainer = validate(TrainerOptions(sp=8, chunk_size=32 * K, offload=False), 256 * K, 8, "cpu", {})
    assert out["setup"]["mlp_chunks"] is trainer.mlp_chunks is None   # default changed from 2 u = 16
    from fpdt.plan.setup import Setup
    assert mlp_chunks(load_model("llama-3-8b"), Setup.build(seq_len=256 * K, chunk_size=32 * K, hp=8)) == 56
    fixed = plan("llama-3-8b", cluster, seq_len=256 * K, choice=Choice().fix(chunk_size=32 * K, mlp_chunks=16))
    assert fixed["setup"]["mlp_chunks"] == 16
    assert out["step_time_split_s"]["wgrad_accumulation"] > 3 * fixed["step_time_split_s"]["wgrad_accumulation"]


def test_mlp_and_loss_chunks_from_the_json_and_flags(tmp_path, capsys):
    from fpdt.plan.cli import main
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                                "fpdt": {"chunk_size": 32 * K, "mlp_chunks": 24, "loss_chunks": 100}}))
    base = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(256 * K), "--deepspeed", str(path), "--json"]
    assert main(base) == 0
    s = json.loads(capsys.readouterr().out)["setup"]
    assert (s["mlp_chunks"], s["loss_chunks"]) == (24, 100)
    assert main(base + ["--mlp-chunks", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["mlp_chunks"] == 8
    assert main(base + ["--mlp-chunks", "0"]) == 2
    assert "--mlp-chunks 0" in capsys.readouterr().err


def test_the_micro_batch_is_derived_from_train_batch_size_as_deepspeed_does(tmp_path):
    """A JSON with train_batch_size and no micro batch: DeepSpeed runs train_batch_size /
    (accumulation x world) sequences per micro step; fpdt-plan plans the same."""
    import json

    from fpdt.plan.deepspeed_config import apply_deepspeed_config
    from fpdt.plan.planner import Choice
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "gradient_accumulation_steps": 2,
                                "zero_optimization": {"stage": 3}}))
    assert apply_deepspeed_config(str(path), Choice(), world_size=8).batch == 2
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}}))
    assert apply_deepspeed_config(str(path), Choice(), world_size=8).batch == 3


def test_auto_values_of_the_trainer_leave_the_planners_choice():
    """Hugging Face's Trainer fills in ``"auto"``: the planner keeps its own precision and micro
    batch and DeepSpeed's ZeRO sizes for those keys, and reads the rest of the file."""
    from fpdt.plan import Choice
    from fpdt.plan.deepspeed_config import apply_deepspeed_dict
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "sub_group_size": 1e8,
                                 "offload_optimizer": {"device": "cpu"}}}
    start = Choice(dtype="fp32", batch=3)
    choice = apply_deepspeed_dict(cfg, start)
    assert (choice.dtype, choice.batch, choice.reduce_bucket_size) == ("fp32", 3, start.reduce_bucket_size)
    assert (choice.zero_stage, choice.sub_group_size, choice.offload_optimizer) == (2, 1e8, True)
    assert apply_deepspeed_dict({**cfg, "bf16": {"enabled": True}}, start).dtype == "bf16"
    # the Trainer fills reduce_bucket_size with hidden_size ** 2
    assert apply_deepspeed_dict(cfg, start, hidden_size=4096).reduce_bucket_size == 4096.0 ** 2


def test_fpdt_train_refuses_auto_naming_the_trainer():
    from fpdt.train.config import ConfigError, load_ds_config
    for cfg, where in (({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
                       ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
                       ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
                        "zero_optimization.reduce_bucket_size")):
        with pytest.raises(ConfigError, match=f"{where}='auto' is filled in by Hugging Face's Trainer"):
            load_ds_config(cfg)

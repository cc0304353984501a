"""fpdt-train's memory preflight: the host bytes offload will hold, predicted by fpdt-plan's
model, refuse a run the node cannot hold before it starts; on CUDA a predicted device peak
above the GPU's capacity is a warning."""

from __future__ import annotations

import pytest
import torch

import fpdt.model as fm
from fpdt.offload import fresh_runtime
from fpdt.offload.host_pool import _ALL_POOLS
from fpdt.plan import load_model_config
from fpdt.plan import trainer_run as mp
from fpdt.plan.decide import Node, decide_run
from fpdt.train.config import TrainerOptions, load_ds_config, validate
from tests.train.helpers import fresh_env, write_fixture

CPU = Node("cpu", None, 1, 64 * 2 ** 30)

HF = dict(model_type="llama", vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
          num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
          tie_word_embeddings=False)


def _pool_bytes() -> int:
    return sum(p.stats.allocated_bytes for p in list(_ALL_POOLS))


@pytest.mark.slow
@pytest.mark.parametrize("seq_len, u, dtype, checkpoint, offload", [
    (512, 4, torch.float32, "offload", True),
    (512, 2, torch.bfloat16, "offload", True),
    (768, 3, torch.float32, "offload", False),
    (512, 4, torch.float32, "on", True),
    (1024, 8, torch.bfloat16, "offload", True),
])
def test_predicted_host_bytes_match_what_the_host_pool_holds(seq_len, u, dtype, checkpoint, offload):
    """The estimate the trainer gates on, against the host memory the pool actually holds
    after a forward + backward (buffers in use and cached for reuse: what the node's RAM
    holds), within 10%. The layer-input checkpoints, the term that grows with layers x
    tokens, are exact."""
    with fresh_runtime("sim") as rt:              # a fresh runtime (and host pool), drained at exit
        torch.manual_seed(0)
        model = fm.from_config(HF, dtype=dtype, num_chunks=u, offload=offload, checkpointing=checkpoint, runtime=rt)
        inputs = model.prepare_inputs(torch.randint(0, HF["vocab_size"], (1, seq_len)))
        before = _pool_bytes()
        model(**inputs).backward()
        held = _pool_bytes() - before

    # runtime="sim": validate() allows CPU offload on it
    opts = TrainerOptions(chunk_size=seq_len // u, offload=offload, checkpointing=checkpoint, runtime="sim")
    ds = load_ds_config(None, "cpu")[0]
    plan = validate(opts, seq_len, 1, "cpu", ds)
    est = mp.estimate(model.config, plan, opts, ds, "fp32" if dtype == torch.float32 else "bf16", "cpu", 1)
    predicted = sum(est.breakdown[k] for k in mp.HOST_CATEGORIES)
    assert est.breakdown["checkpoints_host"] == (HF["num_hidden_layers"] * seq_len * HF["hidden_size"]
                                                 * dtype.itemsize if checkpoint == "offload" else 0)
    assert 0.9 <= predicted / held <= 1.1, (predicted, held)


def _estimate(seq_len: int, sp: int, ranks_on_node: int, ds=None):
    from fpdt.plan import load_model_config
    opts = TrainerOptions(sp=sp)
    ds = ds or load_ds_config(None, "cuda")[0]
    plan = validate(opts, seq_len, sp, "cuda", ds)
    return mp.estimate(load_model_config("llama-3-8b"), plan, opts, ds, "bf16", "cuda", ranks_on_node)


def test_a_node_that_cannot_hold_the_offload_is_refused_with_the_fix():
    """Llama-3-8B at 4M on 8 GPUs offloads 32 layers x 512K tokens x 4096 x 2 B x 8 ranks =
    1 TiB of layer inputs per node, plus the attention stash."""
    est = _estimate(4 * 1024 * 1024, 8, 8)
    assert est.breakdown["checkpoints_host"] == 1024 ** 4
    need = sum(est.breakdown[k] for k in mp.HOST_CATEGORIES)
    mp.check_host_memory(est, 8, need, 4 * 1024 * 1024)              # just enough: fine
    with pytest.raises(Exception, match=r"8 rank\(s\) on this node would offload 1\d\d\d\.\d GiB to host memory at "
                                        r"--seq-len 4194304 \(checkpoints 1024\.0 GiB, attention stash .* GiB\), but it "
                                        r"has 1000\.0 GiB available.*--checkpoint-device-layers K .*--checkpoint on"
                                        r".*fpdt-plan --max-seq-len"):
        mp.check_host_memory(est, 8, 1000 * 1024 ** 3, 4 * 1024 * 1024)


def test_device_layers_move_layer_inputs_from_host_to_gpu():
    """--checkpoint-device-layers K in the trainer's prediction: K layer inputs per rank leave
    the node's host memory and join the GPU's checkpoints (two in flight otherwise)."""
    ds = load_ds_config(None, "cuda")[0]
    plan = validate(TrainerOptions(sp=8), 4 * 1024 * 1024, 8, "cuda", ds)
    cfg = load_model_config("llama-3-8b")
    per_rank_layer = 512 * 1024 * 4096 * 2
    base = mp.estimate(cfg, plan, TrainerOptions(sp=8), ds, "bf16", "cuda", 8)
    tiered = mp.estimate(cfg, plan, TrainerOptions(sp=8, checkpoint_device_layers=6), ds, "bf16", "cuda", 8)
    assert base.breakdown["checkpoints_host"] - tiered.breakdown["checkpoints_host"] == 6 * 8 * per_rank_layer
    assert tiered.breakdown["checkpoints_device"] - base.breakdown["checkpoints_device"] == (6 - 2) * per_rank_layer
    advice = mp.out_of_memory_advice(1, plan, TrainerOptions(sp=8, checkpoint_device_layers=6), tiered, "x", 80 * 2 ** 30)
    assert "fewer --checkpoint-device-layers (now 6" in advice
    assert "--checkpoint-device-layers" not in mp.out_of_memory_advice(1, plan, TrainerOptions(sp=8), base, "x",
                                                                       80 * 2 ** 30)


def test_ranks_on_this_node_come_from_the_launcher(monkeypatch):
    for key in mp.LOCAL_SIZE_VARS:
        monkeypatch.delenv(key, raising=False)
    assert mp.ranks_on_this_node(16) == 16
    assert mp.ranks_on_this_node(16, gpus_on_node=8) == 8    # no launcher variable: one rank per GPU at most
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")   # Open MPI
    assert mp.ranks_on_this_node(16, gpus_on_node=8) == 2
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "6")        # srun
    assert mp.ranks_on_this_node(16) == 6
    monkeypatch.setenv("LOCAL_SIZE", "8")                # deepspeed's launcher
    assert mp.ranks_on_this_node(16) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")          # torchrun's
    assert mp.ranks_on_this_node(16) == 4
    # half the ranks on the node: half the host bytes
    assert (_estimate(1024 * 1024, 8, 4).host_peak_bytes * 2 == _estimate(1024 * 1024, 8, 8).host_peak_bytes)


def test_offloaded_optimizer_state_counts_on_the_host():
    ds = load_ds_config(None, "cuda")[0]
    ds["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    est = _estimate(1024 * 1024, 8, 8, ds)
    assert est.breakdown["model_states_host"] > 0 and est.breakdown["optimizer_state"] == 0


def test_device_warning_names_the_largest_parts_and_the_planners_settings():
    est = _estimate(4 * 1024 * 1024, 8, 8)
    flags = mp.Recommendation("--chunk-size 32768 --hp 8 --cp 1", "fpdt-plan's settings for this GPU: --chunk-size 32768")
    assert mp.device_memory_warning(est, 80 * 1024 ** 3, lambda: pytest.fail("searched for a run that fits")) is None
    line = mp.device_memory_warning(est, 20 * 1024 ** 3, lambda: flags)
    assert line.startswith("warning: fpdt-plan's model predicts a device peak of ")
    assert "more than its 20.0 GiB (largest: optimizer state 11.2, in flight layer 8.0, checkpoints device 8.0 GiB)" in line
    assert line.endswith("; fpdt-plan's settings for this GPU: --chunk-size 32768")


def _heavy_run(seq_len, ds, **extra):
    """Llama-3-8B on 8 GPUs set up to need too much: one chunk, layer inputs on the GPU,
    nothing offloaded, the fp32 LM-head accumulator."""
    opts = TrainerOptions(sp=8, chunk_size=seq_len, checkpointing="on", offload=False, **extra)
    return opts, validate(opts, seq_len, 8, "cuda", ds)


def test_the_planners_flags_fit_and_fpdt_train_takes_them():
    """The recommended flags, given on the command line over a JSON whose "fpdt" section
    sets another mesh, parse, validate, keep the run's fixed MLP chunk count, and are
    predicted to fit 8 x 80 GiB; nothing fits 4 GiB GPUs."""
    from fpdt.plan import load_model_config
    from fpdt.cli.train import build_parser, fpdt_flags
    from fpdt.train.config import merge_options
    cfg, S = load_model_config("llama-3-8b"), 2 * 1024 * 1024
    ds = load_ds_config(None, "cuda")[0]
    heavy, plan = _heavy_run(S, ds, mlp_chunks=48)
    assert _estimate_of(cfg, plan, heavy, ds).device_peak_bytes > 80 * 1024 ** 3
    rec = mp.recommend(cfg, plan, heavy, ds, 8, 80 * 1024 ** 3, 1024 ** 4)
    assert rec.flags.startswith("--chunk-size ")
    assert " --checkpoint offload --checkpoint-device-layers 0 --offload --lm-head-wgrad " in rec.flags
    assert rec.note == f"fpdt-plan's settings for this GPU: {rec.flags}"
    section = {"sp": 8, "hp": 2, "cp": 4, "mlp_chunks": 48}            # the run's JSON: flags win over it
    args = build_parser().parse_args(["--model-config", "c.json", "--data", "d", "--seq-len", str(S), "--steps", "1",
                                      *rec.flags.split()])
    opts = merge_options(fpdt_flags(args), section)
    fixed = validate(opts, S, 8, "cuda", ds)
    assert f"--hp {fixed.hp} --cp {fixed.cp}" in rec.flags and fixed.mlp_chunks == 48
    assert _estimate_of(cfg, fixed, opts, ds).device_peak_bytes <= 80 * 1024 ** 3
    none = mp.recommend(cfg, plan, heavy, ds, 8, 4 * 1024 ** 3, 1024 ** 4)
    assert none.flags is None and "no setting of this length and GPU count that fits" in none.note


def test_a_mesh_no_power_of_two_splits_still_gets_settings():
    """6 GPUs: the planner also tries fpdt-train's own default chunk for the mesh."""
    from fpdt.plan import load_model_config
    cfg = {**load_model_config("llama-3-8b").to_hf(), "num_attention_heads": 24, "num_key_value_heads": 6,
           "head_dim": 128, "hidden_size": 3072}
    from fpdt.model import ModelConfig
    cfg = ModelConfig.from_hf(cfg)
    S, ds = 6 * 8 * 65536, load_ds_config(None, "cuda")[0]
    opts = TrainerOptions(sp=6, chunk_size=S, checkpointing="on", offload=False)
    plan = validate(opts, S, 6, "cuda", ds)
    rec = mp.recommend(cfg, plan, opts, ds, 6, 80 * 1024 ** 3, 1024 ** 4)
    from fpdt.train.config import default_chunk_size
    assert default_chunk_size(S, 6) == 49152
    assert rec.flags is not None and rec.flags.startswith("--chunk-size 49152 --hp 6 --cp 1"), rec


def _estimate_of(cfg, plan, opts, ds):
    return mp.estimate(cfg, plan, opts, ds, "bf16", "cuda", 8)


def test_micro_batch_from_train_batch_size_counts():
    """train_batch_size 16 over 8 ranks without a micro batch: DeepSpeed runs 2 sequences per
    micro step, so the layer inputs offloaded double."""
    one = _estimate(1024 * 1024, 8, 8)
    ds = {**load_ds_config(None, "cuda")[0], "train_batch_size": 16}
    del ds["train_micro_batch_size_per_gpu"]
    two = _estimate(1024 * 1024, 8, 8, ds)
    assert two.breakdown["checkpoints_host"] == 2 * one.breakdown["checkpoints_host"]


@pytest.mark.slow
def test_a_run_the_planner_cannot_describe_still_trains(tmp_path):
    """S = 63 with one rank and one chunk: fpdt-train runs it (the planner's cost model once
    refused odd lengths)."""
    import subprocess
    import sys
    cfg, data = write_fixture(str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "fpdt.cli", "--model-config", cfg, "--data", data, "--seq-len", "63",
                           "--steps", "1", "--no-mem-accounting"], capture_output=True, text=True, env=_clean_env(),
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _clean_env():
    return fresh_env("FPDT_RUNTIME", "FPDT_DEBUG")


REFUSE_RUN = """
import sys, types, psutil
psutil.virtual_memory = lambda: types.SimpleNamespace(available=4096, total=4096)
from fpdt.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_cli_refuses_before_building_the_model(tmp_path):
    import subprocess
    import sys
    cfg, data = write_fixture(str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", REFUSE_RUN, "--model-config", cfg, "--data", data, "--seq-len", "64",
                           "--steps", "1", "--checkpoint", "offload", "--offload", "--chunk-size", "32"],
                          capture_output=True, text=True, env={**_clean_env(), "FPDT_RUNTIME": "sim"}, timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "would offload" in err and "0.0 GiB available" in err and "--checkpoint on" in err, err


def test_out_of_memory_advice_lists_only_levers_not_in_use():
    from fpdt.plan import load_model_config
    ds = load_ds_config(None, "cuda")[0]
    lean = TrainerOptions(sp=8, lm_head_wgrad="recompute")
    plan = validate(lean, 1024 * 1024, 8, "cuda", ds)
    est = mp.estimate(load_model_config("llama-3-8b"), plan, lean, ds, "bf16", "cuda", 8)
    rec = mp.Recommendation("--chunk-size 32768 --hp 8 --cp 1", "fpdt-plan's settings for this GPU: --chunk-size 32768")
    line = mp.out_of_memory_advice(3, plan, lean, est, "CUDA out of memory. Tried to allocate 2 GiB", 80 * 1024 ** 3,
                                   rec)
    assert line.startswith("step 3: out of device memory (CUDA out of memory. Tried to allocate 2 GiB); the GPU has "
                           "80.0 GiB; fpdt-plan's model predicted a peak of ")
    assert "--offload" not in line and "--checkpoint offload" not in line and "--lm-head-wgrad" not in line
    assert "a smaller --chunk-size (now 65536, e.g. 32768)" in line and "offload_optimizer" in line
    assert line.endswith(rec.note)
    bare = TrainerOptions(sp=8, offload=False, checkpointing="on", lm_head_wgrad="accumulate")
    plan = validate(bare, 1024 * 1024, 8, "cuda", ds)
    line = mp.out_of_memory_advice(1, plan, bare, est, "x", 80 * 1024 ** 3, rec)
    assert "--offload (attention chunks" in line and "--checkpoint offload" in line and "--lm-head-wgrad recompute" in line
    cpu = mp.out_of_memory_advice(1, plan, bare, None, "x", model_path="m/config.json")   # no GPU, no prediction
    assert "the GPU has" not in cpu and "predicted" not in cpu and "--offload" not in cpu
    assert cpu.endswith("fpdt-plan --model m/config.json --deepspeed <this JSON> --seq-len 1048576 --gpu ... recommends "
                        "settings that fit")


OOM_RUN = """
import sys, torch
import fpdt.train.loop as loop
def oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB\\nmore detail")
loop.train_step = oom
from fpdt.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_cli_turns_an_out_of_memory_step_into_one_line_with_the_levers(tmp_path):
    """In a process of its own: the run gets as far as its first step (process group,
    DeepSpeed engine) before the allocator fails."""
    import subprocess
    import sys
    cfg, data = write_fixture(str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", OOM_RUN, "--model-config", cfg, "--data", data, "--seq-len", "64",
                           "--steps", "2", "--chunk-size", "32"], capture_output=True, text=True, env=_clean_env(),
                          timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("fpdt-train: error: step 1: out of device memory (CUDA out of memory. Tried to allocate "
                          "64.00 MiB); fpdt-plan's model predicted a peak of "), err
    assert "a smaller --chunk-size (now 32, e.g. 16)" in err and "--checkpoint on" in err and "--offload" not in err
    assert f"fpdt-plan --model {cfg} --seq-len 64 --gpu ... recommends" in err       # no JSON given: none named


def test_a_planner_failure_becomes_a_note_not_an_error(tmp_path, monkeypatch):
    from fpdt.train import preflight

    def broken(*args, **kwargs):
        raise ValueError("a shape the model does not cover")
    monkeypatch.setattr(mp, "estimate", broken)
    cfg, _ = write_fixture(str(tmp_path))
    ds = load_ds_config(None, "cpu")[0]
    plan = validate(TrainerOptions(), 64, 1, "cpu", ds)
    check = decide_run(preflight.model_source(None, cfg).config, plan, TrainerOptions(), ds, "fp32", CPU).memory
    assert check.estimate is None and check.lines == (
        "note: fpdt-plan's model cannot describe this run (ValueError: a shape the model does not cover); no memory "
        "prediction or host check",)
    assert "predicted" not in mp.out_of_memory_advice(1, plan, TrainerOptions(), check.estimate, "x")


def _short_node_body(rank, world_size, tmp, cfg, data, short_rank):
    import os
    import types

    import fpdt.cli.train as cli
    os.environ["FPDT_RUNTIME"] = "sim"          # this rank only: offload on the CPU
    os.environ["LOCAL_WORLD_SIZE"] = "1"        # one rank per "node"
    free = 4096 if rank == short_rank else 64 * 2 ** 30
    cli.psutil.virtual_memory = lambda: types.SimpleNamespace(available=free, total=free)
    status = cli.main(["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "1", "--sp", "2",
                       "--checkpoint", "offload", "--offload", "--chunk-size", "32"])
    with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
        f.write(str(status))


@pytest.mark.slow
@pytest.mark.parametrize("short_rank", [0, 1])
def test_every_rank_stops_together_when_one_node_is_short(tmp_path, short_rank):
    """Two ranks, each on its own "node"; only one node lacks the memory. Both stop at once
    with exit status 2 (before, the short rank left and the other waited in a collective)."""
    import os

    from tests.distributed import run_distributed
    cfg, data = write_fixture(str(tmp_path))
    run_distributed(_short_node_body, 2, args=(str(tmp_path), cfg, data, short_rank), timeout=120)
    assert [open(os.path.join(tmp_path, f"rank{r}")).read() for r in (0, 1)] == ["2", "2"]


def test_the_prediction_follows_the_kernels_gqa_expansion(tmp_path, monkeypatch):
    """A kernel without native GQA (cpu, math, cuda_efficient) holds the KV heads repeated
    to the query heads per block; the prediction fpdt-train prints models the run's kernel
    (``not AttentionBackend.native_gqa``), and by default the device type's automatic one."""
    from fpdt.attention.kernels import BACKENDS
    from fpdt.train import preflight
    cfg, _ = write_fixture(str(tmp_path))
    source = preflight.model_source(None, cfg)
    ds = load_ds_config(None, "cpu")[0]
    plan = validate(TrainerOptions(), 64, 1, "cpu", ds)
    # given; else on CUDA the named kernel's or the automatic one's for the precision; elsewhere yes
    for expands, device_type, dtype, kernel, want in (
            (True, "cuda", "bf16", None, True), (False, "cpu", "fp32", None, False),
            (None, "cpu", "bf16", None, True), (None, "cuda", "bf16", None, False),    # FlashAttention-2 / cuDNN
            (None, "cuda", "fp32", None, True),                                         # the efficient kernel
            (None, "cuda", "bf16", "cuda_efficient", True), (None, "cuda", "bf16", "cuda_cudnn", False)):
        opts = TrainerOptions(backend=kernel)
        setup = mp.planned_setup(plan, opts, ds, dtype, device_type, expands, source.config.head_dim)
        assert setup.kernel_expands_gqa is want, (expands, device_type, dtype, kernel)
    seen = []
    real = mp.estimate
    monkeypatch.setattr(mp, "estimate", lambda *a: seen.append(a[7]) or real(*a))   # kernel_expands_gqa
    for expands in (True, False):
        decide_run(source.config, plan, TrainerOptions(), ds, "fp32", CPU, kernel_expands_gqa=expands)
    assert seen == [True, False]
    kernel = preflight.attention_kernel(None, torch.device("cpu"), torch.float32, source.config.head_dim)
    assert kernel is BACKENDS["cpu"] and not kernel.native_gqa


def test_the_recommendation_keeps_layer_inputs_on_the_gpu_when_the_host_is_short():
    """Llama-3-8B at 4M on 8 x 80 GiB with 1 TiB of host: with every input offloaded the host
    cannot hold it; the planner's settings keep the fewest last layers' inputs on the GPUs."""
    ds = load_ds_config(None, "cuda")[0]
    plan = validate(TrainerOptions(sp=8), 4 * 1024 * 1024, 8, "cuda", ds)
    cfg = load_model_config("llama-3-8b")
    rec = mp.recommend(cfg, plan, TrainerOptions(sp=8), ds, 8, 80 * 2 ** 30, 1024 * 2 ** 30)
    k = int(rec.flags.split("--checkpoint-device-layers ")[1].split()[0])
    assert 0 < k < cfg.num_layers and "--checkpoint offload" in rec.flags
    fits = [mp.estimate(cfg, plan, TrainerOptions(sp=8, checkpoint_device_layers=j), ds, "bf16", "cuda", 8)
            for j in (k - 1, k)]
    host = [sum(e.breakdown[c] for c in mp.HOST_CATEGORIES) + e.breakdown["process_host"] for e in fits]
    assert host[0] > 1024 * 2 ** 30 >= host[1]                      # the fewest that fit the host


def test_a_lora_run_is_checked_as_lora(monkeypatch):
    """Llama-3-70B on one node of 8, ZeRO-3 with the optimizer offloaded: trained fully, its
    gradients and AdamW state (about 920 GiB per node) do not fit 512 GiB of host memory and the
    run is refused; with --lora-rank 16 only the adapters' are offloaded (about 2.3 GiB) and it
    passes (the planner's LoRA setup: the frozen base holds no gradient or optimizer state)."""


    from fpdt.train import preflight
    from fpdt.train.config import ConfigError
    node = Node("cpu", None, 8, 512 * 2 ** 30)
    cfg = load_model_config("llama-3-70b")
    source = preflight.ModelSource("llama-3-70b", cfg)
    ds = {**load_ds_config(None, "cpu")[0], "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    opts = TrainerOptions(sp=8)
    plan = validate(opts, 128 * 1024, 8, "cpu", ds)
    with pytest.raises(ConfigError, match=r"8 rank\(s\) on rank 0's node would offload 9\d\d\.\d GiB .*\(model states 9"):
        decide_run(source.config, plan, opts, ds, "bf16", node)
    check = decide_run(source.config, plan, opts, ds, "bf16", node, lora_rank=16).memory
    assert check.estimate.breakdown["model_states_host"] < 3 * 2 ** 30
    assert check.lines == ("fpdt-plan's model of this run: host offload 2.31 GiB per node",)
    full = mp.estimate(cfg, plan, opts, ds, "bf16", "cpu", 8)
    assert check.estimate.breakdown["optimizer_state"] == full.breakdown["optimizer_state"] == 0   # on the host


def test_a_lora_runs_memory_advice_is_the_lora_plans(monkeypatch):
    """Llama-3-70B at 512K on one node of 8 x 80 GiB (1 TiB of host), ZeRO-3 without offload:
    trained fully, its weights, gradients and AdamW state (16 B per parameter over 8 GPUs, about
    130 GiB per GPU) fit no setting; with --lora-rank 16 the frozen base holds no gradient or
    optimizer state, and the planner's LoRA settings fit. The CUDA path of decide_run (the
    device-memory warning's and the out-of-memory line's advice), with the GPU faked."""


    from fpdt.train import preflight
    from fpdt.cli.train import build_parser, fpdt_flags
    from fpdt.train.config import merge_options
    node = Node("cuda", 80 * 2 ** 30, 8, 1024 * 2 ** 30)
    cfg, S = load_model_config("llama-3-70b"), 512 * 1024
    source = preflight.ModelSource("llama-3-70b", cfg)
    ds = load_ds_config(None, "cuda")[0]
    opts = TrainerOptions(sp=8)
    plan = validate(opts, S, 8, "cuda", ds)
    full = decide_run(source.config, plan, opts, ds, "bf16", node).memory
    assert full.recommend().flags is None and "no setting of this length and GPU count that fits" in full.recommend().note
    lora = decide_run(source.config, plan, opts, ds, "bf16", node, lora_rank=16).memory
    rec = lora.recommend()
    assert rec.flags is not None and rec.flags.endswith(" --lora-rank 16"), rec
    assert rec.flags.startswith("--chunk-size ") and " --checkpoint offload " in rec.flags, rec
    args = build_parser().parse_args(["--model-config", "c.json", "--data", "d", "--seq-len", str(S), "--steps", "1",
                                      "--sp", "8", *rec.flags.split()])
    assert args.lora_rank == 16
    fixed_opts = merge_options(fpdt_flags(args), {})
    fixed = validate(fixed_opts, S, 8, "cuda", ds)
    est = mp.estimate(cfg, fixed, fixed_opts, ds, "bf16", "cuda", 8, lora_rank=16)
    assert est.device_peak_bytes <= 80 * 2 ** 30                     # the LoRA plan's settings fit
    line = mp.out_of_memory_advice(1, plan, opts, lora.estimate, "x", 80 * 2 ** 30, rec)
    assert line.endswith(f"fpdt-plan's settings for this GPU: {rec.flags}")
    cpu = mp.out_of_memory_advice(1, plan, opts, None, "x", model_path="m/config.json", deepspeed_path=None,
                                  lora_rank=16)
    assert cpu.endswith(f"fpdt-plan --model m/config.json --seq-len {S} --lora-rank 16 --gpu ... recommends settings "
                        f"that fit")

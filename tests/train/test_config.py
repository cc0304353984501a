"""Option merging and up-front validation: every bad configuration names its fix."""

from __future__ import annotations

import pytest

from fpdt.cli.train import build_parser, fpdt_flags, fpdt_options, main
from fpdt.train.config import ConfigError, TrainerOptions, load_ds_config, merge_options, validate
from tests.train.helpers import write_fixture, write_json

FP32 = {"train_micro_batch_size_per_gpu": 1}


def test_flags_win_over_json_over_defaults():
    opts = merge_options({"sp": 2, "chunk_size": None, "offload": None},
                         {"chunk_size": 64, "sp": 4, "checkpoint": "on"})
    assert opts == TrainerOptions(sp=2, chunk_size=64, checkpointing="on")
    assert merge_options({}, None) == TrainerOptions()


def test_lm_head_wgrad_reaches_the_model():
    """The flag (or JSON key) is one of the model's modes and is handed to it."""
    from fpdt.model.loss import WGRAD_MODES
    from fpdt.options import LM_HEAD_WGRAD_MODES
    assert LM_HEAD_WGRAD_MODES == WGRAD_MODES
    args = build_parser().parse_args(["--model-config", "c.json", "--steps", "1", "--data", "x.npy", "--seq-len", "8",
                                     "--lm-head-wgrad", "recompute"])
    assert merge_options(fpdt_flags(args), {"lm_head_wgrad": "accumulate"}).lm_head_wgrad == "recompute"
    # unset: recompute (the H100 measurement of benchmarks/README.md); a JSON can still choose
    no_flag = build_parser().parse_args(["--model-config", "c.json", "--steps", "1", "--data", "x.npy", "--seq-len", "8"])
    assert merge_options(fpdt_flags(no_flag), {}).lm_head_wgrad == "recompute"
    assert merge_options(fpdt_flags(no_flag), {"lm_head_wgrad": "accumulate"}).lm_head_wgrad == "accumulate"
    import fpdt.model as fm
    from tests.model.helpers import hf_model
    model = fm.from_config(hf_model("llama_gqa").config, lm_head_wgrad="recompute")
    assert "lm_head_wgrad='recompute'" in repr(model)


def test_fpdt_key_is_stripped_and_rest_passed_untouched(tmp_path):
    cfg = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "whatever_deepspeed_knows": 1,
           "train_batch_size": 8, "fpdt": {"sp": 2}}
    ds, section = load_ds_config(write_json(str(tmp_path / "ds.json"), cfg))
    assert section == {"sp": 2}
    assert ds == {k: v for k, v in cfg.items() if k != "fpdt"}


@pytest.mark.parametrize("section, match", [
    ({"chunk_sise": 4}, r"unknown key 'chunk_sise'.*did you mean 'chunk_size'"),
    ({"sp": 0}, r"sp=0 must be an integer >= 1"),
    ({"checkpoint": "full"}, r"checkpoint='full' must be one of"),
    ({"offload": "yes"}, r"offload='yes' must be True or False"),
    ({"lm_head_wgrad": "sliced"}, r"lm_head_wgrad='sliced' must be one of \('accumulate', 'recompute'\)"),
])
def test_bad_fpdt_section(section, match):
    with pytest.raises(ConfigError, match=match):
        validate(merge_options({}, section), 64, 1, "cpu", {})


@pytest.mark.parametrize("opts, seq_len, world, device, ds, match", [
    (TrainerOptions(sp=3), 96, 2, "cpu", FP32, r"--sp 3 does not divide the world size 2"),
    (TrainerOptions(sp=2, chunk_size=45), 90, 2, "cpu", FP32, r"not divisible by sp x chunks = 2 x 2 = 4"),
    (TrainerOptions(chunk_size=128), 96, 1, "cpu", FP32, r"chunk_size=128 is larger than the sequence"),
    (TrainerOptions(chunk_size=40), 96, 1, "cpu", FP32, r"seq_len=96 is not divisible by chunk_size=40"),
    (TrainerOptions(offload=True), 96, 1, "cpu", FP32, r"--offload needs a CUDA device.*--no-offload"),
    (TrainerOptions(checkpointing="offload"), 96, 1, "cpu", FP32, r"'offload' needs a CUDA device.*--checkpoint on"),
    (TrainerOptions(), 96, 1, "cpu", {"fp16": {"enabled": True}}, r"fp16 training needs a CUDA device.*bf16"),
    (TrainerOptions(runtime="cuda"), 96, 1, "cpu", FP32, r"--runtime cuda needs a CUDA device.*--runtime sim"),
])
def test_validate_errors(opts, seq_len, world, device, ds, match):
    with pytest.raises(ConfigError, match=match):
        validate(opts, seq_len, world, device, ds)


def test_validate_plan():
    plan = validate(TrainerOptions(sp=2, chunk_size=32), 128, 4, "cpu", FP32)
    assert (plan.sp, plan.dp, plan.num_chunks, plan.mlp_chunks, plan.local_seq_len) == (2, 2, 4, None, 64)  # the rule
    assert validate(TrainerOptions(offload=True, checkpointing="offload"), 64, 1, "cuda", {"fp16": {"enabled": True}})


K = 1024


@pytest.mark.parametrize("seq_len, split, chunk", [
    (256, 1, 256),                  # up to 64K: one chunk, the whole sequence
    (64 * K, 8, 64 * K),
    (4 * 1024 * K, 8, 64 * K),      # the paper's 64K
    (3 * 64 * K, 8, 64 * K),
    (100_000, 1, 50_000),           # 64K does not divide: the largest divisor below it
    (100_000, 16, 50_000),
    (96 * K, 32, 48 * K),
    (2 * 65537, 1, 2 * 65537),      # no divisor between 8K and 64K: one chunk
    (96 * K + 1, 2, 96 * K + 1),    # odd, split over 2: nothing fits (validate names the fix)
    (5 * 19661, 1, 19661),
])
def test_default_chunk_size(seq_len, split, chunk):
    from fpdt.train.config import default_chunk_size
    got = default_chunk_size(seq_len, split)
    assert got == chunk and seq_len % got == 0 and (got == seq_len or got % split == 0)


def test_defaults_follow_the_fpdt_design_on_cuda_only():
    """Unset, offload and checkpointing are FPDT's (attention chunks and layer inputs on the
    host) on CUDA and off elsewhere, where they need runtime="sim"; given values win."""
    cuda = validate(TrainerOptions(sp=8), 4 * 1024 * K, 8, "cuda", FP32)
    assert (cuda.offload, cuda.checkpoint, cuda.chunk_size, cuda.num_chunks) == (True, "offload", 64 * K, 64)
    cpu = validate(TrainerOptions(), 96, 1, "cpu", FP32)
    assert (cpu.offload, cpu.checkpoint, cpu.chunk_size, cpu.num_chunks) == (False, "off", 96, 1)
    given = validate(TrainerOptions(offload=False, checkpointing="on", chunk_size=32), 96, 1, "cuda", FP32)
    assert (given.offload, given.checkpoint, given.num_chunks) == (False, "on", 3)
    mesh = validate(TrainerOptions(hp=2, cp=2), 96 * K, 4, "cuda", FP32)     # 2D: chunks split into 2 x 2 x 2
    assert mesh.chunk_size == 48 * K and mesh.chunk_size % 8 == 0
    one = validate(TrainerOptions(), 32 * K, 1, "cuda", FP32)      # one chunk: nothing to pipeline, nothing offloaded
    assert (one.num_chunks, one.offload, one.checkpoint) == (1, False, "offload")


def test_default_precision_is_bf16_on_cuda_only(tmp_path):
    from fpdt.train.config import ds_dtype_name
    assert ds_dtype_name(load_ds_config(None, "cuda")[0]) == "bf16"
    assert ds_dtype_name(load_ds_config(None, "cpu")[0]) == "fp32"
    assert ds_dtype_name(load_ds_config(None)[0]) == "fp32"
    given = write_json(str(tmp_path / "ds.json"), {"zero_optimization": {"stage": 3}})
    assert ds_dtype_name(load_ds_config(given, "cuda")[0]) == "fp32"      # a given JSON is DeepSpeed's to read


def test_planner_defaults_are_the_trainers_on_a_gpu():
    """fpdt-plan plans a GPU run; its defaults are what fpdt-train does there without flags."""
    from fpdt.plan import Choice
    from fpdt.options import device_defaults
    from fpdt.train.config import ds_dtype_name, ds_zero_stage
    from fpdt.plan.planner import candidates
    from fpdt.plan import load_model_config
    ds = load_ds_config(None, "cuda")[0]
    choice = Choice()
    assert (choice.dtype, choice.zero_stage) == (ds_dtype_name(ds), ds_zero_stage(ds))
    cfg = load_model_config("llama-3.2-1b")
    for seq_len in (32 * K, 1024 * K):                  # one chunk, and many
        for s in candidates(cfg, seq_len, choice, 8):
            assert (s.options.offload, s.options.checkpointing) == device_defaults(
                "cuda", s.num_chunks, stream_layers=s.options.stream_layers)      # planned streaming, as fpdt-train


@pytest.mark.parametrize("extra, json_section, message", [
    (["--sp", "2"], None, "--sp 2 does not divide the world size 1"),
    (["--chunk-size", "100"], None, "--chunk-size 100 is larger than the sequence"),
    (["--offload", "--runtime", "cuda"], None, "--runtime cuda needs a CUDA device"),
    ([], {"chunk": 8}, "unknown key 'chunk'"),
])
def test_cli_reports_config_errors_before_starting(tmp_path, capsys, extra, json_section, message, monkeypatch):
    monkeypatch.delenv("FPDT_RUNTIME", raising=False)
    cfg, data = write_fixture(str(tmp_path))
    argv = ["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "1", *extra]
    if json_section is not None:
        argv += ["--deepspeed", write_json(str(tmp_path / "ds.json"), {"fpdt": json_section})]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_attention_backend_reaches_every_layer(tmp_path):
    """--attention-backend (or the JSON key) is handed to every attention layer of the
    model fpdt-train builds; left out, the layers select automatically (None)."""
    from types import SimpleNamespace

    import torch

    from fpdt.cli import train as cli
    cfg, _ = write_fixture(str(tmp_path))
    argv = ["--model-config", cfg, "--steps", "1", "--data", "x.npy", "--seq-len", "64"]
    for extra, section, want in ((["--attention-backend", "math"], {}, "math"), ([], {"attention_backend": "cpu"}, "cpu"),
                                 ([], {}, None)):
        args = build_parser().parse_args(argv + extra)
        opts = merge_options(fpdt_flags(args), section)
        plan = validate(opts, 64, 1, "cpu", FP32)
        model = cli.build_model(args, opts, plan, SimpleNamespace(mesh=None, sp_group=None), torch.float32)
        assert [layer.self_attn.backend for layer in model.model.layers] == [want] * len(model.model.layers)


def test_checkpoint_device_layers_reach_the_model(tmp_path):
    """--checkpoint-device-layers (or the JSON key) is the model's option of the same name."""
    from types import SimpleNamespace

    import torch

    from fpdt.cli import train as cli
    cfg, _ = write_fixture(str(tmp_path))
    argv = ["--model-config", cfg, "--steps", "1", "--data", "x.npy", "--seq-len", "64", "--checkpoint", "offload",
            "--runtime", "sim"]                    # offloaded checkpointing on the CPU
    for extra, section, want in ((["--checkpoint-device-layers", "1"], {"checkpoint_device_layers": 2}, 1),
                                 ([], {"checkpoint_device_layers": 2}, 2), ([], {}, 0)):
        args = build_parser().parse_args(argv + extra)
        opts = merge_options(fpdt_flags(args), section)
        plan = validate(opts, 64, 1, "cpu", FP32)
        model = cli.build_model(args, opts, plan, SimpleNamespace(mesh=None, sp_group=None), torch.float32)
        assert model.options.checkpoint_device_layers == want


def test_nvme_path_flag_and_json_key_reach_the_model(tmp_path):
    """--nvme-path (or the "nvme_path" JSON key, DeepSpeed's own name) is the model's option; without
    offloaded checkpointing it is refused with one line naming the fix, also when the CPU default chose."""
    from types import SimpleNamespace

    import torch

    from fpdt.cli import train as cli
    cfg, _ = write_fixture(str(tmp_path))
    argv = ["--model-config", cfg, "--steps", "1", "--data", "x.npy", "--seq-len", "64", "--runtime", "sim"]
    for extra, section, want in ((["--nvme-path", "/a"], {"nvme_path": "/b"}, "/a"), ([], {"nvme_path": "/b"}, "/b"),
                                 ([], {}, None)):
        args = build_parser().parse_args(argv + ["--checkpoint", "offload"] + extra)
        opts = merge_options(fpdt_flags(args), section)
        plan = validate(opts, 64, 1, "cpu", FP32)
        model = cli.build_model(args, opts, plan, SimpleNamespace(mesh=None, sp_group=None), torch.float32)
        assert model.options.nvme_path == want
    with pytest.raises(ConfigError, match="fpdt option nvme_path='/a' .* needs checkpointing='offload' \\(now 'on'\\)"):
        validate(merge_options(fpdt_flags(build_parser().parse_args(argv + ["--checkpoint", "on", "--nvme-path", "/a"])),
                               None), 64, 1, "cpu", {})
    opts = merge_options(fpdt_flags(build_parser().parse_args(argv + ["--nvme-path", "/a"])), None)
    with pytest.raises(ConfigError, match="needs checkpointing='offload' \\(now 'off'\\).*fpdt-train's default on cpu"):
        validate(opts, 64, 1, "cpu", FP32)
    with pytest.raises(ConfigError, match="nvme_path=5 must be a directory path"):
        validate(merge_options({}, {"nvme_path": 5, "checkpoint": "offload"}), 64, 1, "cpu", {})
    # --nvme-layers (JSON "nvme_layers"): the first K layers on disk; it needs --nvme-path
    for extra, section, want in ((["--nvme-layers", "1"], {"nvme_layers": 2}, 1), ([], {"nvme_layers": 2}, 2)):
        args = build_parser().parse_args(argv + ["--checkpoint", "offload", "--nvme-path", "/a"] + extra)
        opts = merge_options(fpdt_flags(args), section)
        plan = validate(opts, 64, 1, "cpu", FP32)
        model = cli.build_model(args, opts, plan, SimpleNamespace(mesh=None, sp_group=None), torch.float32)
        assert model.options.nvme_layers == want
    with pytest.raises(ConfigError, match="fpdt option nvme_layers=1 counts the layers .* it needs nvme_path"):
        validate(merge_options({}, {"nvme_layers": 1, "checkpoint": "offload"}), 64, 1, "cpu", {})


def test_runtime_flag_json_and_its_environment_default(tmp_path, monkeypatch):
    """fpdt-train's runtime: --runtime > the "runtime" JSON key > FPDT_RUNTIME > automatic (None),
    and it reaches the model it builds."""
    from types import SimpleNamespace

    import torch

    from fpdt.cli import train as cli
    cfg, _ = write_fixture(str(tmp_path))
    argv = ["--model-config", cfg, "--steps", "1", "--data", "x.npy", "--seq-len", "64", "--offload",
            "--chunk-size", "32"]
    parse = build_parser().parse_args
    monkeypatch.delenv("FPDT_RUNTIME", raising=False)
    assert fpdt_options(parse(argv), {}).runtime is None
    monkeypatch.setenv("FPDT_RUNTIME", "sim")
    opts = fpdt_options(parse(argv), {})
    assert opts.runtime == "sim"                                                        # the default
    assert fpdt_options(parse(argv), {"runtime": "sync"}).runtime == "sync"              # JSON wins over it
    assert fpdt_options(parse(argv + ["--runtime", "sync"]), {"runtime": "sim"}).runtime == "sync"  # the flag wins
    plan = validate(opts, 64, 1, "cpu", FP32)          # CPU offload: allowed on the simulated runtime
    model = cli.build_model(parse(argv), opts, plan, SimpleNamespace(mesh=None, sp_group=None), torch.float32)
    assert model.options.runtime == "sim" and {layer.self_attn.runtime for layer in model.model.layers} == {"sim"}
    monkeypatch.setenv("FPDT_RUNTIME", "gpu")
    with pytest.raises(ConfigError, match="FPDT_RUNTIME='gpu' is not a device runtime: use one of sim, sync, cuda"):
        fpdt_options(parse(argv), {})
    with pytest.raises(ConfigError, match=r"runtime='gpu' must be one of \('sim', 'sync', 'cuda'\)"):
        validate(merge_options({}, {"runtime": "gpu"}), 64, 1, "cpu", {})

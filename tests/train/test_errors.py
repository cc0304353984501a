"""Bad inputs to ``fpdt-train`` / ``fpdt-export``: each stops before the expensive part with
one ``fpdt-train: error: ...`` line that names the file or flag and the fix, no traceback,
exit status 2 (docs/train.md, "Configuration and errors"). Called in-process: every case fails before any process group."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fpdt.cli.train import build_parser, main
from fpdt.train.config import ConfigError
from tests.train.helpers import TINY_CONFIG, write_fixture, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    """Every case here must fail before the process group starts (and none may start one
    in the test process)."""
    import fpdt.cli.train as cli

    def refuse(*a, **k):
        raise AssertionError("the run got as far as the process group")

    monkeypatch.setattr(cli, "init_distributed", refuse)


@pytest.fixture
def fixture(tmp_path):
    cfg, data = write_fixture(str(tmp_path))
    return tmp_path, cfg, data


def _fails(capsys, argv: list[str], *needles: str, status: int = 2) -> str:
    """Run ``main(argv)``; assert the status and exactly one error line containing every needle."""
    assert main(argv) == status
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip() and "[WARNING]" not in l]
    assert len(lines) == 1, err
    assert lines[0].startswith("fpdt-train: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _argv(cfg: str, data: str, *extra: str, seq_len: int = 64) -> list[str]:
    return ["--model-config", cfg, "--data", data, "--seq-len", str(seq_len), "--steps", "1", *extra]


# ----------------------------------------------------------------------------- 1. no silent wrong data

def test_uint32_bin_read_with_the_default_dtype_is_refused(fixture, capsys):
    tmp, cfg, _ = fixture
    path = str(tmp / "ids.bin")
    np.tile(np.arange(TINY_CONFIG["vocab_size"], dtype=np.uint32), 2).tofile(path)
    _fails(capsys, _argv(cfg, path), path, "every other id is 0", "--data-dtype uint32")


def test_bin_dtype_follows_the_vocabulary():
    from fpdt.train.data import bin_dtype_for_vocab

    assert bin_dtype_for_vocab(65536) == "uint16"
    assert bin_dtype_for_vocab(65537) == "uint32"
    assert bin_dtype_for_vocab(128256) == "uint32"   # Llama 3


def test_help_shows_the_data_dtype_default():
    text = " ".join(build_parser().format_help().split())
    assert "default: uint16 when the vocabulary has at most 65536 ids, else uint32" in text


def test_uint16_bin_read_as_uint32_is_refused(fixture, capsys):
    tmp, cfg, _ = fixture
    path = str(tmp / "ids.bin")
    np.tile(np.arange(200, dtype=np.uint16), 20).tofile(path)
    _fails(capsys, _argv(cfg, path, "--data-dtype", "uint32"), "vocab_size is 256", "check --data-dtype")


# ----------------------------------------------------------------------------- 2. fail before the expensive part

def test_heads_not_divisible_by_sp(fixture, capsys, monkeypatch):
    tmp, cfg, data = fixture
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    _fails(capsys, _argv(cfg, data, "--sp", "3", seq_len=96), "--sp 3 does not divide the model's 4 attention heads",
           cfg, "use --sp in [1, 2, 4]")


@pytest.mark.parametrize("ds, needles", [
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
     ["train_batch_size 8 != train_micro_batch_size_per_gpu 1 x gradient_accumulation_steps 1 x world size 1 = 1",
      "set it to 1", "drop train_batch_size"]),
    ({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2},
     ["train_batch_size 3 is not divisible by train_micro_batch_size_per_gpu 2 x world size 1"]),
    ({"train_micro_batch_size_per_gpu": 0}, ["train_micro_batch_size_per_gpu=0 must be a positive integer"]),
])
def test_train_batch_size_arithmetic(fixture, capsys, ds, needles):
    tmp, cfg, data = fixture
    _fails(capsys, _argv(cfg, data, "--deepspeed", write_json(str(tmp / "ds.json"), ds)), *needles)


def test_save_dir_is_a_file(fixture, capsys):
    tmp, cfg, data = fixture
    path = str(tmp / "afile")
    open(path, "w").close()
    _fails(capsys, _argv(cfg, data, "--save-dir", path), f"--save-dir {path} is a file")


def test_export_hf_into_a_file_is_refused_before_training(fixture, capsys):
    tmp, cfg, data = fixture
    path = str(tmp / "afile")
    open(path, "w").close()
    _fails(capsys, _argv(cfg, data, "--save-dir", str(tmp / "ck"), "--export-hf", path),
           f"--export-hf {path} is a file, not a directory")
    _fails(capsys, _argv(cfg, data, "--save-dir", str(tmp / "ck"), "--export-hf", os.path.join(path, "hf")),
           f"--export-hf {os.path.join(path, 'hf')}: {path} is a file, so the directory cannot be created")


def test_model_dir_without_safetensors(fixture, capsys):
    tmp, cfg, data = fixture
    d = tmp / "model"
    d.mkdir()
    shutil.copy(cfg, d / "config.json")
    _fails(capsys, ["--model", str(d), "--data", data, "--seq-len", "64", "--steps", "1"],
           f"--model {d}: no model.safetensors", "--model-config")
    _fails(capsys, ["--model", cfg, "--data", data, "--seq-len", "64", "--steps", "1"],
           f"--model {cfg} is a file", f"--model-config {cfg}")


def test_export_hf_needs_save_dir(fixture, capsys):
    tmp, cfg, data = fixture
    _fails(capsys, _argv(cfg, data, "--export-hf", str(tmp / "hf")), "--export-hf needs --save-dir DIR")
    _fails(capsys, _argv(cfg, data, "--keep-last", "2"), "--keep-last needs --save-dir DIR")


def test_fpdt_export_missing_source(tmp_path, capsys):
    from fpdt.train.export import main as export_main

    missing = str(tmp_path / "nope")
    assert export_main([missing, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fpdt-export: error: {missing}: no such directory; pass the --save-dir of an fpdt-train run")
    (tmp_path / "empty").mkdir()
    assert export_main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "has no 'latest' file and no step<N> checkpoints" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert export_main([str(tmp_path / "empty"), str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err.strip() == (f"fpdt-export: error: {tmp_path / 'afile'} is a file, not a directory; "
                                               f"pass a directory path for the export (it is created if missing)")


# ----------------------------------------------------------------------------- 3. one clean line per error

def test_malformed_jsonl_names_file_and_line(fixture, capsys):
    tmp, cfg, _ = fixture
    path = tmp / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "broken\n' + json.dumps({"text": "x"}) + "\n")
    tok = os.path.join(ROOT, "examples/tiny-llama/tokenizer.json")
    _fails(capsys, _argv(cfg, str(path), "--tokenizer", tok), f"{path}:2: not valid JSON", '"text" field')


def test_non_utf8_text_names_file(fixture, capsys):
    tmp, cfg, _ = fixture
    path = tmp / "latin1.txt"
    path.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    tok = os.path.join(ROOT, "examples/tiny-llama/tokenizer.json")
    _fails(capsys, _argv(cfg, str(path), "--tokenizer", tok), f"{path}: not UTF-8 text (byte 0xe9 at offset 3)",
           "iconv")


def test_bin_size_not_a_multiple_of_the_dtype(fixture, capsys):
    tmp, cfg, _ = fixture
    path = tmp / "odd.bin"
    path.write_bytes(bytes(1001))
    _fails(capsys, _argv(cfg, str(path)), f"{path}: 1001 bytes is not a multiple of 2 (uint16 ids)",
           "the file is truncated: re-write it")
    path.write_bytes(bytes(1002))
    _fails(capsys, _argv(cfg, str(path), "--data-dtype", "uint32"),
           f"{path}: 1002 bytes is not a multiple of 4 (uint32 ids)", "pass --data-dtype uint16")


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
     "sliding-window attention"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type='gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_unsupported_model_config_is_one_line(fixture, capsys, change, needle):
    tmp, _, data = fixture
    cfg = write_json(str(tmp / "bad_config.json"), {**TINY_CONFIG, **change})
    _fails(capsys, _argv(cfg, data), f"{cfg}: ", needle)


def test_malformed_model_config_names_the_line(fixture, capsys):
    tmp, _, data = fixture
    cfg = tmp / "config_bad.json"
    cfg.write_text('{\n  "vocab_size": 256,\n  "hidden_size": 64,,\n}\n')
    _fails(capsys, _argv(str(cfg), data), f"{cfg}:3: not valid JSON")


def test_only_rank_0_prints(fixture, capsys, monkeypatch):
    tmp, cfg, data = fixture
    monkeypatch.setenv("RANK", "1")
    assert main(_argv(cfg, data, "--chunk-size", "100")) == 2
    assert "error" not in capsys.readouterr().err


def test_debug_shows_the_traceback(fixture, monkeypatch):
    tmp, cfg, data = fixture
    with pytest.raises(ConfigError, match="chunk_size=100 is larger"):
        main(_argv(cfg, data, "--chunk-size", "100", "--debug"))
    monkeypatch.setenv("FPDT_DEBUG", "1")
    with pytest.raises(ConfigError, match="chunk_size=100 is larger"):
        main(_argv(cfg, data, "--chunk-size", "100"))


def test_unexpected_errors_are_one_line_too(fixture, capsys, monkeypatch):
    import fpdt.cli.train as cli

    tmp, cfg, data = fixture

    def boom(*a, **k):
        raise RuntimeError("something deep\nwith a second line")

    monkeypatch.setattr(cli, "load_windows", boom)
    _fails(capsys, _argv(cfg, data), "RuntimeError: something deep with a second line", "--debug", status=1)


def test_a_kernel_failure_names_the_kernel_and_the_flag(capsys):
    """An error raised inside an attention kernel adapter (e.g. a cuDNN or flash-attn build
    that refuses a shape the self-check did not cover) says where, and how to run another
    kernel; other unexpected errors do not."""
    import torch

    from fpdt.attention.kernels import BACKENDS
    from fpdt.train.errors import report
    q = torch.randn(1, 8, 4, 16)
    try:   # a shape the CPU kernel refuses: key head_dim differs from the query's
        BACKENDS["cpu"].forward(q, torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8), True, 0.25)
    except RuntimeError as e:
        assert report("fpdt-train", e) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("fpdt-train: error: RuntimeError: ") and "\n" not in line
    assert "raised in the attention kernel adapter torch_cpu.cpu_forward: --attention-backend runs another" in line
    assert report("fpdt-train", RuntimeError("elsewhere")) == 1
    assert "attention kernel" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- already clear: keep them so

@pytest.mark.parametrize("extra, ds, needle", [
    (["--sp", "2", "--chunk-size", "45"], None, "--sp 2 does not divide the world size 1"),
    (["--chunk-size", "100"], None, "--chunk-size 100 is larger than the sequence (--seq-len 64)"),
    (["--chunk-size", "24"], None, "--seq-len 64 is not divisible by --chunk-size 24"),
    (["--offload", "--runtime", "cuda"], None, "--runtime cuda needs a CUDA device"),
    (["--stream-layers", "--checkpoint", "on"], None, "--stream-layers keeps each layer's input in host memory as its "
                                                       "checkpoint: pass --checkpoint offload (now on)"),
    ([], {"fp16": {"enabled": True}}, "fp16 training needs a CUDA device"),
    ([], {"fpdt": {"chunk_sise": 32}}, "unknown key 'chunk_sise'"),
    (["--skip-nonfinite", "1"], {"gradient_accumulation_steps": 2}, "--skip-nonfinite needs gradient_accumulation_steps 1"),
    (["--attention-backend", "cuda_flash"], None, "--attention-backend cuda_flash: attention backend 'cuda_flash' is not "
                                                  "available here (needs a CUDA build of torch and a GPU)"),
    ([], {"fpdt": {"attention_backend": "flash3"}}, "--attention-backend flash3 must be one of ('flash_attn3'"),
    (["--checkpoint-device-layers", "1"], None, "--checkpoint-device-layers 1 keeps some offloaded layer inputs on "
                                               "the device: it needs --checkpoint offload (now off) "
                                               "(--checkpoint off is fpdt-train's default on cpu; --checkpoint sets it)"),
    (["--checkpoint-device-layers", "-1"], None, "--checkpoint-device-layers -1 must be an integer >= 0"),
])
def test_config_errors(fixture, capsys, extra, ds, needle, monkeypatch):
    monkeypatch.delenv("FPDT_RUNTIME", raising=False)  # FPDT_RUNTIME=sim|sync would allow CPU offload
    tmp, cfg, data = fixture
    if ds is not None:
        extra = [*extra, "--deepspeed", write_json(str(tmp / "ds.json"), ds)]
    _fails(capsys, _argv(cfg, data, *extra), needle)


def test_more_device_layers_than_the_model_has(fixture, capsys, monkeypatch):
    monkeypatch.setenv("FPDT_RUNTIME", "sim")            # offloaded checkpointing on the CPU
    tmp, cfg, data = fixture
    _fails(capsys, _argv(cfg, data, "--checkpoint", "offload", "--checkpoint-device-layers", "3"),
           "--checkpoint-device-layers 3 is more than the model's 2 decoder layers", "use at most 2")


def test_seq_len_not_divisible_by_sp_chunks(fixture, capsys, monkeypatch):
    tmp, cfg, data = fixture
    monkeypatch.setenv("WORLD_SIZE", "2")
    _fails(capsys, _argv(cfg, data, "--sp", "2", "--chunk-size", "45", seq_len=90), "sp x chunks = 2 x 2 = 4")


def test_malformed_deepspeed_json(fixture, capsys):
    tmp, cfg, data = fixture
    (tmp / "ds.json").write_text("{ not json")
    _fails(capsys, _argv(cfg, data, "--deepspeed", str(tmp / "ds.json")), f"--deepspeed {tmp / 'ds.json'} is not valid JSON")


@pytest.mark.parametrize("make, needle", [
    (lambda tmp: str(tmp / "missing.npy"), "no such file or directory"),
    (lambda tmp: (np.save(tmp / "empty.npy", np.zeros(0, np.int32)), str(tmp / "empty.npy"))[1], "holds no tokens"),
    (lambda tmp: (np.save(tmp / "short.npy", np.arange(10)), str(tmp / "short.npy"))[1], "fewer than one window"),
    (lambda tmp: (np.save(tmp / "big.npy", np.arange(1000)), str(tmp / "big.npy"))[1], "vocab_size is 256"),
    (lambda tmp: (np.save(tmp / "neg.npy", -np.arange(100)), str(tmp / "neg.npy"))[1], "token ids in [-99, 0]"),
    (lambda tmp: (np.save(tmp / "f.npy", np.arange(100.0)), str(tmp / "f.npy"))[1], "must be integers, found dtype float64"),
    (lambda tmp: (os.makedirs(tmp / "d", exist_ok=True), str(tmp / "d"))[1], "holds no .npy, .bin, .txt or .jsonl"),
])
def test_bad_data(fixture, capsys, make, needle):
    tmp, cfg, _ = fixture
    _fails(capsys, _argv(cfg, make(tmp)), needle)


# ----------------------------------------------------------------------------- resume against a real checkpoint

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step tiny run saved at steps 1 and 2 (one subprocess, so no process group here)."""
    tmp = tmp_path_factory.mktemp("saved")
    cfg, data = write_fixture(str(tmp))
    cmd = [sys.executable, "-m", "fpdt.cli", *_argv(cfg, data), "--steps", "2", "--save-dir", str(tmp / "ckpt"),
           "--save-every", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"saved step 2 to {tmp / 'ckpt' / 'step2'} (" in proc.stdout + proc.stderr
    return tmp, cfg, data


def _copy(saved_run, tmp_path) -> str:
    src, _, _ = saved_run
    dst = tmp_path / "ckpt"
    shutil.copytree(src / "ckpt", dst)
    return str(dst)


@pytest.mark.slow
def test_resume_with_steps_below_the_saved_step(saved_run, tmp_path, capsys):
    _, cfg, data = saved_run
    ck = _copy(saved_run, tmp_path)
    _fails(capsys, _argv(cfg, data, "--resume", ck), "--steps 1 is below the step of the checkpoint (2,",
           "pass --steps 3")


@pytest.mark.slow
def test_resume_with_another_seq_len_warns_and_trains(saved_run, tmp_path):
    """docs/train.md: what the next steps read may change on resume (a curriculum, a context
    extension): one warning line per difference, and the run goes on."""
    _, cfg, data = saved_run
    ck = _copy(saved_run, tmp_path)
    cmd = [sys.executable, "-m", "fpdt.cli", *_argv(cfg, data, seq_len=32), "--steps", "3", "--resume", ck]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings_ = [l for l in proc.stderr.splitlines() if l.startswith("warning: the resumed run differs")]
    assert len(warnings_) == 1 and warnings_[0].endswith("(seq_len: saved 64, now 32)"), proc.stderr[-3000:]
    assert "steps 2->3" in proc.stderr


@pytest.mark.slow
def test_resume_with_another_model_config(saved_run, tmp_path, capsys):
    _, _, data = saved_run
    ck = _copy(saved_run, tmp_path)
    other = write_json(str(tmp_path / "other.json"), {**TINY_CONFIG, "hidden_size": 96, "num_hidden_layers": 3})
    _fails(capsys, _argv(other, data, "--steps", "3", "--resume", ck),
           "hidden_size 64 vs 96", "num_layers 2 vs 3", "resume with the model config it was trained with")


@pytest.mark.slow
def test_resume_with_another_precision(saved_run, tmp_path, capsys):
    _, cfg, data = saved_run
    ck = _copy(saved_run, tmp_path)
    ds = write_json(str(tmp_path / "bf16.json"), {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    _fails(capsys, _argv(cfg, data, "--steps", "3", "--resume", ck, "--deepspeed", ds),
           "the checkpoint was trained in fp32, this run's DeepSpeed JSON asks for bf16")


@pytest.mark.slow
def test_resume_without_a_json_names_the_default_precision(saved_run, tmp_path):
    """An fp32 checkpoint resumed on CUDA without --deepspeed (whose default is bf16 there):
    the message says where bf16 comes from and how to keep fp32."""
    from fpdt.train import preflight
    from fpdt.train.config import ConfigError
    _, cfg, _ = saved_run
    ck = _copy(saved_run, tmp_path)
    with pytest.raises(ConfigError, match=r"trained in fp32, without --deepspeed this run trains in bf16; pass a "
                                          r"--deepspeed JSON in fp32"):
        preflight.check_resume(ck, steps=3, world_size=1, precision="bf16", model=preflight.model_source(None, cfg),
                               zero_stage=3, default_config=True)


@pytest.mark.slow
def test_resume_with_a_missing_or_truncated_shard(saved_run, tmp_path, capsys):
    _, cfg, data = saved_run
    ck = _copy(saved_run, tmp_path)
    step2 = os.path.join(ck, "step2")
    shard = sorted(n for n in os.listdir(step2) if "optim_states" in n)[0]
    with open(os.path.join(step2, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(step2, shard)) // 2)
    _fails(capsys, _argv(cfg, data, "--steps", "3", "--resume", ck),
           f"checkpoint file {os.path.join(step2, shard)} is truncated or corrupt", "(step1)")
    os.remove(os.path.join(step2, shard))
    _fails(capsys, _argv(cfg, data, "--steps", "3", "--resume", ck),
           f"checkpoint file {os.path.join(step2, shard)} is missing", "(step1)")


@pytest.mark.slow
def test_resume_with_another_zero_stage(saved_run, tmp_path, capsys):
    _, cfg, data = saved_run
    ck = _copy(saved_run, tmp_path)
    ds = write_json(str(tmp_path / "z1.json"), {"zero_optimization": {"stage": 1}})
    _fails(capsys, _argv(cfg, data, "--steps", "3", "--resume", ck, "--deepspeed", ds),
           "written with ZeRO stage 3, this run's DeepSpeed JSON asks for stage 1")


@pytest.mark.slow
def test_resume_with_another_world_size(saved_run, tmp_path, capsys, monkeypatch):
    _, cfg, data = saved_run
    ck = _copy(saved_run, tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    _fails(capsys, _argv(cfg, data, "--steps", "3", "--resume", ck),
           "the checkpoint was written by 1 processes, this run has 2")


def test_resume_from_a_missing_dir(fixture, capsys):
    tmp, cfg, data = fixture
    _fails(capsys, _argv(cfg, data, "--resume", str(tmp / "nothing")), f"--resume {tmp / 'nothing'}: no such directory")


@pytest.mark.slow
def test_fpdt_export_with_a_truncated_shard_or_missing_tag(saved_run, tmp_path, capsys):
    from fpdt.train.export import main as export_main

    ck = _copy(saved_run, tmp_path)
    assert export_main([ck, str(tmp_path / "out"), "--tag", "step9"]) == 2
    assert capsys.readouterr().err.strip() == (f"fpdt-export: error: {os.path.join(ck, 'step9')}: no such checkpoint; "
                                               f"pass --tag (one of step1, step2)")
    step2 = os.path.join(ck, "step2")
    for name in os.listdir(step2):
        if "optim_states" in name:
            with open(os.path.join(step2, name), "r+b") as f:
                f.truncate(100)
            bad = os.path.join(step2, name)
    assert export_main([ck, str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"fpdt-export: error: {bad} is truncated or corrupt; export another "
                                               f"checkpoint with --tag (one of step1, step2)")


@pytest.mark.slow
def test_fpdt_export_uses_the_config_its_tag_was_trained_with(saved_run, tmp_path):
    """Each step<N> dir keeps the config.json (and tokenizer) of its run: a later run of another
    model into the same --save-dir rewrites DIR/config.json, and export of the old tag still
    builds the model it trained (before, it read DIR's and failed on the shapes). A tag written
    before tags kept a copy falls back to DIR's."""
    import json

    from fpdt.train.export import main as export_main

    ck = _copy(saved_run, tmp_path)
    for tag in ("step1", "step2"):
        assert os.path.isfile(os.path.join(ck, tag, "config.json"))
    with open(os.path.join(ck, "config.json")) as f:
        trained = json.load(f)
    with open(os.path.join(ck, "config.json"), "w") as f:        # another model's run rewrote it
        json.dump({**trained, "intermediate_size": trained["intermediate_size"] * 2}, f)
    assert export_main([ck, str(tmp_path / "out"), "--tag", "step1"]) == 0
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["intermediate_size"] == trained["intermediate_size"]
    os.remove(os.path.join(ck, "step2", "config.json"))            # an older checkpoint: DIR's config
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(trained, f)
    assert export_main([ck, str(tmp_path / "out2"), "--tag", "step2"]) == 0

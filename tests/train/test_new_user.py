"""What a new user meets first: flags over the DeepSpeed JSON (and what a flag implies), the CPU's
offload on the simulated runtime, errors in the flags typed, and the README's main job streamed."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from fpdt.cli.train import build_parser, fpdt_options
from fpdt.options import FPDTOptions, OptionsError, as_flag, in_flag_terms
from fpdt.train.config import cpu_runtime, merge_flags, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = ["--model-config", "c.json", "--data", "x.npy", "--seq-len", "256", "--steps", "1"]


def test_a_flag_and_what_it_implies_win_over_the_json_with_one_line():
    section = {"chunk_size": 128, "checkpoint": "off", "offload": False}
    opts, line = merge_flags({"stream_layers": True}, section)
    assert (opts.stream_layers, opts.offload, opts.checkpointing, opts.chunk_size) == (True, True, "offload", 128)
    assert line == ('fpdt-train: flags win over the DeepSpeed JSON\'s "fpdt" section: --offload over "offload": false '
                    '(implied by --stream-layers); --checkpoint offload over "checkpoint": "off" (implied by '
                    '--stream-layers)')
    opts, line = merge_flags({"checkpoint": "on"}, section)             # a flag typed: it wins, said once
    assert opts.checkpointing == "on" and line.endswith('--checkpoint on over "checkpoint": "off"')
    assert merge_flags({}, section)[1] is None                          # nothing overrode: no line
    assert merge_flags({"chunk_size": 128}, section)[1] is None         # the same value: nothing to say


def test_a_flag_typed_beside_it_still_conflicts_in_flag_terms():
    from fpdt.train.config import ConfigError
    with pytest.raises(ConfigError, match=r"stream_layers=True keeps each layer's input .*checkpointing='offload' "
                                          r"\(now 'on'\)") as e:
        validate(merge_flags({"stream_layers": True, "checkpoint": "on"}, {})[0], 256, 1, "cpu", {})
    assert in_flag_terms(str(e.value)) == ("--stream-layers keeps each layer's input in host memory as its checkpoint: "
                                           "pass --checkpoint offload (now on)")


@pytest.mark.parametrize("extra, runtime, said", [
    (["--stream-layers"], "sim", "--offload and --checkpoint offload run on the simulated CUDA runtime (--runtime sim)"),
    (["--checkpoint", "offload"], "sim", "--checkpoint offload runs on the simulated"),
    (["--offload"], "sim", "--offload runs on the simulated"),
    (["--offload", "--runtime", "sync"], "sync", None),                  # a runtime given: as given
    ([], None, None),                                                    # nothing offloaded: nothing chosen
])
def test_the_cpu_runs_offload_on_the_simulated_runtime(monkeypatch, extra, runtime, said):
    monkeypatch.delenv("FPDT_RUNTIME", raising=False)
    lines: list[str] = []
    opts = fpdt_options(build_parser().parse_args(ARGV + extra), {"checkpoint": "off"}, "cpu", lines)
    assert opts.runtime == runtime
    assert (said is None and not any("simulated" in line for line in lines)) or any(said in line for line in lines)
    assert cpu_runtime(opts, "cuda") == (opts, None)


def test_errors_name_flags_on_the_command_line_and_options_in_the_library():
    with pytest.raises(OptionsError, match=r"set checkpointing='offload' \(now 'off'\)"):   # the library's terms
        FPDTOptions(stream_layers=True, offload=True).validate()
    assert as_flag("offload", False) == "--no-offload" and as_flag("checkpointing", "on") == "--checkpoint on"
    assert in_flag_terms("checkpoint_device_layers=2 keeps ...: it needs checkpointing='offload' (now 'off'); "
                         "drop save_attention_layers") == ("--checkpoint-device-layers 2 keeps ...: it needs "
                                                           "--checkpoint offload (now off); drop --save-attention-layers")
    assert in_flag_terms("fpdt option attention_backend='x' / checkpoint_device_layers='8'") == \
        "--attention-backend x / --checkpoint-device-layers '8'"       # a JSON string where a number belongs: quoted
    assert in_flag_terms("chunk_size=100 is larger than the sequence (seq_len=64)") == \
        "--chunk-size 100 is larger than the sequence (--seq-len 64)"


def test_every_trainer_option_has_one_flag():
    from fpdt.options import OPTION_FLAGS
    from fpdt.train.config import FPDT_KEYS, option_field
    flags = {a.option_strings[0] for a in build_parser()._actions if a.option_strings}
    for key in FPDT_KEYS:
        entry = OPTION_FLAGS[option_field(key)]
        assert entry.flag in flags and entry.json_key == key, key


@pytest.mark.slow
def test_the_readme_main_job_runs_with_stream_layers(tmp_path, capsys, monkeypatch):
    """The README's main job with --stream-layers added (2 of its steps): no other flag needed on
    the CPU, the same first loss as the README's run, and the lines that say what was chosen."""
    from fpdt.cli.train import main
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    command = re.search(r"## The main job.*?```bash slow\n(fpdt-train [^\n]*)\n", readme, re.S).group(1)
    argv = shlex.split(command)[1:]
    argv[argv.index("--steps") + 1] = "2"
    argv[argv.index("--log-json") + 1] = str(tmp_path / "tiny.jsonl")
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("FPDT_RUNTIME", raising=False)
    assert main(argv + ["--stream-layers"]) == 0
    err = capsys.readouterr().err
    assert "offload=on checkpoint=offload" in err
    assert "--checkpoint offload over \"checkpoint\": \"off\" (implied by --stream-layers)" in err
    assert "run on the simulated CUDA runtime (--runtime sim)" in err
    assert "loss 7.6582 ->" in err


def test_a_misspelt_deepspeed_key_gets_one_warning_naming_the_closest():
    from fpdt.train.config import load_ds_config, unknown_ds_keys
    cfg, _ = load_ds_config({"zero_optimisation": {"stage": 3}, "bf16": {"enabled": False}, "fpdt": {}})
    (line,) = unknown_ds_keys(cfg)
    assert line.startswith("warning: the DeepSpeed JSON's key 'zero_optimisation' is not one DeepSpeed reads "
                           "(did you mean 'zero_optimization'?)")
    with open(os.path.join(ROOT, "examples", "tiny-llama", "ds_cpu.json")) as f:
        import json
        assert unknown_ds_keys(load_ds_config(json.load(f))[0]) == ()


def test_a_resumed_log_keeps_one_record_per_step(tmp_path, capsys):
    import json

    from fpdt.train.progress import Progress, read_log, truncate_log
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 15)))
    progress = Progress(20, 10, True, str(log), resumed=True)      # resumed from step 10: 11-14 go
    progress.close()
    assert [r["step"] for r in read_log(str(log))] == list(range(1, 11))
    assert "dropped 4 record(s) after step 10, the resumed step" in capsys.readouterr().out   # above the bar
    assert truncate_log(str(log), 10) == 0 and truncate_log(str(tmp_path / "none.jsonl"), 3) == 0
    Progress(20, 10, True, str(log)).close()                       # not resumed: appended to, as before
    assert len(read_log(str(log))) == 10


def test_the_nvme_tier_says_what_it_reclaims_and_warns_on_tmpfs(tmp_path, monkeypatch):
    import json
    import socket

    from fpdt.offload import nvme
    from fpdt.train.nvme_aio import setup_tier
    monkeypatch.setattr("fpdt.train.nvme_aio.default_backend", lambda: (nvme.PortableBackend(), "NVMe backend: test"))
    left = tmp_path / "rank0"                    # what a kill -9 leaves: the marker of a process that is gone
    left.mkdir()
    (left / nvme.MARKER).write_text(json.dumps({"pid": 2 ** 22 + 7, "host": socket.gethostname()}))
    (left / "3.bin").write_bytes(b"x" * 8192)
    from fpdt.model.layer_checkpoints import NVMeBytes
    text, tier = setup_tier(str(tmp_path), NVMeBytes(2, 8192, 0, 0))
    assert isinstance(tier, nvme.NVMeTier) and not tier.open_stores()
    lines = text.splitlines()
    assert lines[0].startswith("NVMe backend: test; nvme_path ") and not left.exists()
    assert lines[1] == (f"nvme_path: removed {left}, left by a run that did not end cleanly (process {2 ** 22 + 7} on "
                        f"{socket.gethostname()}): 1 file(s), 7.63e-06 GiB")
    monkeypatch.setattr(nvme, "filesystem_type", lambda path, mounts_text=None: "tmpfs")
    (line, warning) = setup_tier(str(tmp_path), NVMeBytes(4, 8192, 0, 0))[0].splitlines()
    assert warning == (f"warning: nvme_path {tmp_path} is on tmpfs, which is RAM-backed: what the NVMe tier writes "
                       f"there costs host memory, not disk; point --nvme-path at a local drive")


def test_the_first_aio_build_is_announced(monkeypatch, capsys):
    import deepspeed.ops.op_builder as builders

    from fpdt.train import nvme_aio

    class Handle:
        def get_alignment(self):
            return 4096

    class Builder:
        name = "fpdt_test_not_built"

        def is_compatible(self, verbose=False):
            return True

        def load(self, verbose=False):
            return type("Op", (), {"aio_handle": staticmethod(lambda **kw: Handle())})

    monkeypatch.setattr(builders, "AsyncIOBuilder", Builder)
    monkeypatch.delenv("RANK", raising=False)
    assert nvme_aio.aio_backend() is not None
    err = capsys.readouterr().err
    assert nvme_aio.BUILDING in err and "libaio-dev" in err and "AsyncIOBuilder().load()" in err
    monkeypatch.setattr(nvme_aio, "_built", lambda builder: True)
    nvme_aio.aio_backend()
    assert nvme_aio.BUILDING not in capsys.readouterr().err        # cached: nothing to wait for


def test_the_summary_shows_the_host_and_the_prediction_beside_the_measured():
    from fpdt.train.progress import Predicted, StepRecord, summary
    recs = [StepRecord(step=s, loss=7.0, lr=1e-3, tokens=1024, step_time_s=t, tokens_per_s=1.0, tgs=1.0, mfu=None,
                       mfu_full=None, hfu=None, peak_mem_gib=0.5, host_rss_gib=rss, host_stash_gib=0.25)
            for s, t, rss in ((1, 9.0, 1.5), (2, 2.0, 2.5), (3, 3.0, 2.0))]
    line = summary(recs, 0, 20.0, None, None)
    assert "peak device memory 0.5 GiB, host stash 0.25 GiB; host process 2.5 GiB (RSS); step 3 s (median)" in line
    line = summary(recs, 0, 20.0, None, None, Predicted(device_peak_gib=0.625, host_offload_gib=0.3, step_time_s=2.5))
    assert ("peak device memory 0.5 GiB (fpdt-plan: 0.625 GiB), host stash 0.25 GiB (fpdt-plan: 0.3 GiB); "
            "host process 2.5 GiB (RSS); step 3 s (median) (fpdt-plan: 2.5 s)") in line


def test_the_prediction_is_the_start_up_lines(tmp_path):
    """What the summary puts beside the measured figures is what the start-up line printed, and
    the step time is fpdt-plan's for a GPU it knows."""
    from fpdt.plan import trainer_run
    from fpdt.train import preflight
    from fpdt.train.config import load_ds_config, validate
    ds, section = load_ds_config(os.path.join(ROOT, "examples", "tiny-llama", "ds_cpu.json"), "cpu")
    config = preflight.model_source(None, os.path.join(ROOT, "examples", "tiny-llama", "config.json")).config
    for extra, host in (([], False), (["--stream-layers"], True)):
        opts = fpdt_options(build_parser().parse_args(ARGV + extra), section, "cpu")
        plan = validate(opts, 256, 1, "cpu", ds)
        est = trainer_run.estimate(config, plan, opts, ds, "fp32", "cpu", 1, True, 0)
        got = trainer_run.prediction(est, None)
        assert (got is not None) == host == (trainer_run.prediction_line(est, None) is not None)
        if host:
            assert got.device_peak_gib is None and got.host_offload_gib * 2 ** 30 == pytest.approx(
                sum(trainer_run.host_offload_bytes(est).values()))
    assert trainer_run.gpu_preset("NVIDIA H100 80GB HBM3", 80 * 2 ** 30) == "h100-80g"
    assert trainer_run.gpu_preset("NVIDIA H200", 141e9) == "h200" and trainer_run.gpu_preset("Tesla T4", 16e9) is None
    seconds = trainer_run.step_time(config, plan, opts, ds, "bf16", "NVIDIA H100 80GB HBM3", 80 * 2 ** 30, 1)
    assert seconds is not None and 0 < seconds < 1
    assert trainer_run.step_time(config, plan, opts, ds, "bf16", "Tesla T4", 16e9, 1) is None


@pytest.mark.long
@pytest.mark.slow
def test_the_lora_speed_script_runs_both_models_on_the_same_tokens():
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "profiling.hf_lora_step", "--seq-len", "128", "--hidden", "64",
                           "--intermediate", "128", "--vocab", "256", "--layers", "1", "--num-chunks", "2", "--reps",
                           "2"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loss"]["fpdt"] == pytest.approx(out["loss"]["plain"], rel=1e-5) and out["ratio"] > 0
    # the rule's ceil(2 * 2 * 256 / 64) = 16 chunks, floored to one of 128 tokens; the checkout's own fpdt
    assert out["loss_chunks"] == 1 and out["fpdt"].startswith(ROOT)


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(tmp_path, capsys):
    """Train 4 steps saving at 2, then resume from step 2 to 4 with the same --log-json: steps 3
    and 4 of the first run are dropped (one line), so the log holds steps 1-4 once each."""
    from fpdt.cli.train import main
    from fpdt.train.progress import read_log
    from tests.train.helpers import write_fixture
    cfg, data = write_fixture(str(tmp_path))
    log, ck = tmp_path / "run.jsonl", tmp_path / "ck"
    argv = ["--model-config", cfg, "--data", data, "--seq-len", "32", "--steps", "4", "--log-json", str(log),
            "--save-dir", str(ck), "--save-every", "2", "--keep-last", "0"]
    assert main(argv) == 0
    assert main(argv + ["--resume", str(ck / "step2")]) == 0
    assert [r["step"] for r in read_log(str(log))] == [1, 2, 3, 4]
    assert "dropped 2 record(s) after step 2, the resumed step" in capsys.readouterr().out


def test_a_json_key_error_keeps_the_json_s_terms(tmp_path, capsys):
    from fpdt.cli.train import main
    from tests.train.helpers import write_fixture, write_json
    cfg, data = write_fixture(str(tmp_path))
    ds = write_json(str(tmp_path / "ds.json"), {"fpdt": {"chunk_sise": 32}})
    assert main(["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "1", "--deepspeed", ds]) == 2
    err = capsys.readouterr().err
    assert "(did you mean 'chunk_size'?)" in err and "inner_ring, chunk_size" in err and "--" not in err.split(";")[1]

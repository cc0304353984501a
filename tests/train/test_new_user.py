"""What a new user meets first: flags over the DeepSpeed JSON (and what a flag implies), the CPU's
offload on the simulated runtime, errors in the flags typed, and the README's main job streamed."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from fpdt.cli.train import build_parser, fpdt_options
from fpdt.options import FPDTOptions, OptionsError, as_flag, in_flag_terms
from fpdt.train.config import cpu_runtime, merge_flags

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
        merge_flags({"stream_layers": True, "checkpoint": "on"}, {})
    assert in_flag_terms(str(e.value)) == ("--stream-layers keeps each layer's input in host memory as its checkpoint: "
                                           "pass --checkpoint offload (now on)")


@pytest.mark.parametrize("extra, runtime, said", [
    (["--stream-layers"], "sim", "--offload and --checkpoint offload run on the simulated CUDA runtime (--runtime sim)"),
    (["--checkpoint", "offload"], "sim", "--checkpoint offload run on the simulated"),
    (["--offload"], "sim", "--offload run on the simulated"),
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

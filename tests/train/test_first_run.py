"""What a first run prints: flags that would train nothing or be ignored are refused with one
line, the progress bar fits a 100-column terminal, and the run ends with a summary line. (The
end-to-end run, its summary and the export's "wrote DIR" are checked in test_main_job.py.)"""

from __future__ import annotations

import os

import pytest
from tqdm import tqdm

from fpdt.cli.train import main, summary
from fpdt.train.progress import BAR_FORMAT, StepRecord, postfix
from tests.train.helpers import write_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = os.path.join(ROOT, "examples", "data", "jargon-file-4.4.7.txt")
TINY = os.path.join(ROOT, "examples", "tiny-llama", "config.json")


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    """The refusals come before any process group."""
    import fpdt.cli.train as cli

    def refuse(*a, **k):
        raise AssertionError("the run got as far as the process group")

    monkeypatch.setattr(cli, "init_distributed", refuse)


def _one_error_line(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip() and "[WARNING]" not in l]
    assert len(lines) == 1 and lines[0].startswith("fpdt-train: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_steps_zero_is_refused(tmp_path, capsys):
    cfg, data = write_fixture(str(tmp_path))
    _one_error_line(capsys, ["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "0",
                             "--save-dir", str(tmp_path / "ckpt")], "--steps 0", "N >= 1")
    assert not os.path.exists(tmp_path / "ckpt" / "step0")


@pytest.mark.parametrize("kind", ["text", "npy"])
def test_data_dtype_without_bin_files_is_refused(tmp_path, capsys, kind):
    cfg, npy = write_fixture(str(tmp_path))
    data, model = (TEXT, TINY) if kind == "text" else (npy, cfg)
    _one_error_line(capsys, ["--model-config", model, "--data", data, "--seq-len", "64", "--steps", "1",
                             "--data-dtype", "uint32"], "--data-dtype uint32", "drop --data-dtype")


def _record(**kw):
    base = dict(step=1, loss=7.6543, lr=1e-3, tokens=256, step_time_s=1.0, tokens_per_s=256.0, tgs=256.0,
                mfu=0.123, mfu_full=0.2, hfu=0.15, peak_mem_gib=0.0241, host_rss_gib=0.9)
    base.update(kw)
    return StepRecord(**base)


@pytest.mark.parametrize("rec, n, total, elapsed", [
    (_record(), 30, 60, 31.0),                                                          # the main job, CPU
    (_record(step=999, loss=10.1234, tokens_per_s=123_456.0, mfu=0.555, peak_mem_gib=79.99,
             peak_reserved_gib=80.0, host_stash_gib=123.45, host_rss_gib=600.0), 999, 1000, 5025.0),   # worst
])
def test_progress_line_fits_100_columns(rec, n, total, elapsed):
    line = tqdm.format_meter(n, total, elapsed, ncols=100, unit="step", bar_format=BAR_FORMAT,
                             postfix=postfix(rec))
    assert len(line) <= 100, line
    bar = line[line.index("|") + 1:line.rindex("|")]
    assert len(bar) >= 10, line                         # the bar itself stays readable
    assert f"loss={rec.loss:.4f}" in line


def test_summary_line_names_steps_tokens_time_losses_memory_and_files():
    recs = [_record(step=s, loss=7.6 - s / 10, peak_mem_gib=0.02 + s / 1000) for s in (11, 12, 13)]
    line = summary(recs, 10, 42.4, "runs/x/step13", "runs/x-hf")
    assert line.startswith("fpdt-train: done: steps 11-13, 768 tokens in 42 s")
    assert "loss 6.5000 -> 6.3000" in line and "peak device memory 0.033 GiB" in line
    assert "saved runs/x/step13" in line and "exported runs/x-hf" in line and "\n" not in line
    off = summary([_record(peak_mem_gib=None, host_stash_gib=2.5)], 0, 1.0, None, None)
    assert "peak device memory n/a, host stash 2.5 GiB" in off and "saved" not in off
    assert "no steps" in summary([], 60, 3.0, None, None)

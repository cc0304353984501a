"""The README's main-job command (with a tiny step count), fpdt-export, and the example configs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from fpdt.train.config import load_ds_config, merge_options, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_main_job() -> list[str]:
    """The one ``fpdt-train`` line of the README's main-job section (up to its first subsection,
    where the same model shows FPDT's mechanisms on the CPU)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index("## The main job")
    text = text[start:text.index("\n#", start + 1)]
    lines = [l for l in text.splitlines() if l.startswith("fpdt-train ") and "examples/tiny-llama/config.json" in l]
    assert len(lines) == 1, f"expected exactly one main-job command in the README, found {lines}"
    return shlex.split(lines[0])


@pytest.mark.slow
def test_readme_main_job_runs_and_exports(tmp_path):
    argv = readme_main_job()[1:]
    argv[argv.index("--steps") + 1] = "3"
    log = str(tmp_path / "tiny.jsonl")
    argv[argv.index("--log-json") + 1] = log
    save, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    cmd = [sys.executable, "-m", "fpdt.cli", *argv, "--save-dir", save, "--export-hf", hf]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(log) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "tokens_per_s", "tgs", "mfu", "mfu_full", "step_time_s", "peak_mem_gib", "peak_reserved_gib",
                "host_stash_gib", "host_rss_gib"):
        assert key in records[0]
    assert all(r["peak_mem_gib"] > 0 and r["host_stash_gib"] == 0 for r in records)   # CPU: counted, no offload
    assert records[0]["loss"] == pytest.approx(7.6, abs=0.3)       # ~ln(2048) at random init
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[0]["lr"] > 0                                      # the warm-up starts above zero
    assert "before it has started" not in proc.stderr               # DeepSpeed's scheduler warning is silenced
    assert re.search(r"peak=\d\S* TFLOP/s", proc.stderr) and "peak=0.00 " not in proc.stderr
    assert " attention=cpu " in proc.stderr                         # the kernel automatic selection took
    # a first run that reads well: the export says where it wrote, without DeepSpeed's merge chatter,
    # and the last line sums the run up
    assert f"wrote {hf}" in proc.stderr and "Processing zero checkpoint" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fpdt-train: done: steps 1-3, ") and f"exported {hf}" in last, last
    assert f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}" in last, last
    _check_export(save, hf)


def _check_export(save: str, hf: str) -> None:
    """The exported checkpoint loads in Transformers and computes what fpdt computes."""
    from transformers import AutoModelForCausalLM

    from fpdt.model import from_pretrained

    assert os.path.isfile(os.path.join(hf, "tokenizer.json"))
    ours = from_pretrained(hf)
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(ids[:, :-1], labels=ids[:, 1:])
        b = theirs(ids[:, :-1]).logits.float()
    b = torch.nn.functional.cross_entropy(b.reshape(-1, b.shape[-1]), ids[:, 1:].reshape(-1))
    assert a.item() == pytest.approx(b.item(), rel=1e-4)
    # training moved the weights away from the seed-0 random init
    from fpdt.model import from_config

    torch.manual_seed(0)
    init = from_config(os.path.join(save, "config.json"))
    assert not torch.equal(init.lm_head.weight, ours.lm_head.weight)


@pytest.mark.parametrize("config, seq_len, world", [
    ("examples/tiny-llama/ds_cpu.json", 256, 1),
    ("examples/llama-3.2-1b/ds_1gpu.json", 262144, 1),
    ("examples/llama-3-8b/ds_zero3_4gpu.json", 2097152, 4),
    ("examples/llama-3-8b/ds_zero3_8gpu.json", 4194304, 8),
])
def test_example_configs_validate(config, seq_len, world):
    ds, section = load_ds_config(os.path.join(ROOT, config))
    device = "cpu" if "tiny" in config else "cuda"
    plan = validate(merge_options({}, section), seq_len, world, device, ds)
    assert plan.sp * plan.dp == world


def test_readme_launch_lines_match_example_configs():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    for path in re.findall(r"--deepspeed (examples/\S+\.json)", text):
        assert os.path.isfile(os.path.join(ROOT, path)), path

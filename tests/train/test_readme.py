"""The README's set-up lines (consistent with .ci/run), the shipped configs' warm-up, the
silenced scheduler warning and the CPU's MFU peak. (The attention snippet is run as written by
tests/attention/test_readme_snippet.py, every other block by tests/test_docs.py.)"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _section_block(heading: str, lang: str) -> str:
    """The first ```lang block after ``heading``."""
    text = _readme()
    start = text.index(heading)
    m = re.search(rf"```{lang}[^\n]*\n(.*?)```", text[start:], re.S)
    assert m, f"no {lang} block after {heading!r}"
    return m.group(1)


def test_set_up_is_two_commands_that_pick_the_cpu_torch_build():
    lines = [l for l in _section_block("## Set up", "bash").splitlines() if l.strip()]
    assert len(lines) == 2, lines
    install = lines[0].split("#")[0]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install
    assert 'pip install -e ".[test]"' in install
    test_command = lines[1].split("#")[0].strip()
    assert test_command == 'python3 -m pytest -q -m "not slow"'
    version = re.search(r"torch==(\S+)", install).group(1)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [l.strip() for l in f if not l.lstrip().startswith("#")]
    assert any(f"torch=={version}" in l for l in ci), "the README and .ci/run pin different torch versions"
    # CI runs the README's command, then the slow set but its long tier, which CONTRIBUTING.md
    # tells how and when to run: every test runs somewhere
    slow = [i for i, l in enumerate(ci) if l.startswith('python3 -m pytest -q -m "slow and not long"')]
    assert len(slow) == 1 and ci.index(test_command) < slow[0]
    with open(os.path.join(ROOT, "CONTRIBUTING.md")) as f:
        assert "`python3 -m pytest -q -m long`" in f.read()


@pytest.mark.parametrize("config", ["examples/tiny-llama/ds_cpu.json", "examples/llama-3.2-1b/ds_1gpu.json",
                                    "examples/llama-3-8b/ds_zero3_4gpu.json", "examples/llama-3-8b/ds_zero3_8gpu.json"])
def test_shipped_warmup_starts_above_zero(config):
    with open(os.path.join(ROOT, config)) as f:
        sched = json.load(f).get("scheduler") or {}
    if sched.get("type") == "WarmupLR":
        params = sched["params"]
        assert 0 < params["warmup_min_lr"] < params["warmup_max_lr"], params


def test_scheduler_warning_is_silenced(caplog):
    from deepspeed.utils import logger

    from fpdt.train.zero import quiet_deepspeed_warnings

    quiet_deepspeed_warnings()
    quiet_deepspeed_warnings()                                   # idempotent
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("Attempting to get learning rate from scheduler before it has started")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert seen == ["something else"]


@pytest.mark.parametrize("rates, dtype, want", [
    ({"float32": 5e10, "bfloat16": 2e9}, "bf16", (5e10, "measured CPU matmul: fp32, faster than bf16 here")),
    ({"float32": 5e10, "bfloat16": 2e11}, "bf16", (2e11, "measured CPU bf16 matmul")),
    ({"float32": 5e10}, "fp32", (5e10, "measured CPU fp32 matmul")),
])
def test_cpu_peak_is_never_below_what_the_cpu_reaches(monkeypatch, rates, dtype, want):
    import torch

    from fpdt.train import metrics

    calls = []

    def measure(dt=torch.float32, n=1024, **k):
        calls.append((str(dt).split(".")[1], n))
        return rates[calls[-1][0]]

    monkeypatch.setattr(metrics, "measure_matmul_flops", measure)
    assert metrics.resolve_peak_flops(torch.device("cpu"), dtype, None) == want
    if dtype == "bf16":     # probed small first; measured at full size only where the probe is not slow
        assert ("bfloat16", metrics.PROBE_N) in calls
        assert (("bfloat16", 1024) in calls) == (rates["bfloat16"] >= rates["float32"] / 2)
    else:
        assert calls == [("float32", 1024)]
    assert metrics.resolve_peak_flops(torch.device("cpu"), dtype, 1.5) == (1.5e12, "--peak-tflops")

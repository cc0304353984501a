"""fpdt-train's per-step memory figures on the CPU (``peak_mem_gib``, ``peak_reserved_gib``,
``host_stash_gib``; see :mod:`fpdt.train.loop`).

The figures must be the ones an independent :class:`MemoryAccountant` reports when it is
wrapped around the same optimizer step (entered just before ``train_step``, left just
after): equal to the byte, max over the ranks, on 2 gloo ranks with sp=2, ZeRO-3,
attention offload and offloaded activation checkpoints (so the host stash is non-zero).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.distributed import run_distributed
from tests.train.helpers import SGD, SGD_CLIP, ds_config, quiet, write_fixture, write_json

GIB = 2 ** 30
STEPS = 2


def _body(rank: int, world_size: int, tmp: str) -> None:
    quiet()
    os.environ["FPDT_RUNTIME"] = "sync"   # this rank only: offload paths on the CPU
    import fpdt.train.loop as loop
    from fpdt.memory.accountant import MemoryAccountant
    from fpdt.cli.train import main

    seen = []
    inner = loop.train_step

    def outer_step(*args, **kwargs):
        with MemoryAccountant("cpu") as acct:
            rec = inner(*args, **kwargs)
        seen.append({"device_peak": acct.device_peak, "host_peak": acct.host_peak})
        return rec

    loop.train_step = outer_step
    argv = ["--model-config", os.path.join(tmp, "config.json"), "--data", os.path.join(tmp, "tokens.npy"),
            "--seq-len", "64", "--steps", str(STEPS), "--sp", "2", "--chunk-size", "16",
            "--offload", "--checkpoint", "offload", "--deepspeed", os.path.join(tmp, "sgd.json"),
            "--log-json", os.path.join(tmp, "log.jsonl"), "--seed", "0"]
    assert main(argv) == 0
    with open(os.path.join(tmp, f"outer{rank}.json"), "w") as f:
        json.dump(seen, f)


@pytest.mark.slow
def test_step_memory_is_what_an_accountant_around_the_step_counts(tmp_path):
    tmp = str(tmp_path)
    write_fixture(tmp)
    write_json(os.path.join(tmp, "sgd.json"), ds_config(SGD, SGD_CLIP))
    run_distributed(_body, world_size=2, args=(tmp,), timeout=240)
    with open(os.path.join(tmp, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    outer = []
    for rank in range(2):
        with open(os.path.join(tmp, f"outer{rank}.json")) as f:
            outer.append(json.load(f))
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    for i, rec in enumerate(log):
        device = max(o[i]["device_peak"] for o in outer)
        host = max(o[i]["host_peak"] for o in outer)
        assert device > 0 and host > 0, (device, host)
        assert math.isfinite(rec["peak_mem_gib"]) and rec["peak_mem_gib"] > 0
        assert rec["peak_mem_gib"] * GIB == device, (i, rec["peak_mem_gib"] * GIB, device)
        assert rec["host_stash_gib"] * GIB == host, (i, rec["host_stash_gib"] * GIB, host)
        assert rec["peak_reserved_gib"] is None    # no caching allocator on the CPU


def test_bar_shows_reserved_and_host_stash_where_measured():
    from fpdt.train.progress import StepRecord, postfix

    base = dict(step=1, loss=1.0, lr=0.1, tokens=10, step_time_s=1.0, tokens_per_s=10.0, tgs=10.0, mfu=None,
                mfu_full=None, hfu=None, host_rss_gib=0.5)
    cuda = postfix(StepRecord(**base, peak_mem_gib=12.5, peak_reserved_gib=14.0, host_stash_gib=3.0))
    assert cuda.endswith("mem=12.5G/14G stash=3G")          # allocated / reserved peak, host stash
    cpu = postfix(StepRecord(**base, peak_mem_gib=0.0241, peak_reserved_gib=None, host_stash_gib=0.0))
    assert cpu.endswith("mem=24.7M")
    off = postfix(StepRecord(**base, peak_mem_gib=None, host_stash_gib=0.0))
    assert off.endswith("mem=n/a")

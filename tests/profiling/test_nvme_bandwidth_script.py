"""profiling/nvme_bandwidth.py at tiny sizes: its JSON fields, bit-exact round trips through the
portable backend, the calibration ``fpdt-plan`` reads, and the step mode's host peak."""

import json

import pytest

from fpdt.plan.hardware import load_calibration
from tests.profiling.helpers import run_script


@pytest.mark.long
@pytest.mark.slow
def test_bandwidth_rows_and_calibration(tmp_path):
    """The portable backend only (DeepSpeed's aio JIT-builds on first use: minutes)."""
    cal, out = tmp_path / "cal.json", tmp_path / "rows.jsonl"
    store = tmp_path / "store"
    store.mkdir()
    run_script("nvme_bandwidth", "bandwidth", "--backends", "portable", "--dir", store, "--blocks", "4096,65536",
               "--total-mib", "1", "--depth", "2", "--calibration-out", cal, "--out", out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["backend"] for r in rows} == {"portable"} and len(rows) == 2
    for r in rows:
        assert r["bit_exact"] and r["bytes"] == 1 << 20 and r["write_gb_s"] > 0 and r["read_gb_s"] > 0
    c = load_calibration(cal)
    big = [r for r in rows if r["block_bytes"] == 65536]
    assert c["nvme_read_bytes_s"] == pytest.approx(max(r["read_gb_s"] for r in big) * 1e9)
    assert list(store.iterdir()) == []       # the store's files are gone


@pytest.mark.slow
@pytest.mark.long
def test_step_mode_host_peak_falls_with_the_tier(tmp_path):
    out = tmp_path / "rows.jsonl"
    run_script("nvme_bandwidth", "step", "--dir", tmp_path, "--seq", "1024", "--chunk", "256", "--layers", "6",
               "--out", out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    host, tier = (next(r for r in rows if r["nvme"] is n) for n in (False, True))
    assert tier["nvme_bytes_written"] > 0 and host["nvme_bytes_written"] == 0
    assert tier["host_peak_bytes"] < host["host_peak_bytes"]

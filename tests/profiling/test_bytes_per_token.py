"""CPU smoke test of profiling/memory_budget.py's bytes-per-added-token section
(profiling/bytes_per_token.py): tiny model, 512 and 1024 tokens (at 256 tokens the tiny fpdt peak is a
constant of the first layer forward, larger than at 512), trials in-process, the script run as
``python -m``."""

import importlib.util
import json

import pytest

from tests.profiling.helpers import read_json, run_script

pytestmark = pytest.mark.slow


def _has(*packages):
    return all(importlib.util.find_spec(p) is not None for p in packages)


STRATEGIES = ["fpdt"] + (["alst"] if _has("deepspeed", "transformers") else [])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_budget")
    argv = ["--skip-table", "--tiny", "--strategies", *STRATEGIES, "--lengths", "512", "1024",
            "--chunk-size", "256", "--out-dir", str(out)]
    run_script("memory_budget", *argv)
    return out, argv, read_json(out / "memory_budget.json")


def test_fields_are_derived_and_positive(run):
    _, _, result = run
    r = result["bytes_per_token"]
    layers = r["model"]["num_hidden_layers"]
    for s in STRATEGIES:
        by_len = {t["seq_len"]: t for t in r["trials"] if t["strategy"] == s}
        assert set(by_len) == {512, 1024}
        for t in by_len.values():
            assert t["status"] == "ok", t
            assert t["device_peak_bytes"] > 0 and t["host_peak_bytes"] > 0   # both offload to the host pool
            phases = t["phases"]
            assert {f"fwd layer {i}" for i in range(layers)} | {f"bwd layer {i}" for i in range(layers)} <= set(phases)
            assert phases[t["peak_phase"]]["peak"] == t["device_peak_bytes"] == max(p["peak"] for p in phases.values())
            assert max(t["fwd_peak_bytes"], t["bwd_peak_bytes"]) == t["device_peak_bytes"]
        a, b = by_len[512], by_len[1024]
        assert r["per_token"][s]["device"] == (b["device_peak_bytes"] - a["device_peak_bytes"]) / 512 > 0
        assert r["per_token"][s]["host"] == (b["host_peak_bytes"] - a["host_peak_bytes"]) / 512 > 0


def test_markdown_and_json_written(run):
    out, argv, result = run
    text = (out / "memory_budget.md").read_text()
    assert "python -m profiling.memory_budget " + " ".join(argv) in text
    for s in STRATEGIES:
        kb = result["bytes_per_token"]["per_token"][s]["device"] / 1000
        assert f"| {s} | " in text and f"**{kb:.1f}**" in text
    if "alst" in STRATEGIES:
        assert "fpdt / alst device bytes per added token" in text
    saved = json.loads((out / "memory_budget.json").read_text())
    assert saved["bytes_per_token"]["per_token"] == result["bytes_per_token"]["per_token"]


@pytest.mark.long
def test_reuse_keeps_rows_not_rerun(run, tmp_path):
    out, _, first = run
    if "alst" not in STRATEGIES:
        pytest.skip("needs deepspeed and transformers for a second strategy")
    run_script("memory_budget", "--skip-table", "--tiny", "--strategies", "fpdt", "--lengths", "512", "1024",
               "--chunk-size", "256", "--reuse", out / "memory_budget.json", "--out-dir", tmp_path)
    again = read_json(tmp_path / "memory_budget.json")
    r = again["bytes_per_token"]
    assert r["strategies"] == ["fpdt", "alst"]
    assert r["per_token"]["alst"] == first["bytes_per_token"]["per_token"]["alst"]
    assert r["per_token"]["fpdt"]["device"] > 0

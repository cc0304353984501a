"""CPU smoke run of ``profiling/hf_integration.py`` (as ``python -m``): every strategy measured,
the JSON's fields, and the ordering its counts must show (exact on the CPU, so deterministic)."""

import pytest

from tests.profiling.helpers import read_json, run_script

STRATEGIES = {"hf", "alst", "hf+fpdt", "hf+fpdt offload", "hf+fpdt offload, ckpt offload", "fpdt.model"}
HOST_STASH = {"alst", "hf+fpdt offload", "hf+fpdt offload, ckpt offload", "fpdt.model"}
TINY_HIDDEN, TINY_HEADS = 64, 4          # the script's --tiny model


@pytest.mark.slow
@pytest.mark.long
def test_hf_integration_script_runs_tiny(tmp_path):
    run_script("hf_integration", "--tiny", "--out-dir", tmp_path)
    res = read_json(tmp_path / "hf_integration.json")
    assert res["script"] == "hf_integration.py" and res["software"]["transformers"]
    assert {t["strategy"] for t in res["trials"]} == STRATEGIES
    for t in res["trials"]:
        assert t["status"] == "ok" and t["device_peak_bytes"] > 0 and t["step_s"] > 0, t
        assert (t["host_stash_peak_bytes"] > 0) == (t["strategy"] in HOST_STASH), t
    per_1k = {s: v["device_bytes_per_1k_tokens"] for s, v in res["slopes"].items()}
    assert per_1k["hf+fpdt offload"] < per_1k["hf+fpdt"] < per_1k["alst"] < per_1k["hf"]
    # with fpdt.model's settings, fpdt.hf holds exactly what fpdt.model does plus Transformers'
    # RoPE tables (cos and sin, head_dim values each per token, fp32 here)
    rope_tables = 2 * TINY_HIDDEN // TINY_HEADS * 4 * 1024
    assert per_1k["hf+fpdt offload, ckpt offload"] - per_1k["fpdt.model"] == pytest.approx(rope_tables, rel=1e-6)
    host = {(t["strategy"], t["seq_len"]): t["host_stash_peak_bytes"] for t in res["trials"]}
    for (s, n), b in host.items():   # fpdt's checkpoint puts the layer inputs on the host too
        if s == "hf+fpdt offload, ckpt offload":
            assert b > host[("hf+fpdt offload", n)]
    assert res["slopes"]["hf"]["ratio_to_hf"] == 1.0

import pytest

from tests.profiling.helpers import read_json, run_script


@pytest.mark.long
@pytest.mark.slow
def test_attention_offload_script_runs_tiny(tmp_path):
    out = tmp_path / "r.md"
    run_script("attention_offload", "--tiny", "--out", out, "--json", tmp_path / "r.json")
    rows = read_json(tmp_path / "r.json")
    assert [r["chunks"] for r in rows] == [4, 2]            # 512 tokens in chunks of 128 and 256
    assert all(r["time_plain_s"] > 0 and r["time_offload_s"] > 0 for r in rows)
    for r in rows:                                          # CPU: the accountant's count, never n/a
        plain, offload = r["peak_plain"], r["peak_offload"]
        assert plain["source"] == "accountant" and plain["reserved"] is None
        assert plain["allocated"] > plain["allocated_at_start"] and offload["allocated"] > offload["allocated_at_start"]
        assert plain["host_stash"] == 0 and offload["host_stash"] > 0
    text = out.read_text()
    assert "| 128 | 4 |" in text and "MiB (counted) | " in text

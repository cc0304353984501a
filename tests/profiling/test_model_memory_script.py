import pytest

from tests.profiling.helpers import read_json, run_script


@pytest.mark.long
@pytest.mark.slow
def test_model_memory_script_runs_tiny(tmp_path):
    out = tmp_path / "r.md"
    run_script("model_memory", "--tiny", "--seq-lens", "64", "--chunk-size", "32", "--warmup", "0", "--iters", "1",
               "--out", out, "--json", tmp_path / "r.json")
    rows = read_json(tmp_path / "r.json")
    features = ["checkpoint_offload", "chunked_attention", "chunked_loss", "chunked_mlp", "offload"]
    assert rows[0]["label"] == "plain (all off)" and len(rows) == 1 + 2 * len(features)
    by_label = {r["label"]: r for r in rows}
    assert by_label["all on"]["features"] == features
    # the options each feature set runs with: none of the features, and all of them (64 tokens in chunks of 32)
    assert by_label["plain (all off)"]["lengths"]["64"]["options"] == {
        "num_chunks": 1, "offload": False, "mlp_chunks": 0, "loss_chunks": 0, "checkpointing": "off"}
    assert by_label["all on"]["lengths"]["64"]["options"] == {
        "num_chunks": 2, "offload": True, "mlp_chunks": None, "loss_chunks": None, "checkpointing": "offload"}
    for row in rows:                       # CPU: the accountant's count, never an empty cell
        offload = bool({"offload", "checkpoint_offload"} & set(row["features"]))
        for cell in row["lengths"].values():
            peaks = cell["peaks"]
            assert peaks["source"] == "accountant" and peaks["allocated"] > 0 and cell["seconds"] > 0, row["label"]
            assert peaks["reserved"] is None and (peaks["host_stash"] > 0) == offload, row["label"]
    text = out.read_text()
    assert "| plain (all off) | " in text and "MiB (counted) /" in text and "n/a" not in text
    assert "GPU figures are owed" in text

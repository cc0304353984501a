from profiling import model_memory


def test_model_memory_script_runs_tiny(tmp_path):
    out = tmp_path / "r.md"
    rows = model_memory.main(["--tiny", "--seq-lens", "64", "--warmup", "0", "--iters", "1", "--out", str(out)])
    labels = [label for label, _ in rows]
    assert labels[0] == "plain (all off)" and "all on" in labels and len(rows) == 1 + 2 * len(model_memory.FEATURES)
    for (label, results), (_, features) in zip(rows, model_memory.feature_sets()):
        offload = bool({"offload", "checkpoint_offload"} & features)
        for peaks, secs in results.values():   # CPU: the accountant's count, never an empty cell
            assert peaks.source == "accountant" and peaks.allocated > 0 and secs > 0, label
            assert peaks.reserved is None and (peaks.host_stash > 0) == offload, label
    text = out.read_text()
    assert "| plain (all off) | " in text and "MiB (counted) /" in text and "n/a" not in text
    assert "GPU figures are owed" in text


def test_feature_options():
    plain = model_memory.options_for(frozenset(), 131072, 32768)
    assert plain == {"num_chunks": 1, "offload": False, "mlp_chunks": 0, "loss_chunks": 0, "checkpointing": "off"}
    full = model_memory.options_for(frozenset(model_memory.FEATURES), 131072, 32768)
    assert full == {"num_chunks": 4, "offload": True, "mlp_chunks": None, "loss_chunks": None,
                    "checkpointing": "offload"}

from profiling import attention_offload


def test_attention_offload_script_runs_tiny(tmp_path):
    out = tmp_path / "r.md"
    rows = attention_offload.main(["--tiny", "--out", str(out)])
    assert [r[1] for r in rows] == [4, 2]            # 512 tokens in chunks of 128 and 256
    assert all(r[2] > 0 and r[3] > 0 for r in rows)
    for _, _, _, _, plain, offload, _ in rows:      # CPU: the accountant's count, never n/a
        assert plain.working_set > 0 and offload.working_set > 0 and plain.reserved is None
        assert plain.host_stash == 0 and offload.host_stash > 0
    text = out.read_text()
    assert "| 128 | 4 |" in text and "MiB (counted) | " in text

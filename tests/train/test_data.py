"""The data contract: sources, windows, DP assignment, global shift then FPDT sharding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fpdt.layout import unshard
from fpdt.train.data import (DataError, Windows, check_vocab, load_tokens, sequence_ids, shard_windows)

TOKENIZER = "examples/tiny-llama/tokenizer.json"


def test_npy_and_bin_sources(tmp_path):
    ids = np.arange(1000) % 700
    np.save(tmp_path / "a.npy", ids.astype(np.int32))
    ids.astype(np.uint16).tofile(tmp_path / "b.bin")
    ids.astype(np.uint32).tofile(tmp_path / "c.bin")
    assert np.array_equal(load_tokens(str(tmp_path / "a.npy")), ids)
    assert np.array_equal(load_tokens(str(tmp_path / "b.bin")), ids)
    assert np.array_equal(load_tokens(str(tmp_path / "c.bin"), bin_dtype="uint32"), ids)


def test_text_sources_and_directory_order(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.jsonl").write_text(json.dumps({"text": "second doc"}) + "\n" + json.dumps("third") + "\n")
    (tmp_path / "d" / "a.txt").write_text("first document\n")
    (tmp_path / "d" / "ignored.md").write_text("not data")
    got = load_tokens(str(tmp_path / "d"), tokenizer_path=TOKENIZER, eos_id=0)
    want = []
    for doc in ("first document\n", "second doc", "third"):
        want += tok.encode(doc, add_special_tokens=False).ids + [0]
    assert got.tolist() == want


def test_text_without_tokenizer_names_the_fix(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(DataError, match="no tokenizer.json"):
        load_tokens(str(tmp_path / "a.txt"), tokenizer_path=str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="vocab_size is 10"):
        check_vocab(np.array([3, 12]), 10, "x")


def test_windows_are_consecutive_and_wrap():
    w = Windows(np.arange(100), seq_len=9)            # windows of 10 tokens, 10 of them
    assert w.num_windows == 10
    assert w.sequences([0, 3]).tolist() == [list(range(0, 10)), list(range(30, 40))]
    assert w.window_of_sequence(13) == 3              # second pass starts again at window 0
    s = Windows(np.arange(100), seq_len=9, shuffle=True, seed=5)
    assert sorted(s.window_of_sequence(k) for k in range(10)) == list(range(10))
    with pytest.raises(DataError, match="fewer than one window"):
        Windows(np.arange(5), seq_len=9)


def test_dp_groups_read_distinct_windows_in_order():
    seen = [k for step in range(2) for micro in range(2) for d in range(3)
            for k in sequence_ids(step, micro, grad_accum=2, dp_rank=d, dp=3, micro_batch=2)]
    assert seen == list(range(24))


@pytest.mark.parametrize("sp, chunks", [(1, 1), (2, 2), (4, 2)])
def test_shift_is_global_then_sharded(sp, chunks):
    windows = torch.arange(2 * 33).reshape(2, 33)     # S = 32
    parts = [shard_windows(windows, sp, chunks, r) for r in range(sp)]
    for key, want in (("input_ids", windows[:, :-1]), ("labels", windows[:, 1:]),
                      ("position_ids", torch.arange(32).expand(2, 32))):
        assert torch.equal(unshard([p[key] for p in parts], chunks, dim=1), want)
    # every label is the token after its input, at the same local position, on every rank
    for p in parts:
        assert torch.equal(p["labels"], p["input_ids"] + 1)

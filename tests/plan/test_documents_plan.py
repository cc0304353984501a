"""fpdt-plan --doc-len: the attention work, blocks and MFU of packed documents."""

import dataclasses
import random

import pytest

from fpdt.plan import GPU_PRESETS, Cluster, load_model_config
from fpdt.plan.cli import main
from fpdt.plan.documents import (causal_pairs, document_lengths, effective_length, equal_touched_blocks,
                                 tiled_pairs, touched_blocks, work_fraction)
from fpdt.plan.planner import evaluate
from fpdt.plan.setup import Setup
from fpdt.plan.time_model import estimate_time
from fpdt.train.metrics import ModelShape, train_flops_per_token

CFG = load_model_config("llama-3-8b")
NODE = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, host_mem_bytes=1024 * 2 ** 30)
BASE = Setup.build(seq_len=2 ** 20, chunk_size=2 ** 16, hp=8, mlp_chunks=32, lm_head_wgrad="recompute")


def doc_ids(lengths):
    return [d for d, n in enumerate(lengths) for _ in range(n)]


def brute_tiled(lengths, tile):
    """Every (query tile, key tile) of each document's causal square, tile rows x tile keys
    clipped to the document, the keys of a tile up to the query tile's end."""
    total = 0
    for n in lengths:
        for q0 in range(0, n, tile):
            rows = min(tile, n - q0)
            total += rows * min(n, q0 + tile)
    return total


def brute_touched(lengths, chunks):
    ids = doc_ids(lengths)
    c = len(ids) // chunks
    return sum(any(ids[q] == ids[k] and k <= q for q in range(i * c, (i + 1) * c) for k in range(j * c, (j + 1) * c))
               for i in range(chunks) for j in range(i + 1))


@pytest.mark.parametrize("seed", range(4))
def test_block_and_tile_counts_equal_brute_force(seed):
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < 96:
        lengths.append(rng.choice([1, 2, 3, 5, 8, 13, 30]))
    lengths[-1] -= sum(lengths) - 96
    lengths = [n for n in lengths if n]
    ends = [sum(lengths[:i + 1]) for i in range(len(lengths))]
    for chunks in (1, 4, 8, 12):
        assert touched_blocks(ends, chunks) == brute_touched(lengths, chunks)
    counts = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    for tile in (1, 4, 16):
        assert tiled_pairs(counts, tile) == brute_tiled(lengths, tile)
    assert tiled_pairs(counts, 1) == causal_pairs(counts) == sum(n * (n + 1) // 2 for n in lengths)


@pytest.mark.parametrize("seq_len,doc_len,chunks", [(96, 7, 8), (96, 96, 4), (96, 200, 6), (96, 1, 12), (96, 13, 3)])
def test_equal_documents(seq_len, doc_len, chunks):
    lengths = [n for n, c in document_lengths(seq_len, doc_len).items() for _ in range(c)]
    assert sum(lengths) == seq_len and max(lengths) == min(doc_len, seq_len)
    ends = [sum(lengths[:i + 1]) for i in range(len(lengths))]
    assert equal_touched_blocks(seq_len, doc_len, chunks) == touched_blocks(ends, chunks) == brute_touched(lengths,
                                                                                                           chunks)


def test_work_for_equal_documents_is_s_n_over_2_plus_the_diagonal_tiles():
    s, n = 2 ** 20, 2048
    assert work_fraction(s, n) == (s * n / 2 + s * 128 / 2) / (s * s / 2 + s * 128 / 2)
    assert work_fraction(s, s) == work_fraction(s, 2 * s) == work_fraction(s, None) == 1.0
    assert effective_length(s, n) == n and effective_length(s, None) == s
    assert effective_length(96, 40) == (2 * 40 ** 2 + 16 ** 2) / 96        # the last document is cut


def test_one_document_changes_nothing_and_short_ones_scale_attention():
    ref = estimate_time(CFG, BASE, NODE)
    assert estimate_time(CFG, dataclasses.replace(BASE, doc_len=2 ** 20), NODE) == ref
    docs = estimate_time(CFG, dataclasses.replace(BASE, doc_len=8192), NODE)
    assert docs["attention"] == pytest.approx(ref["attention"] * work_fraction(2 ** 20, 8192), rel=1e-12)
    assert docs["gemms"] == ref["gemms"] and docs["elementwise"] < ref["elementwise"]   # fewer merges


def test_skipped_blocks_fetch_nothing():
    # 16 chunks of 64K, documents of 64K aligned with them: only the diagonal blocks are touched,
    # so the forward fetches no K/V block (cp = 1 fetches (T - u) blocks)
    from fpdt.plan.memory_model import layer_attention_costs
    from fpdt.plan.time_model import _document_copies
    s = dataclasses.replace(BASE, doc_len=2 ** 16)
    assert equal_touched_blocks(2 ** 20, 2 ** 16, 16) == 16
    c = _document_copies(CFG, s, layer_attention_costs(CFG, s))
    assert c.h2d_bytes_fwd == 0
    half = dataclasses.replace(BASE, doc_len=2 ** 17)      # each document spans two chunks: 8 more blocks
    c2 = _document_copies(CFG, half, layer_attention_costs(CFG, half))
    k_block = layer_attention_costs(CFG, BASE).h2d_bytes_fwd / (16 * 17 // 2 - 16)
    assert c2.h2d_bytes_fwd == pytest.approx(8 * k_block)


def test_mfu_counts_only_the_attention_the_mask_needs():
    m = ModelShape.from_config(CFG)
    full, docs = evaluate(CFG, BASE, NODE), evaluate(CFG, dataclasses.replace(BASE, doc_len=4096), NODE)
    flops = {k: r["mfu"] * r["step_time_s"] for k, r in (("full", full), ("docs", docs))}
    assert flops["docs"] / flops["full"] == pytest.approx(
        train_flops_per_token(m, 4096) / train_flops_per_token(m, 2 ** 20), rel=1e-12)
    assert docs["step_time_s"] < full["step_time_s"] / 10


def test_cli_doc_len(capsys):
    args = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(2 ** 20), "--chunk-size", "65536",
            "--hp", "8"]
    assert main([*args, "--doc-len", "8192"]) == 0
    assert "packed documents of 8K tokens" in capsys.readouterr().out
    assert main([*args, "--doc-len", "0"]) == 2
    assert "--doc-len 0 must be a whole number of tokens" in capsys.readouterr().err

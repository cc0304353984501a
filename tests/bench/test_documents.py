"""fpdt.bench.documents: per-rank attention work of packed documents, counted."""

import pytest
import torch

from fpdt.bench import documents as db
from fpdt.layout import global_token_index, mesh_token_index


def test_packing_splits_documents_at_the_window_and_restarts_the_continuation():
    windows = db.pack_windows(iter([5, 9, 3, 20, 2, 100]), 8, 4)
    assert windows == [[5, 3], [6, 2], [1, 7], [8]]
    assert db.keys_seen([3, 2]).tolist() == [1, 2, 3, 1, 2]


@pytest.mark.parametrize("docs,ranks,chunks", [([40, 3, 21, 64], 4, 2), ([128], 4, 4), ([1] * 64 + [64], 2, 4)])
def test_rank_work_is_the_pairs_each_rank_computes(docs, ranks, chunks):
    s = sum(docs)
    ids = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    lays = db.layouts(s, ranks, chunks)
    work = db.keys_seen(docs)

    def brute(queries):   # keys of the same document at or before each query
        return sum(int(((ids == ids[q]) & (torch.arange(s) <= q)).sum()) for q in queries.tolist())

    total = sum(n * (n + 1) // 2 for n in docs)
    for name, layout in lays.items():
        per_rank = db.rank_work(work, layout)
        assert sum(per_rank) == pytest.approx(total), name
        if name == "fpdt_ring":
            assert per_rank == [brute(global_token_index(s, ranks, chunks, r)) for r in range(ranks)]
        if name == "zigzag":
            assert per_rank == [brute(mesh_token_index(s, 1, ranks, chunks, c, 0)) for c in range(ranks)]
    assert db.imbalance(db.rank_work(work, lays["ulysses"])) == pytest.approx(1.0)


def test_one_document_is_balanced_exactly_by_the_zigzag():
    s = 2 ** 10
    lays = db.layouts(s, 8, 4)
    dense = torch.arange(1, s + 1)
    assert db.imbalance(db.rank_work(dense, lays["zigzag"])) == 1.0
    assert db.imbalance(db.rank_work(dense, lays["fpdt_ring"])) > 1.0


def test_arranged_windows_are_the_trainers_pieces():
    """Each window's documents in fpdt-train's ring order: the same pieces, so the same total work."""
    windows = db.pack_windows(db.document_stream(0, 64, 1.5, 1024), 4096, 6)
    arranged = db.arranged_windows(windows, 4096, 8, 4)
    for w, docs in enumerate(windows):
        assert int(arranged(w).sum()) == sum(n * (n + 1) // 2 for n in docs)

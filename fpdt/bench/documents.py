"""Per-rank attention work of packed documents, counted (no model runs): the document lengths,
their packing into windows, and the query-key pairs each rank computes under a layout.

**Work**: a query at position ``q`` of its document (0-based) sees ``q + 1`` keys (causal,
itself included), so a rank's work is the sum of that over the query tokens it holds, times
the fraction of the heads it computes: the exact pair count the masked path runs.
**Layouts** (:func:`layouts`, ``P`` ranks, ``u`` FPDT chunks per rank): ``ulysses``, ``fpdt_ring``
(rank ``r`` holds global piece ``i P + r`` of every chunk ``i``), ``zigzag``
(:func:`fpdt.layout.mesh_token_index`, ``hp = 1``) and ``mesh_{hp}x{cp}``. Used by
``profiling/doc_balance.py`` (its docstring: the experiment) and the tests.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch

from fpdt.layout import global_token_index, mesh_token_index


def document_stream(seed: int, median: int, sigma: float, max_doc: int):
    """Document lengths, log-normal (median, sigma), clipped to [1, max_doc]."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        for z in torch.randn(4096, generator=gen, dtype=torch.float64).tolist():
            yield max(1, min(max_doc, round(median * math.exp(sigma * z))))


def pack_windows(lengths, seq_len: int, count: int) -> list[list[int]]:
    """``count`` windows of ``seq_len`` tokens, each a list of document lengths; a document
    longer than what is left is split, its continuation starting the next window."""
    windows, current, room, carry = [], [], seq_len, 0
    while len(windows) < count:
        n = carry or next(lengths)
        take = min(n, room)
        current.append(take)
        room -= take
        carry = n - take
        if room == 0:
            windows.append(current)
            current, room = [], seq_len
    return windows


def keys_seen(docs: list[int]) -> torch.Tensor:
    """Per global token, the keys it sees under the causal document mask (``[S]`` int64)."""
    lengths = torch.tensor(docs, dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(int(lengths.sum()), dtype=torch.int64)
    return pos - torch.repeat_interleave(starts, lengths) + 1


def layouts(seq_len: int, ranks: int, chunks: int) -> dict[str, list[tuple[torch.Tensor, float]]]:
    """Per layout, per rank: (global query tokens whose work it runs, the share of heads)."""
    out = {"ulysses": [(torch.arange(seq_len), 1 / ranks)] * ranks,
           "fpdt_ring": [(global_token_index(seq_len, ranks, chunks, r), 1.0) for r in range(ranks)],
           "zigzag": [(mesh_token_index(seq_len, 1, ranks, chunks, c, 0), 1.0) for c in range(ranks)]}
    for hp in (2, 4):
        cp = ranks // hp
        if hp < ranks and ranks % hp == 0:
            cp_tokens = [torch.cat([mesh_token_index(seq_len, hp, cp, chunks, c, h) for h in range(hp)])
                         for c in range(cp)]
            out[f"mesh_{hp}x{cp}"] = [(cp_tokens[c], 1 / hp) for c in range(cp) for _ in range(hp)]
    return out


def arranged_windows(windows: list[list[int]], seq_len: int, ranks: int, chunks: int):
    """``w -> keys_seen`` of window ``w``'s documents in the order ``fpdt-train`` writes them on
    a ring of ``ranks`` CP ranks (:meth:`fpdt.train.data.PackedWindows.arrangement`; the windows
    are already cut at their ends, so ``split`` packing reproduces them piece for piece)."""
    from fpdt.train.data import PackedWindows
    lengths = np.asarray([n for docs in windows for n in docs], dtype=np.int64)
    packed = PackedWindows(np.zeros(int(lengths.sum()), dtype=np.int64), lengths, seq_len, packing="split",
                           balance_cp=ranks, balance_chunks=chunks)
    return lambda w: keys_seen(packed.piece_len[packed.arrangement(w)].tolist())


def rank_work(work: torch.Tensor, layout: list[tuple[torch.Tensor, float]]) -> list[float]:
    return [float(work[idx].sum()) * share for idx, share in layout]


def imbalance(per_rank: list[float]) -> float:
    return max(per_rank) / statistics.fmean(per_rank)

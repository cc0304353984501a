"""Packed documents in the planner (``fpdt-plan --doc-len N``): the kernel's attention work under a
document mask (time), the pairs the mask needs (MFU) and the (query chunk, key chunk) blocks it
skips (copies and merges), for documents of one length end to end. The assumptions:
``docs/plan.md``, "Packed documents"."""

from __future__ import annotations

DOC_TILE = 128
"""Query and key tile of the flash-attention varlen kernels (rows and columns per tile)."""


def document_lengths(seq_len: int, doc_len: int) -> dict[int, int]:
    """Documents of ``doc_len`` tokens end to end over ``seq_len`` (the last one cut by the
    window; ``doc_len >= seq_len``: one document), as ``{length: count}``."""
    if doc_len < 1:
        raise ValueError(f"--doc-len {doc_len} must be at least 1 token")
    n = min(doc_len, seq_len)
    out = {n: seq_len // n}
    if seq_len % n:
        out[seq_len % n] = 1
    return out


def tiled_pairs(lengths: dict[int, int], tile: int = DOC_TILE) -> int:
    """Query-key pairs a varlen kernel computes over documents ``{length: count}``: per
    document, each query tile of up to ``tile`` rows against the keys from the document's
    start to the tile's end (whole key tiles, the diagonal one masked inside: its pairs count)."""
    total = 0
    for n, count in lengths.items():
        full, rest = divmod(n, tile)       # full tiles r = 0..full-1 see (r + 1) tiles of keys
        total += count * (tile * tile * full * (full + 1) // 2 + rest * n)
    return total


def causal_pairs(lengths: dict[int, int]) -> int:
    """Query-key pairs the mask needs: ``n (n + 1) / 2`` per document."""
    return sum(count * n * (n + 1) // 2 for n, count in lengths.items())


def work_fraction(seq_len: int, doc_len: int | None, tile: int = DOC_TILE) -> float:
    """The kernel's attention work with documents of ``doc_len`` over that of one
    ``seq_len``-token document (1.0 with None)."""
    if doc_len is None:
        return 1.0
    return tiled_pairs(document_lengths(seq_len, doc_len), tile) / tiled_pairs({seq_len: 1}, tile)


def effective_length(seq_len: int, doc_len: int | None) -> float:
    """The sequence length that puts the needed attention work into the FLOPs formula
    (:func:`fpdt.train.metrics.attention_flops`, ``S / 2`` keys per token when causal):
    ``sum n_d^2 / S``, ``N`` for documents of one length dividing ``S``; ``S`` with None."""
    if doc_len is None:
        return float(seq_len)
    return sum(count * n * n for n, count in document_lengths(seq_len, doc_len).items()) / seq_len


def touched_blocks(doc_ends: list[int], num_chunks: int) -> int:
    """Causal (query chunk, key chunk) blocks, ``j <= i`` over ``num_chunks`` equal chunks of
    the sequence, in which some query sees some key: every diagonal block, and ``(i, j < i)``
    when the document holding chunk ``j``'s last token reaches into chunk ``i``.
    ``doc_ends``: each document's exclusive end, increasing, the last = the sequence length."""
    seq_len = doc_ends[-1]
    if seq_len % num_chunks:
        raise ValueError(f"{num_chunks} chunks do not divide the {seq_len} tokens")
    c = seq_len // num_chunks
    total, d = 0, 0
    for j in range(num_chunks):
        last = (j + 1) * c - 1                 # chunk j's last token
        while doc_ends[d] <= last:
            d += 1
        reach = (doc_ends[d] - 1) // c         # the last chunk its document reaches
        total += 1 + min(num_chunks - 1, reach) - j
    return total


def equal_touched_blocks(seq_len: int, doc_len: int, num_chunks: int) -> int:
    """:func:`touched_blocks` for documents of ``doc_len`` end to end (no list built)."""
    c, n = seq_len // num_chunks, min(doc_len, seq_len)
    total = 0
    for j in range(num_chunks):
        end = min(seq_len, ((j + 1) * c - 1) // n * n + n)     # end of the document holding the last token
        total += 1 + min(num_chunks - 1, (end - 1) // c) - j
    return total


def touch_fraction(seq_len: int, doc_len: int | None, num_chunks: int, cp: int = 1) -> float:
    """Touched over causal blocks (1.0 with None), over ``num_chunks * cp`` chunks for the ring."""
    if doc_len is None:
        return 1.0
    n = num_chunks * cp
    return equal_touched_blocks(seq_len, doc_len, n) / (n * (n + 1) // 2)


def ring_touches(seq_len: int, doc_len: int | None, num_chunks: int, cp: int = 1) -> float:
    """(Query chunk, KV block) touches of one attention call per rank, ``cp u (u + 1) / 2``
    causal (:mod:`fpdt.attention.ring_costs`), times :func:`touch_fraction`."""
    return cp * num_chunks * (num_chunks + 1) / 2 * touch_fraction(seq_len, doc_len, num_chunks, cp)

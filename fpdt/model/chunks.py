"""Token chunking shared by the chunked MLP and the chunked loss."""

from __future__ import annotations


def chunk_bounds(total: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` near-equal ``[start, end)`` spans covering ``range(total)`` (no empty ones)."""
    n = max(1, min(num_chunks, total))
    step = -(-total // n)
    return [(s, min(s + step, total)) for s in range(0, total, step)]

"""Token chunking shared by the chunked MLP, loss and RMSNorm, and the byte budget behind their
default counts: one local attention chunk of bf16 hidden states, ``L * hidden * 2``, for each op's
widest per-chunk tensor. SwiGLU ``ceil(2 u I / hidden)`` (four bf16 ``[n, I]`` live in backward,
half the budget each), LM head + CE ``ceil(2 u V / hidden)`` (fp32 ``[n, V]``), RMSNorm ``2 u``
(fp32 ``[n, hidden]``). Explicit counts (``mlp_chunks=``, ``loss_chunks=``) win.
"""

from __future__ import annotations


def _span(total: int, num_chunks: int) -> int:
    return -(-total // max(1, min(num_chunks, total)))


def chunk_bounds(total: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` near-equal ``[start, end)`` spans covering ``range(total)`` (no empty ones)."""
    step = _span(total, num_chunks)
    return [(s, min(s + step, total)) for s in range(0, total, step)]


def chunk_count(total: int, num_chunks: int) -> int:
    """``len(chunk_bounds(total, num_chunks))``: spans of ``ceil(total / num_chunks)`` tokens,
    so sometimes fewer than asked."""
    return -(-total // _span(total, num_chunks))


def budget_chunks(num_chunks: int, hidden: int, bytes_per_token: int) -> int:
    """Token chunks so that ``bytes_per_token`` per token fits the budget of one local attention
    chunk of bf16 hidden states (``S_local / num_chunks * hidden * 2`` bytes): see the module
    docstring. At least 1."""
    return max(1, -(-num_chunks * bytes_per_token // (hidden * 2)))

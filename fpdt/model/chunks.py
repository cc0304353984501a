"""Token chunking shared by the chunked MLP, the chunked loss and RMSNorm, and the byte
budget that picks their default chunk counts.

**The default rule.** One budget for every chunked op: the bytes of one local attention
chunk of bf16 hidden states, ``B = L * hidden * 2`` with ``L = S_local / u`` (``U / P``).
Each op takes as many token chunks as it needs for its widest per-chunk tensor to fit in
``B``; counted per token, that is independent of ``S``:

* SwiGLU MLP, ``[n, I]`` intermediates (bf16 bytes): ``ceil(2 * u * I / hidden)`` chunks
  (four of them are live in its backward: each gets half the budget);
* LM head + CE, fp32 ``[n, V]`` logits: ``ceil(2 * u * V / hidden)`` (``2 V / hidden``
  at ``u = 1``);
* RMSNorm, fp32 ``[n, hidden]`` temporaries: ``2 * u``.

Explicit counts always win (``mlp_chunks=``, ``loss_chunks=``).
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

"""How a sequence splits over the sequence-parallel ranks, and the bytes of a rank's tokens.

One rule each, used by the layouts, the attention, the trainer's checks, the accountant and
the planner: a global FPDT chunk is cut into :func:`chunk_split` equal pieces, so the sequence
length ``S`` must be a multiple of :func:`sequence_multiple` (:func:`chunking_problems` says
why a length and chunk do not fit); :func:`hidden_bytes` is the
memory unit (``Nd`` for a rank's whole sequence, ``U`` for one chunk).
"""

from __future__ import annotations


def chunk_split(sp: int, zigzag: bool) -> int:
    """Equal pieces each global chunk is cut into over ``sp = hp * cp`` ranks: ``sp`` in the FPDT
    layout, ``2 * sp`` in the mesh layout (``zigzag``: its ring halves every piece).
    ``fpdt-train`` and ``fpdt-plan`` use the mesh layout when ``cp > 1``."""
    return 2 * sp if zigzag else sp


def sequence_multiple(sp: int, num_chunks: int, zigzag: bool) -> int:
    """What ``S`` must be a multiple of for ``num_chunks`` chunks per rank:
    ``chunk_split(sp, zigzag) * num_chunks``."""
    return chunk_split(sp, zigzag) * num_chunks


def chunking_problems(seq_len: int, chunk: int, hp: int, cp: int) -> list[str]:
    """Why ``seq_len`` tokens cannot be cut into global chunks of ``chunk`` tokens over an
    ``hp x cp`` mesh (empty when they can), worded in option names (``chunk_size=``,
    ``seq_len=``), which ``fpdt-train`` and ``fpdt-plan`` word as their flags."""
    if chunk > seq_len:
        return [f"chunk_size={chunk} is larger than the sequence (seq_len={seq_len}); use a chunk size "
                f"<= {seq_len} that divides it"]
    if seq_len % chunk:
        return [f"seq_len={seq_len} is not divisible by chunk_size={chunk}; pick a chunk size that divides "
                f"the sequence length"]
    sp, u = hp * cp, seq_len // chunk
    split = chunk_split(sp, zigzag=cp > 1)
    if chunk % split == 0:
        return []
    what, why = ((f"sp x chunks = {sp} x {u}", f"must split evenly over {sp} ranks") if cp == 1 else
                 (f"2 x hp x cp x chunks = 2 x {hp} x {cp} x {u}", "is cut into 2 x cp zigzag pieces split over hp ranks"))
    return [f"seq_len={seq_len} is not divisible by {what} = {split * u}; each chunk of {chunk} tokens {why}: "
            f"use a chunk size that is a multiple of {split}"]


def hidden_bytes(tokens: int, hidden: int, itemsize: int = 2) -> int:
    """Bytes of ``tokens`` hidden states of width ``hidden``: ``Nd`` for a rank's sequence
    (``B * S / P`` tokens), ``U`` for one chunk (bf16 by default)."""
    return tokens * hidden * itemsize

"""How a sequence splits over the sequence-parallel ranks, and the bytes of a rank's tokens.

One rule each, used by the layouts, the attention, the trainer's checks, the accountant and
the planner: a global FPDT chunk is cut into :func:`chunk_split` equal pieces, so the sequence
length ``S`` must be a multiple of :func:`sequence_multiple`; :func:`hidden_bytes` is the
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


def hidden_bytes(tokens: int, hidden: int, itemsize: int = 2) -> int:
    """Bytes of ``tokens`` hidden states of width ``hidden``: ``Nd`` for a rank's sequence
    (``B * S / P`` tokens), ``U`` for one chunk (bf16 by default)."""
    return tokens * hidden * itemsize

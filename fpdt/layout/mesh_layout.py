"""The 2D (head-parallel x context-parallel) token layout: FPDT chunk order x zigzag.

Notation: ``S`` global tokens, ``u`` FPDT chunks per rank, ``hp`` ranks in a head-parallel
(Ulysses) group, ``cp`` ranks in a context-parallel (ring) group; a rank has mesh
coordinates ``(c, h)`` (CP rank ``c``, HP rank ``h``) and holds ``S / (hp * cp)`` tokens.

The layout, from the outside in:

1. **Spans (FPDT chunk order).** The sequence is cut into ``u`` global spans of
   ``S / u`` tokens. Local chunk ``i`` of every rank comes from span ``i``.
2. **Zigzag over CP (causal load balance).** Span ``i`` is cut into ``2 * cp`` pieces of
   ``p = S / (2 * cp * u)`` tokens; CP rank ``c`` takes pieces ``c`` and ``2*cp - 1 - c``,
   concatenated in that order: its *CP chunk* ``i`` of ``2p`` tokens.
3. **Ulysses split over HP.** CP chunk ``i`` is cut into ``hp`` contiguous slices of
   ``L = 2p / hp`` tokens; HP rank ``h`` holds slice ``h`` as its local chunk ``i``.

So after the Ulysses all-to-all of local chunk ``i`` (sequence -> heads) inside an HP
group, every member holds the whole CP chunk ``i`` (both zigzag pieces, in order) for its
heads, which is what ring attention runs on. Local order is chunk-major:
``[chunk 0 | chunk 1 | ... | chunk u-1]``, each ``L`` tokens.

Global token of local position ``t = i * L + r`` (``0 <= r < L``) on rank ``(c, h)``:
``k = h * L + r`` (position inside CP chunk ``i``), then
``i * S/u + c * p + k`` if ``k < p`` else ``i * S/u + (2*cp - 1 - c) * p + (k - p)``.

With ``cp = 1`` the two pieces are adjacent and this is exactly the FPDT layout of
:mod:`fpdt.layout.fpdt_layout` with ``P = hp`` (local chunk ``i`` of rank ``h`` = global
piece ``i * hp + h``). ``S`` must be divisible by ``2 * hp * cp * u``.

The *SP rank* of ``(c, h)`` is ``c * hp + h``; :func:`mesh_unshard` takes the shards in
that order.
"""

from __future__ import annotations

import torch

from fpdt.layout.split import sequence_multiple


def check_mesh_layout(seq_len: int, hp: int, cp: int, num_chunks: int) -> int:
    """Validate ``(S, hp, cp, u)`` and return the local chunk length ``L = S / (hp*cp*u)``.

    Raises ``ValueError`` naming the required multiple ``2 * hp * cp * u``.
    """
    if min(hp, cp, num_chunks) < 1:
        raise ValueError(f"hp={hp}, cp={cp} and num_chunks={num_chunks} must all be >= 1")
    multiple = sequence_multiple(hp * cp, num_chunks, zigzag=True)
    if seq_len <= 0 or seq_len % multiple:
        raise ValueError(
            f"sequence length S={seq_len} is not divisible by 2*hp*cp*num_chunks=2*{hp}*{cp}*{num_chunks}="
            f"{multiple}; pad or trim the sequence to a multiple of {multiple}, or use fewer chunks")
    return seq_len // (hp * cp * num_chunks)


def mesh_token_index(seq_len: int, hp: int, cp: int, num_chunks: int, cp_rank: int, hp_rank: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the tokens rank ``(cp_rank, hp_rank)`` holds, in local order.

    Returns a ``LongTensor`` ``[S / (hp * cp)]`` (see the module docstring for the map).
    """
    if not (0 <= cp_rank < cp and 0 <= hp_rank < hp):
        raise ValueError(f"mesh coordinates (cp_rank={cp_rank}, hp_rank={hp_rank}) outside cp={cp} x hp={hp}")
    L = check_mesh_layout(seq_len, hp, cp, num_chunks)
    span = seq_len // num_chunks
    piece = span // (2 * cp)
    k = hp_rank * L + torch.arange(L, device=device)                     # position inside the CP chunk
    first = cp_rank * piece + k
    second = (2 * cp - 1 - cp_rank) * piece + (k - piece)
    within = torch.where(k < piece, first, second)                       # position inside the span
    starts = torch.arange(num_chunks, device=device) * span
    return (starts[:, None] + within[None, :]).reshape(-1)


def mesh_shard(x: torch.Tensor, hp: int, cp: int, num_chunks: int, cp_rank: int, hp_rank: int,
               dim: int = 1) -> torch.Tensor:
    """Rank ``(cp_rank, hp_rank)``'s slice of a global tensor along ``dim`` (any dtype)."""
    dim = dim % x.dim()
    index = mesh_token_index(x.shape[dim], hp, cp, num_chunks, cp_rank, hp_rank, device=x.device)
    return x.index_select(dim, index)


def mesh_unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], hp: int, cp: int, num_chunks: int,
                 dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`mesh_shard`: ``shards[c * hp + h]`` is rank ``(c, h)``'s slice."""
    if len(shards) != hp * cp:
        raise ValueError(f"mesh_unshard needs hp*cp={hp * cp} shards (index c*hp + h), got {len(shards)}")
    dim = dim % shards[0].dim()
    seq_len = shards[0].shape[dim] * hp * cp
    shape = list(shards[0].shape)
    shape[dim] = seq_len
    out = shards[0].new_empty(shape)
    for c in range(cp):
        for h in range(hp):
            index = mesh_token_index(seq_len, hp, cp, num_chunks, c, h, device=out.device)
            out.index_copy_(dim, index, shards[c * hp + h])
    return out

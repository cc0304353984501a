"""The 2D (head-parallel x context-parallel) token layout: FPDT chunk order x zigzag.

Rank ``(c, h)`` (SP rank ``c * hp + h``, the order :func:`mesh_unshard` takes) holds ``S / (hp cp)``
tokens, chunk-major. Span ``i`` of ``u`` is cut into ``2 cp`` pieces of ``p = S / (2 cp u)``; CP
rank ``c`` takes pieces ``c`` and ``2cp - 1 - c`` (its CP chunk ``i``), cut into ``hp`` slices of
``L = 2p / hp``, HP rank ``h`` holding slice ``h``. Local position ``t = i L + r``, ``k = h L + r``:
global ``i S/u + c p + k`` if ``k < p``, else ``i S/u + (2cp - 1 - c) p + (k - p)``. ``S`` must
be divisible by ``2 hp cp u``; ``cp = 1`` is the FPDT layout with ``P = hp``.
"""

from __future__ import annotations

import torch

from fpdt.layout.split import sequence_multiple


def check_mesh_layout(seq_len: int, hp: int, cp: int, num_chunks: int) -> int:
    """Validate ``(S, hp, cp, u)`` and return ``L = S / (hp*cp*u)``; ``ValueError`` naming the
    required multiple ``2 * hp * cp * u`` otherwise.
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

"""The FPDT token layout ("rank-ordinal scattering").

``P`` ranks, ``u`` chunks per rank, ``L = S / (P * u)``: rank ``r``'s local chunk ``i`` is global
tokens ``[(i*P + r) * L, (i*P + r + 1) * L)``, so the all-to-all of chunk ``i`` gives every rank
the contiguous span ``[i P L, (i + 1) P L)`` (the causal mask stays block-diagonal, the traffic
balanced). Ids, labels, masks and position ids all go through it, labels shifted on the *global*
sequence first.
"""

from __future__ import annotations

import torch

from fpdt.layout.split import sequence_multiple


def check_layout(seq_len: int, sp_size: int, num_chunks: int) -> int:
    """Validate ``(S, P, u)`` and return ``L = S / (P * u)``; ``ValueError`` naming the fix otherwise."""
    if sp_size < 1 or num_chunks < 1:
        raise ValueError(f"sp_size={sp_size} and num_chunks={num_chunks} must both be >= 1")
    denom = sequence_multiple(sp_size, num_chunks, zigzag=False)
    if seq_len % denom != 0:
        raise ValueError(
            f"sequence length S={seq_len} is not divisible by sp_size*num_chunks="
            f"{sp_size}*{num_chunks}={denom}; pad or trim the sequence to a multiple of {denom}, "
            f"or choose a chunk count that divides S/{sp_size}"
        )
    if seq_len == 0:
        raise ValueError("sequence length S=0: nothing to shard")
    return seq_len // denom


def global_token_index(seq_len: int, sp_size: int, num_chunks: int, rank: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Global token positions held by ``rank``, in its local order: a ``LongTensor`` ``[S / P]``."""
    if not 0 <= rank < sp_size:
        raise ValueError(f"rank={rank} outside [0, sp_size={sp_size})")
    piece = check_layout(seq_len, sp_size, num_chunks)
    chunk_ids = torch.arange(num_chunks, device=device) * sp_size + rank  # global piece per local chunk
    offsets = torch.arange(piece, device=device)
    return (chunk_ids[:, None] * piece + offsets[None, :]).reshape(-1)


def shard(x: torch.Tensor, sp_size: int, num_chunks: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Take ``rank``'s slice of a global tensor along ``dim`` in the FPDT layout.

    ``x`` has the full sequence (length ``S``) along ``dim``; the result has ``S / P``
    there, ordered as described in the module docstring. Works for any dtype (ids,
    labels, masks, position ids, activations); returns a new contiguous tensor.
    """
    dim = dim % x.dim()
    index = global_token_index(x.shape[dim], sp_size, num_chunks, rank, device=x.device)
    return x.index_select(dim, index)


def unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], num_chunks: int,
            dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: the global tensor from every rank's slice ``shards[r]``."""
    sp_size = len(shards)
    if sp_size == 0:
        raise ValueError("unshard needs at least one shard")
    dim = dim % shards[0].dim()
    local = shards[0].shape[dim]
    if local % num_chunks != 0:
        raise ValueError(f"local length {local} is not divisible by num_chunks={num_chunks}")
    piece = local // num_chunks
    # Local chunk i of rank r is global piece i*P + r: interleave ranks inside each chunk.
    pieces = [s.split(piece, dim=dim) for s in shards]
    ordered = [pieces[r][i] for i in range(num_chunks) for r in range(sp_size)]
    return torch.cat(ordered, dim=dim)


def local_position_ids(seq_len: int, sp_size: int, num_chunks: int, rank: int,
                       batch_size: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids ``[B, S / P]`` for ``rank``: the global positions of its tokens."""
    pos = global_token_index(seq_len, sp_size, num_chunks, rank, device=device)
    return pos.unsqueeze(0).expand(batch_size, -1).contiguous()

"""Packed documents: which (query, key) blocks of an attention call can see each other.

``doc_ids`` ``[B, S]``: document index of every *global* token, non-decreasing along ``S``; a
query attends to the keys of its own document (causally). A :class:`Block` is ``skip`` (no query
sees any key: no kernel call, no fetch), ``dense`` (one document per row on both sides) or
``masked`` (``segments``: per row, the (query run, key run) pairs of shared documents; rows in no
segment get lse ``-inf``, out 0). Classification runs on one host copy of ``doc_ids`` per call,
so the loops need no device sync and every rank decides alike.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from fpdt.layout import global_token_index, mesh_token_index

SKIP, DENSE, MASKED = "skip", "dense", "masked"

Segment = tuple[int, int, int, int, int]   # (row, q0, q1, k0, k1): local query rows [q0, q1) x keys [k0, k1)


@dataclass(frozen=True)
class Block:
    """How one (query side, key side) block is computed: ``skip``, ``dense`` or ``masked``."""

    kind: str                           # SKIP, DENSE or MASKED
    causal: bool                        # a causal diagonal block (each segment causal to itself)
    segments: tuple[Segment, ...]       # the shared-document runs, every row (empty for SKIP)
    pairs: int                          # (query, key) pairs that see each other, summed over rows
    q_len: int = 0                      # tokens on each side
    k_len: int = 0


def check_doc_ids(doc_ids: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Validate ``doc_ids`` ``[B, S]`` (errors name the fix); returns an int64 host copy."""
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError("doc_ids must be an integer tensor [B, S] of per-token document indices "
                         f"(got {type(doc_ids).__name__} {getattr(doc_ids, 'dtype', '')})")
    if tuple(doc_ids.shape) != (batch, seq_len):
        raise ValueError(f"doc_ids must be [B, S]=[{batch}, {seq_len}] for the whole global sequence in global "
                         f"token order, got {tuple(doc_ids.shape)}")
    ids = doc_ids.detach().to("cpu", torch.int64)
    if seq_len > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
        raise ValueError("doc_ids must be non-decreasing along the sequence (documents contiguous and in order, "
                         "in global token order); pass them before any layout permutation")
    return ids


def check_batch(doc_ids: torch.Tensor | None, batch: int) -> None:
    """``doc_ids`` must have one row per batch row of the attention inputs."""
    if doc_ids is not None and (doc_ids.dim() != 2 or doc_ids.shape[0] != batch):
        raise ValueError(f"doc_ids must be [B, S] with B={batch} (one row per batch row of the inputs), got "
                         f"{tuple(doc_ids.shape)}")


class _Side:
    """The document runs of one block side, per row: ``(docs, starts, counts)`` (local indices)."""

    def __init__(self, ids: torch.Tensor, index: torch.Tensor):
        self.index = index
        self.len = int(index.numel())
        self.first, self.last = int(index[0]), int(index[-1])
        self.runs = []
        for row in ids.index_select(1, index):
            docs, counts = torch.unique_consecutive(row, return_counts=True)
            self.runs.append((docs, torch.cumsum(counts, 0) - counts, counts))


def _block(q: _Side, k: _Side | None, causal: bool) -> Block:
    """``k=None``: the diagonal block of ``q`` with itself."""
    segments: list[Segment] = []
    pairs = 0
    one_run = True
    if k is None:
        for row, (_, starts, counts) in enumerate(q.runs):
            one_run &= counts.numel() == 1
            for s, c in zip(starts.tolist(), counts.tolist()):
                segments.append((row, s, s + c, s, s + c))
                pairs += c * (c + 1) // 2 if causal else c * c
        kind = DENSE if one_run else MASKED
        return Block(kind, causal, tuple(segments), pairs, q.len, q.len)
    if causal and not k.last < q.first:
        raise AssertionError("a causal off-diagonal block must have every key before every query")
    for row, ((qd, qs, qc), (kd, ks, kc)) in enumerate(zip(q.runs, k.runs)):
        one_run &= qd.numel() == 1 and kd.numel() == 1
        idx = torch.searchsorted(kd, qd).clamp_(max=kd.numel() - 1)
        match = kd[idx] == qd
        for a, b in zip(match.nonzero().flatten().tolist(), idx[match].tolist()):
            q0, n_q = int(qs[a]), int(qc[a])
            k0, n_k = int(ks[b]), int(kc[b])
            segments.append((row, q0, q0 + n_q, k0, k0 + n_k))
            pairs += n_q * n_k
    if not segments:
        kind = SKIP
    elif one_run and len(segments) == len(q.runs):
        kind = DENSE
    else:
        kind = MASKED
    return Block(kind, False, tuple(segments), pairs, q.len, k.len)


class Documents:
    """Block classification for one attention call over ``doc_ids`` (cached per block).

    ``side(key, index)`` registers a block side: ``index`` is a LongTensor of the global
    token indices of its tokens in the block's local order (increasing).
    ``block(q_key, k_key)`` classifies queries ``q_key`` against keys ``k_key``; equal keys
    make a diagonal block (causal when the call is).
    """

    def __init__(self, doc_ids: torch.Tensor, causal: bool, *, batch: int | None = None,
                 seq_len: int | None = None):
        B, S = doc_ids.shape if doc_ids.dim() == 2 else (batch, seq_len)
        self.ids = check_doc_ids(doc_ids, B if batch is None else batch, S if seq_len is None else seq_len)
        self.causal = causal
        self._index: dict = {}
        self._sides: dict = {}
        self._blocks: dict = {}

    def add_side(self, key, index: torch.Tensor) -> None:
        self._index[key] = index.to("cpu", torch.int64)

    def _side(self, key) -> _Side:
        if key not in self._sides:
            self._sides[key] = _Side(self.ids, self._index[key])
        return self._sides[key]

    def block(self, q_key, k_key) -> Block:
        key = (q_key, k_key)
        if key not in self._blocks:
            q = self._side(q_key)
            self._blocks[key] = _block(q, None if q_key == k_key else self._side(k_key), self.causal)
        return self._blocks[key]


def ulysses_chunk_index(seq_len: int, sp: int, num_chunks: int, i: int) -> torch.Tensor:
    """Global tokens of head-layout chunk ``i`` of the Ulysses pipeline (after the
    sequence -> heads all-to-all: local chunk ``i`` of every rank, in rank order)."""
    L = seq_len // (sp * num_chunks)
    return torch.cat([global_token_index(seq_len, sp, num_chunks, r)[i * L:(i + 1) * L] for r in range(sp)])


def mesh_chunk_index(seq_len: int, hp: int, cp: int, num_chunks: int, cp_rank: int, i: int) -> torch.Tensor:
    """Global tokens of CP chunk ``i`` of CP rank ``cp_rank`` on the 2D mesh (after the HP
    all-to-all: local chunk ``i`` of every HP rank, in HP rank order)."""
    L = seq_len // (hp * cp * num_chunks)
    return torch.cat([mesh_token_index(seq_len, hp, cp, num_chunks, cp_rank, h)[i * L:(i + 1) * L]
                      for h in range(hp)])


class UlyssesDocuments(Documents):
    """Blocks ``(i, j)`` (query chunk i, KV chunk j) of the Ulysses FPDT pipeline."""

    def __init__(self, doc_ids: torch.Tensor, *, seq_len: int, sp: int, num_chunks: int, causal: bool):
        super().__init__(doc_ids, causal, batch=doc_ids.shape[0], seq_len=seq_len)
        for i in range(num_chunks):
            self.add_side(i, ulysses_chunk_index(seq_len, sp, num_chunks, i))

    def visible(self, i: int, j: int) -> bool:
        return self.block(i, j).kind != SKIP


class MeshDocuments(Documents):
    """Blocks of the mesh pipeline for CP rank ``cp_rank``: query chunk ``i`` (of this rank,
    rows ``q_half``) against KV chunk ``j`` of CP rank ``src`` (keys ``k_half``); a half is
    None (all), 0 (first zigzag piece) or 1 (second)."""

    def __init__(self, doc_ids: torch.Tensor, *, seq_len: int, hp: int, cp: int, num_chunks: int, causal: bool,
                 cp_rank: int):
        super().__init__(doc_ids, causal, batch=doc_ids.shape[0], seq_len=seq_len)
        self.me = cp_rank
        self._geometry = (seq_len, hp, cp, num_chunks)

    def mesh_block(self, i: int, j: int, src: int, q_half: int | None, k_half: int | None) -> Block:
        q_key, k_key = (i, self.me, q_half), (j, src, k_half)
        for key in (q_key, k_key):
            if key not in self._index:
                full = mesh_chunk_index(*self._geometry, key[1], key[0])
                half = full.numel() // 2
                self.add_side(key, full if key[2] is None else full[key[2] * half:(key[2] + 1) * half])
        return self.block(q_key, k_key)


_CACHE: dict[tuple, tuple] = {}     # (class, geometry) -> (weakref to doc_ids, its version, documents)


def cached_documents(cls, doc_ids: torch.Tensor, **geometry):
    """``cls(doc_ids, **geometry)``, reused while the same unmodified ``doc_ids`` tensor comes back
    with the same geometry (every layer of a step), so classification runs once per step.
    """
    key = (cls, tuple(sorted(geometry.items())))
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is doc_ids and hit[1] == doc_ids._version:
        return hit[2]
    docs = cls(doc_ids, **geometry)
    if len(_CACHE) >= 16:
        _CACHE.clear()
    _CACHE[key] = (weakref.ref(doc_ids), doc_ids._version, docs)
    return docs

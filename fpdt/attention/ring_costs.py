"""Costs of one attention layer on the 2D mesh (hp x cp, inner ring w) with FPDT chunking (u).

:func:`attention_costs` (what the planner calls) gives, per rank and per layer, the P2P,
all-to-all and host <-> device bytes and the peak device working set of the attention core; the
tests check the counts against what :mod:`fpdt.attention.mesh_pipeline` sends. Notation and
formulas: ``docs/attention.md`` (Costs of one layer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fpdt.comm.heads import kv_replication_factor
from fpdt.layout import hidden_bytes, sequence_multiple


@dataclass(frozen=True)
class AttentionCosts:
    """Per-rank, per-layer costs of one mesh attention call (bytes unless stated)."""

    p2p_sends_fwd: int
    p2p_bytes_fwd: int
    p2p_sends_bwd: int
    p2p_bytes_bwd: int
    p2p_inner_links: int          # ring links per block pass that stay inside an inner ring
    p2p_outer_links: int          # links per block pass that cross between inner rings
    all_to_alls_fwd: int          # collective calls in the HP group
    all_to_all_bytes_fwd: int     # bytes sent to other HP ranks
    all_to_alls_bwd: int
    all_to_all_bytes_bwd: int
    h2d_bytes_fwd: int
    d2h_bytes_fwd: int
    h2d_bytes_bwd: int
    d2h_bytes_bwd: int
    U: int                        # bytes of one post-all-to-all hidden-state chunk B*C*hidden*e
    Nd: int                       # bytes of this rank's full-sequence hidden tensor B*S_l*hidden*e
    peak_fwd_U: float             # attention-core working set, forward, in U
    peak_bwd_U: float             # attention-core working set, backward, in U
    touches: int = 0              # attention blocks (query chunk x KV block) this rank computes
    attention_pairs: int = 0      # (query, key) pairs its kernels compute, per head, summed over the batch

    @property
    def p2p_bytes(self) -> int:
        return self.p2p_bytes_fwd + self.p2p_bytes_bwd

    @property
    def all_to_all_bytes(self) -> int:
        return self.all_to_all_bytes_fwd + self.all_to_all_bytes_bwd

    def as_dict(self) -> dict:
        return asdict(self) | {"p2p_bytes": self.p2p_bytes, "all_to_all_bytes": self.all_to_all_bytes}


def attention_costs(*, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, hp: int = 1, cp: int = 1,
                    inner_ring: int | None = None, num_chunks: int = 1, hidden: int | None = None,
                    batch: int = 1, dtype_bytes: int = 2, offload: bool = True,
                    causal: bool = True, doc_ids=None, cp_rank: int | None = None) -> AttentionCosts:
    """Costs of one attention layer per rank (formulas: ``docs/attention.md``).

    ``doc_ids``: packed documents ``[B, S]`` (global order; ``batch`` is then its ``B``): only
    the blocks that run are counted, for CP rank ``cp_rank`` (None: the rank with the most).

    ``hidden`` defaults to ``num_heads * head_dim``. Raises ``ValueError`` for shapes the
    mesh refuses (``S`` not divisible by ``2*hp*cp*u`` with a ring, by ``hp*u`` without; ``hp`` not dividing ``H``,
    ``inner_ring`` not dividing ``cp``).
    """
    H, D, u, e = num_heads, head_dim, num_chunks, dtype_bytes
    if doc_ids is not None:
        batch = doc_ids.shape[0]
    hidden = H * D if hidden is None else hidden
    w = cp if inner_ring is None else inner_ring
    if w < 1 or cp % w:
        raise ValueError(f"inner_ring={inner_ring} must divide cp={cp}")
    multiple = sequence_multiple(hp * cp, u, zigzag=cp > 1)     # the ring's zigzag halves every chunk
    if seq_len % multiple:
        raise ValueError(f"S={seq_len} is not divisible by {'2*hp*cp' if cp > 1 else 'hp'}*num_chunks={multiple}")
    f = kv_replication_factor(H, num_kv_heads, hp)
    Hkv = f * num_kv_heads
    n = cp // w
    L = seq_len // (hp * cp * u)
    C = hp * L
    K = 2 * batch * C * (Hkv // hp) * D * e
    Q = hidden_bytes(batch * L, hidden, e)
    U = hp * Q
    acc = Q * 4 // e                   # one fp32 accumulator chunk (o in forward, dq in backward)
    lse = batch * C * (H // hp) * 4    # one fp32 lse chunk
    T = cp * (u * (u + 1) // 2 if causal else u * u)
    m = u - 1 if causal else u
    C = seq_len // (cp * u)
    if causal and cp > 1:
        pairs = batch * u * ((u - 1) * cp * C * C + C * (C + 1) + (cp - 1) * C * C) // 2
    else:
        pairs = batch * (seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len) // cp
    if doc_ids is not None:
        ranks = range(cp) if cp_rank is None else [cp_rank]
        T, m, pairs = max(document_work(doc_ids, seq_len=seq_len, hp=hp, cp=cp, num_chunks=u, causal=causal,
                                        cp_rank=c) for c in ranks)
    ring = cp > 1
    frac_num, S_l = hp - 1, seq_len // (hp * cp)
    a2a_f = batch * S_l * D * (H + 2 * Hkv + H) * e * frac_num // hp
    a2a_b = batch * S_l * D * (H * e + 4 * (H + 2 * Hkv)) * frac_num // hp
    if offload and ring:
        h2d_f = u * K + T * Q + (T - u) * (acc + lse)
        d2h_f = u * (Q + K) + (T - u) * (acc + lse) + u * (Q + lse)
        h2d_b = u * K + T * (3 * Q + lse) + (T - u) * acc
        d2h_b = u * Q + (T - u) * acc
    elif offload:  # cp = 1 runs the Ulysses pipeline: K/V fetched per (i, j), q side per backward touch
        T1 = T
        h2d_f = (T1 - u) * K
        d2h_f = u * (K + 2 * Q + lse)
        h2d_b = u * K + T1 * (2 * Q + lse) + (T1 - u) * (Q + acc)
        d2h_b = (T1 - u) * acc + m * Q
    else:
        h2d_f = d2h_f = h2d_b = d2h_b = 0
    g2 = K / Q  # = 2g
    blocks = (2 if n == 1 else 4) * g2
    peak_f = 16 + blocks                              # in Q
    peak_b = 16 + blocks + 7 * g2  # + fp32 dK/dV local, incoming, outgoing (6K) + block grads (K)
    if not offload:
        peak_f += u * (1 + g2) + 2 * u
        peak_b += u * (1 + g2) + 4 * u
    return AttentionCosts(
        p2p_sends_fwd=u * (cp - 1), p2p_bytes_fwd=u * (cp - 1) * K,
        p2p_sends_bwd=u * (cp - 1) + (u * cp if ring else 0),
        p2p_bytes_bwd=u * (cp - 1) * K + (u * cp * K * 4 // e if ring else 0),
        p2p_inner_links=n * (w - 1), p2p_outer_links=n - 1,
        all_to_alls_fwd=2 * u if hp > 1 else 0, all_to_all_bytes_fwd=a2a_f,
        all_to_alls_bwd=3 * u if hp > 1 else 0, all_to_all_bytes_bwd=a2a_b,
        h2d_bytes_fwd=h2d_f, d2h_bytes_fwd=d2h_f, h2d_bytes_bwd=h2d_b, d2h_bytes_bwd=d2h_b,
        U=U, Nd=u * Q, peak_fwd_U=peak_f / hp, peak_bwd_U=peak_b / hp, touches=T, attention_pairs=pairs)


def document_work(doc_ids, *, seq_len: int, hp: int = 1, cp: int = 1, num_chunks: int = 1, causal: bool = True,
                  cp_rank: int = 0) -> tuple[int, int, int]:
    """``(T, m, pairs)`` of CP rank ``cp_rank`` under packed documents ``doc_ids`` ``[B, S]``:
    the blocks its pipeline computes (skipped ones excluded), the query chunks it touches
    more than once, and the (query, key) pairs its kernels compute per head."""
    from fpdt.attention.documents import SKIP, MeshDocuments, UlyssesDocuments
    from fpdt.attention.mesh_pipeline import touch_kind
    u = num_chunks
    touched = [0] * u
    pairs = 0
    if cp == 1:
        docs = UlyssesDocuments(doc_ids, seq_len=seq_len, sp=hp, num_chunks=u, causal=causal)
        blocks = [(i, j, docs.block(i, j)) for i in range(u) for j in (range(i + 1) if causal else range(u))]
    else:
        docs = MeshDocuments(doc_ids, seq_len=seq_len, hp=hp, cp=cp, num_chunks=u, causal=causal, cp_rank=cp_rank)
        blocks = []
        for j in range(u):
            for src in range(cp):
                for i in range(u):
                    kind = touch_kind(i, j, src, cp_rank, causal)
                    if kind is not None:
                        blocks.append((i, j, docs.mesh_block(i, j, src, 1 if kind == "q_second" else None,
                                                             0 if kind == "k_first" else None)))
    for i, _, blk in blocks:
        if blk.kind != SKIP:
            touched[i] += 1
            pairs += blk.pairs
    return sum(touched), sum(n > 1 for n in touched), pairs


def ulysses_working_set_U(*, num_heads: int, num_kv_heads: int, head_dim: int, sp: int = 1,
                          num_chunks: int, offload: bool = True,
                          kernel_expands_gqa: bool = False) -> tuple[float, float]:
    """``(forward, backward)`` working set of the Ulysses FPDT pipeline (``cp = 1``) per rank, in
    ``U``, beyond its output / input gradients (per tensor: ``docs/memory.md``). ``r = H_kv' / H``;
    ``kernel_expands_gqa``: the kernel repeats K/V to ``H`` heads (the CPU kernel); ``e = 2 / D``, one
    fp32 lse chunk. With ``sp > 1`` head-layout tensors are ``1/sp`` of these, and the all-to-all
    buffers add ``(2 (1 + 2r) + 2) / sp`` forward and ``2 / sp`` backward (the next dô's all-to-all,
    in flight during the kernel; dK/dV's runs after the outer step's kernels).
    """
    H, u, P = num_heads, num_chunks, sp
    r = kv_replication_factor(H, num_kv_heads, P) * num_kv_heads / H
    e = 2 / head_dim
    expand = kernel_expands_gqa and r < 1
    if offload:
        fwd = 2 + 1 + 4 * r + (2 if expand else 0) + 2 * e
        q_side = 6 if u > 2 else 3                           # in use + next prefetched (u = 2: one step)
        bwd = (q_side + 2 + 2 * r + 4 * r + 1 + (2 if expand else 2 * r)
               + (2 + 4 * r if expand else 0) + 2 * e)
    else:
        fwd = 3 + (2 if expand else 0) + (u - 1) * (1 + e)
        bwd = 5 + 2 * u
    if P > 1:
        fwd = fwd / P + (2 * (1 + 2 * r) + 2) / P
        bwd = bwd / P + 2 / P
    return fwd, bwd

"""Step time of one optimizer step, split by what the GPU waits on.

Per rank, with the rates of :meth:`fpdt.plan.hardware.Cluster.rates`:

* **gemms**: projections, MLP and LM head, ``3 x`` forward FLOPs of ``T`` tokens (one
  more layer forward when checkpointing recomputes), the trainer's FLOP formulas
  (:mod:`fpdt.train.metrics`), at the sustained GEMM rate.
* **attention**: causal ``q.k^T`` and ``p.v`` FLOPs of ``T`` query tokens against ``S``
  keys, forward + backward (+ recompute), at the sustained attention rate.
* **all_to_all**: Ulysses all-to-alls of q/k/v in and o out per layer and pass (forward,
  recompute, backward), ``(hp - 1) / hp`` of the bytes leave the rank; NVLink when the
  head group sits inside a node, else the network. Chunk ``i + 1``'s all-to-all overlaps
  chunk ``i``'s attention, so only the first chunk's and what attention cannot cover is
  exposed.
* **p2p**: ring K/V blocks (``cp > 1``): each block crosses the ring once per pass
  (twice in backward, with dK/dV); exposed where it exceeds the attention time.
* **h2d_d2h**: offload copies. Forward fetches ``i`` earlier K/V chunks for query chunk
  ``i``; backward fetches, per (KV chunk j, query chunk i >= j) block, q̂, o, dô (``e``) and
  lse, and round-trips the fp32 dq. A block hides its copies behind its own attention; the
  rest, plus the first fetch of each layer and the layer-input checkpoint copies not
  covered by one layer's compute, is exposed.
* **zero_collectives**: ZeRO-3 parameter all-gathers (forward, recompute, backward) and
  gradient reduce-scatter, exposed only where they exceed the step's compute (DeepSpeed
  prefetches the next layer).
"""

from __future__ import annotations

from fpdt.model.config import ModelConfig
from fpdt.plan.hardware import Cluster, Rates
from fpdt.plan.memory_model import kv_dim
from fpdt.plan.models import param_counts
from fpdt.plan.setup import Setup
from fpdt.train.metrics import ModelShape, attention_flops, layer_matmul_flops


def model_shape(cfg: ModelConfig) -> ModelShape:
    return ModelShape(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.intermediate_size, cfg.vocab_size)


def _link(cluster: Cluster, group: int, adjacent: bool, rates: Rates) -> float:
    """Bandwidth of a collective over ``group`` ranks: NVLink when they share a node."""
    inside = adjacent and group <= cluster.gpus_per_node or cluster.nodes == 1
    return rates.intra_node_bytes_s if inside else rates.inter_node_bytes_s


def estimate_time(cfg: ModelConfig, s: Setup, cluster: Cluster) -> dict:
    """Seconds per optimizer step, per component (exposed time) plus ``"total"``."""
    rates = cluster.rates()
    m, e, l = model_shape(cfg), s.elem_bytes, cfg.num_layers
    tokens = s.batch * s.local_tokens                       # per rank
    recompute = s.checkpoint != "off"
    passes = 4 if recompute else 3                          # forward, (recompute), backward = 2 x
    gemm_flops = tokens * (passes * l * layer_matmul_flops(m) + 3 * 2 * cfg.hidden_size * cfg.vocab_size)
    attn_fwd = tokens * l * attention_flops(m, s.seq_len, causal=True)
    t_gemm = gemm_flops / rates.gemm_flops
    t_attn = passes * attn_fwd / rates.attention_flops
    u = s.num_chunks

    qd, kvd = cfg.num_heads * cfg.head_dim, kv_dim(cfg, s)
    a2a_passes = 3 if recompute else 2                      # backward moves grads both ways: count 1 + 1
    a2a_bytes = l * a2a_passes * tokens * (2 * qd + 2 * kvd) * e * (s.hp - 1) / s.hp
    a2a = a2a_bytes / _link(cluster, s.hp, s.placement == "head_first", rates) if s.hp > 1 else 0.0
    a2a_exposed = a2a / u + max(0.0, a2a * (u - 1) / u - t_attn * (u - 1) / u)

    p2p_exposed = 0.0
    if s.cp > 1:
        kv_block = tokens * 2 * kvd * e                     # this rank's k̂ + v̂, all chunks
        p2p_bytes = l * (s.cp - 1) * kv_block * ((1 if recompute else 0) + 1 + 2)
        p2p = p2p_bytes / _link(cluster, s.cp, s.placement == "context_first", rates)
        # the first block of every pass waits for its transfer; the rest hides behind attention
        p2p_exposed = p2p / ((s.cp - 1) * u) + max(0.0, p2p - t_attn)

    h2d_exposed = 0.0
    if s.offload:
        t_c = tokens / u                                     # per-rank tokens of one chunk
        block_fwd = tokens * 4 * qd * s.seq_len / u ** 2 / rates.attention_flops   # one full block
        kv_copy = t_c * 2 * kvd * e / rates.h2d_bytes_s
        q_copy = t_c * (3 * qd * e + 2 * qd * 4 + cfg.num_heads * 4) / rates.h2d_bytes_s
        blocks = u * (u + 1) / 2
        fwd_passes = 2 if recompute else 1
        per_layer = (fwd_passes * (blocks * max(0.0, kv_copy - block_fwd) + kv_copy)
                     + blocks * max(0.0, q_copy - 2.5 * block_fwd) + q_copy)
        h2d_exposed = l * per_layer
    if s.checkpoint == "offload":
        layer_compute = (t_gemm + t_attn) / l
        ckpt_copy = tokens * cfg.hidden_size * e / rates.h2d_bytes_s
        h2d_exposed += l * max(0.0, ckpt_copy - layer_compute) + ckpt_copy

    zero_exposed = 0.0
    if s.zero_stage == 3 and cluster.world > 1:
        psi, n = param_counts(cfg).total, cluster.world
        gathers = 3 if recompute else 2
        zero_bytes = (gathers + 1) * psi * e * (n - 1) / n
        zero = zero_bytes / _link(cluster, n, True, rates)
        zero_exposed = max(0.0, zero - (t_gemm + t_attn))

    parts = {"gemms": t_gemm, "attention": t_attn, "all_to_all": a2a_exposed, "p2p": p2p_exposed,
             "h2d_d2h": h2d_exposed, "zero_collectives": zero_exposed}
    parts["total"] = sum(parts.values())
    return parts

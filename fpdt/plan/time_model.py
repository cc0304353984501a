"""Step time of one optimizer step per rank, split by what the GPU waits on: GEMMs, attention,
exposed all-to-all, P2P, H2D/D2H and ZeRO collectives, NVMe I/O, memory-bound ops and
weight-gradient accumulation. What each term counts, and the constants' derivations:
``docs/plan.md``, "How the planner counts step time"."""

from __future__ import annotations

import dataclasses

from fpdt.attention.ring_costs import AttentionCosts
from fpdt.model.chunks import chunk_count
from fpdt.model.config import ModelConfig
from fpdt.plan.hardware import Cluster, Rates
from fpdt.plan.memory_model import (gdn_stash_bytes, kv_dim, layer_attention_costs, loss_chunks, mlp_chunks, moe_chunks,
                                    nvme_layers_on_disk, nvme_tier_bytes, saving_split)
from fpdt.plan.documents import ring_touches, work_fraction
from fpdt.plan.models import (gdn_core_flops, lora_param_count, mixer_input_width, mlp_recompute_flops,
                              model_spec, param_counts)
from fpdt.plan.models import layer_matmul_flops as kind_matmul_flops
from fpdt.plan.setup import Setup
from fpdt.train.metrics import ModelShape, attention_flops, layer_matmul_flops


def _link(cluster: Cluster, group: int, adjacent: bool, rates: Rates) -> float:
    """Bandwidth of a collective over ``group`` ranks: NVLink when they share a node."""
    inside = adjacent and group <= cluster.gpus_per_node or cluster.nodes == 1
    return rates.intra_node_bytes_s if inside else rates.inter_node_bytes_s


# Bytes read + written by the memory-bound ops of one forward + backward (checkpointing on:
# a recompute forward included), per token, by weight precision (2: bf16/fp16, 4: fp32):
# per layer, per element of the hidden size, MLP width and K/V width; per merge of the
# online softmax (per element of one chunk's hidden states); per vocabulary entry for the
# loss with lm_head_wgrad="accumulate". Least-squares fits of the counted bytes over 14 model
# shapes, each within 3%. Without checkpointing (no recompute forward) the layer terms are 0.76
# of these. "recompute" adds lm_head_recompute_bytes per vocabulary entry and
# LM_HEAD_SLICE_BYTES per vocabulary slice (docs/plan.md, "How the planner counts step time").
ELEMENTWISE_BYTES = {
    2: {"hidden": 609, "mlp": 58, "kv": 85, "merge": 39, "vocab": 56},
    4: {"hidden": 820, "mlp": 93, "kv": 47, "merge": 96, "vocab": 45},
}
NO_RECOMPUTE_FACTOR = 0.76
LM_HEAD_SLICE_BYTES = 87
"""Per token and vocabulary slice of the recomputed LM-head gradient: the slice's label mask and
target index, the lse, row-scale and target reads (int64 labels), counted 86.8-87.1 B."""
LORA_ELEMENTWISE_BYTES = 42
"""Adapters' memory-bound bytes per token, layer and element of the adapted widths (``docs/plan.md``)."""


GDN_CORE_PASSES = 5
"""Passes of the GDN core (conv and delta rule) per checkpointed step: forward, the layer's recompute,
and a backward of three (the chunk rebuilt from its stash, then fla's backward: gradients, states again)."""
GDN_ELEMENTWISE_BYTES = 85
"""Memory-bound bytes per token and GDN layer per element of its projected width (conv, SiLU, the q/k
L2 norms, the gates, the gated RMSNorm; their backward): the K/V coefficient of ``ELEMENTWISE_BYTES``, not counted."""
MOE_ROUTED_BYTES = 8
"""Memory-bound bytes per token and MoE layer per element of ``k * hidden`` and byte of the dtype: the
rows gathered per expert and scattered back (forward, recompute, backward)."""

SAVED_OUTPUT_ALL_TO_ALLS = 1
"""All-to-alls of the attention output per step, beyond the forward's, for a saving layer (``docs/plan.md``)."""


def elementwise_bytes(cfg: ModelConfig, s: Setup) -> float:
    """Device bytes the memory-bound ops move per optimizer step on one rank (weight-gradient accumulation apart)."""
    k = ELEMENTWISE_BYTES[4 if s.elem_bytes == 4 else 2]
    h, tokens, u = cfg.hidden_size, s.rank_tokens, s.num_chunks
    spec = model_spec(cfg)
    per_token = (k["hidden"] * h + k["mlp"] * cfg.intermediate_size
                 + k["kv"] * cfg.num_kv_heads * cfg.head_dim)
    if not spec.plain:      # per layer kind, averaged over the layers
        m, e = spec.moe, s.elem_bytes
        mixer = {"attention": k["kv"] * cfg.num_kv_heads * cfg.head_dim,
                 "gdn": GDN_ELEMENTWISE_BYTES * spec.gdn.projected_width if spec.gdn else 0}
        mlp = {"dense": k["mlp"] * cfg.intermediate_size,
               "moe": k["mlp"] * (m.routed_width + m.shared_ffn) + MOE_ROUTED_BYTES * e * m.top_k * h if m else 0}
        per_token = k["hidden"] * h + sum(mixer[a] + mlp[b] for a, b in zip(spec.mixers, spec.mlps)) / cfg.num_layers
    if s.lora_rank:
        per_token += LORA_ELEMENTWISE_BYTES * lora_param_count(cfg, 1) / cfg.num_layers
    if s.options.checkpointing == "off":
        per_token *= NO_RECOMPUTE_FACTOR
    merges = ring_touches(s.seq_len, s.doc_len, u, s.cp) - u   # touches after each query chunk's first
    layers = cfg.num_layers * tokens * per_token + spec.attention_layers * k["merge"] * merges * tokens / u * h
    head_mode = "accumulate" if s.lora_rank else s.options.lm_head_wgrad     # a frozen head recomputes nothing
    return layers + lm_head_elementwise_bytes(tokens, cfg.vocab_size, s.elem_bytes, head_mode, loss_chunks(cfg, s))


def lm_head_recompute_bytes(elem_bytes: int) -> int:
    """Per token and vocabulary entry, the recomputed gradient's passes over an fp32 ``[T, V / N]`` slice:
    cast up and down (none in fp32), subtract lse, exp, the target scatter and the row scale."""
    return 32 + (0 if elem_bytes == 4 else 2 * (elem_bytes + 4))


def lm_head_elementwise_bytes(tokens: int, vocab: int, elem_bytes: int, mode: str, num_loss_chunks: int = 1) -> float:
    """The loss's share of :func:`elementwise_bytes`, by LM-head mode (``num_loss_chunks`` vocabulary slices)."""
    per_entry = ELEMENTWISE_BYTES[4 if elem_bytes == 4 else 2]["vocab"]
    if mode != "recompute":
        return tokens * vocab * per_entry
    return tokens * (vocab * (per_entry + lm_head_recompute_bytes(elem_bytes)) + LM_HEAD_SLICE_BYTES * num_loss_chunks)


def accumulation_bytes_per_weight(weight_bytes: int) -> int:
    """Bytes per weight element to add one chunk's ``dW`` partial into its fp32 accumulator: 20 in bf16, 16 in fp32."""
    cast = 0 if weight_bytes == 4 else weight_bytes + 4
    return weight_bytes + cast + 12


def wgrad_accumulation_bytes(cfg: ModelConfig, s: Setup) -> dict:
    """Device bytes per optimizer step of the fp32 weight-gradient accumulators, by ``mlp``, ``qkv``,
    ``o_proj`` (accumulated per attention chunk inside the attention backward) and ``lm_head``
    (0 with ``"recompute"``)."""
    e, h, l = s.elem_bytes, cfg.hidden_size, cfg.num_layers
    tokens = s.rank_tokens
    per_weight = accumulation_bytes_per_weight(e)
    qkv_weights = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    o_weights = h * cfg.num_heads * cfg.head_dim
    out = {"mlp": l * chunk_count(tokens, mlp_chunks(cfg, s)) * 3 * cfg.intermediate_size * h * per_weight,
           "qkv": l * s.num_chunks * qkv_weights * per_weight,
           "o_proj": l * s.num_chunks * o_weights * per_weight}
    spec = model_spec(cfg)
    if not spec.plain:   # per layer: the mixer's input projections per attention chunk, the MLP's weights per its chunk
        m = spec.moe
        mlp = {"dense": chunk_count(tokens, mlp_chunks(cfg, s)) * 3 * cfg.intermediate_size * h,
               "moe": chunk_count(tokens, moe_chunks(cfg, spec, s)) * (m.params(h) - (h if m.shared_gate else 0))
               if m else 0}
        out = {"mlp": sum(mlp[b] for b in spec.mlps) * per_weight,
               "qkv": sum(s.num_chunks * h * mixer_input_width(cfg, spec, a) for a in spec.mixers) * per_weight,
               "o_proj": spec.attention_layers * s.num_chunks * o_weights * per_weight}
    out["lm_head"] = lm_head_accumulation_bytes(tokens, loss_chunks(cfg, s), cfg.vocab_size, h, e,
                                                s.options.lm_head_wgrad)
    return out


def lm_head_accumulation_bytes(tokens: int, num_loss_chunks: int, vocab: int, hidden: int, elem_bytes: int,
                               mode: str) -> float:
    """The ``lm_head`` entry of :func:`wgrad_accumulation_bytes` (0 with ``"recompute"``)."""
    if mode != "accumulate":
        return 0
    per_weight = 8 if elem_bytes == 4 else accumulation_bytes_per_weight(elem_bytes)
    return chunk_count(tokens, num_loss_chunks) * vocab * hidden * per_weight


def lm_head_seconds(hidden: int, vocab: int, tokens: int, num_loss_chunks: int, mode: str, elem_bytes: int,
                    rates: Rates) -> dict:
    """Seconds of one forward + backward of the fused LM head + loss, by part (``gemms``,
    ``elementwise``, ``wgrad_accumulation``, ``total``): the terms :func:`estimate_time` charges for the
    head, for ``profiling/lm_head_wgrad.py`` to set beside its measurement."""
    parts = {"gemms": lm_head_gemm_flops(tokens, hidden, vocab, mode) / rates.gemm_flops,
             "elementwise": lm_head_elementwise_bytes(tokens, vocab, elem_bytes, mode, num_loss_chunks)
             / rates.memory_bytes_s,
             "wgrad_accumulation": lm_head_accumulation_bytes(tokens, num_loss_chunks, vocab, hidden, elem_bytes,
                                                              mode) / rates.memory_bytes_s}
    parts["total"] = sum(parts.values())
    return parts


def lm_head_gemm_flops(tokens: int, hidden: int, vocab: int, mode: str) -> float:
    """FLOPs of the ``T x hidden x V`` head GEMMs in one forward + backward: 3, or 4 with ``"recompute"``."""
    return (4 if mode == "recompute" else 3) * 2 * hidden * vocab * tokens


def _document_copies(cfg: ModelConfig, s: Setup, c: AttentionCosts) -> AttentionCosts:
    """``c`` with the host copies of the blocks a document mask skips taken out (interpolated in the touches)."""
    u = s.num_chunks
    if s.doc_len is None or u == 1 or not s.options.offload:
        return c
    full = layer_attention_costs(cfg, s, causal=False)
    t_causal, t_full = s.cp * u * (u + 1) / 2, s.cp * u * u
    x = (ring_touches(s.seq_len, s.doc_len, u, s.cp) - t_causal) / (t_full - t_causal)
    fields = ("h2d_bytes_fwd", "d2h_bytes_fwd", "h2d_bytes_bwd", "d2h_bytes_bwd")
    return dataclasses.replace(c, **{f: getattr(c, f) + x * (getattr(full, f) - getattr(c, f)) for f in fields})


def o_proj_refetch(cfg: ModelConfig, s: Setup, rates) -> tuple[float, float]:
    """Per layer under ``checkpointing="off"`` with offload (else ``(0, 0)``): the exposed seconds of
    fetching ``o`` back for ``o_proj``'s backward, and the bytes of its extra all-to-all (``hp > 1``)."""
    if s.options.checkpointing != "off" or not s.options.offload:
        return 0.0, 0.0
    u = s.num_chunks
    fetch = _output_bytes(cfg, s) / rates.h2d_bytes_s
    wgrad = 2 * s.rank_tokens * cfg.num_heads * cfg.head_dim * cfg.hidden_size / rates.gemm_flops
    return fetch / u + max(0.0, fetch - wgrad) * (u - 1) / u, float(_output_all_to_all_bytes(cfg, s))


def _output_bytes(cfg: ModelConfig, s: Setup) -> int:
    """One layer's attention output on one rank, ``B (S / P) H D e`` bytes."""
    return s.batch * s.local_tokens * cfg.num_heads * cfg.head_dim * s.elem_bytes


def _output_all_to_all_bytes(cfg: ModelConfig, s: Setup) -> int:
    """The bytes of one layer's attention output that leave the rank in one all-to-all."""
    return _output_bytes(cfg, s) * (s.hp - 1) // s.hp


STREAM_COPIES_ND = 12.0
"""Full-length ``[T, h]`` copies per layer and step with ``stream_layers``, both directions (``docs/plan.md``)."""


def nvme_io(cfg: ModelConfig, s: Setup, cluster: Cluster, compute_s: float, passes: int) -> dict:
    """The NVMe tier's I/O per step, seconds: ``write_s`` against ``forward_s``, ``read_s`` against
    ``backward_s``, ``exposed_s`` (uncovered plus the first read) and ``hidden``. All zero without the tier."""
    disk, _ = nvme_tier_bytes(cfg, s)
    if disk == 0:
        return {"write_s": 0.0, "read_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "exposed_s": 0.0, "hidden": True}
    rates = cluster.rates()
    node = min(cluster.gpus_per_node, cluster.world) * disk
    write, read = node / rates.nvme_write_bytes_s, node / rates.nvme_read_bytes_s
    forward = compute_s / passes
    backward = compute_s - forward
    exposed = max(0.0, write - forward) + max(0.0, read - backward) + read / nvme_layers_on_disk(cfg, s)
    return {"write_s": write, "read_s": read, "forward_s": forward, "backward_s": backward, "exposed_s": exposed,
            "hidden": write <= forward and read <= backward}


def _gemm_flops(cfg: ModelConfig, spec, s: Setup, gemm_passes: int) -> tuple[float, float]:
    """``(all, GDN layers')`` GEMM FLOPs of one step on one rank (the LM head in the first)."""
    tokens, m = s.rank_tokens, ModelShape.from_config(cfg)
    head_flops = (2 * tokens * cfg.hidden_size * cfg.vocab_size * 2 if s.lora_rank
                  else lm_head_gemm_flops(tokens, cfg.hidden_size, cfg.vocab_size, s.options.lm_head_wgrad))
    if spec.plain:  # the chunked MLP's backward recomputes each chunk's gate and up projections (fpdt.model.mlp)
        mlp_recompute = 4 * cfg.hidden_size * cfg.intermediate_size
        return tokens * cfg.num_layers * (gemm_passes * layer_matmul_flops(m) + mlp_recompute) + head_flops, 0.0
    per_layer = kind_matmul_flops(cfg, spec)     # per layer kind (fpdt.plan.models.layer_matmul_flops)
    gemm = tokens * (gemm_passes * sum(per_layer) + sum(mlp_recompute_flops(cfg, spec))) + head_flops
    return gemm, tokens * gemm_passes * sum(f for f, a in zip(per_layer, spec.mixers) if a == "gdn")


def _gdn_exposed(cfg: ModelConfig, spec, s: Setup, cluster: Cluster, gemm_pass: float,
                 core_pass: float) -> tuple[float, float]:
    """``(all-to-all, host copies)`` exposed seconds of the GDN layers (0 without them): per pass the
    pre-conv channels and gates cross to head layout and the core output back (``hp > 1``); each
    layer's chunk stash goes to the host in the forward that backward uses (the recompute under layer
    checkpoints: ``fpdt.model.gdn_chunks`` stashes only then) and comes back once in backward (offload),
    beside the layers' GEMMs (``gemm_pass`` seconds per pass) and core (``core_pass``)."""
    if not spec.gdn_layers:
        return 0.0, 0.0
    rates, g, n, u = cluster.rates(), spec.gdn, spec.gdn_layers, s.num_chunks
    fwd_passes = 2 if s.options.checkpointing != "off" else 1
    compute = gemm_pass + core_pass                     # all GDN layers, one pass
    a2a = 0.0
    if s.hp > 1:
        per_pass = s.rank_tokens * (g.qkv_width + 2 * g.value_heads + g.value_width) * s.elem_bytes * (s.hp - 1) / s.hp
        a2a_s = n * (fwd_passes + 1) * per_pass / _link(cluster, s.hp, True, rates)
        a2a = a2a_s / u + max(0.0, (a2a_s - (fwd_passes + 2) * compute) * (u - 1) / u)
    copies = 0.0
    if s.options.offload:
        stash = gdn_stash_bytes(cfg, spec, s)
        write, read = stash / rates.d2h_bytes_s, stash / rates.h2d_bytes_s
        copies = n * (max(0.0, write - compute / n) + write / u + max(0.0, read - 2 * compute / n) + read / u)
    return a2a, copies


def estimate_time(cfg: ModelConfig, s: Setup, cluster: Cluster,
                  saved_output_all_to_alls: int = SAVED_OUTPUT_ALL_TO_ALLS) -> dict:
    """Seconds per optimizer step, per component (exposed time) plus ``"total"``
    (``saved_output_all_to_alls``: :data:`SAVED_OUTPUT_ALL_TO_ALLS`)."""
    rates = cluster.rates()
    m, e, l, spec = ModelShape.from_config(cfg), s.elem_bytes, cfg.num_layers, model_spec(cfg)
    la = spec.attention_layers                  # attention runs in these only (every layer of a plain model)
    tokens = s.rank_tokens
    recompute = s.options.checkpointing != "off"
    passes = 4 if recompute else 3                          # forward, (recompute), backward = 2 x
    # LoRA: the frozen weights' backward is the input gradient alone, the LM head's too
    gemm_passes = passes - 1 if s.lora_rank else passes
    gemm_flops, gdn_gemm_flops = _gemm_flops(cfg, spec, s, gemm_passes)
    attn_layer = tokens * attention_flops(m, s.seq_len, causal=True) * work_fraction(s.seq_len, s.doc_len)
    t_gemm = gemm_flops / rates.gemm_flops
    saving = sum(saving_split(cfg, s, spec))               # their recompute runs no attention kernel
    t_attn = (passes * la - saving) * attn_layer / rates.attention_flops
    core_passes = GDN_CORE_PASSES if recompute else GDN_CORE_PASSES - 1
    t_gdn = (tokens * spec.gdn_layers * core_passes * gdn_core_flops(spec.gdn) / rates.attention_flops
             if spec.gdn_layers else 0.0)
    u = s.num_chunks

    # Per-layer communication and copy volumes of the attention schedule (fpdt.attention.ring_costs).
    c = _document_copies(cfg, s, layer_attention_costs(cfg, s))
    fwd_passes = 2 if recompute else 1
    o_fetch_s, o_a2a_bytes = o_proj_refetch(cfg, s, rates)
    a2a = 0.0
    if s.hp > 1:
        a2a_bytes = la * (fwd_passes * c.all_to_all_bytes_fwd + c.all_to_all_bytes_bwd)
        a2a_bytes -= saving * (1 - saved_output_all_to_alls) * _output_all_to_all_bytes(cfg, s)
        a2a_bytes += la * o_a2a_bytes
        a2a = a2a_bytes / _link(cluster, s.hp, s.placement == "head_first", rates)
    a2a_exposed = a2a / u + max(0.0, a2a * (u - 1) / u - t_attn * (u - 1) / u)
    gdn_a2a, gdn_copies = _gdn_exposed(cfg, spec, s, cluster, gdn_gemm_flops / rates.gemm_flops / gemm_passes,
                                       t_gdn / core_passes)
    a2a_exposed += gdn_a2a

    p2p_exposed = 0.0
    if s.cp > 1:
        p2p_bytes = l * (fwd_passes * c.p2p_bytes_fwd + c.p2p_bytes_bwd)
        p2p = p2p_bytes / _link(cluster, s.cp, s.placement == "context_first", rates)
        # the first block of every pass waits for its transfer; the rest hides behind attention
        p2p_exposed = p2p / ((s.cp - 1) * u) + max(0.0, p2p - t_attn)

    h2d_exposed = 0.0
    if s.options.offload:   # copies run beside the attention of the same pass; the first fetch of a layer waits
        duplex = 2 * min(rates.h2d_bytes_s, rates.d2h_bytes_s)               # both directions at once
        copy_f = (c.h2d_bytes_fwd + c.d2h_bytes_fwd) / duplex                 # per layer and pass
        copy_b = (c.h2d_bytes_bwd + c.d2h_bytes_bwd) / duplex
        attn_f = attn_layer / rates.attention_flops
        blocks = ring_touches(s.seq_len, s.doc_len, u, s.cp)
        forward = max(0.0, copy_f - attn_f) + copy_f / blocks
        h2d_exposed = la * (forward + max(0.0, copy_b - 2 * attn_f) + copy_b / blocks)
        if recompute:   # a saving layer's recompute stashes q̂ and its K/V chunks and fetches each saved o
            q = c.Nd / u  # once (to send it back to sequence layout), beside its GEMMs
            stashed = u * (q + 2 * q * kv_dim(cfg, s) / cfg.hidden_size) / rates.d2h_bytes_s
            fetched = u * q / rates.h2d_bytes_s
            gemm_pass = t_gemm / (l * gemm_passes)
            h2d_exposed += (la - saving) * forward + saving * max(0.0, max(stashed, fetched) - gemm_pass)
    h2d_exposed += la * o_fetch_s + gdn_copies
    if s.options.stream_layers:    # every layer's chunks to the host and back, beside its compute
        layer_compute = (t_gemm + t_attn + t_gdn) / l
        stream_copy = STREAM_COPIES_ND * tokens * cfg.hidden_size * e / (2 * min(rates.h2d_bytes_s, rates.d2h_bytes_s))
        h2d_exposed += l * (max(0.0, stream_copy - layer_compute) + stream_copy / (STREAM_COPIES_ND * u))
    elif s.options.checkpointing == "offload":   # the layers whose inputs go to the host and come back
        layer_compute = (t_gemm + t_attn + t_gdn) / l
        ckpt_copy = tokens * cfg.hidden_size * e / rates.h2d_bytes_s
        offloaded = l - s.options.checkpoint_device_layers
        h2d_exposed += offloaded * max(0.0, ckpt_copy - layer_compute) + (ckpt_copy if offloaded else 0.0)

    zero_exposed = 0.0
    if s.zero_stage == 3 and cluster.world > 1:
        psi, n = param_counts(cfg).total, cluster.world
        gathers = 3 if recompute else 2
        reduced = 4 * lora_param_count(cfg, s.lora_rank) if s.lora_rank else psi * e   # gradients reduce-scattered
        zero_bytes = (gathers * psi * e + reduced) * (n - 1) / n
        zero = zero_bytes / _link(cluster, n, True, rates)
        zero_exposed = max(0.0, zero - (t_gemm + t_attn + t_gdn))

    wgrad = 0.0 if s.lora_rank else sum(wgrad_accumulation_bytes(cfg, s).values()) / rates.memory_bytes_s
    elementwise = elementwise_bytes(cfg, s) / rates.memory_bytes_s

    parts = {"gemms": t_gemm, "attention": t_attn, **({"gdn_core": t_gdn} if spec.gdn_layers else {}),
             "all_to_all": a2a_exposed, "p2p": p2p_exposed,
             "h2d_d2h": h2d_exposed, "zero_collectives": zero_exposed, "elementwise": elementwise,
             "wgrad_accumulation": wgrad,
             "nvme_io": nvme_io(cfg, s, cluster, t_gemm + t_attn + t_gdn, passes)["exposed_s"]}
    parts["total"] = sum(parts.values())
    return parts

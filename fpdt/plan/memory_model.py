"""Device and host bytes of one training step, per category (per rank / per node).

Notation: ``l`` layers, ``h`` hidden, ``V`` vocabulary, ``I`` MLP width, ``kvd = max(H_kv, hp) D``,
``e`` bytes per element, ``N`` GPUs, ``Psi`` parameters; ``T``, ``Nd``, ``U`` as in
:mod:`fpdt.plan.setup`. What each category counts: ``docs/plan.md``, "How the planner counts memory"."""

from __future__ import annotations

from dataclasses import dataclass

from fpdt.attention.offload_volume import saved_attention_bytes as attention_saved_bytes
from fpdt.attention.ring_costs import AttentionCosts, attention_costs, ulysses_working_set_U
from fpdt.comm.heads import kv_replication_factor
from fpdt.layout import hidden_bytes
from fpdt.model.config import ModelConfig
from fpdt.model.apply import loss_chunks_for, mlp_chunks_for
from fpdt.model.layer_checkpoints import NVMeBytes, nvme_bytes
from fpdt.model.layer_checkpoints import nvme_layers_on_disk as layers_on_disk
from fpdt.plan.hardware import GIB
from fpdt.plan.models import ModelSpec, lora_param_count, model_spec, param_counts
from fpdt.plan.setup import Setup
from fpdt.train.config import PRECISIONS

# Calibrated on the CPU with fpdt.memory.accountant against this implementation (tests/plan/
# test_activation_model.py pins them: a change to the layer's memory must update them).
NORM_PHASE_ND = 3.0
"""Full-length [T, h] tensors beside the layer inputs at a separate RMSNorm's backward (a Gated DeltaNet
layer's input norm, a zero-centred post-attention norm)."""
RECOMPUTE_PHASE_ND = 2.0
"""The same at the recompute of an attention branch, whose input norm runs inside the attention."""
ATTENTION_PHASE_ND = 1.0
"""Full-length tensors beside the attention core's working set in its backward."""
GDN_PHASE_ND = 2.0
"""The same beside a Gated DeltaNet's (its input norm apart: the norm's output gradient too)."""
ATTENTION_PHASE_OFF_ND = 1.0
""":data:`ATTENTION_PHASE_ND` under ``checkpointing="off"`` (``tests/plan/test_activation_model.py``)."""
MLP_PHASE_ND = 2.0
"""Full-length tensors beside the chunked MLP's working set in its backward."""
SAVED_PER_LAYER_ND = 1.0
"""Full-length tensors an attention layer saves without checkpointing, beyond norm statistics and stash."""
GDN_SAVED_PER_LAYER_ND = 2.0
"""The same for a Gated DeltaNet layer (its input norm saves the layer input)."""
ATTENTION_WS_U = 16.0
"""Chunk-sized buffers of the attention pipeline at its backward peak."""
STREAM_LAYER_U = 2.0
"""With ``stream_layers``: chunk-sized tensors of the layer in flight beside the attention working set."""
STREAM_GRADIENTS_HOST_ND = 3.0
"""With ``stream_layers``: full-length gradients on the host during a layer's backward."""
GDN_WS_CHUNKS = 8.5
"""A Gated DeltaNet layer's backward on the device beyond its input gradient and weight gradients, in
one chunk's stash (:func:`gdn_chunk_bytes`): the chunk being rebuilt and the one prefetched, the
recomputed conv output, normalised q/k, gates and core output of the chunk and their gradients
(``fpdt.model.gdn_chunks``). Counted by the accountant on the CPU kernel: 7.9 at u = 2, 8.4 at u = 4
(hidden 256, Hk 2, HV 4, dk = dv 64, 512-token chunks; ``tests/plan/test_hybrid_moe_plan.py``)."""
GDN_KERNEL_STATES = 2
"""States per 64 tokens ``[L / 64, HV / P, dk, dv]`` in the input dtype that fla's chunk kernel holds in
one chunk's backward (``h`` recomputed and ``dh``)."""
FLA_CHUNK = 64
"""The token block of fla's chunked delta rule (and of ``fpdt.ops.delta_rule``)."""
LOSS_PHASE_ND = 3.0
"""Full-length tensors at the loss beside the checkpoints: the final norm's input (the last layer's
output) and output (the loss's input), and the loss's input gradient ``dh``."""
RUNTIME_RESERVE_BYTES = 2.5 * GIB
FRAGMENTATION = 1.10
HOST_RESERVE_PER_RANK = 4 * GIB
"""Python, torch, DeepSpeed and the pinned pool's rounding, per training process."""


@dataclass(frozen=True)
class MemoryEstimate:
    breakdown: dict
    """Category -> bytes at the device peak (per rank) and ``*_host`` per node; they sum to the peaks."""
    working_sets: dict
    """Each transient's own size, whether or not it is live at the peak."""
    device_peak_bytes: float
    activation_peak_bytes: float
    """Peak beyond model states, buffers and reserve, before fragmentation (the accountant's measure)."""
    host_peak_bytes: float
    """Per node."""
    nvme_bytes: float = 0.0
    """Per node: what the NVMe tier holds at the end of forward (:func:`nvme_tier_bytes`)."""


def loss_chunks(cfg: ModelConfig, s: Setup) -> int:
    """The model's own count (:func:`fpdt.model.apply.loss_chunks_for`: its default unless set)."""
    return loss_chunks_for(s.options, cfg, s.rank_tokens)


def mlp_chunks(cfg: ModelConfig, s: Setup) -> int:
    """The model's own count (:func:`fpdt.model.apply.mlp_chunks_for`: its default unless set)."""
    return mlp_chunks_for(s.options, cfg)


def kv_dim(cfg: ModelConfig, s: Setup) -> int:
    """``H_kv' * D``: KV width after the replication the head split needs (fpdt.comm.heads)."""
    return kv_replication_factor(cfg.num_heads, cfg.num_kv_heads, s.hp) * cfg.num_kv_heads * cfg.head_dim


def model_states(cfg: ModelConfig, s: Setup, world: int) -> dict:
    """Device and host bytes per rank of parameters, gradients and optimizer state."""
    psi, e = param_counts(cfg).total, s.elem_bytes
    if s.lora_rank:
        psi_l = lora_param_count(cfg, s.lora_rank)
        param_bytes, grad_bytes, opt_bytes = e * psi + 4 * psi_l, 4 * psi_l, 8 * psi_l
    else:
        param_bytes, grad_bytes, opt_bytes = e * psi, e * psi, (12 if s.dtype == "bf16" else 8) * psi
    params = param_bytes / (world if s.zero_stage == 3 else 1)
    grads = grad_bytes / (world if s.zero_stage >= 2 else 1)
    opt = opt_bytes / (world if s.zero_stage >= 1 else 1)
    dev = {"parameters": 0.0 if s.offload_param else params,
           "gradients": 0.0 if s.offload_optimizer else grads,
           "optimizer_state": 0.0 if s.offload_optimizer else opt}
    host = (params if s.offload_param else 0.0) + ((grads + opt) if s.offload_optimizer else 0.0)
    return {**dev, "model_states_host": host}


def layer_attention_costs(cfg: ModelConfig, s: Setup, causal: bool = True) -> AttentionCosts:
    """Per-rank, per-layer costs of the attention schedule (:mod:`fpdt.attention.ring_costs`)."""
    return attention_costs(seq_len=s.seq_len, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, hp=s.hp, cp=s.cp, inner_ring=s.inner_ring,
                           num_chunks=s.num_chunks, hidden=cfg.hidden_size, batch=s.batch,
                           dtype_bytes=s.elem_bytes, offload=s.options.offload, causal=causal)


def _dq_nd(cfg: ModelConfig, s: Setup) -> float:
    return cfg.num_heads * cfg.head_dim * 4 / (cfg.hidden_size * s.elem_bytes)


def attention_stash_nd(cfg: ModelConfig, s: Setup) -> float:
    """One layer's attention stash in Nd: q̂, k̂, v̂, o, fp32 lse, fp32 dq, projection input."""
    h, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, kv_dim(cfg, s)
    lse = cfg.num_heads * 4 / (h * s.elem_bytes)
    dq = qd * 4 / (h * s.elem_bytes)
    return (2 * qd + 2 * kvd) / h + lse + dq + 1.0


def saved_per_layer_nd(cfg: ModelConfig, s: Setup) -> float:
    """What one layer keeps from forward to backward under ``checkpointing="off"``, in Nd
    (``tests/plan/test_activation_model.py``)."""
    h, e = cfg.hidden_size, s.elem_bytes
    own = SAVED_PER_LAYER_ND + 4 / (h * e)
    if s.options.offload:
        return own
    return own + attention_stash_nd(cfg, s) - _dq_nd(cfg, s)   # o_proj reads its input from the stash


def saved_attention_bytes(cfg: ModelConfig, s: Setup) -> int:
    """Bytes per rank one saving layer keeps: its attention output and fp32 log-sum-exp,
    ``B (S / P) H (D e + 4)`` with ``P = hp * cp`` (arXiv:2406.18485, section 5.2)."""
    return attention_saved_bytes(batch=s.batch, seq_local=s.local_tokens, num_heads=cfg.num_heads,
                                 head_dim=cfg.head_dim, dtype=PRECISIONS[s.dtype])


NVME_STAGED_INPUTS = 4
"""Layer inputs of the NVMe tier in host buffers at once, unstreamed (two landing, two being written)."""
NVME_STAGED_STREAMED = 3
"""Layer boundaries of the streamed residual stream on the host at once with the tier."""
NVME_STAGED_SAVED = 2
"""Layers' saved attention outputs on the host at once with the tier, in backward."""


def nvme_layers_on_disk(cfg: ModelConfig, s: Setup) -> int:
    """Decoder layers whose checkpoints the NVMe tier holds (the first ones; streamed, never the last)."""
    return layers_on_disk(s.options, cfg.num_layers)


def nvme_step_bytes(cfg: ModelConfig, s: Setup) -> NVMeBytes:
    """What the NVMe tier writes per rank and micro-batch of ``s`` (``fpdt-train``'s preflight and start-up line too)."""
    return nvme_bytes(s.options, cfg.num_layers, s.rank_tokens, cfg.hidden_size, cfg.num_heads, cfg.head_dim,
                      PRECISIONS[s.dtype])


def nvme_tier_bytes(cfg: ModelConfig, s: Setup) -> tuple[float, float]:
    """``(disk, host freed)`` bytes per rank of the NVMe tier (:func:`fpdt.model.layer_checkpoints.nvme_bytes`),
    the host freed being the disk bytes less the host staging buffers."""
    b = nvme_step_bytes(cfg, s)
    if b.layers == 0:
        return 0.0, 0.0
    staged = min(b.layers, NVME_STAGED_STREAMED if s.options.stream_layers else NVME_STAGED_INPUTS) * b.per_layer \
        + min(b.saving, NVME_STAGED_SAVED) * b.per_saved
    return float(b.total), max(0.0, b.total - staged)


def communication(cfg: ModelConfig, s: Setup) -> float:
    pc, e = param_counts(cfg), s.elem_bytes
    # one layer's unsharded gradients wait for the reduce-scatter: the adapters' alone with LoRA
    grads = 4 * lora_param_count(cfg, s.lora_rank) / cfg.num_layers if s.lora_rank else pc.layer * e
    if s.zero_stage == 3:
        gathered = max(2 * pc.layer, pc.layer + max(pc.embedding, pc.head))
        zero = gathered * e + grads
    else:
        zero = grads if s.zero_stage == 2 else 0.0
    return zero + zero_bucket(s)


def zero_bucket(s: Setup) -> float:
    """DeepSpeed's contiguous-gradient bucket (ZeRO-2/3), resident for the whole run."""
    return s.reduce_bucket_size * s.elem_bytes if s.zero_stage >= 2 and s.contiguous_gradients else 0.0


def optimizer_step_transient(cfg: ModelConfig, s: Setup, world: int) -> float:
    """Bytes the ZeRO-3 optimizer step adds: one sub-group's flat gradient and its fp32 cast."""
    if s.offload_optimizer or s.zero_stage != 3:
        return 0.0
    if s.lora_rank:     # fp32 adapters: no cast
        return min(s.sub_group_size, lora_param_count(cfg, s.lora_rank) / world) * 4
    n = min(s.sub_group_size, param_counts(cfg).total / world)
    return n * (4 + (s.elem_bytes if s.elem_bytes != 4 else 0))


def _checkpoint_bytes(cfg: ModelConfig, s: Setup, nd: float) -> tuple[float, float]:
    """``(device, host)`` bytes of the layer-input checkpoints."""
    l = cfg.num_layers
    if s.options.stream_layers:     # every layer input on the host (and the final hidden state), none on the device
        return 0.0, (l + 1) * nd
    if s.options.checkpointing == "on":
        return l * nd, 0.0
    if s.options.checkpointing == "offload":
        # Two inputs on the device at a time (the layer's own, the next one fetched); with
        # the last k layers' inputs kept there, k at the start of backward, then fewer.
        k = s.options.checkpoint_device_layers
        return max(k, min(2, l)) * nd, (l - k) * nd
    spec = model_spec(cfg)
    if spec.gdn_layers == 0:
        return l * saved_per_layer_nd(cfg, s) * nd, 0.0   # every layer keeps its activations (and its stash)
    # a GDN layer keeps what an attention layer's own tensors are, and its chunk stash when not offloaded
    own = (GDN_SAVED_PER_LAYER_ND + 2 * 4 / (cfg.hidden_size * s.elem_bytes)) * nd
    gdn = own + (0.0 if s.options.offload else gdn_stash_bytes(cfg, spec, s))
    return spec.attention_layers * saved_per_layer_nd(cfg, s) * nd + spec.gdn_layers * gdn, 0.0


def saving_split(cfg: ModelConfig, s: Setup, spec: ModelSpec | None = None) -> tuple[int, int]:
    """``(host, device)`` saving layers (:meth:`Setup.saving_layers`); in a hybrid model the
    full-attention layers among the first ``save_attention_layers`` save, by where their input
    checkpoint is (GDN layers have no attention output: ``fpdt.model.layer_checkpoints``)."""
    spec = spec or model_spec(cfg)
    if spec.gdn_layers == 0:
        return s.saving_layers(cfg.num_layers)
    first = sum(s.saving_layers(cfg.num_layers))            # the layers whose attention output is kept
    saving = [i for i, kind in enumerate(spec.mixers[:first]) if kind == "attention"]
    if s.options.checkpointing != "offload":
        return 0, len(saving)
    on_device = sum(1 for i in saving if i >= cfg.num_layers - s.options.checkpoint_device_layers)
    return len(saving) - on_device, on_device


def gdn_chunk_bytes(cfg: ModelConfig, spec: ModelSpec, s: Setup) -> float:
    """One chunk's stash of a GDN layer on one rank (``fpdt.model.gdn_chunks``): the input ``x`` and
    the core output (``L`` tokens of ``hidden`` and ``HV dv``), the head-layout pre-conv channels and
    gates (``P L`` tokens of ``(2 Hk dk + HV dv + 2 HV) / P``), the fp32 boundary state
    ``[HV / P, dk, dv]`` and the conv window (``K - 1`` pre-conv tokens)."""
    g, p, e = spec.gdn, s.hp, s.elem_bytes
    tokens = s.rank_tokens / s.num_chunks
    return (tokens * (cfg.hidden_size + g.projected_width) * e + s.batch * g.state_bytes(g.value_heads / p)
            + s.batch * (g.conv_kernel - 1) * g.qkv_width / p * e)


def gdn_working_set(cfg: ModelConfig, spec: ModelSpec, s: Setup) -> float:
    """A GDN layer's device bytes beyond its full-length tensors at its backward peak: :data:`GDN_WS_CHUNKS`
    chunk stashes and fla's per-64-token states of one chunk (:data:`GDN_KERNEL_STATES`)."""
    g = spec.gdn
    states = (s.rank_tokens / s.num_chunks / FLA_CHUNK) * g.value_heads * g.key_dim * g.value_dim * s.elem_bytes
    return GDN_WS_CHUNKS * gdn_chunk_bytes(cfg, spec, s) + GDN_KERNEL_STATES * states


def moe_elements_per_token(cfg: ModelConfig, spec: ModelSpec) -> int:
    """A MoE chunk's backward set per token, in elements of the model's dtype, as ``fpdt.model.moe``
    counts it (``moe_elements_per_token``, held there by the accountant): the norm's and input
    gradient's ``5 hidden``, the fp32 router probabilities ``2 E``, the top-k bookkeeping ``24 k``, and
    per routed row ``max(5 hidden + 4 ffn, 3 hidden + 5 ffn)``; the shared expert's ``9 hidden + 4 shared``."""
    m, h = spec.moe, cfg.hidden_size
    row = max(5 * h + 4 * m.expert_ffn, 3 * h + 5 * m.expert_ffn)
    return max(5 * h + 2 * m.num_experts + 24 * m.top_k + m.top_k * row, 9 * h + 4 * m.shared_ffn)


def moe_chunks(cfg: ModelConfig, spec: ModelSpec, s: Setup) -> int:
    """Token chunks of a MoE MLP: ``mlp_chunks`` if set, else the fewest whose backward set
    (:func:`moe_elements_per_token`) fits two local attention chunks of hidden states, as
    ``fpdt.model.moe.default_moe_chunks`` chooses (the dense MLP's rule)."""
    if s.options.mlp_chunks is not None:
        return s.options.mlp_chunks
    return max(1, -(-s.num_chunks * moe_elements_per_token(cfg, spec) // (cfg.hidden_size * 2)))


def moe_working_set(cfg: ModelConfig, spec: ModelSpec, s: Setup) -> float:
    """A MoE MLP's device bytes in its backward beyond its full-length tensors: one chunk's set
    (:func:`moe_elements_per_token`), the grouped kernel's ``gate_up``-sized weight gradient of the
    chunk, and the fp32 gradient accumulators of all ``E`` experts (16-bit weights, full training)."""
    m, h, e = spec.moe, cfg.hidden_size, s.elem_bytes
    t = s.rank_tokens / moe_chunks(cfg, spec, s)
    grads = 0.0 if s.lora_rank else m.num_experts * 2 * m.expert_ffn * h * e + (4 * m.expert_params(h) if e != 4 else 0)
    return t * moe_elements_per_token(cfg, spec) * e + grads


def gdn_stash_bytes(cfg: ModelConfig, spec: ModelSpec, s: Setup) -> float:
    """One GDN layer's stash on one rank: every chunk's (:func:`gdn_chunk_bytes`)."""
    return s.num_chunks * gdn_chunk_bytes(cfg, spec, s)


def _attention_working_set(cfg: ModelConfig, s: Setup, nd: float, stash_resident: float) -> float:
    """The attention core's working set at its peak (with its on-device stash without offload)."""
    costs = layer_attention_costs(cfg, s)       # its peaks include the on-device stash without offload
    if s.cp == 1:   # the Ulysses pipeline, plus the projection-input chunk the layer fetches for dW
        ws_U = max(ulysses_working_set_U(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                         head_dim=cfg.head_dim, sp=s.hp, num_chunks=s.num_chunks,
                                         offload=s.options.offload, kernel_expands_gqa=s.kernel_expands_gqa))
        # without offload the stash recomputed in the layer's forward is resident in its backward
        return ws_U * costs.U + (nd / s.num_chunks if s.options.offload else stash_resident)
    return max(costs.peak_fwd_U, costs.peak_bwd_U) * costs.U


def loss_logit_copies(elem_bytes: int) -> float:
    """``[t, V]`` fp32 logits chunks the loss holds at once: the logits, and below fp32 their copy in
    the weights' dtype (the LM head's output as it is cast up, then the gradient cast down)."""
    return 1.0 + (elem_bytes / 4 if elem_bytes != 4 else 0.0)


def _loss_bytes(cfg: ModelConfig, s: Setup, nd: float) -> float:
    """The loss chunk's bytes (the larger of its forward and backward), by LM-head mode (``docs/plan.md``)."""
    e, h, v = s.elem_bytes, cfg.hidden_size, cfg.vocab_size
    t_loss = s.rank_tokens / loss_chunks(cfg, s)
    logits = loss_logit_copies(e) * t_loss * v * 4
    if s.lora_rank:     # a frozen LM head: no weight gradient in either mode
        return LOSS_PHASE_ND * nd + logits
    if s.options.lm_head_wgrad == "recompute":   # the backward peaks: dW beside a [T, V / N] slice (a chunk's size)
        return LOSS_PHASE_ND * nd + v * h * e + logits
    # a chunk's dW partial, summed a vocabulary slice of min(t, h) / h rows at a time, and its fp32 cast
    partial = min(t_loss, h) * v * (e + 4) if e != 4 else 0.0
    cast = v * h * e if e != 4 else 0.0         # the backward's cast of the fp32 accumulator
    return LOSS_PHASE_ND * nd + v * h * 4 + max(logits + partial, cast)


def _layer_phases(spec: ModelSpec, s: Setup, nd: float, mixer_phase: dict, mlp_chunk: dict,
                  o_grad: float = 0.0, zero_centred: bool = False) -> dict:
    """Sub-phase -> (full-length tensors of the in-flight layer, working-set category, bytes), for each
    layer kind (a plain model has one, ``("attention", "dense")``, and keeps the names ``norm``,
    ``attention``, ``mlp``). ``mixer_phase``: mixer -> (category, working set, resident stash);
    ``mlp_chunk``: MLP kind -> its chunk's working set; ``o_grad``: the bytes of ``o_proj``'s input
    gradient, whose ``u`` chunks ``g_i W`` the attention backward keeps on the device without offload;
    ``zero_centred``: the post-attention norm runs apart (``NORM_PHASE_ND`` in every layer)."""
    recomputed = s.options.checkpointing != "off"
    mixer_nds = {"attention": ATTENTION_PHASE_ND, "gdn": GDN_PHASE_ND} if recomputed else \
        {"attention": ATTENTION_PHASE_OFF_ND, "gdn": ATTENTION_PHASE_OFF_ND}
    norm_nds = {"attention": NORM_PHASE_ND if zero_centred else RECOMPUTE_PHASE_ND, "gdn": NORM_PHASE_ND}
    kept_o_grad = 0.0 if s.options.offload else o_grad
    phases = {}
    chunk = nd / s.num_chunks
    for mixer, mlp in sorted(spec.kinds()):
        key, ws, resident = mixer_phase[mixer]
        name = "" if spec.plain else f"{mixer}_{mlp}_"
        if s.options.stream_layers:    # the layer in flight holds chunks only (fpdt.model.streaming)
            phases[name + mixer if name else "attention"] = (STREAM_LAYER_U * chunk, key, ws)
            # the dense MLP runs one attention chunk at a time; a MoE chunk is already within one
            phases[name + "mlp"] = (STREAM_LAYER_U * chunk, "mlp_chunk",
                                    mlp_chunk[mlp] / (s.num_chunks if mlp == "dense" else 1))
            continue
        phases[name + "norm"] = (norm_nds[mixer] * nd + resident, None, 0.0)
        phases[name + mixer if name else "attention"] = (mixer_nds[mixer] * nd
                                                         + (kept_o_grad if mixer == "attention" else 0.0), key, ws)
        phases[name + "mlp"] = (MLP_PHASE_ND * nd + resident, "mlp_chunk", mlp_chunk[mlp])
    return phases


def estimate_memory(cfg: ModelConfig, s: Setup, world: int, gpus_per_node: int) -> MemoryEstimate:
    """Per-category bytes of ``s`` (``docs/plan.md``, "How the planner counts memory")."""
    e, h = s.elem_bytes, cfg.hidden_size
    spec = model_spec(cfg)
    nd = hidden_bytes(s.rank_tokens, h, e)
    stash_nd = attention_stash_nd(cfg, s)

    states = model_states(cfg, s, world)
    streamed = s.options.stream_layers
    ckpt_dev, ckpt_host = _checkpoint_bytes(cfg, s, nd)
    # at the loss (end of forward) offloaded checkpointing keeps only the last k layers' inputs on the device
    ckpt_at_loss = (min(ckpt_dev, s.options.checkpoint_device_layers * nd) if s.options.checkpointing == "offload"
                    else ckpt_dev)
    saved_host_layers, saved_dev_layers = saving_split(cfg, s, spec)
    saved_dev = saved_dev_layers * saved_attention_bytes(cfg, s)
    saved_host = saved_host_layers * saved_attention_bytes(cfg, s)
    # without offload a checkpointed layer's stash, recomputed in backward, stays on the device
    # through that layer's backward (under "off" every layer's is in ckpt_dev already)
    recomputed = s.options.checkpointing != "off"
    stash_resident = (stash_nd - _dq_nd(cfg, s)) * nd if recomputed and not s.options.offload else 0.0
    attn_ws = _attention_working_set(cfg, s, nd, stash_resident)
    t_mlp = s.rank_tokens / mlp_chunks(cfg, s)
    mlp_ws = 4 * t_mlp * cfg.intermediate_size * e
    # per layer kind: the mixer's working set and resident stash, the MLP's chunk (docs/plan.md, "Hybrid and
    # mixture-of-experts models"); a plain model has one kind, ("attention", "dense")
    gdn_ws = gdn_working_set(cfg, spec, s) if spec.gdn_layers else 0.0
    gdn_resident = gdn_stash_bytes(cfg, spec, s) if spec.gdn_layers and recomputed and not s.options.offload else 0.0
    moe_ws = moe_working_set(cfg, spec, s) if spec.moe_layers else 0.0
    loss = _loss_bytes(cfg, s, nd)

    # The peak is in one layer's backward or at the loss (end of forward); the breakdown
    # holds what is live at that moment, so that it sums to the peak.
    at_peak = {"checkpoints_device": ckpt_dev, "attention_saved_device": saved_dev, "in_flight_layer": 0.0,
               "attention_working_set": 0.0, **({"gdn_working_set": 0.0} if spec.gdn_layers else {}),
               "mlp_chunk": 0.0, "loss_chunk": 0.0}
    mixer_phase = {"attention": ("attention_working_set", attn_ws, stash_resident),
                   "gdn": ("gdn_working_set", gdn_ws, gdn_resident)}
    phases = _layer_phases(spec, s, nd, mixer_phase, {"dense": mlp_ws, "moe": moe_ws},
                           cfg.num_heads * cfg.head_dim / h * nd, cfg.zero_centred_norms)
    chunk = nd / s.num_chunks
    if streamed:
        loss += 2 * chunk - LOSS_PHASE_ND * nd
    in_flight, ws_key, ws = max(phases.values(), key=lambda p: p[0] + p[2])
    layer_phase = ckpt_dev + saved_dev + in_flight + ws
    loss_phase = ckpt_at_loss + saved_dev + loss
    if layer_phase >= loss_phase:
        at_peak["in_flight_layer"] = in_flight
        if ws_key:
            at_peak[ws_key] = ws
    else:
        at_peak["loss_chunk"], at_peak["checkpoints_device"] = loss, ckpt_at_loss
    activation = activation_peak = max(layer_phase, loss_phase)
    comm, bucket = communication(cfg, s), zero_bucket(s)
    step_phase = optimizer_step_transient(cfg, s, world) + bucket
    step = 0.0
    if step_phase > activation + comm:               # the optimizer step is the peak
        at_peak = {k: 0.0 for k in at_peak}
        activation, comm, step = 0.0, bucket, step_phase - bucket
    dynamic = activation + comm + step
    device = (states["parameters"] + states["gradients"] + states["optimizer_state"]
              + FRAGMENTATION * dynamic + RUNTIME_RESERVE_BYTES)

    stash_host = 0.0
    if s.options.offload:   # the layer in flight's (every layer's without checkpointing): K/V stash or GDN chunks
        per_kind = {"attention": stash_nd * nd, "gdn": gdn_stash_bytes(cfg, spec, s) if spec.gdn_layers else 0.0}
        stash_host = (sum(per_kind[m] for m in spec.mixers) if s.options.checkpointing == "off"
                      else max(per_kind[m] for m in set(spec.mixers)))
    if streamed:
        stash_host += (STREAM_GRADIENTS_HOST_ND + cfg.num_heads * cfg.head_dim / h) * nd
    disk, freed = nvme_tier_bytes(cfg, s)
    ckpt_freed = min(freed, ckpt_host)          # the inputs first, then the saved outputs
    ckpt_host -= ckpt_freed
    saved_host -= freed - ckpt_freed
    per_rank_host = ckpt_host + saved_host + stash_host + states["model_states_host"] + HOST_RESERVE_PER_RANK
    ranks = min(gpus_per_node, world)
    breakdown = {
        "parameters": states["parameters"],
        "gradients": states["gradients"],
        "optimizer_state": states["optimizer_state"],
        **at_peak,
        "communication_buffers": comm,
        "optimizer_step": step,
        "runtime_reserve": RUNTIME_RESERVE_BYTES + (FRAGMENTATION - 1) * dynamic,
        "checkpoints_host": ranks * ckpt_host,
        "attention_saved_host": ranks * saved_host,
        "attention_stash_host": ranks * stash_host,
        "model_states_host": ranks * states["model_states_host"],
        "process_host": ranks * HOST_RESERVE_PER_RANK,
    }
    kinds = {**({"gdn": gdn_ws} if spec.gdn_layers else {}), **({"moe_chunk": moe_ws} if spec.moe_layers else {})}
    working_sets = {"attention": attn_ws, "mlp_chunk": mlp_ws, **kinds, "loss": loss, "optimizer_step": step_phase,
                    **{f"layer_{k}_phase": v[0] + v[2] for k, v in phases.items()}}
    return MemoryEstimate(breakdown, working_sets, device, activation_peak, ranks * per_rank_host, ranks * disk)

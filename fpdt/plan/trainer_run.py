"""An ``fpdt-train`` run's memory, predicted before it starts by the planner's model
(:func:`fpdt.plan.memory_model.estimate_memory` of the run's own settings, :func:`planned_setup`):
host memory over a node's available is an error decided on every rank's figures
(:func:`host_memory_error`), a device peak over the GPU's a warning with the planner's settings
(:func:`recommend`), and a step out of device memory gets :func:`out_of_memory_advice`
(``docs/train.md``, "Memory before the run").
"""

from __future__ import annotations

import dataclasses

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from fpdt.attention.kernels import expands_gqa_on_gpu
from fpdt.model import ModelConfig
from fpdt.plan.deepspeed_config import apply_deepspeed_dict
from fpdt.plan.hardware import GPU_PRESETS, Cluster
from fpdt.plan.memory_model import MemoryEstimate, estimate_memory
from fpdt.plan.planner import Choice, plan_at
from fpdt.plan.setup import Setup
from fpdt.layout import chunk_split
from fpdt.train.config import PRECISIONS, ConfigError, TrainerOptions, RunLayout
from fpdt.train.progress import Predicted

GIB = 1024 ** 3
HOST_CATEGORIES = ("checkpoints_host", "attention_saved_host", "attention_stash_host", "model_states_host")
"""Host bytes per node that the run allocates for offload (the process's own memory aside)."""
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")
"""Where launchers say how many processes share a node: torchrun, deepspeed, Slurm, Open MPI."""


def ranks_on_this_node(world_size: int, gpus_on_node: int | None = None) -> int:
    """Processes sharing this node, as the launcher says (:data:`LOCAL_SIZE_VARS`); without
    one, at most one per GPU of this node (``gpus_on_node``), else every rank (one node)."""
    for key in LOCAL_SIZE_VARS:
        value = os.environ.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), world_size)
    return min(world_size, gpus_on_node) if gpus_on_node else world_size


def planned_setup(plan: RunLayout, opts: TrainerOptions, ds_config: Mapping[str, Any], dtype_name: str,
                  device_type: str, kernel_expands_gqa: bool | None = None, head_dim: int = 128) -> Setup:
    """The :class:`~fpdt.plan.setup.Setup` of this run (ZeRO and precision from the DeepSpeed
    config; an unchunked MLP or loss, ``0`` chunks, is modelled as one chunk; an
    ``attention_checkpoint`` still to be chosen, None, as ``"recompute"``).
    ``kernel_expands_gqa``: whether the run's attention kernel repeats the KV heads (not
    ``AttentionBackend.native_gqa``); None: on CUDA as ``opts.backend``, or the
    automatic choice for this precision and ``head_dim``, does
    (:func:`fpdt.attention.kernels.expands_gqa_on_gpu`); on other devices yes."""
    if kernel_expands_gqa is None:
        kernel_expands_gqa = device_type != "cuda" or expands_gqa_on_gpu(
            opts.backend, PRECISIONS[dtype_name], head_dim)
    choice = _deepspeed_choice(ds_config, plan.world_size)
    options = opts.model_options(plan)    # what the model gets; None (to choose) attention_checkpoint: recompute
    return Setup(
        seq_len=plan.seq_len, chunk_size=plan.chunk_size, hp=plan.hp, cp=plan.cp, placement=plan.placement,
        inner_ring=plan.inner_ring, kernel_expands_gqa=kernel_expands_gqa,
        options=replace(options, mlp_chunks=_modelled(plan.mlp_chunks), loss_chunks=_modelled(options.loss_chunks)),
        **{**choice.run_settings(), "dtype": "fp32" if dtype_name == "fp32" else "bf16"})


def _modelled(chunks: int | None) -> int | None:
    """A trainer chunk count as the planner models it: ``0`` (unchunked) as one chunk."""
    return None if chunks is None else max(1, chunks)


def _deepspeed_choice(ds_config: Mapping[str, Any], world_size: int) -> Choice:
    """The planner's ZeRO, precision and micro-batch settings from the run's DeepSpeed config."""
    return apply_deepspeed_dict({k: v for k, v in ds_config.items() if k != "fpdt"}, Choice(), world_size)


def estimate(model: ModelConfig, plan: RunLayout, opts: TrainerOptions, ds_config: Mapping[str, Any], dtype_name: str,
             device_type: str, ranks_per_node: int, kernel_expands_gqa: bool | None = None,
             lora_rank: int = 0) -> MemoryEstimate:
    """:class:`~fpdt.plan.memory_model.MemoryEstimate` of this run (``kernel_expands_gqa``: as
    :func:`planned_setup`). With ``lora_rank`` the setup is LoRA's (the frozen base's
    parameters only, the adapters' gradients and optimizer state), so a LoRA run is not checked
    as if it trained every weight; adapters are counted on every projection that can carry one, an upper
    bound when ``--lora-targets`` names fewer."""
    setup = planned_setup(plan, opts, ds_config, dtype_name, device_type, kernel_expands_gqa, model.head_dim)
    if lora_rank:
        setup = dataclasses.replace(setup, lora_rank=lora_rank)
    return estimate_memory(model, setup, plan.world_size, ranks_per_node)


def host_offload_bytes(est: MemoryEstimate) -> dict[str, float]:
    """Bytes per node the run allocates in host memory for offload, per :data:`HOST_CATEGORIES`."""
    return {k: est.breakdown[k] for k in HOST_CATEGORIES}


def host_memory_error(need_bytes: float, available_bytes: float, ranks_per_node: int, seq_len: int,
                      parts: dict[str, float] | None = None, where: str = "this node") -> ConfigError | None:
    """The error for a node whose offload (``need_bytes``, split as ``parts`` when known)
    exceeds its ``available_bytes``, with the fixes; None when it fits."""
    if need_bytes <= available_bytes:
        return None
    split = ""
    if parts:
        split = " (" + ", ".join(f"{k.removesuffix('_host').replace('_', ' ')} {v / GIB:.1f} GiB"
                                 for k, v in parts.items() if v) + ")"
    fixes = []
    if parts is None or parts["checkpoints_host"]:
        fixes.append("--checkpoint-device-layers K (the last K layers' inputs stay on the GPU, each taking one "
                     "offloaded layer's share of the checkpoints off the host) or --checkpoint on (all of them)")
    if parts is not None and parts.get("attention_saved_host"):
        fixes.append("fewer --save-attention-layers (each saving layer's attention output and lse are offloaded "
                     "beside its input) or --attention-checkpoint recompute (none)")
    fixes += ["a larger --sp over more nodes (fewer tokens per rank)", "a shorter --seq-len"]
    return ConfigError(
        f"the {ranks_per_node} rank(s) on {where} would offload {need_bytes / GIB:.1f} GiB to host memory at "
        f"--seq-len {seq_len}{split}, but it has {available_bytes / GIB:.1f} GiB available: the run would be "
        f"killed for lack of memory in its first step. Use {', or '.join(fixes)}; fpdt-plan --max-seq-len "
        f"gives the longest that fits")


def check_host_memory(est: MemoryEstimate, ranks_per_node: int, available_bytes: float, seq_len: int) -> None:
    """Raise :func:`host_memory_error` for this node when its offload does not fit."""
    parts = host_offload_bytes(est)
    error = host_memory_error(sum(parts.values()), available_bytes, ranks_per_node, seq_len, parts)
    if error is not None:
        raise error


def prediction_line(est: MemoryEstimate, capacity_bytes: float | None) -> str | None:
    """What the planner's model predicts for the run, for its start-up output (so that a log
    holds the prediction beside the measured ``peak_mem_gib``): the device peak per GPU on
    CUDA, the host bytes offload holds per node when there are any; None when neither."""
    parts = []
    if capacity_bytes:
        parts.append(f"device peak {est.device_peak_bytes / GIB:.1f} of {capacity_bytes / GIB:.1f} GiB per GPU")
    host = sum(host_offload_bytes(est).values())
    if host:
        size = f"{host / GIB:.2f} GiB" if host >= GIB else f"{host / 2 ** 20:.1f} MiB"
        parts.append(f"host offload {size} per node")
    return f"fpdt-plan's model of this run: {', '.join(parts)}" if parts else None


def prediction(est: MemoryEstimate | None, capacity_bytes: float | None, step_s: float | None = None) -> Predicted | None:
    """The figures of :func:`prediction_line` (and the step time, when known) for the closing
    summary; None when no prediction was printed at start."""
    if est is None or prediction_line(est, capacity_bytes) is None:
        return None
    host = sum(host_offload_bytes(est).values())
    return Predicted(device_peak_gib=est.device_peak_bytes / GIB if capacity_bytes else None,
                     host_offload_gib=host / GIB if host else None, step_time_s=step_s)


def gpu_preset(name: str, mem_bytes: float) -> str | None:
    """The :data:`GPU_PRESETS` key of a CUDA device name (``"NVIDIA H100 80GB HBM3"``), or None."""
    name = name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100-80g"
    if "a100" in name:
        return "a100-80g" if mem_bytes > 60 * GIB else "a100-40g"
    return None


def step_time(model: ModelConfig, plan: RunLayout, opts: TrainerOptions, ds_config: Mapping[str, Any],
              dtype_name: str, gpu_name: str, mem_bytes: float, ranks_per_node: int,
              kernel_expands_gqa: bool | None = None, lora_rank: int = 0) -> float | None:
    """fpdt-plan's seconds per step of this run on a GPU it has a preset for (datasheet rates x
    efficiency, as ``fpdt-plan`` without ``--calibration``); None for another GPU, or a run its
    model cannot describe."""
    from fpdt.plan.time_model import estimate_time
    preset = gpu_preset(gpu_name, mem_bytes)
    if preset is None:
        return None
    try:
        setup = planned_setup(plan, opts, ds_config, dtype_name, "cuda", kernel_expands_gqa, model.head_dim)
        if lora_rank:
            setup = dataclasses.replace(setup, lora_rank=lora_rank)
        cluster = Cluster(GPU_PRESETS[preset], gpus_per_node=ranks_per_node,
                          nodes=max(1, plan.world_size // ranks_per_node))
        return float(estimate_time(model, setup, cluster)["total"])
    except Exception:  # noqa: BLE001 -- a figure beside the measured one, never a reason to fail
        return None


@dataclass(frozen=True)
class Recommendation:
    """What the planner suggests for a run on this GPU (:func:`recommend`)."""

    flags: str | None
    """``fpdt-train`` flags of the planner's choice (None when it has none)."""
    note: str
    """The sentence to print: the flags, or why there are none."""


def device_memory_warning(est: MemoryEstimate, capacity_bytes: float,
                          recommend: Callable[[], Recommendation]) -> str | None:
    """A warning line when the predicted device peak per GPU exceeds ``capacity_bytes``,
    with the planner's :func:`recommend` (``recommend()``: called only then)."""
    if est.device_peak_bytes <= capacity_bytes:
        return None
    top = sorted(((v, k) for k, v in est.breakdown.items() if not k.endswith("_host") and v), reverse=True)[:3]
    largest = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for v, k in top)
    return (f"warning: fpdt-plan's model predicts a device peak of {est.device_peak_bytes / GIB:.1f} GiB per GPU, more "
            f"than its {capacity_bytes / GIB:.1f} GiB (largest: {largest} GiB); {recommend().note}")


def out_of_memory_advice(step: int, plan: RunLayout, opts: TrainerOptions, est: MemoryEstimate | None, detail: str,
                         capacity_bytes: float | None = None, recommendation: Recommendation | None = None,
                         model_path: str = "<config.json>", deepspeed_path: str | None = "<this JSON>",
                         lora_rank: int = 0) -> str:
    """The error line for a step that ran out of device memory: what the GPU has, what the
    model predicted, the settings of this run that would lower the peak (offload only on
    CUDA, where it runs), and the planner's :func:`recommend` (on CUDA) or the
    ``fpdt-plan`` command to ask it (with ``--lora-rank`` for a LoRA run, ``lora_rank``)."""
    cuda = capacity_bytes is not None
    deepspeed = f" --deepspeed {deepspeed_path}" if deepspeed_path else ""
    lora = f" --lora-rank {lora_rank}" if lora_rank else ""
    levers = []
    if cuda and not plan.offload:
        levers.append("--offload (attention chunks in host memory)")
    if cuda and plan.checkpoint != "offload":
        levers.append("--checkpoint offload (layer inputs in host memory)")
    if plan.checkpoint == "offload" and opts.checkpoint_device_layers:
        levers.append(f"fewer --checkpoint-device-layers (now {opts.checkpoint_device_layers}; each keeps a layer "
                      f"input on the GPU)")
    if not cuda and plan.checkpoint == "off":
        levers.append("--checkpoint on (recompute each layer in backward)")
    half = plan.chunk_size // 2
    split = chunk_split(plan.sp, zigzag=plan.cp > 1)
    if half >= split and plan.chunk_size % 2 == 0 and half % split == 0:
        levers.append(f"a smaller --chunk-size (now {plan.chunk_size}, e.g. {half})")
    if opts.lm_head_wgrad == "accumulate":
        levers.append("--lm-head-wgrad recompute (no fp32 [vocab, hidden] gradient buffer)")
    levers.append("more GPUs in the sequence-parallel group (--sp)")
    if est is not None and est.breakdown["optimizer_state"]:
        levers.append('"offload_optimizer": {"device": "cpu"} in the DeepSpeed JSON\'s zero_optimization')
    has = f"the GPU has {capacity_bytes / GIB:.1f} GiB; " if cuda else ""
    predicted = (f"fpdt-plan's model predicted a peak of {est.device_peak_bytes / GIB:.1f} GiB for this run. "
                 if est is not None else "")
    hint = (recommendation.note if recommendation is not None else
            f"fpdt-plan --model {model_path}{deepspeed} --seq-len {plan.seq_len}{lora} --gpu ... recommends "
            f"settings that fit")
    return f"step {step}: out of device memory ({detail}); {has}{predicted}To lower it: {'; '.join(levers)}. {hint}"


def recommend(model: ModelConfig, plan: RunLayout, opts: TrainerOptions, ds_config: Mapping[str, Any], ranks_per_node: int,
              capacity_bytes: float, host_bytes: float, lora_rank: int = 0) -> Recommendation:
    """``fpdt-plan``'s settings for this run's model, length, sequence-parallel size, fixed
    FPDT settings (inner ring, MLP and loss chunks) and DeepSpeed settings on GPUs of
    ``capacity_bytes`` (``host_bytes`` per node), as ``fpdt-train`` flags, which win over
    the JSON's ``"fpdt"`` section. ``lora_rank``: a LoRA run's (``--lora-rank``), searched as
    ``fpdt-plan --lora-rank`` does (the frozen base holds no gradient or optimizer state), and
    given back among the flags; 0: full training. The GPU's speed only breaks ties between
    settings that fit, so the H100 preset's rates stand in for it."""
    gpu = replace(GPU_PRESETS["h100-80g"], name="this GPU", mem_bytes=capacity_bytes)
    ranks = min(ranks_per_node, plan.world_size)
    cluster = Cluster(gpu, gpus_per_node=ranks, nodes=max(1, -(-plan.world_size // ranks)), host_mem_bytes=host_bytes)
    choice = _deepspeed_choice(ds_config, plan.world_size).fix(
        sp=plan.sp, inner_ring=plan.inner_ring, mlp_chunks=_modelled(opts.mlp_chunks),
        loss_chunks=_modelled(opts.loss_chunks), backend=opts.backend, lora_rank=lora_rank,
        attention_checkpoint="recompute")
    out = plan_at(model, plan.seq_len, cluster, choice)
    if "reason" in out:
        return Recommendation(None, f"fpdt-plan has no setting to suggest for this mesh ({out['reason']})")
    rec = out["recommended"]
    if rec is None:
        return Recommendation(None, "fpdt-plan finds no setting of this length and GPU count that fits: use more "
                                    "GPUs or a shorter --seq-len")
    flags = [f"--chunk-size {rec['chunk_size']}", f"--hp {rec['hp']}", f"--cp {rec['cp']}"]
    if rec["cp"] > 1:
        flags.append(f"--placement {rec['placement']}")
    # every setting given, 0 device layers too: flags win over the JSON, whose values may not fit the advice
    flags += [f"--checkpoint {rec['checkpoint']}", f"--checkpoint-device-layers {rec['checkpoint_device_layers']}",
              "--offload" if rec["offload"] else "--no-offload", f"--lm-head-wgrad {rec['lm_head_wgrad']}"]
    if lora_rank:
        flags.append(f"--lora-rank {lora_rank}")
    text = " ".join(flags)
    return Recommendation(text, f"fpdt-plan's settings for this GPU: {text}")


@dataclass(frozen=True)
class AttentionCheckpoint:
    """How the run's checkpointed layers get their attention output back in backward
    (the model's ``attention_checkpoint`` and ``save_attention_layers``), and why."""

    mode: str
    """``"save"`` or ``"recompute"``."""
    layers: int | None
    """With ``"save"``: how many layers (the first ones) save; None: every layer."""
    reason: str

    def line(self, num_layers: int) -> str:
        """The start-up line's words for it."""
        if self.mode == "save":
            n = num_layers if self.layers is None else self.layers
            return f"attention_checkpoint=save layers={n}/{num_layers} ({self.reason})"
        return f"attention_checkpoint=recompute ({self.reason})"


def saving_layers_that_fit(model: ModelConfig, setup: Setup, est: MemoryEstimate, host_available: float,
                           device_capacity: float | None, ranks_per_node: int) -> int:
    """The most layers of ``setup`` (a recompute setup, ``est`` its estimate) that can save
    their attention output in what the run's memory check predicts is left: the node's
    ``host_available`` bytes less its offload (:func:`host_offload_bytes`), and on CUDA the
    GPU's capacity less the predicted device peak (:func:`fpdt.plan.planner.most_saving_layers`)."""
    from fpdt.plan.planner import most_saving_layers
    host_room = host_available - sum(host_offload_bytes(est).values())
    device_room = None if device_capacity is None else device_capacity - est.device_peak_bytes
    return most_saving_layers(model, setup, host_room, device_room, ranks_per_node)


def attention_checkpoint(requested: str | None, layers: int | None, checkpoint: str, fit: int,
                         num_layers: int, per_layer_bytes: float | None = None) -> AttentionCheckpoint:
    """The run's choice: ``requested`` / ``layers`` as given (flag or JSON; None: not given),
    else ``"save"`` for the ``fit`` layers the memory check leaves room for
    (:func:`saving_layers_that_fit`, agreed by every rank), else ``"recompute"``.
    ``per_layer_bytes``: one saving layer's bytes per rank, for the reason."""
    if requested == "recompute":
        return AttentionCheckpoint("recompute", None, "--attention-checkpoint recompute")
    if checkpoint == "off":
        return AttentionCheckpoint("recompute", None, "checkpointing is off: no layer runs a recompute")
    if layers is not None:
        return AttentionCheckpoint("save", min(layers, num_layers), f"--save-attention-layers {layers}")
    size = f" ({per_layer_bytes / GIB:.2f} GiB per rank and layer)" if per_layer_bytes else ""
    given = "--attention-checkpoint save" if requested == "save" else "default"
    if fit >= num_layers:
        return AttentionCheckpoint("save", None, f"{given}: the predicted host and device memory hold every "
                                                 f"layer's attention output and lse{size}")
    if fit > 0:
        return AttentionCheckpoint("save", fit, f"{given}: the predicted host and device memory hold the attention "
                                                f"outputs of the first {fit} layers{size}, not more")
    if requested == "save":
        return AttentionCheckpoint("save", 0, f"{given}, but the predicted host and device memory hold no layer's "
                                              f"attention output{size}: every layer recomputes")
    return AttentionCheckpoint("recompute", None, f"default: the predicted host and device memory hold no layer's "
                                                  f"attention output{size}")


def stream_layers(requested: bool | None, unstreamed: MemoryEstimate, streamed: Callable[[], MemoryEstimate | None],
                  capacity: float | None) -> tuple[bool, str | None]:
    """Whether ``fpdt-train`` streams its layers, and the start-up line that says why when it
    chose to. ``requested``: ``--stream-layers`` (None: choose); ``streamed()``: the estimate with
    streaming (None when that run is not valid). It streams only when the device, ``capacity``
    bytes (None: unknown, as on the CPU), does not hold the run otherwise and does with it."""
    if requested is not None or capacity is None or unstreamed.device_peak_bytes <= capacity:
        return bool(requested), None
    est = streamed()
    if est is None or est.device_peak_bytes > capacity:
        return False, None
    return True, (f"stream_layers on: the predicted device peak is {unstreamed.device_peak_bytes / GIB:.1f} GiB "
                  f"without it, {est.device_peak_bytes / GIB:.1f} GiB with it, of {capacity / GIB:.1f} GiB "
                  f"(--no-stream-layers to refuse)")


@dataclass(frozen=True)
class NVMeLayers:
    """How many of the first decoder layers keep their checkpoints on the NVMe tier, and why."""

    layers: int | None
    """The first this many offloaded layers go to disk; None: every one (nothing predicted)."""
    reason: str

    def line(self, offloaded: int) -> str:
        """The start-up line's words for it."""
        n = offloaded if self.layers is None else self.layers
        return f"nvme_layers={n}/{offloaded} ({self.reason})"


def nvme_layers(requested: int | None, offloaded: int, host_need: Callable[[int], float],
                available: float) -> NVMeLayers:
    """The run's ``nvme_layers``: ``requested`` (``--nvme-layers``) as given, else the fewest
    ``K`` of the ``offloaded`` layers whose predicted host offload ``host_need(K)`` (bytes per
    node, falling as ``K`` grows) is within ``available``; all of them when none is (the host
    check then refuses the run)."""
    if requested is not None:
        return NVMeLayers(requested, f"--nvme-layers {requested}")
    avail = f"the {_size(available)} available"
    if host_need(0) <= available:
        return NVMeLayers(0, f"the predicted host offload, {_size(host_need(0))}, fits {avail} without it")
    if host_need(offloaded) > available:
        return NVMeLayers(offloaded, f"even with every offloaded layer on disk the predicted host offload, "
                                     f"{_size(host_need(offloaded))}, exceeds {avail}")
    lo, hi = 1, offloaded            # host_need(lo - 1) is over, host_need(hi) fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if host_need(mid) <= available else (mid + 1, hi)
    return NVMeLayers(lo, f"the fewest first layers on disk that bring the predicted host offload within {avail}: "
                          f"{_size(host_need(lo))} with {lo}, {_size(host_need(lo - 1))} with {lo - 1}")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"

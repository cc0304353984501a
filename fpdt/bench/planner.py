"""The planner's prediction beside a measurement: the cluster (rates) it is set on, and its
peaks and step time for a single-device trial of an fpdt strategy."""

from __future__ import annotations

from fpdt.bench.environment import default_device
from fpdt.plan import GPU_PRESETS, Cluster, evaluate, load_calibration, load_model_config
from fpdt.plan.setup import Setup
from fpdt.train.config import TrainerOptions


def planner_cluster(calibration: str | None, kernel: str | None = None):
    """``(cluster, rates label)`` the scripts set the planner's predictions on: one GPU of the
    H100 preset, with ``calibration``'s measured rates (``op_latency.py``) when given.

    ``kernel``: the attention kernel the predicted run uses. Its own measured rate
    (``attention_flops_by_kernel``) replaces the automatic kernel's when the file has it; when
    it has not and the file's kernel (``attention_backend``) is another, the label says so
    (``"calibration, attention rate of <kernel>"``), and plot.py sets no ratio beside it."""
    cal = load_calibration(calibration) if calibration else None
    label = "calibration" if cal else "h100-80g datasheet"
    if cal and kernel and kernel not in (cal.get("attention_flops_by_kernel") or {}) \
            and cal.get("attention_backend") not in (None, kernel):
        label = f"calibration, attention rate of {cal['attention_backend']}"
    return Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1, calibration=cal).for_kernel(kernel), label


def planned(cfg: dict, strategy: str, seq_len: int, chunk: int, dtype: str, calibration: str | None = None,
            states_bytes: float | None = None, kernel_expands_gqa: bool | None = None,
            lm_head_wgrad: str | None = None, kernel: str | None = None) -> dict:
    """The planner's prediction for a single-device run of an fpdt strategy (no ZeRO).

    Memory does not depend on the device's rates; the step time does: with ``calibration``
    (``profiling/op_latency.py``'s file, measured on this machine) the planner uses its rates,
    else the H100 preset's datasheet rates (then ``planned_step_s`` is not this machine's).

    ``states_bytes``: the trial's own parameters + gradients + optimizer state. The planner
    models fpdt-train's mixed precision (in bf16: 2 + 2 + 12 = 16 bytes per parameter, the 12
    being fp32 master weights and both moments); the trial (``profiling/max_seqlen.py``) trains the weights in their own
    dtype with torch's AdamW (in bf16: 2 + 2 + 4 = 8 bytes per parameter; in fp32 both hold
    16). Given them, the planned peaks below hold these states in place of the planner's own:

    * ``planned_allocated_peak_bytes``: states + the larger of the activation and
      optimizer-step phases, what an allocated peak counts: compare it with the measured
      ``device_peak_bytes``;
    * ``planned_device_peak_bytes``: that plus the planner's runtime reserve and allocator
      fragmentation (``breakdown["runtime_reserve"]``), the figure that decides whether a run fits.

    ``kernel``: the attention kernel the trial ran: the planner models its GQA expansion and
    uses its own calibrated rate when the file has it (:func:`planner_cluster`).
    ``kernel_expands_gqa``: default, ``kernel``'s (else this machine's: True on the CPU, whose
    kernel repeats the KV heads; False on CUDA). ``lm_head_wgrad``: default, the fpdt
    trainer's (:class:`fpdt.train.config.TrainerOptions`).
    """
    offload = strategy in ("fpdt", "fpdt-save", "fpdt-stream")
    if kernel_expands_gqa is None:
        from fpdt.attention.kernels import BACKENDS
        kernel_expands_gqa = (not BACKENDS[kernel].native_gqa) if kernel else default_device().type == "cpu"
    s = Setup.build(seq_len=seq_len, chunk_size=min(chunk, seq_len), checkpointing="offload" if offload else "on",
                    offload=offload, zero_stage=0, dtype=dtype, kernel_expands_gqa=kernel_expands_gqa,
                    lm_head_wgrad=lm_head_wgrad or TrainerOptions().lm_head_wgrad,
                    attention_checkpoint="save" if strategy == "fpdt-save" else "recompute",
                    stream_layers=strategy == "fpdt-stream")
    cluster, rates = planner_cluster(calibration, kernel)
    r = evaluate(load_model_config(cfg), s, cluster)
    b = r["breakdown"]
    states = b["parameters"] + b["gradients"] + b["optimizer_state"]
    own = states if states_bytes is None else states_bytes
    return {"planned_activation_peak_bytes": r["activation_peak_bytes"],
            # what the allocator's peak counts (torch.cuda.max_memory_allocated): states + the larger
            # of the activation and optimizer-step phases
            "planned_allocated_peak_bytes": r["device_peak_bytes"] - b["runtime_reserve"] - states + own,
            # what must fit in the GPU: plus the planner's reserve (CUDA context, workspaces) and
            # allocator fragmentation, which the allocated peak does not see
            "planned_device_peak_bytes": r["device_peak_bytes"] - states + own,
            "planned_host_peak_bytes": b["checkpoints_host"] + b["attention_stash_host"],
            "planned_step_s": r["step_time_s"], "planned_step_split_s": r["step_time_split_s"],
            "planned_rates": rates,
            "planned_setup": {"lm_head_wgrad": s.options.lm_head_wgrad, "kernel_expands_gqa": kernel_expands_gqa}}

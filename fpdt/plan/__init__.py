"""``fpdt-plan``: predict memory, step time and the longest sequence before renting GPUs.

    from fpdt.plan import plan, Cluster, Choice, GPU_PRESETS
    out = plan("llama-3-8b", Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8), seq_len=2**21)
    out["fits"], out["device_peak_bytes"], out["step_time_s"], out["mfu"], out["recommended"]

Modules: :mod:`~fpdt.plan.hardware` (GPU presets, rates, calibration file),
:mod:`~fpdt.plan.models` (model presets, parameter counts), :mod:`~fpdt.plan.setup` (one
configuration), :mod:`~fpdt.plan.memory_model`, :mod:`~fpdt.plan.time_model`,
:mod:`~fpdt.plan.planner` (search), :mod:`~fpdt.plan.cli` (``fpdt-plan``),
:mod:`~fpdt.plan.trainer_run` (``fpdt-train``'s memory checks of its own run).
"""

from fpdt.plan.hardware import GPU_PRESETS, Cluster, GPUSpec, gpu_from_args, load_calibration
from fpdt.plan.models import PRESETS, load_model_config, param_counts
from fpdt.plan.planner import Choice, evaluate, max_seq_len, plan, plan_at
from fpdt.plan.setup import Setup

__all__ = ["GPU_PRESETS", "PRESETS", "Choice", "Cluster", "GPUSpec", "Setup", "evaluate", "gpu_from_args",
           "load_calibration", "load_model_config", "max_seq_len", "param_counts", "plan", "plan_at"]

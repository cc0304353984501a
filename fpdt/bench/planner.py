"""The planner's cluster that the measurement scripts set their predictions on."""

from __future__ import annotations


def planner_cluster(calibration: str | None, kernel: str | None = None):
    """``(cluster, rates label)`` the scripts set the planner's predictions on: one GPU of the
    H100 preset, with ``calibration``'s measured rates (``op_latency.py``) when given.

    ``kernel``: the attention kernel the predicted run uses. Its own measured rate
    (``attention_flops_by_kernel``) replaces the automatic kernel's when the file has it; when
    it has not and the file's kernel (``attention_backend``) is another, the label says so
    (``"calibration, attention rate of <kernel>"``), and plot.py sets no ratio beside it."""
    from fpdt.plan import GPU_PRESETS, Cluster, load_calibration
    cal = load_calibration(calibration) if calibration else None
    label = "calibration" if cal else "h100-80g datasheet"
    if cal and kernel and kernel not in (cal.get("attention_flops_by_kernel") or {}) \
            and cal.get("attention_backend") not in (None, kernel):
        label = f"calibration, attention rate of {cal['attention_backend']}"
    return Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1, calibration=cal).for_kernel(kernel), label

"""What a ``torch.profiler`` trace of a CUDA step says: kernel classes, busy time, exposed copies."""

from __future__ import annotations


def kernel_class(name: str) -> str:
    """A CUDA kernel's coarse class by its name: ``attention`` (flash, cuDNN, memory-efficient
    or Triton attention), ``gemm``, ``copy_h2d_d2h``, ``copy_device`` (device-to-device copies
    and memsets), ``collective`` (NCCL) or ``other`` (elementwise, reductions, norms, ...)."""
    n = name.lower()
    if "memcpy" in n and ("htod" in n or "dtoh" in n):
        return "copy_h2d_d2h"
    if "memcpy" in n or "memset" in n:
        return "copy_device"
    if "nccl" in n:
        return "collective"
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn", "cudnn_generated")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")):
        return "gemm"
    return "other"


def _union(spans: list[tuple[float, float]]) -> list[list[float]]:
    """The disjoint ``[start, end]`` intervals covering ``spans``, in order."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def step_kernels(prof, top: int = 20) -> dict:
    """From a ``torch.profiler`` trace of one step on CUDA: the device's busy time (the union of
    every kernel's and copy's span, ``gpu_busy_s``) and the trace's span (``traced_s``, first
    start to last end), the summed time per :func:`kernel_class` (``kernel_class_s``), and the
    ``top`` kernels by summed time (``kernels_by_time``: name, seconds, calls). Busy time well
    under the span means the GPU waited on the host."""
    from torch.autograd import DeviceType
    spans, by_name, calls, by_class = [], {}, {}, {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        a, b = e.time_range.start, e.time_range.end
        spans.append((a, b))
        by_name[e.name] = by_name.get(e.name, 0.0) + (b - a)
        calls[e.name] = calls.get(e.name, 0) + 1
        c = kernel_class(e.name)
        by_class[c] = by_class.get(c, 0.0) + (b - a)
    busy = sum(b - a for a, b in _union(spans))
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"gpu_busy_s": busy * 1e-6,
            "traced_s": (max(b for _, b in spans) - min(a for a, _ in spans)) * 1e-6 if spans else 0.0,
            "kernel_class_s": {c: t * 1e-6 for c, t in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "kernels_by_time": [{"name": n[:160], "s": t * 1e-6, "calls": calls[n]} for n, t in ranked]}


def exposed_copy_seconds(prof) -> dict:
    """From a ``torch.profiler`` trace on CUDA: host<->device copy time, and the part of it
    not overlapped by any compute kernel (FPDT Fig. 12's "exposed" copies)."""
    from torch.autograd import DeviceType
    copies, kernels = [], []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        span, c = (e.time_range.start, e.time_range.end), kernel_class(e.name)
        if c == "copy_h2d_d2h":
            copies.append(span)
        elif c != "copy_device":
            kernels.append(span)
    merged = _union(kernels)
    total = exposed = 0.0
    for s, t in copies:
        total += t - s
        covered = sum(max(0.0, min(t, b) - max(s, a)) for a, b in merged if a < t and b > s)
        exposed += (t - s) - covered
    return {"copy_s": total * 1e-6, "exposed_copy_s": exposed * 1e-6}

"""Shared by the measurement scripts: where results go, device names, trial subprocesses.

Every script writes JSON under ``benchmarks/results/<device-name>/<date>/`` relative to the
repository (whatever the working directory); ``--tiny`` runs go to
``benchmarks/results/<device-name>/cpu-smoke/`` so they never overwrite real results.
``<device-name>`` is the CUDA device name, or ``cpu-<cpu model>`` on the CPU, lower-case
with non-alphanumerics as ``-``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device | None = None) -> str:
    device = device or default_device()
    if device.type == "cuda":
        return slug(torch.cuda.get_device_name(device))
    return slug("cpu-" + cpu_name())


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def results_dir(tiny: bool, out_dir: str | None = None, device: torch.device | None = None) -> str:
    """``benchmarks/results/<device>/<UTC date>`` (``.../cpu-smoke`` for ``--tiny``), created."""
    if out_dir:
        path = out_dir
    else:
        leaf = "cpu-smoke" if tiny else datetime.now(timezone.utc).strftime("%Y-%m-%d")
        path = os.path.join(RESULTS, device_name(device), leaf)
    os.makedirs(path, exist_ok=True)
    return path


def git_commit() -> str | None:
    """The checkout's short commit; ``FPDT_GIT_COMMIT`` when set (a copy of the tree without
    ``.git``, as the device tool may send)."""
    if os.environ.get("FPDT_GIT_COMMIT"):
        return os.environ["FPDT_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def software() -> dict:
    """The versions a result depends on: torch, its CUDA and cuDNN (None without CUDA; torch's
    SDPA prefers cuDNN only with a new enough runtime cuDNN), and the peers' packages (None
    when not installed), without importing them."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "transformers": installed("transformers"), "deepspeed": installed("deepspeed"),
            "flash_attn": installed("flash_attn") or installed("flash-attn")}


def header(script: str, args) -> dict:
    """The fields every results file starts with (``software``: :func:`software`)."""
    dev = default_device()
    return {"script": script, "device": device_name(dev), "device_type": dev.type,
            "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
            "torch": torch.__version__, "software": software(), "args": vars(args)}


def write_json(path: str, obj: dict) -> str:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    return path


def run_trial(module: str, argv: list[str], timeout_s: float) -> dict:
    """Run ``python -m module --trial argv...`` (``module`` e.g. ``"profiling.max_seqlen"``) in a
    fresh process, with the repository root on its path; its last stdout line is JSON.

    Returns that dict, or ``{"status": "timeout"}`` / ``{"status": "error", "error": ...}``.
    """
    cmd = [sys.executable, "-m", module, "--trial", *argv]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "timeout_s": timeout_s}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"status": "error", "returncode": proc.returncode, "error": " | ".join(tail)}


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

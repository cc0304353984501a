"""GPU presets, cluster shape and the kernel rates the planner's time model uses: datasheet
figures (:data:`GPU_PRESETS`) times stated efficiency factors (:data:`DEFAULT_EFFICIENCY`), or
the measured rates of a calibration file (:func:`load_calibration`), which replace both. Where
each factor comes from: ``docs/plan.md``, "Rates".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

GIB = 1024 ** 3
GB = 1e9

DEFAULT_EFFICIENCY = {
    "gemm": 0.75,        # of dense bf16 peak
    "attention": 0.50,   # of dense bf16 peak, forward + backward
    "pcie_pinned": 0.80,
    "pcie_pageable": 0.40,
    "nvlink": 0.60,      # all-to-all / P2P inside a node
    "network": 0.80,     # all-to-all / P2P / ZeRO collectives across nodes
    "hbm": 0.90,         # elementwise kernels (read + write) of device memory bandwidth
}


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model: capacity and datasheet link rates (bytes, FLOP/s, bytes/s)."""

    name: str
    mem_bytes: float
    """HBM capacity."""
    bf16_flops: float
    """Dense bf16 peak (also the MFU denominator, as the trainer's metrics use)."""
    pcie_bytes_s: float
    """Host link, one direction."""
    nvlink_bytes_s: float
    """Intra-node link per GPU, one direction."""
    network_bytes_s: float
    """Inter-node bandwidth per GPU (NIC share), one direction."""
    hbm_bytes_s: float
    """Device memory bandwidth (reads + writes)."""


# Datasheet figures. A100: PCIe Gen4 x16 (32 GB/s, the FPDT paper's figure), NVLink3
# 300 GB/s per direction, HDR-200 InfiniBand (25 GB/s). H100/H200 SXM: PCIe Gen5 x16
# (64 GB/s), NVLink4 450 GB/s per direction, NDR-400 (50 GB/s) per GPU. HBM: A100 40G
# 1555 GB/s, A100 80G SXM 2039 GB/s, H100 SXM 3350 GB/s, H200 4800 GB/s.
GPU_PRESETS = {
    "a100-40g": GPUSpec("a100-40g", 40 * GIB, 312e12, 32 * GB, 300 * GB, 25 * GB, 1555 * GB),
    "a100-80g": GPUSpec("a100-80g", 80 * GIB, 312e12, 32 * GB, 300 * GB, 25 * GB, 2039 * GB),
    "h100-80g": GPUSpec("h100-80g", 80 * GIB, 989.4e12, 64 * GB, 450 * GB, 50 * GB, 3350 * GB),
    "h200": GPUSpec("h200", 141 * GB, 989.4e12, 64 * GB, 450 * GB, 50 * GB, 4800 * GB),
}


@dataclass(frozen=True)
class NVMeSpec:
    """A node's local drives for the NVMe tier (``docs/nvme.md``): capacity and sustained
    sequential rates, bytes and bytes/s per node (all drives together; the node's ranks share them)."""

    name: str
    capacity_bytes: float
    read_bytes_s: float
    write_bytes_s: float


TB = 1e12
# "gen4": one 7.68 TB PCIe Gen4 datacenter drive at its datasheet sequential rates (Samsung PM9A3
# class: 6.9 GB/s read, 4.1 GB/s write). "gen5-x8": eight 3.84 TB drives (a DGX H100's 30.72 TB) at
# the rates DeepSpeed's DeepNVMe measured on 8 Gen5 drives (48 GB/s read, 26 GB/s write;
# deepspeed.ai/tutorials/deepnvme). Sustained figures: no efficiency factor applies.
NVME_PRESETS = {
    "gen4": NVMeSpec("gen4", 7.68 * TB, 6.9 * GB, 4.1 * GB),
    "gen5-x8": NVMeSpec("gen5-x8", 8 * 3.84 * TB, 48 * GB, 26 * GB),
}
DEFAULT_NVME = "gen4"
"""The rates a plan uses for a fixed ``nvme_path`` without ``--nvme`` / ``--nvme-gbps``."""


def nvme_from_args(preset: str | None, gib: float | None = None, gbps: str | None = None) -> NVMeSpec | None:
    """The node's drives from ``fpdt-plan``'s ``--nvme PRESET``, ``--nvme-gib`` and ``--nvme-gbps
    READ[,WRITE]`` (None when none is given: no NVMe tier offered)."""
    if preset is None and gib is None and gbps is None:
        return None
    if preset is not None and preset.lower() not in NVME_PRESETS:
        raise ValueError(f"unknown NVMe preset {preset!r}; choose one of {sorted(NVME_PRESETS)} "
                         f"or give --nvme-gib and --nvme-gbps")
    spec = NVME_PRESETS[(preset or DEFAULT_NVME).lower()]
    if gib is not None:
        if not gib > 0:
            raise ValueError(f"--nvme-gib {gib} must be > 0 (the node's NVMe capacity in GiB)")
        spec = replace(spec, capacity_bytes=gib * GIB)
    if gbps is not None:
        try:
            rw = [float(x) for x in str(gbps).split(",")]
        except ValueError:
            rw = []
        if len(rw) not in (1, 2) or min(rw) <= 0:
            raise ValueError(f"--nvme-gbps {gbps!r} must be READ or READ,WRITE in GB/s per node, each > 0 "
                             f"(e.g. 48,26)")
        spec = replace(spec, read_bytes_s=rw[0] * GB, write_bytes_s=rw[-1] * GB)
    return replace(spec, name=spec.name if preset is not None and gib is None and gbps is None else "custom")


@dataclass(frozen=True)
class Rates:
    """Sustained rates the time model divides by (FLOP/s and bytes/s, per GPU)."""

    gemm_flops: float
    attention_flops: float
    h2d_bytes_s: float
    d2h_bytes_s: float
    intra_node_bytes_s: float
    inter_node_bytes_s: float
    memory_bytes_s: float
    """Device memory traffic (bytes read + written) of streaming elementwise kernels."""
    source: str
    """``"datasheet x efficiency"`` or the calibration file's path."""
    nvme_read_bytes_s: float = NVME_PRESETS[DEFAULT_NVME].read_bytes_s
    nvme_write_bytes_s: float = NVME_PRESETS[DEFAULT_NVME].write_bytes_s
    """The node's NVMe tier, sequential (``profiling/nvme_bandwidth.py`` measures them)."""


@dataclass(frozen=True)
class Cluster:
    """The machines: ``nodes`` x ``gpus_per_node`` GPUs, ``host_mem_bytes`` per node."""

    gpu: GPUSpec
    gpus_per_node: int = 8
    nodes: int = 1
    host_mem_bytes: float = 1024 * GIB
    efficiency: dict = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    calibration: dict | None = None
    """Parsed calibration file (:func:`load_calibration`), or None for datasheet rates."""
    nvme: NVMeSpec | None = None
    """The node's drives: the planner offers the NVMe tier (``docs/nvme.md``) when given."""

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} and nodes={self.nodes} must be >= 1")
        if self.host_mem_bytes <= 0:
            raise ValueError(f"host memory per node must be > 0, got {self.host_mem_bytes} bytes")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def for_kernel(self, kernel: str | None) -> "Cluster":
        """This cluster with ``kernel``'s own calibrated attention rate, where the calibration
        timed that kernel (``attention_flops_by_kernel``, ``op_latency.py --backends``); else
        unchanged (the calibration's ``attention_flops`` is the automatic kernel's)."""
        rate = ((self.calibration or {}).get("attention_flops_by_kernel") or {}).get(kernel) if kernel else None
        return replace(self, calibration={**self.calibration, "attention_flops": rate}) if rate else self

    def rates(self) -> Rates:
        """Sustained rates: the calibration's where it has them, else datasheet x efficiency."""
        eff, g, cal = self.efficiency, self.gpu, self.calibration or {}
        rates = Rates(
            gemm_flops=g.bf16_flops * eff["gemm"],
            attention_flops=g.bf16_flops * eff["attention"],
            h2d_bytes_s=g.pcie_bytes_s * eff["pcie_pinned"],
            d2h_bytes_s=g.pcie_bytes_s * eff["pcie_pinned"],
            intra_node_bytes_s=g.nvlink_bytes_s * eff["nvlink"],
            inter_node_bytes_s=g.network_bytes_s * eff["network"],
            memory_bytes_s=g.hbm_bytes_s * eff["hbm"],
            source="datasheet x efficiency",
        )
        if self.nvme is not None:
            rates = replace(rates, nvme_read_bytes_s=self.nvme.read_bytes_s, nvme_write_bytes_s=self.nvme.write_bytes_s)
        measured = {k: cal[k] for k in _CALIBRATED_RATES if cal.get(k)}
        if measured:
            rates = replace(rates, source=str(cal.get("path", "calibration")), **measured)
        return rates


# Keys of a calibration file that replace a Rates field (same names).
_CALIBRATED_RATES = ("gemm_flops", "attention_flops", "h2d_bytes_s", "d2h_bytes_s",
                     "intra_node_bytes_s", "inter_node_bytes_s", "memory_bytes_s",
                     "nvme_read_bytes_s", "nvme_write_bytes_s")


def gpu_from_args(preset: str | None, mem_gib: float | None = None, tflops: float | None = None,
                  pcie_gbps: float | None = None) -> GPUSpec:
    """A preset by name, optionally with some fields overridden, or a fully explicit GPU.

    Explicit GPUs need all three of ``mem_gib``, ``tflops`` (dense bf16) and ``pcie_gbps``;
    their NVLink, network and HBM rates are the H100 preset's.
    """
    if preset is not None:
        key = preset.lower()
        if key not in GPU_PRESETS:
            raise ValueError(f"unknown GPU preset {preset!r}; choose one of {sorted(GPU_PRESETS)} "
                             f"or give --gpu-mem-gib, --gpu-tflops and --pcie-gbps")
        gpu = GPU_PRESETS[key]
    else:
        missing = [n for n, v in (("--gpu-mem-gib", mem_gib), ("--gpu-tflops", tflops),
                                  ("--pcie-gbps", pcie_gbps)) if v is None]
        if missing:
            raise ValueError(f"without a --gpu preset the GPU needs {', '.join(missing)}")
        gpu = replace(GPU_PRESETS["h100-80g"], name="custom")
    changes = {}
    if mem_gib is not None:
        changes["mem_bytes"] = mem_gib * GIB
    if tflops is not None:
        changes["bf16_flops"] = tflops * 1e12
    if pcie_gbps is not None:
        changes["pcie_bytes_s"] = pcie_gbps * GB
    for name, value in changes.items():
        if value <= 0:
            raise ValueError(f"GPU {name} must be > 0, got {value}")
    return replace(gpu, **changes) if changes else gpu


def load_calibration(path: str | os.PathLike) -> dict:
    """Read a calibration JSON written by ``profiling/op_latency.py``.

    Expected keys (any subset; missing ones fall back to datasheet x efficiency):
    ``gemm_flops``, ``attention_flops`` (forward + backward, causal FLOPs counted),
    ``h2d_bytes_s``, ``d2h_bytes_s`` (pinned), ``intra_node_bytes_s`` (all-to-all),
    ``inter_node_bytes_s``, ``memory_bytes_s`` (device memory, read + written, by an
    elementwise add), ``nvme_read_bytes_s``, ``nvme_write_bytes_s`` (per node, from
    ``profiling/nvme_bandwidth.py``); plus ``device`` (the name it was measured on).
    """
    with open(path) as f:
        cal = json.load(f)
    if not isinstance(cal, dict):
        raise ValueError(f"{path}: a calibration file holds one JSON object, got {type(cal).__name__}")
    bad = [k for k in _CALIBRATED_RATES if k in cal and cal[k] is not None
           and not (isinstance(cal[k], (int, float)) and cal[k] > 0)]
    if bad:
        raise ValueError(f"{path}: rates must be positive numbers: {bad}")
    return {**cal, "path": os.fspath(path)}

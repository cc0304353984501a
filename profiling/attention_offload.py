"""Offload cost of FPDT attention: time, peak memory and copy/compute overlap.

For one rank, times forward+backward of :func:`fpdt.attention.fpdt_attention` at each
global chunk size with ``offload=False`` and ``offload=True`` (ratio = offload / no
offload, measured in the same run), reports the peak device memory of both and of one
unchunked call, and, on CUDA, the share of host<->device copy time that overlapped with
compute kernels (from a ``torch.profiler`` trace).

GPU (issue targets: time ratio <= 1.05; offload peak <= unchunked / num_chunks + small)::

    python -m profiling.attention_offload                       # S=256K, H=32, H_kv=8, D=128, chunks 32K and 64K

Peak memory: device bytes above what was allocated before the call (on CUDA
``max_memory_allocated``, with the call's ``max_memory_reserved`` beside it, cache emptied
first; on the CPU the memory accountant's count), via
:class:`fpdt.memory.accountant.RegionMemory`.

CPU smoke run (what the test suite runs; the overlap column is n/a there)::

    python -m profiling.attention_offload --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from fpdt.bench.timing import sync
from fpdt.attention import fpdt_attention
from fpdt.memory.accountant import MemoryPeaks, RegionMemory
from fpdt.bench import trace


RUNTIME = os.environ.get("FPDT_RUNTIME") or None   # the device runtime: $FPDT_RUNTIME (e.g. sim), else automatic


def run_once(q, k, v, num_chunks, offload):
    """One forward+backward; returns seconds."""
    for t in (q, k, v):
        t.grad = None
    sync(q.device, RUNTIME)
    start = time.perf_counter()
    out = fpdt_attention(q, k, v, num_chunks=num_chunks, offload=offload, runtime=RUNTIME)
    out.backward(torch.ones_like(out))
    sync(q.device, RUNTIME)
    return time.perf_counter() - start


def timed(q, k, v, num_chunks, offload, warmup, iters):
    for _ in range(warmup):
        run_once(q, k, v, num_chunks, offload)
    return statistics.median(run_once(q, k, v, num_chunks, offload) for _ in range(iters))


def peak_memory(q, k, v, num_chunks, offload) -> MemoryPeaks:
    """Peaks of one forward+backward (``working_set``: device bytes above those allocated before it)."""
    for t in (q, k, v):
        t.grad = None
    sync(q.device, RUNTIME)
    with RegionMemory(q.device, fresh_cache=True) as region:
        run_once(q, k, v, num_chunks, offload)
    return region.peaks


def copy_overlap(q, k, v, num_chunks):
    """Share of H2D/D2H copy time that runs while a compute kernel runs (CUDA only)."""
    if q.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_once(q, k, v, num_chunks, True)
    t = trace.exposed_copy_seconds(prof)
    return 0.0 if t["copy_s"] == 0 else 1.0 - t["exposed_copy_s"] / t["copy_s"]


def _fmt_peak(p: MemoryPeaks) -> str:
    return p.describe(above_start=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256 * 1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-sizes", default="32768,65536", help="global tokens per chunk, comma separated")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="small CPU-sized problem (smoke test)")
    p.add_argument("--out", default="benchmarks/results/attention_offload.md")
    p.add_argument("--json", help="also write the rows here (peaks as fpdt.memory.MemoryPeaks fields)")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.heads, args.kv_heads, args.head_dim = 512, 4, 2, 32
        args.chunk_sizes, args.warmup, args.iters, args.dtype = "128,256", 1, 1, "float32"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    S = args.seq_len
    q = torch.randn(1, S, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, S, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    unchunked_peak = peak_memory(q, k, v, 1, False)
    rows = []
    for chunk in (int(c) for c in args.chunk_sizes.split(",")):
        u = S // chunk
        t_plain = timed(q, k, v, u, False, args.warmup, args.iters)
        t_off = timed(q, k, v, u, True, args.warmup, args.iters)
        overlap = copy_overlap(q, k, v, u)
        rows.append((chunk, u, t_plain, t_off, peak_memory(q, k, v, u, False), peak_memory(q, k, v, u, True), overlap))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"# FPDT attention offload ({name}, torch {torch.__version__})",
        "",
        f"1 rank, S={S}, H={args.heads}, H_kv={args.kv_heads}, D={args.head_dim}, {args.dtype}, "
        f"fwd+bwd median of {args.iters}. Unchunked (1 call) peak: {_fmt_peak(unchunked_peak)}.",
        "",
        "Peaks: device memory above what was allocated before the call (" + (
            "max_memory_allocated; reserved: the call's max_memory_reserved, cache emptied first)" if device.type == "cuda"
            else "counted by the CPU memory accountant)") + ".",
        "",
        "| chunk | chunks | time no-offload (s) | time offload (s) | ratio | peak no-offload | peak offload "
        "| copy time overlapped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for chunk, u, tp, to, mp, mo, ov in rows:
        lines.append(f"| {chunk} | {u} | {tp:.4f} | {to:.4f} | {to / tp:.3f} | {_fmt_peak(mp)} | {_fmt_peak(mo)} "
                     f"| {'n/a' if ov is None else f'{100 * ov:.1f}%'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        keys = ("chunk", "chunks", "time_plain_s", "time_offload_s", "peak_plain", "peak_offload", "copy_overlap")
        with open(args.json, "w") as f:
            json.dump([{k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in zip(keys, row)}
                       for row in rows], f, indent=2)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

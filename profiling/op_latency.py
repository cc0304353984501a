"""Per-chunk-size latency of FPDT's operations, and the planner's calibration file.

For each global chunk size ``C`` (one rank; heads and head dim from the model config,
default Llama-3-8B: 32 query / 8 KV heads of 128) it times, median of ``--iters`` after
``--warmup``:

* attention forward and backward of one diagonal (causal) block and one full block
  ``[1, C, H, D]`` against ``[1, C, H_kv, D]``, through :mod:`fpdt.attention.kernels`
  (automatic selection; the calibration's attention rate is its); with ``--backends``, the
  same for each named kernel (``all``: every one that runs here) and for ``sdpa``, torch's
  ``scaled_dot_product_attention`` called as Hugging Face calls it (``enable_gqa``,
  autograd backward), i.e. the kernel the ``hf`` and ``alst`` strategies run, under
  ``kernels`` in each chunk's row;
* the device->host and host->device copies of one chunk's q/k/v, pinned and pageable
  (on the CPU: a host-to-host copy, reported as such);
* the Ulysses all-to-all of one chunk's q/k/v when launched on several ranks
  (``torchrun --nproc_per_node N -m profiling.op_latency``), else skipped;
* copy bandwidth against transfer size, pinned vs pageable (FPDT Fig. 10).

It writes ``op_latency.json`` and ``calibration.json`` (``fpdt-plan --calibration``):
``gemm_flops`` (a square matmul in the run's dtype), ``attention_flops`` (causal
forward + backward FLOPs per second at the largest chunk), ``h2d_bytes_s`` /
``d2h_bytes_s`` (pinned, largest size), ``memory_bytes_s`` (device memory read + written by an
in-place fp32 add, as the weight-gradient accumulators do) and ``intra_node_bytes_s``
(all-to-all, when measured).

    python -m profiling.op_latency                       # 8K..256K chunks on the GPU
    python -m profiling.op_latency --tiny                # CPU smoke sizes
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from fpdt.bench.timing import median_seconds
from fpdt.bench.environment import default_device, device_name
from profiling import bench_common as bc

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def attention_latency(c: int, heads: int, kv_heads: int, head_dim: int, device, dtype, warmup, iters,
                      backend: str | None = None) -> dict:
    """Forward and backward seconds of a diagonal (causal) and a full ``c``-token block with
    ``backend`` (None: automatic selection; ``"sdpa"``: :func:`sdpa_latency`)."""
    if backend == "sdpa":
        return sdpa_latency(c, heads, kv_heads, head_dim, device, dtype, warmup, iters)
    from fpdt.attention.kernels import default_scale, get_backend
    be = get_backend(backend, device, dtype, head_dim)
    q = torch.randn(1, c, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, c, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    scale = default_scale(head_dim)
    out = {"backend": be.name}
    for label, causal in (("diag", True), ("full", False)):
        o, lse = be.forward(q, k, v, causal, scale)
        do = torch.randn_like(o)
        out[f"{label}_fwd_s"] = median_seconds(lambda: be.forward(q, k, v, causal, scale), device, warmup, iters)
        out[f"{label}_bwd_s"] = median_seconds(lambda: be.backward(do, q, k, v, o, lse, causal, scale), device, warmup, iters)
    return out


def sdpa_latency(c: int, heads: int, kv_heads: int, head_dim: int, device, dtype, warmup, iters) -> dict:
    """:func:`attention_latency` for torch's ``scaled_dot_product_attention`` as Hugging Face's
    SDPA attention calls it (``[1, H, C, D]``, ``enable_gqa`` for GQA, no mask, inputs that
    require grad); the backward is autograd's, on a retained graph. ``backend`` names the
    kernel torch dispatches to (``sdpa:cudnn``, ``sdpa:flash``, ...)."""
    import torch.nn.functional as F

    from fpdt.attention.kernels.torch_cuda import sdpa_choice
    q = torch.randn(1, heads, c, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, c, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    gqa = heads != kv_heads
    out = {"backend": f"sdpa:{sdpa_choice(device, dtype, heads, kv_heads, head_dim)}"}
    for label, causal in (("diag", True), ("full", False)):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        do = torch.randn_like(o)
        out[f"{label}_fwd_s"] = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
                                      device, warmup, iters)
        out[f"{label}_bwd_s"] = median_seconds(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), device, warmup,
                                      iters)
    return out


def kernel_names(requested: list[str], device, dtype, head_dim: int) -> list[str]:
    """``--backends`` resolved: ``all`` is every kernel of :data:`fpdt.attention.kernels.BACKENDS`
    that is installed and supports this device, dtype and head size (the float64 ``math``
    reference aside), then ``sdpa``; other names are kept, in order, without repeats."""
    from fpdt.attention.kernels import BACKENDS
    names: list[str] = []
    for name in requested:
        expand = ([n for n, b in BACKENDS.items() if n != "math" and b.available() and b.supports(device, dtype, head_dim)]
                  + ["sdpa"]) if name == "all" else [name]
        names += [n for n in expand if n not in names]
    return names


def copy_latency(nbytes: int, device, warmup, iters) -> dict:
    """Seconds to copy ``nbytes`` device->host and host->device, pinned and pageable."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for pinned in (True, False):
        if pinned and device.type != "cuda":
            continue
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        tag = "pinned" if pinned else "pageable"
        out[f"d2h_{tag}_s"] = median_seconds(lambda: host.copy_(src, non_blocking=pinned), device, warmup, iters)
        out[f"h2d_{tag}_s"] = median_seconds(lambda: src.copy_(host, non_blocking=pinned), device, warmup, iters)
    return out


def all_to_all_latency(c: int, width: int, device, dtype, warmup, iters) -> float | None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from fpdt.comm.ulysses import seq_to_heads
    p = dist.get_world_size()
    x = torch.randn(1, c // p, width, 1, device=device, dtype=dtype)   # this rank's q/k/v rows of the chunk
    return median_seconds(lambda: seq_to_heads(x, None), device, warmup, iters)


def gemm_flops(device, dtype, n: int, iters: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / median_seconds(lambda: a @ b, device, 1, iters)


def memory_bytes_s(device, nbytes: int, iters: int) -> float:
    """Device memory bandwidth of ``a += b`` on fp32 tensors of ``nbytes`` each: it reads
    both and writes one, ``3 * nbytes`` per call."""
    a = torch.zeros(nbytes // 4, device=device)
    b = torch.ones(nbytes // 4, device=device)
    return 3 * a.numel() * 4 / median_seconds(lambda: a.add_(b), device, 1, iters)


def attention_rate(lat: dict, c: int, heads: int, head_dim: int) -> float:
    """Causal forward + backward FLOPs per second of one chunk's timings (``diag_*``/``full_*``)."""
    causal_flops = 4 * c * c * heads * head_dim / 2            # one diagonal block, forward
    full_flops = 4 * c * c * heads * head_dim
    return 3 * (causal_flops + full_flops) / (lat["diag_fwd_s"] + lat["diag_bwd_s"] + lat["full_fwd_s"]
                                              + lat["full_bwd_s"])


def calibration(rows: list[dict], rates: dict, heads: int, head_dim: int) -> dict:
    """The planner's calibration: ``rates`` plus the attention rate (causal forward + backward
    FLOPs per second) of the largest chunk in ``rows`` for the automatically selected kernel
    (``attention_flops``, ``attention_backend`` names it) and for every kernel timed with
    ``--backends`` (``attention_flops_by_kernel``), and the all-to-all's, when measured."""
    last = rows[-1]
    c = last["chunk"]
    by_kernel = {last["backend"]: attention_rate(last, c, heads, head_dim)}
    by_kernel.update({name: attention_rate(lat, c, heads, head_dim) for name, lat in last.get("kernels", {}).items()
                      if "error" not in lat})
    out = {**rates, "attention_flops": by_kernel[last["backend"]], "attention_backend": last["backend"],
           "attention_flops_by_kernel": by_kernel}
    if last["all_to_all_s"]:
        p = dist.get_world_size()
        out["intra_node_bytes_s"] = last["qkv_bytes"] / p * (p - 1) / p / last["all_to_all_s"]
    return out


def _save(args, device, rows: list, bandwidth: list, cal: dict) -> dict:
    """Write ``op_latency.json`` and ``calibration.json`` (rank 0) and return the former's content."""
    result = {**bc.header("op_latency", args), "world_size": dist.get_world_size() if dist.is_initialized() else 1,
              "chunks": rows, "bandwidth": bandwidth, "calibration": cal,
              "note": None if device.type == "cuda" else "CPU: copies are host-to-host memcpy, not PCIe"}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out = bc.results_dir(args.tiny, args.out_dir, device)
        bc.write_json(os.path.join(out, "op_latency.json"), result)
        bc.write_json(os.path.join(out, "calibration.json"), cal)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[2 ** k for k in range(13, 19)])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--bandwidth-sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--gemm-size", type=int, default=8192, help="n of the n x n matmul timed for gemm_flops")
    p.add_argument("--memory-mib", type=float, default=1024,
                   help="size of each fp32 operand of the add timed for memory_bytes_s")
    p.add_argument("--backends", nargs="+", default=[], metavar="KERNEL",
                   help="also time these attention kernels (names of fpdt.attention.kernels.BACKENDS, 'sdpa' for "
                        "torch's scaled_dot_product_attention as Hugging Face calls it, 'all' for every one that "
                        "runs here); the calibration keeps the automatic choice's rate")
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes, results in cpu-smoke/")
    p.add_argument("--out-dir")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.chunks, args.heads, args.kv_heads, args.head_dim = [64, 128], 4, 2, 16
        args.warmup, args.iters, args.bandwidth_sizes_mib = 0, 2, [0.25, 1]
        args.dtype = "fp32" if "--dtype" not in (argv or sys.argv) else args.dtype
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = default_device()
    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    from fpdt.attention.kernels import BACKENDS
    kernels = kernel_names(args.backends, device, dtype, args.head_dim)
    unknown = [n for n in kernels if n not in BACKENDS and n != "sdpa"]
    if unknown:
        raise SystemExit(f"--backends: unknown kernel(s) {unknown}; choose from {list(BACKENDS)}, sdpa or all")
    # The quick rates first, then one chunk size at a time, both files rewritten after each: a run
    # stopped by its time budget keeps a calibration from the largest chunk it finished.
    bandwidth = []
    for mib in args.bandwidth_sizes_mib:
        nbytes = int(mib * 2 ** 20)
        lat = copy_latency(nbytes, device, args.warmup, args.iters)
        bandwidth.append({"bytes": nbytes, **{k.replace("_s", "_bytes_s"): nbytes / v for k, v in lat.items()}})
    big = bandwidth[-1]
    rates = {
        "device": device_name(device), "dtype": args.dtype,
        "gemm_flops": gemm_flops(device, dtype, 256 if args.tiny else args.gemm_size, args.iters),
        "h2d_bytes_s": big.get("h2d_pinned_bytes_s", big.get("h2d_pageable_bytes_s")),
        "d2h_bytes_s": big.get("d2h_pinned_bytes_s", big.get("d2h_pageable_bytes_s")),
        "memory_bytes_s": memory_bytes_s(device, int((1 if args.tiny else args.memory_mib) * 2 ** 20), args.iters),
    }
    rows: list = []
    result: dict = {}
    for c in args.chunks:
        qkv_bytes = c * (args.heads + 2 * args.kv_heads) * args.head_dim * elem
        row = {"chunk": c, "qkv_bytes": qkv_bytes,
               **attention_latency(c, args.heads, args.kv_heads, args.head_dim, device, dtype, args.warmup,
                                   args.iters),
               **{f"qkv_{k}": v for k, v in copy_latency(qkv_bytes, device, args.warmup, args.iters).items()},
               "all_to_all_s": all_to_all_latency(c, (args.heads + 2 * args.kv_heads) * args.head_dim, device,
                                                  dtype, args.warmup, args.iters)}
        row["kernels"] = {}
        for name in kernels:       # one that cannot run here is recorded as such, not fatal
            try:
                row["kernels"][name] = attention_latency(c, args.heads, args.kv_heads, args.head_dim, device, dtype,
                                                         args.warmup, args.iters, backend=name)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                row["kernels"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        rows.append(row)
        print(f"  chunk {c:>7}: attention fwd {row['diag_fwd_s'] * 1e3:8.2f} / {row['full_fwd_s'] * 1e3:8.2f} ms "
              f"(diag/full), bwd {row['full_bwd_s'] * 1e3:8.2f} ms ({row['backend']}), "
              f"qkv d2h {row['qkv_d2h_pageable_s'] * 1e3:7.2f} ms", flush=True)
        for name, lat in row["kernels"].items():
            print(f"           {name:>14}: " + (lat["error"][:100] if "error" in lat else
                  f"fwd {lat['diag_fwd_s'] * 1e3:8.2f} / {lat['full_fwd_s'] * 1e3:8.2f} ms, bwd "
                  f"{lat['diag_bwd_s'] * 1e3:8.2f} / {lat['full_bwd_s'] * 1e3:8.2f} ms ({lat['backend']})"), flush=True)
        result = _save(args, device, rows, bandwidth, calibration(rows, rates, args.heads, args.head_dim))
    print(f"wrote {os.path.relpath(bc.results_dir(args.tiny, args.out_dir, device), bc.ROOT)}/op_latency.json "
          f"and calibration.json")
    return result


if __name__ == "__main__":
    main()

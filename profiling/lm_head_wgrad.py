"""The chunked loss's two LM-head weight-gradient modes, measured side by side.

For each shape (hidden, vocab, local tokens) the fused LM head + cross-entropy
(:func:`fpdt.model.loss.chunked_lm_loss`, default loss chunks for ``--attn-chunks``) runs
forward + backward in ``"accumulate"`` mode (fp32 ``[V, hidden]`` accumulator) and in
``"recompute"`` mode (logits recomputed in backward a vocabulary slice at a time), in the
same process, alternating, ``--repeats`` times each. Reported per mode: the median time and
the device peak beyond the inputs (:class:`~fpdt.memory.accountant.RegionMemory`: CUDA's
``max_memory_allocated``, the memory accountant on the CPU), and per shape the ratios recompute /
accumulate. Beside them, the planner's own time for each mode
(:func:`fpdt.plan.time_model.lm_head_seconds`: the head GEMMs, 4 instead of 3 with recompute;
the softmax's elementwise traffic; accumulate's fp32 weight-gradient adds) from
``--calibration``'s rates (``op_latency.py``, this machine), else the H100 preset's datasheet
rates: ``planner_time_ratio``. ``gemm_ratio_model`` is the GEMM count's 4/3 alone.

    python -m profiling.lm_head_wgrad                      # Llama-3 heads on a GPU
    python -m profiling.lm_head_wgrad --tiny               # seconds, on the CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from fpdt.bench.timing import sync
from fpdt.model.loss import WGRAD_MODES, chunked_lm_loss, default_loss_chunks
from fpdt.memory.accountant import RegionMemory
from fpdt.bench.environment import default_device
from fpdt.bench.planner import planner_cluster
from profiling import bench_common as bc

# (hidden, vocab, local tokens): Llama-3.2-1B, Llama-3-8B and Llama-3-70B heads at 16K tokens per GPU
GPU_SHAPES = [(2048, 128256, 16384), (4096, 128256, 16384), (8192, 128256, 16384)]
CPU_SHAPES = [(512, 32000, 4096), (1024, 32000, 2048)]
TINY_SHAPES = [(64, 2000, 256)]


def run_once(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunks: int, mode: str) -> tuple[float, int]:
    """Seconds and device peak bytes (beyond what exists before) of one forward + backward."""
    device = h.device
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    sync(device)
    with RegionMemory(device) as region:
        t0 = time.perf_counter()
        chunked_lm_loss(hh, ww, y, 1.0 / y.numel(), chunks, wgrad=mode).backward()
        sync(device)
        elapsed = time.perf_counter() - t0
    return elapsed, region.peaks.allocated - region.peaks.allocated_at_start


def planner_seconds(hidden: int, vocab: int, tokens: int, chunks: int, dtype: torch.dtype,
                    calibration: str | None) -> tuple[dict, str]:
    """The planner's seconds per mode for this shape, and where its rates came from."""
    from fpdt.plan.time_model import lm_head_seconds
    cluster, label = planner_cluster(calibration)
    e = torch.tensor([], dtype=dtype).element_size()
    return ({m: lm_head_seconds(hidden, vocab, tokens, chunks, m, e, cluster.rates())["total"] for m in WGRAD_MODES},
            label)


def measure(hidden: int, vocab: int, tokens: int, attn_chunks: int, dtype: torch.dtype, repeats: int,
            device: torch.device, calibration: str | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    y = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    chunks = default_loss_chunks(vocab, hidden, attn_chunks)
    for mode in WGRAD_MODES:                      # warm-up (kernels, allocator)
        run_once(h, w, y, chunks, mode)
    times = {m: [] for m in WGRAD_MODES}
    peaks = {m: 0 for m in WGRAD_MODES}
    for _ in range(repeats):                      # alternate, so that load drifts hit both modes alike
        for mode in WGRAD_MODES:
            t, p = run_once(h, w, y, chunks, mode)
            times[mode].append(t)
            peaks[mode] = max(peaks[mode], p)
    med = {m: statistics.median(v) for m, v in times.items()}
    planned, rates = planner_seconds(hidden, vocab, tokens, chunks, dtype, calibration)
    return {"hidden": hidden, "vocab": vocab, "tokens": tokens, "loss_chunks": chunks,
            "modes": {m: {"time_s": med[m], "times_s": times[m], "device_peak_bytes": peaks[m]}
                      for m in WGRAD_MODES},
            "time_ratio": med["recompute"] / med["accumulate"],
            "peak_ratio": peaks["recompute"] / peaks["accumulate"],
            "peak_saved_bytes": peaks["accumulate"] - peaks["recompute"],
            "accumulator_bytes": vocab * hidden * 4,
            "gemm_ratio_model": 4 / 3,
            "planner_time_s": planned, "planner_rates": rates,
            "planner_time_ratio": planned["recompute"] / planned["accumulate"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=3, action="append", metavar=("HIDDEN", "VOCAB", "TOKENS"),
                   help="hidden, vocabulary, local tokens (repeatable; default: Llama-3 heads on a GPU, "
                        "smaller on the CPU)")
    p.add_argument("--attn-chunks", type=int, default=1, help="attention chunks u, for the default loss chunks")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calibration", help="op_latency.py's calibration.json: the planner's times use its rates")
    p.add_argument("--tiny", action="store_true", help="one small shape, for the CPU smoke test")
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    device = default_device()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    shapes = args.shape or (TINY_SHAPES if args.tiny else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    rows = []
    for hidden, vocab, tokens in shapes:
        r = measure(hidden, vocab, tokens, args.attn_chunks, dtype, args.repeats, device, args.calibration)
        rows.append(r)
        print(f"hidden {hidden} vocab {vocab} tokens {tokens} ({r['loss_chunks']} loss chunks): "
              f"recompute/accumulate time {r['time_ratio']:.2f} (planner {r['planner_time_ratio']:.2f} from "
              f"{r['planner_rates']} rates; GEMMs alone {r['gemm_ratio_model']:.2f}), "
              f"peak {r['peak_ratio']:.2f} ({r['peak_saved_bytes'] / 2**20:.1f} MiB saved; "
              f"fp32 accumulator {r['accumulator_bytes'] / 2**20:.1f} MiB)")
    out = {**bc.header("lm_head_wgrad.py", args), "dtype": str(dtype).replace("torch.", ""), "rows": rows}
    path = bc.write_json(os.path.join(bc.results_dir(args.tiny, args.out_dir), "lm_head_wgrad.json"), out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

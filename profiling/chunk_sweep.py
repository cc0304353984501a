"""Chunk-size sweep at a fixed model and length (FPDT Fig. 12).

For each global chunk size (default 8K..256K, those dividing ``--seq-len``) one fresh
process runs one full ``fpdt`` training step (and, with ``--no-offload-too``, the same
without offload, for the offload on/off time ratio) and records:

* peak device memory (``device_peak_bytes``, the steady-state step peak of
  :mod:`max_seqlen`'s trial: CUDA ``max_memory_allocated`` with
  ``device_reserved_peak_bytes`` beside it; on the CPU the memory accountant's count plus
  the parameters), split into model states (parameters, gradients in the parameter dtype,
  AdamW's state as measured) and activations (the rest);
* step time and MFU (the trainer's formula);
* copy time not hidden by compute, from a ``torch.profiler`` trace (CUDA only; null on
  the CPU, where the copies are synchronous memcpys).

    python -m profiling.chunk_sweep --seq-len 262144            # Llama-3.2-1B shape, 1 GPU
    python -m profiling.chunk_sweep --tiny                       # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

from profiling import bench_common as bc
from profiling import max_seqlen as ms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", help="config.json (default: examples/llama-3.2-1b/config.json)")
    p.add_argument("--seq-len", type=int, default=262144)
    p.add_argument("--chunks", type=int, nargs="+", default=[2 ** k for k in range(13, 19)])
    p.add_argument("--dtype", default="bf16", choices=sorted(ms.DTYPES))
    p.add_argument("--no-offload-too", action="store_true", help="also run fpdt-no-offload at every chunk size")
    p.add_argument("--attention-backend", metavar="KERNEL", help="attention kernel (default: automatic)")
    p.add_argument("--trial-timeout-s", type=float, default=580.0)
    p.add_argument("--in-process", action="store_true", help="tests only: trials in this process")
    p.add_argument("--tiny", action="store_true", help="tiny model, CPU smoke sizes, results in cpu-smoke/")
    p.add_argument("--out-dir")
    return p


def _result(args, trial_args, rows: list[dict]) -> dict:
    """``chunk_sweep.json``'s content for the trials so far (offload time ratios where both ran)."""
    result = {**bc.header("chunk_sweep", args), "model": ms.load_config(trial_args), "seq_len": args.seq_len,
              "rows": list(rows)}
    if args.no_offload_too:
        ratios = {}
        for chunk in sorted({r["chunk_size"] for r in rows}):
            t = {r["strategy"]: r.get("step_s") for r in rows if r["chunk_size"] == chunk}
            if t.get("fpdt") and t.get("fpdt-no-offload"):
                ratios[str(chunk)] = t["fpdt"] / t["fpdt-no-offload"]
        result["offload_time_ratio"] = ratios
    return result


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.seq_len = 128
        args.chunks = args.chunks if "--chunks" in (argv or sys.argv) else [32, 64, 128]
        args.dtype = "fp32" if "--dtype" not in (argv or sys.argv) else args.dtype
    chunks = [c for c in args.chunks if c <= args.seq_len and args.seq_len % c == 0]
    if not chunks:
        raise SystemExit(f"no chunk size in {args.chunks} divides --seq-len {args.seq_len}")
    trial_args = ms.build_parser().parse_args([])
    trial_args.tiny, trial_args.model_config, trial_args.dtype = args.tiny, args.model_config, args.dtype
    trial_args.device_mem_gib, trial_args.trial_timeout_s = None, args.trial_timeout_s
    trial_args.in_process, trial_args.profile_step = args.in_process, True
    trial_args.attention_backend = args.attention_backend
    ms.check_attention_backend(args.attention_backend, ms.load_config(trial_args), args.dtype)
    strategies = ["fpdt"] + (["fpdt-no-offload"] if args.no_offload_too else [])
    rows: list = []
    path = os.path.join(bc.results_dir(args.tiny, args.out_dir), "chunk_sweep.json")
    result: dict = {}
    for chunk in chunks:
        trial_args.chunk_size = chunk
        for strategy in strategies:
            log: list = []
            r = ms.run_one(trial_args, strategy, args.seq_len, log)
            r["chunk_size"] = chunk
            if r.get("status") == "ok":
                # weights, gradients (same dtype), AdamW's moments and step counts
                states = 2 * r["param_bytes"] + r["optimizer_state_bytes"]
                r["model_states_bytes"] = states
                r["activation_bytes"] = r["device_peak_bytes"] - states
            rows.append(r)
            # after every trial, so a sweep stopped by its time budget keeps what it measured
            result = _result(args, trial_args, rows)
            bc.write_json(path, result)
    print(f"wrote {os.path.relpath(path, bc.ROOT)}")
    return result


if __name__ == "__main__":
    main()

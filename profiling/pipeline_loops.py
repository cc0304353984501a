"""The Ulysses pipeline's loop against the 2D mesh pipeline's with a ring of one (cp = 1), on one
process: could one loop serve both? Per ``u``: attention kernel calls (forward and backward
blocks), host <-> device copy bytes and copies (the simulated runtime's counters), the device
peak of a forward + backward (counted by :class:`fpdt.memory.MemoryAccountant`), and CPU time
(median of ``--repeats``, interleaved). Prints one JSON line per loop and ``u``.

    python -m profiling.pipeline_loops --u 4,8,16 --chunk 512 --out benchmarks/results/cpu/pipeline_loops.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from fpdt.attention.fpdt_attention import FPDTAttentionFunction
from fpdt.attention.mesh_pipeline import single_rank_mesh_spec
from fpdt.attention.pipeline import build_spec
from fpdt.memory.accountant import MemoryAccountant
from fpdt.offload import fresh_runtime

H, H_KV, D = 8, 2, 64


def _spec(loop: str, u: int, S: int, dtype: torch.dtype):
    shape = dict(num_heads=H, num_kv_heads=H_KV, head_dim=D, dtype=dtype, device=torch.device("cpu"), num_chunks=u)
    if loop == "mesh":
        return single_rank_mesh_spec(**shape, backend="math")
    return build_spec(seq_local=S, **shape, group=None, causal=True, softmax_scale=None, backend="math")


def _counted(spec):
    """``spec`` whose backend counts its block calls, and the counts."""
    calls = {"forward": 0, "backward": 0}

    def counting(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    backend = dataclasses.replace(spec.backend, forward=counting("forward", spec.backend.forward),
                                  backward=counting("backward", spec.backend.backward))
    return dataclasses.replace(spec, backend=backend), calls


def measure(loop: str, u: int, chunk: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    torch.manual_seed(0)
    S = u * chunk
    q, k, v = (torch.randn(1, S, h, D, dtype=dtype, requires_grad=True) for h in (H, H_KV, H_KV))
    dout = torch.randn(1, S, H, D, dtype=dtype)
    with fresh_runtime("sim") as rt:
        spec = _spec(loop, u, S, dtype)
        spec.runtime = rt
        FPDTAttentionFunction.apply(q, k, v, spec, True, True).backward(dout)      # first use outside the count
        q.grad = k.grad = v.grad = None
        spec, calls = _counted(spec)
        before = (rt.counters.bytes_d2h, rt.counters.bytes_h2d)
        c0 = time.process_time()
        with MemoryAccountant("cpu") as acct:
            FPDTAttentionFunction.apply(q, k, v, spec, True, True).backward(dout)
        cpu = time.process_time() - c0
        copies = (rt.counters.bytes_d2h - before[0], rt.counters.bytes_h2d - before[1])
    return {"loop": loop, "u": u, "chunk": chunk, "kernel_forward": calls["forward"],
            "kernel_backward": calls["backward"], "d2h_bytes": copies[0], "h2d_bytes": copies[1],
            "device_peak_bytes": acct.device_peak, "cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--u", default="4,8,16")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="append the JSON lines here too")
    args = p.parse_args()
    for u in (int(x) for x in args.u.split(",")):
        runs = {"ulysses": [], "mesh": []}
        for _ in range(args.repeats):
            for loop in runs:                       # interleaved
                runs[loop].append(measure(loop, u, args.chunk))
        for loop, rows in runs.items():
            row = dict(rows[0], cpu_s=statistics.median(r["cpu_s"] for r in rows), repeats=len(rows))
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()

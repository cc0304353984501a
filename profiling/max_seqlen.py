"""Longest sequence one training step completes at, per strategy (FPDT Table 1 style).

For a model config (default: the shipped Llama-3.2-1B shape, random weights) and each
strategy of :mod:`strategies` (``fpdt``, ``fpdt-no-offload``, ``hf``, ``alst``), one trial
runs one full training step (forward, backward, AdamW step) at one length, in a fresh
subprocess, and records:

* ``device_peak_bytes``: the steady-state peak of a training step, i.e. the larger of the
  forward+backward peak plus the optimizer state this first step creates (from the second
  step on it is live through forward and backward) and the optimizer step's own peak;
  ``fwd_bwd_peak_bytes`` / ``optimizer_peak_bytes``: the two phases' peaks (the first
  grows with the sequence, the second does not), ``optimizer_state_bytes`` (AdamW moments),
  ``first_step_device_peak_bytes`` (the measured step as it ran). Peaks are on CUDA the
  allocator's ``max_memory_allocated`` per phase (``device_reserved_peak_bytes``:
  ``max_memory_reserved``, null on the CPU), on the CPU the memory accountant's device tier
  (:class:`fpdt.memory.accountant.MemoryAccountant`: live tensor bytes created in the step)
  plus the parameters, which exist before it; ``counted_device_peak_bytes``: that count on
  any device (both through :class:`fpdt.memory.accountant.RegionMemory`);
* ``host_peak_bytes``: the host tier (offloaded stash in use, counted at the host pool);
  ``host_rss_peak_bytes``: the process's peak RSS;
* ``step_s`` (``fwd_bwd_s`` + ``optimizer_s``): the time of a second step, run after the
  measured one without the memory accountant (whose per-op bookkeeping costs more the
  more ops a strategy runs, so it would bias the comparison), with the optimizer state
  in place; ``counted_step_s``: the first, counted step (``--no-timed-step`` skips the
  second step and reports the first); ``tokens_per_s``, ``mfu`` (the trainer's formula,
  :mod:`fpdt.train.metrics`);
* ``attention_kernel``: the kernel attention ran on (fpdt: the :mod:`fpdt.attention.kernels`
  backend, ``--attention-backend`` or automatic; hf/alst: ``sdpa:<kernel>``, torch's SDPA
  dispatch), so step times are compared knowing whether the kernels differ; for the fpdt strategies
  ``layer_kernels``: the Gated DeltaNet and expert kernels where the model has such layers
  (:func:`strategies.layer_kernels`);
* for the fpdt strategies, ``planned_*``: what :mod:`fpdt.plan` predicts for the same run
  (memory; and the step time, from this machine's rates with ``--calibration``).

Modes: bisection (default) between ``--min-len`` and ``--max-len`` in multiples of the
chunk size, or ``--lengths`` (fixed lengths, each capped at ``--trial-timeout-s``, plus
the least-squares slopes of device bytes per 1K tokens, of the steady-state step peak and of
the forward+backward peak). The fpdt strategies run the attention kernel's first-use
self-check before the measured step. ``--device-mem-gib X`` caps the
device: on CUDA through the allocator's memory fraction, on the CPU by calling a trial
out of memory when the accountant's device tier passes X (so bisection means the same on
both): in bisection the step stops at the operation that passes it, as a GPU's would (so a
failing trial costs only the time up to that point); in ``--lengths`` mode it runs to the
end, is measured (the slopes use it) and is marked out of memory. A strategy whose
packages are missing is reported as skipped, with the reason.

    python -m profiling.max_seqlen --strategies fpdt hf --device-mem-gib 80
    python -m profiling.max_seqlen --lengths 65536 131072 262144 524288 --trial-timeout-s 280
    python -m profiling.max_seqlen --tiny          # CPU smoke run (benchmarks/results/<cpu>/cpu-smoke/)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

from fpdt.bench.fit import slope_per_1k
from fpdt.bench.search import longest_fitting, over_capacity
from fpdt.bench.timing import sync
from fpdt.bench import trace
from fpdt.bench.environment import default_device
from fpdt.bench.planner import planned
from profiling import bench_common as bc
from profiling import strategies as st

DEFAULT_CONFIG = os.path.join(bc.ROOT, "examples", "llama-3.2-1b", "config.json")
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1 << 20,
        "tie_word_embeddings": False, "rope_theta": 10000.0}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 1024 ** 3


def load_config(args) -> dict:
    if args.tiny and not args.model_config:
        return dict(TINY)
    with open(args.model_config or DEFAULT_CONFIG) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), 1 << 24)
    return cfg


# ----------------------------------------------------------------------------- one trial

def trial(args) -> dict:
    """One training step of ``args.strategy`` at ``args.seq_len`` (run in its own process)."""
    from fpdt.memory.accountant import RegionMemory, SimulatedOutOfMemoryError
    device = default_device()
    cfg = load_config(args)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    capacity = args.device_mem_gib * GIB if args.device_mem_gib else None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if args.device_mem_gib:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.device_mem_gib * GIB / total), device)
        # what this process's tensors can have: the GPU's free memory once the CUDA context exists
        free = torch.cuda.mem_get_info(device)[0]
        capacity = min(capacity, free) if capacity else free
    out = {"strategy": args.strategy, "seq_len": args.seq_len}
    try:
        trainee = st.build(args.strategy, cfg, args.seq_len, args.chunk_size, device, dtype, args.attention_backend)
        ids = torch.randint(0, cfg["vocab_size"], (1, args.seq_len), device=device)
        param_bytes = sum(p.numel() * p.element_size() for p in trainee.params)
        # which kernel runs attention (for fpdt this is also the kernel's first-use self-check,
        # kept outside the measured step), and for fpdt its Gated DeltaNet and expert kernels
        out.update(attention_kernel=st.attention_kernel(args.strategy, cfg, device, dtype, args.attention_backend),
                   **({"layer_kernels": st.layer_kernels(cfg, device, dtype)} if args.strategy.startswith("fpdt") else {}))
        opt_before = trainee.optimizer_state_bytes()
        # Simulated capacity on the CPU, enforced as the step runs (the allocation that passes
        # it fails, as on a GPU): forward+backward must leave room for AdamW's two moments,
        # which a second step has beside it, and the optimizer step for itself.
        # (On CUDA the allocator's memory fraction is the capacity.)
        simulate = args.device_mem_gib and args.stop_at_capacity and device.type == "cpu"
        cap = int(args.device_mem_gib * GIB) if simulate else None
        moments = 2 * param_bytes if opt_before == 0 else 0
        with RegionMemory(device, count_cuda=True) as region:
            acct = region.accountant
            if cap is not None:
                acct.set_limit(cap - param_bytes - opt_before - moments)
            t0 = time.perf_counter()
            with acct.phase("forward_backward") as fb:
                trainee.forward_backward(trainee.prepare(ids))
                sync(device)
            t1 = time.perf_counter()
            if cap is not None:
                acct.set_limit(cap - param_bytes - opt_before)
            with acct.phase("optimizer") as op:
                trainee.optimizer_step()
                sync(device)
            seconds, fwd_bwd_s = time.perf_counter() - t0, t1 - t0
        peaks = region.peaks
        if args.profile_step:                     # also on the CPU, where it records nothing: dry runs
            out.update(_profiled_step(trainee, ids, device))
        timed = _timed_step(trainee, ids, device) if args.timed_step else None
    except torch.OutOfMemoryError as exc:          # CUDA's, or the accountant's simulated capacity
        msg = str(exc).splitlines()[0]
        if isinstance(exc, SimulatedOutOfMemoryError):
            msg = f"device tier passes --device-mem-gib {args.device_mem_gib} during the step ({msg})"
        return {**out, "status": "oom", "error": msg}
    opt_state = trainee.optimizer_state_bytes()
    base = param_bytes + opt_before               # what existed before the region (the accountant skips it)
    counted = base + peaks.counted
    if device.type == "cuda":                     # the allocator's absolute peaks per phase
        fwd_bwd_peak, opt_peak = fb.cuda_allocated_peak, op.cuda_allocated_peak
    else:
        fwd_bwd_peak, opt_peak = base + fb.peak, base + op.peak
    # From the second step on, the optimizer state created by this (first) step is live
    # through forward and backward: the steady-state peak of a training step.
    device_peak = max(fwd_bwd_peak + opt_state - opt_before, opt_peak)
    counted_s, cpu_s = seconds, None
    if timed is not None:
        seconds, fwd_bwd_s, cpu_s = timed
    out.update(status="ok", measured=True, step_s=seconds, fwd_bwd_s=fwd_bwd_s, optimizer_s=seconds - fwd_bwd_s,
               counted_step_s=counted_s, timed_step=timed is not None, step_cpu_s=cpu_s, tokens_per_s=args.seq_len / seconds,
               param_bytes=param_bytes, optimizer_state_bytes=opt_state,
               device_peak_bytes=device_peak, fwd_bwd_peak_bytes=fwd_bwd_peak, optimizer_peak_bytes=opt_peak,
               first_step_device_peak_bytes=peaks.allocated if device.type == "cuda" else counted,
               counted_device_peak_bytes=counted, device_reserved_peak_bytes=peaks.reserved,
               host_peak_bytes=peaks.host_stash,
               host_rss_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, notes=trainee.notes)
    from fpdt.model import ModelConfig
    from fpdt.train.metrics import ModelShape, resolve_peak_flops, step_rates
    shape = ModelShape.from_config(ModelConfig.from_hf(cfg))
    peak, source = resolve_peak_flops(device, args.dtype, None)
    rates = step_rates(shape, args.seq_len, args.seq_len, seconds, 1, peak, trainee.recompute)
    out.update(mfu=rates.mfu, mfu_full=rates.mfu_full, peak_flops=peak, peak_source=source)
    if args.strategy.startswith("fpdt"):
        states = param_bytes + param_bytes + opt_state     # gradients in the weights' dtype
        out.update(planned(cfg, args.strategy, args.seq_len, args.chunk_size, args.dtype, args.calibration,
                           states_bytes=states, kernel=out["attention_kernel"]))
    over = over_capacity(device_peak, capacity, args.device_mem_gib)
    if over:
        out["status"], out["error"] = "oom", over
    return out


def check_attention_backend(name: str | None, cfg: dict, dtype: str) -> None:
    """Stop (SystemExit, with the reason) before any trial if kernel ``name`` is unknown, not
    installed or does not fit this device, dtype and head size. No self-check here: it would
    touch the GPU in this parent process (a CUDA context and kernel handles held through every
    trial, less memory for them); each trial self-checks the kernel it runs."""
    if not name:
        return
    from fpdt.attention.kernels import get_backend
    from fpdt.model import ModelConfig
    try:
        get_backend(name, default_device(), DTYPES[dtype], ModelConfig.from_hf(cfg).head_dim, check=False)
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"--attention-backend {name}: {e}") from e


def _timed_step(trainee: st.Trainee, ids: torch.Tensor, device: torch.device) -> tuple[float, float, float]:
    """``(step seconds, forward+backward seconds, step CPU seconds)`` of one more, uncounted
    training step: the steady-state step time (optimizer state in place, no accountant). The
    process's CPU time is the work done, which other load on a busy CPU does not inflate
    (compare it between strategies run with the same ``OMP_NUM_THREADS=1``)."""
    t0, c0 = time.perf_counter(), time.process_time()
    trainee.forward_backward(trainee.prepare(ids))
    sync(device)
    t1 = time.perf_counter()
    trainee.optimizer_step()
    sync(device)
    return time.perf_counter() - t0, t1 - t0, time.process_time() - c0


def _profiled_step(trainee: st.Trainee, ids: torch.Tensor, device: torch.device) -> dict:
    """One more training step under ``torch.profiler`` (``--profile-step``): after the counted
    step, so its optimizer state is in place, and without the memory accountant, whose
    per-op Python would show as device idle time. ``profiled_step_s`` (the profiler's own
    overhead included), and on CUDA the exposed copy time and :func:`fpdt.bench.trace.step_kernels`
    (``profile``)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds, _, _ = _timed_step(trainee, ids, device)
    out = {"profiled_step_s": seconds}
    if device.type == "cuda":                     # the CPU trace has no device events to count
        out.update(trace.exposed_copy_seconds(prof))
        out["profile"] = trace.step_kernels(prof)
    return out


# ----------------------------------------------------------------------------- drivers

def trial_argv(args, strategy: str, seq_len: int) -> list[str]:
    argv = ["--strategy", strategy, "--seq-len", str(seq_len), "--chunk-size", str(args.chunk_size),
            "--dtype", args.dtype]
    if args.tiny:
        argv.append("--tiny")
    if args.model_config:
        argv += ["--model-config", args.model_config]
    if args.device_mem_gib:
        argv += ["--device-mem-gib", str(args.device_mem_gib)]
    if getattr(args, "profile_step", False):
        argv.append("--profile-step")
    if getattr(args, "calibration", None):
        argv += ["--calibration", os.path.abspath(args.calibration)]
    if getattr(args, "attention_backend", None):
        argv += ["--attention-backend", args.attention_backend]
    if not getattr(args, "timed_step", True):
        argv.append("--no-timed-step")
    if not args.lengths:           # bisection: a trial over the capacity need not finish to fail
        argv.append("--stop-at-capacity")
    return argv


def run_one(args, strategy: str, seq_len: int, log: list, on_trial=None) -> dict:
    argv = trial_argv(args, strategy, seq_len)
    if args.in_process:
        r = trial(build_parser().parse_args(["--trial", *argv]))
    else:
        r = bc.run_trial("profiling.max_seqlen", argv, args.trial_timeout_s)
    r.setdefault("strategy", strategy)
    r.setdefault("seq_len", seq_len)
    log.append(r)
    if on_trial is not None:
        on_trial()
    gib = r.get("device_peak_bytes")
    print(f"  {strategy:<16} {seq_len:>9}  {r['status']:<8}"
          + (f" device {gib / GIB:8.3f} GiB  host {r['host_peak_bytes'] / GIB:8.3f} GiB  {r['step_s']:8.2f} s"
             if r["status"] == "ok" else f" {r.get('error', '')[:100]}"), flush=True)
    return r


def bisect(args, strategy: str, log: list, on_trial=None) -> int:
    """Longest multiple of the step (``--step``, default the chunk size) in [min_len, max_len]
    whose trial completes (0 if none): :func:`fpdt.bench.search.longest_fitting`."""
    return longest_fitting(lambda n: run_one(args, strategy, n, log, on_trial)["status"] == "ok",
                           args.step or args.chunk_size, args.min_len, args.max_len, args.resolution)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", nargs="+", default=list(st.DEFAULT_STRATEGIES), choices=st.STRATEGIES)
    p.add_argument("--model-config", help="config.json (default: examples/llama-3.2-1b/config.json)")
    p.add_argument("--chunk-size", type=int, default=65536, help="global FPDT chunk; also the bisection step")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--lengths", type=int, nargs="+", help="fixed lengths instead of bisection")
    p.add_argument("--min-len", type=int, default=65536)
    p.add_argument("--max-len", type=int, default=1 << 24)
    p.add_argument("--resolution", type=int, default=65536, help="stop bisecting below this gap")
    p.add_argument("--step", type=int, help="bisection granularity (default: the chunk size; the fpdt "
                                            "strategies need a multiple of it)")
    p.add_argument("--device-mem-gib", type=float, help="device capacity (simulated on the CPU)")
    p.add_argument("--trial-timeout-s", type=float, default=580.0)
    p.add_argument("--tiny", action="store_true", help="tiny model, CPU smoke sizes, results in cpu-smoke/")
    p.add_argument("--out-dir", help="write here instead of benchmarks/results/<device>/<date>")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--in-process", action="store_true",
                   help="run trials in this process (tests only: no fresh process per trial)")
    p.add_argument("--profile-step", action="store_true",
                   help="trace one more step after the counted one (CUDA: exposed copy time, GPU busy time, "
                        "time per kernel class and the kernels by total time; the CPU records nothing)")
    p.add_argument("--calibration", help="op_latency.py's calibration.json: the planner's step time uses its rates")
    p.add_argument("--attention-backend", metavar="KERNEL",
                   help="the fpdt strategies' attention kernel (fpdt.attention.kernels.BACKENDS; default: automatic). "
                        "Every trial records the kernel it ran as attention_kernel (hf/alst: sdpa:<kernel>)")
    p.add_argument("--no-timed-step", dest="timed_step", action="store_false",
                   help="time the counted first step instead of a second, uncounted one (halves a trial)")
    p.add_argument("--stop-at-capacity", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.trial:
        print(json.dumps(trial(args)), flush=True)
        return {}
    if args.tiny:
        args.chunk_size = min(args.chunk_size, 64)
        args.min_len, args.max_len, args.resolution = 64, min(args.max_len, 512), 64
        args.dtype = "fp32" if "--dtype" not in (argv or sys.argv) else args.dtype
    cfg = load_config(args)
    if args.calibration and not os.path.isfile(args.calibration):
        raise SystemExit(f"--calibration {args.calibration}: no such file (run profiling/op_latency.py first, "
                         f"or leave --calibration out to plan with the H100 preset's datasheet rates)")
    check_attention_backend(args.attention_backend, cfg, args.dtype)
    if args.step and args.step % args.chunk_size and any(x.startswith("fpdt") for x in args.strategies):
        raise SystemExit(f"--step {args.step} must be a multiple of --chunk-size {args.chunk_size} for the fpdt "
                         f"strategies (their lengths are whole chunks); drop --step or run them separately")
    result = {**bc.header("max_seqlen", args), "model": cfg, "mode": "lengths" if args.lengths else "bisect",
              "device_mem_gib": args.device_mem_gib, "strategies": {}}
    name = f"max_seqlen{'-' + args.tag if args.tag else ''}.json"
    path = os.path.join(bc.results_dir(args.tiny, args.out_dir), name)

    def save():   # after every trial, so a piece stopped by its time budget keeps what it measured
        bc.write_json(path, result)
    for strategy in args.strategies:
        why = st.missing_packages(strategy)
        if why:
            result["strategies"][strategy] = {"status": "skipped", "reason": why}
            print(f"  {strategy:<16} skipped: {why}")
            continue
        log: list = []
        entry = result["strategies"][strategy] = {"status": "ran", "trials": log}
        if args.lengths:
            for length in args.lengths:
                run_one(args, strategy, length, log, save)
            ok = [t["seq_len"] for t in log if t["status"] == "ok"]
            entry["max_completed_len"] = max(ok) if ok else 0
        else:
            entry["max_seq_len"] = bisect(args, strategy, log, save)
        entry["slope_device_bytes_per_1k_tokens"] = slope_per_1k(log)
        entry["slope_fwd_bwd_device_bytes_per_1k_tokens"] = slope_per_1k(log, "fwd_bwd_peak_bytes")
        entry["slope_host_bytes_per_1k_tokens"] = slope_per_1k(log, "host_peak_bytes")
    save()
    print(f"wrote {os.path.relpath(path, bc.ROOT)}")
    return result


if __name__ == "__main__":
    main()

"""Run a test body on N processes over gloo.

Usage::

    def _body(rank, world_size, shape):      # module-level, so it pickles
        ...assert things...

    def test_something():
        run_distributed(_body, world_size=2, args=((4, 8),))

Every rank runs ``fn(rank, world_size, *args)`` inside an initialised default process
group (gloo, CPU). If any rank raises, the test fails with the traceback of every rank that failed. If
the ranks do not all finish within ``timeout`` seconds (a hang, e.g. a mismatched
collective), every process is killed and the test fails naming the ranks still running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 120.0


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str,
            args: tuple, results: "mp.Queue", threads: int) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # report everything, including assertion errors and SystemExit
        results.put((rank, traceback.format_exc()))


# What most rank bodies import, loaded once in the fork server instead of once per rank: Transformers'
# models pull in torch._dynamo (about 5 s of CPU each), the Trainer, PEFT and DeepSpeed's engine another
# 1 to 3 s. On a 2-core machine this is most of a small multi-rank test's time.
HEAVY_PRELOAD = ["tests.model.helpers", "transformers.trainer", "peft", "deepspeed.runtime.engine", "fpdt.hf",
                 "fpdt.train"]


def _preload() -> list[str]:
    """The fork server's imports: the heavy ones only without CUDA (importing DeepSpeed or the Trainer
    may query the driver, and a CUDA driver touched before ``fork`` is unusable in the children)."""
    import torch

    light = ["torch", "torch.distributed", "fpdt.attention", "tests.distributed"]
    return light if torch.cuda.is_available() else light + HEAVY_PRELOAD


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (),
                    timeout: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; raise on failure."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The fork server is a fresh process that imports torch once and never runs a
        # kernel, so forking ranks from it is both fast and safe (no inherited OpenMP state).
        ctx.set_forkserver_preload(_preload())
    results = ctx.Queue()
    # A child forked straight from this (test) process inherits its OpenMP runtime, which
    # deadlocks if the child starts a thread team of its own: plain fork gets one thread.
    threads = 1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store_path, args, results, threads),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        errors: dict[int, str] = {}
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, err = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in done and not p.is_alive() and p.exitcode not in (0, None)]
                    for r in dead:  # crashed without reporting (segfault, os._exit)
                        done.add(r)
                        errors[r] = f"process exited with code {procs[r].exitcode} without a report"
                    if errors:
                        break
                    continue
                done.add(rank)
                if err is not None:
                    errors[rank] = err
                    # Other ranks are likely stuck in a collective or about to fail because of
                    # this one: give them a moment to report, then stop.
                    deadline = min(deadline, time.monotonic() + 3.0)
        finally:
            for p in procs:
                p.join(timeout=0.5 if errors or len(done) < world_size else 10)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        report = "\n".join(f"----- rank {r} -----\n{errors[r]}" for r in sorted(errors))
        raise AssertionError(f"ranks {sorted(errors)} of {world_size} failed:\n{report}")
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - done)
        raise AssertionError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s (hang?)")

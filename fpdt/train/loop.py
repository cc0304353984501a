"""The training loop: one optimizer step at a time, on a DeepSpeed engine.

It back-propagates ``sp * loss``: each SP rank's backward carries only its share of the global
mean loss's gradient and DeepSpeed averages over all ``dp * sp`` ranks, so the result is the mean
over DP groups of each sequence's mean-loss gradient (``docs/model.md``, Gradient convention).
Memory per step (:class:`fpdt.memory.accountant.RegionMemory`, max over ranks): CUDA allocator
peaks, the CPU working set (``mem_accounting=False`` skips it) and the host-stash peak
(``docs/train.md``, Progress and MFU).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from fpdt.model.moe import expert_load

from fpdt.offload import resolve_runtime
from fpdt.offload.nvme import NVMeStore, NVMeTier
from fpdt.memory.accountant import MemoryPeaks, RegionMemory
from fpdt.train.config import RunLayout
from fpdt.train.data import PackedWindows, Windows, sequence_ids
from fpdt.train.metrics import ModelShape, step_rates
from fpdt.train.parallel import ParallelState
from fpdt.train.progress import Progress, StepRecord, host_rss_gib


@dataclass(frozen=True)
class LoopSpec:
    """What the loop needs besides the engine and the data."""

    plan: RunLayout
    """Validated parallel sizes and chunking."""
    parallel: ParallelState
    """This rank's place."""
    micro_batch: int
    """Sequences per micro step per DP group (DeepSpeed's ``train_micro_batch_size_per_gpu``)."""
    grad_accum: int
    """Micro steps per optimizer step (DeepSpeed's ``gradient_accumulation_steps``)."""
    shape: ModelShape
    """Model sizes for the FLOPs count."""
    peak_flops: float | None
    """Peak FLOP/s per device, or None (no MFU)."""
    recompute: bool
    """Activation checkpointing is on (counted in HFU only)."""
    skip_nonfinite: int = 0
    """Steps with a non-finite loss that may be skipped (``--skip-nonfinite``); 0: stop at the first."""
    mem_accounting: bool = True
    """Count the step's device working set on the CPU (see the module docstring); no effect on CUDA."""
    lora: Any = None
    """A LoRA run's :class:`fpdt.model.LoraSpec` (its FLOPs are counted as such, :mod:`fpdt.train.metrics`)."""
    runtime: Any = None
    """The model's device runtime option (:attr:`fpdt.options.FPDTOptions.runtime`), whose
    ``synchronize`` brackets each step's wall time; None: automatic."""
    nvme_path: str | None = None
    """The model's NVMe directory (:attr:`fpdt.options.FPDTOptions.nvme_path`): its store's I/O faults
    are deferred and checked on every rank once per step, before the optimizer step
    (:func:`check_nvme_faults`)."""
    nvme_tier: NVMeTier | None = None
    """The tier holding that store (:attr:`fpdt.options.FPDTOptions.nvme_tier`, the model's)."""


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm is not finite (raised on every rank alike)."""


class CommFailure(RuntimeError):
    """A collective failed or timed out: another rank died or stalls."""


class NVMeFault(RuntimeError):
    """The NVMe tier failed on some rank in this step (the same message on every rank); the
    step's update was not applied."""


def _micro_step(engine, windows: Windows | PackedWindows, spec: LoopSpec, step: int, micro: int,
                store: NVMeStore | None) -> torch.Tensor:
    ps = spec.parallel
    ks = sequence_ids(step, micro, spec.grad_accum, ps.dp_rank, ps.dp, spec.micro_batch)
    batch = windows.shard(ks, ps.sp, spec.plan.num_chunks, ps.sp_rank, mesh=ps.mesh)
    batch = {k: v.to(ps.device, non_blocking=True) for k, v in batch.items()}  # [B, S_local] each
    docs = {"doc_ids": batch["doc_ids"]} if "doc_ids" in batch else {}       # packed: [B, S], global order
    loss = engine(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], **docs)
    if spec.skip_nonfinite and not _finite_on_all_ranks(loss, ps.device):
        # Drop the whole step (grad_accum is 1, checked up front): no backward, no update,
        # on every rank alike. DeepSpeed applies non-finite bf16/fp32 updates otherwise.
        if store is not None:
            check_nvme_faults(step, ps.device, store)   # the forward's writes
        return loss.detach().float()
    engine.backward(loss * ps.sp)  # see module docstring
    if store is not None and micro == spec.grad_accum - 1:
        check_nvme_faults(step, ps.device, store)
    engine.step()                  # optimizer update only at the accumulation boundary
    return loss.detach().float()


def check_nvme_faults(step: int, device: torch.device, store: NVMeStore) -> None:
    """Raise :class:`NVMeFault` on every rank, naming the ranks whose NVMe tier failed in step
    ``step`` (0-based) and the first one's error, after closing ``store`` (its files removed);
    nothing when none failed. One all-reduce of ``world_size`` ints (a host sync)."""
    fault = store.take_fault()
    rank, world = dist.get_rank(), dist.get_world_size()
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    flags[rank] = fault is not None
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    messages = [None] * world
    dist.all_gather_object(messages, None if fault is None else str(fault))   # the error path only
    store.close(raise_errors=False)
    ranks = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
    raise NVMeFault(f"step {step + 1}: the NVMe tier failed on {ranks} (rank {failed[0]}: {messages[failed[0]]}); "
                    f"the step's update was not applied")


def _finite_on_all_ranks(loss: torch.Tensor, device: torch.device) -> bool:
    """Whether ``loss`` is finite on every rank (one scalar all-reduce; host sync)."""
    bad = (~torch.isfinite(loss.detach().float())).float().reshape(1).to(device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


def _reduce_stats(loss_sum: torch.Tensor, peaks: MemoryPeaks, spec: LoopSpec) -> tuple[float, dict]:
    """-> (loss averaged over DP groups and micro steps, memory figures in GiB max over ranks:
    ``host_rss_gib``, ``peak_mem_gib``, ``peak_reserved_gib``, ``host_stash_gib``; None where
    a rank did not measure it)."""
    ps = spec.parallel
    mean = (loss_sum / spec.grad_accum).reshape(1).to(ps.device)
    dist.all_reduce(mean)                       # SP ranks hold equal values: world mean = DP mean
    mem = {"host_rss_gib": host_rss_gib(), **peaks.gib()}
    # float64: byte counts stay exact (float32 would round them)
    maxed = torch.tensor([-1.0 if v is None else v for v in mem.values()], dtype=torch.float64, device=ps.device)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    out = {k: (None if v < 0 else v) for k, v in zip(mem, maxed.tolist())}
    return mean.item() / ps.world_size, out


def step_attended_length(windows: Windows | PackedWindows, spec: LoopSpec, step: int) -> float:
    """The mean attended length (``attended_length``) over every sequence optimizer step ``step``
    trains, on all DP groups and micro steps: each holds ``S`` tokens, so the mean puts the step's
    attention FLOPs into :func:`step_rates`. Computed alike on every rank, without communication."""
    ps = spec.parallel
    ks = [k for micro in range(spec.grad_accum) for dp_rank in range(ps.dp)
          for k in sequence_ids(step, micro, spec.grad_accum, dp_rank, ps.dp, spec.micro_batch)]
    return sum(windows.attended_length(k) for k in ks) / len(ks)


def train_step(engine, windows: Windows | PackedWindows, spec: LoopSpec, step: int,
               store: NVMeStore | None = None) -> StepRecord:
    """Run optimizer step ``step`` (0-based) and describe it; ``store``: the NVMe tier's, whose
    deferred faults are checked before the update."""
    ps = spec.parallel
    lr = float(engine.get_lr()[0]) if engine.get_lr() else float("nan")
    runtime = resolve_runtime(spec.runtime, ps.device)
    runtime.synchronize(ps.device)          # host-device sync: the step's wall time starts here
    t0 = time.perf_counter()
    with RegionMemory(ps.device, count=spec.mem_accounting) as region:
        loss_sum = torch.zeros((), dtype=torch.float32, device=ps.device)
        routed: dict = {}                   # MoE: tokens per expert per layer, summed over micro steps
        for micro in range(spec.grad_accum):
            loss_sum += _micro_step(engine, windows, spec, step, micro, store)
            _add_routed(routed, engine)
    runtime.synchronize(ps.device)          # host-device sync: the step's wall time ends here
    seconds = time.perf_counter() - t0
    loss, mem = _reduce_stats(loss_sum, region.peaks, spec)
    tokens = spec.plan.seq_len * spec.micro_batch * spec.grad_accum * ps.dp
    rates = step_rates(spec.shape, step_attended_length(windows, spec, step), tokens, seconds, ps.world_size,
                       spec.peak_flops, spec.recompute, lora=spec.lora)
    norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    return StepRecord(step=step + 1, loss=loss, lr=lr, tokens=tokens, step_time_s=seconds,
                      tokens_per_s=rates.tokens_per_s, tgs=rates.tgs, mfu=rates.mfu, mfu_full=rates.mfu_full,
                      hfu=rates.hfu, grad_norm=None if norm is None else float(norm), **mem,
                      expert_load={str(k): v for k, v in expert_load(routed).items()} if routed else None)


def _add_routed(routed: dict, engine) -> None:
    """Add the last forward's routed-token counts (over the SP group) of an MoE model into ``routed``."""
    stats = getattr(getattr(engine, "module", engine), "router_stats", None)
    if stats is not None and stats.layers:
        for layer, c in stats.layer_counts().items():
            routed[layer] = routed[layer] + c if layer in routed else c.clone()


class DeviceOutOfMemory(RuntimeError):
    """Step ``step`` (1-based) ran out of device memory; ``detail``: the allocator's line."""

    def __init__(self, step: int, detail: str) -> None:
        super().__init__(f"step {step}: out of device memory ({detail})")
        self.step, self.detail = step, detail


def run_steps(engine, windows: Windows | PackedWindows, spec: LoopSpec, start: int, stop: int, progress: Progress,
              on_step_end: Callable[[int], None] | None = None) -> list[StepRecord]:
    """Optimizer steps ``start .. stop-1``; ``on_step_end(steps_done)`` after each (saving).

    Raises :class:`NonFiniteStep` at a step whose loss or gradient norm is not finite
    (after ``spec.skip_nonfinite`` skipped ones), :class:`CommFailure` when a
    collective fails (another rank died, or stalled past the process-group timeout),
    :class:`DeviceOutOfMemory` when a step runs out of device memory, and, with ``spec.nvme``,
    :class:`NVMeFault` when a rank's drive failed in a step (before its update and save).
    """
    # the store the model's tier uses (the process's one for this path and rank), opened here if need be
    store = spec.nvme_tier.store(spec.nvme_path, dist.get_rank()) if spec.nvme_path is not None else None
    with store.deferred_faults() if store is not None else contextlib.nullcontext():
        return _run_steps(engine, windows, spec, start, stop, progress, on_step_end, store)


def _run_steps(engine, windows: Windows | PackedWindows, spec: LoopSpec, start: int, stop: int, progress: Progress,
               on_step_end: Callable[[int], None] | None, store: NVMeStore | None) -> list[StepRecord]:
    records = []
    skipped = 0
    for step in range(start, stop):
        try:
            rec = train_step(engine, windows, spec, step, store)
            progress.update(rec)
            records.append(rec)
            skipped = _check_finite(rec, spec, skipped, progress)
            if on_step_end is not None:
                on_step_end(step + 1)
        except torch.cuda.OutOfMemoryError as e:   # torch.OutOfMemoryError from torch 2.5 on, the same class
            raise DeviceOutOfMemory(step + 1, _first_line(e)) from e
        except RuntimeError as e:
            if isinstance(e, (NonFiniteStep, CommFailure, NVMeFault)) or not is_comm_failure(e):
                raise
            raise CommFailure(f"step {step + 1}: a collective failed, so another rank died or stalled past the "
                              f"process-group timeout (--dist-timeout-min); see that rank's output for its error, "
                              f"then resume from the last checkpoint ({type(e).__name__}: "
                              f"{_first_line(e)})") from e
    return records


def _check_finite(rec: StepRecord, spec: LoopSpec, skipped: int, progress: Progress) -> int:
    """-> skipped steps so far; raises :class:`NonFiniteStep` when the run must stop."""
    norm_bad = rec.grad_norm is not None and not math.isfinite(rec.grad_norm)
    if math.isfinite(rec.loss) and not norm_bad:
        return skipped
    if spec.skip_nonfinite and not math.isfinite(rec.loss):  # dropped before its backward
        skipped += 1
        if skipped <= spec.skip_nonfinite:
            progress.write(f"step {rec.step}: loss is {rec.loss}, step skipped "
                           f"({skipped} of --skip-nonfinite {spec.skip_nonfinite})")
            return skipped
        raise NonFiniteStep(f"step {rec.step}: loss is {rec.loss}, and {spec.skip_nonfinite} non-finite steps "
                            f"were already skipped (--skip-nonfinite {spec.skip_nonfinite})")
    what = f"loss is {rec.loss}" if not math.isfinite(rec.loss) else f"gradient norm is {rec.grad_norm}"
    applied = " and its update was applied" if spec.skip_nonfinite else ""
    raise NonFiniteStep(f"step {rec.step}: {what} (not finite){applied}")


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` comes from a failed or timed-out collective (gloo or NCCL)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return any(k in text for k in ("gloo", "nccl", "connection closed", "connection reset", "timed out",
                                   "broken pipe", "socket timeout"))


def _first_line(e: BaseException) -> str:
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return lines[0][:300] if lines else ""

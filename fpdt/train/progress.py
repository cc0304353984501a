"""Per-step feedback: a tqdm bar on rank 0 and a JSON-lines log.

Every optimizer step produces one :class:`StepRecord`; rank 0 shows it in the bar and, with
``--log-json FILE``, appends it as one JSON object per line (``null`` where a figure is not
available). Memory fields (GiB, max over ranks): ``peak_mem_gib`` (CUDA ``max_memory_allocated``;
CPU the accountant's working set, ``null`` with ``--no-mem-accounting``), ``peak_reserved_gib``
(CUDA only), ``host_stash_gib`` (0 without offload), ``host_rss_gib`` (at the step's end); what
each measures: ``docs/train.md`` (Progress and MFU).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import IO

import psutil


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did."""

    step: int
    """Optimizer steps completed, counting from 1 (a resumed run continues the count)."""
    loss: float
    """Mean training loss of the step: the global token mean per sequence, averaged over
    data-parallel groups and micro steps."""
    lr: float
    """Learning rate used by the step (first parameter group)."""
    tokens: int
    """Tokens trained in this step (all ranks together)."""
    step_time_s: float
    """Wall time of the step, forward through optimizer update."""
    tokens_per_s: float
    """``tokens / step_time_s``."""
    tgs: float
    """Tokens per device per second."""
    mfu: float | None
    """Model FLOPs utilisation (causal-halved attention, recompute not counted)."""
    mfu_full: float | None
    """MFU with full-attention FLOPs (the count other papers use)."""
    hfu: float | None
    """Hardware FLOPs utilisation (recompute counted)."""
    peak_mem_gib: float | None
    """Peak device memory of the step, max over ranks: CUDA allocated; CPU the counted
    working set (see the module docstring); ``None`` on the CPU with ``--no-mem-accounting``."""
    host_rss_gib: float
    """Resident host memory, max over ranks."""
    grad_norm: float | None = None
    """Global gradient norm before clipping, when DeepSpeed reports it."""
    peak_reserved_gib: float | None = None
    """Peak device memory reserved by the caching allocator in the step, max over ranks
    (CUDA; ``None`` on the CPU)."""
    host_stash_gib: float | None = None
    """Most host-stash bytes in use during the step, max over ranks (0 without offload)."""
    expert_load: dict | None = None
    """MoE models: per layer, ``max`` and ``mean`` tokens per expert and ``imbalance`` (max / mean),
    over the step's micro steps and the SP group (routing collapse shows as a rising imbalance)."""


def host_rss_gib() -> float:
    """Resident set size of this process, GiB."""
    return psutil.Process(os.getpid()).memory_info().rss / 2 ** 30


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{suffix}"


def _size(gib: float | None) -> str:
    """``"1.23G"`` from 1 GiB up, ``"24.7M"`` below (three significant digits), ``"n/a"`` for None."""
    if gib is None:
        return "n/a"
    return f"{gib:.3g}G" if gib >= 1 else f"{gib * 1024:.3g}M"


def _count(n: float) -> str:
    """``"950"``, ``"12.3k"``, ``"1.23M"``."""
    return f"{n:.0f}" if n < 1e3 else f"{n / 1e3:.3g}k" if n < 1e6 else f"{n / 1e6:.3g}M"


BAR_FORMAT = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
"""The bar without tqdm's rate (the step time is in the log): with :func:`postfix` it leaves the
bar itself at least 10 columns of a 100-column terminal."""


def postfix(rec: StepRecord) -> str:
    """One-line summary for the progress bar: loss, tokens/s, MFU, peak device memory (and reserved
    on CUDA) and the host stash when offloading; the rest is in the ``--log-json`` record.
    """
    parts = [
        f"loss={rec.loss:.4f}",
        f"tok/s={_count(rec.tokens_per_s)}",
        f"MFU={_fmt(rec.mfu, '.1f', 100, '%')}",
        f"mem={_size(rec.peak_mem_gib)}" + (f"/{_size(rec.peak_reserved_gib)}" if rec.peak_reserved_gib is not None
                                            else ""),
    ]
    if rec.host_stash_gib:
        parts.append(f"stash={_size(rec.host_stash_gib)}")
    return " ".join(parts)


class Progress:
    """Rank-0 progress bar plus optional JSON-lines log; silent on other ranks."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool, log_json: str | None,
                 resumed: bool = False) -> None:
        """``resumed``: the run continues from ``start_step``, so ``log_json``'s records of later
        steps (a run that went on past its last checkpoint) are dropped, with one line: the log
        keeps one record per step."""
        self.enabled = enabled
        self._bar = None
        self._log: IO[str] | None = None
        if not enabled:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         bar_format=BAR_FORMAT)
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            dropped = truncate_log(log_json, start_step) if resumed else 0
            self._log = open(log_json, "a", buffering=1)
            if dropped:
                self.write(f"fpdt-train: --log-json {log_json}: dropped {dropped} record(s) after step {start_step}, "
                           f"the resumed step; this run writes them again")

    def update(self, rec: StepRecord) -> None:
        if not self.enabled:
            return
        assert self._bar is not None
        self._bar.set_postfix_str(postfix(rec), refresh=False)
        self._bar.update(1)
        if self._log is not None:
            self._log.write(json.dumps(dataclasses.asdict(rec)) + "\n")

    def write(self, message: str) -> None:
        """Print a line above the bar (rank 0 only)."""
        if self.enabled and self._bar is not None:
            self._bar.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._log is not None:
            self._log.close()


def truncate_log(path: str, step: int) -> int:
    """Keep the records of ``path`` up to ``step`` (and any line that is not a record); returns
    how many were dropped (0, and the file untouched, when there is none to drop or no file)."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if _step_of(line) is None or _step_of(line) <= step]
    if len(kept) < len(lines):
        with open(path, "w") as f:
            f.writelines(kept)
    return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


@dataclass(frozen=True)
class Predicted:
    """What fpdt-plan's model predicted for the run, shown beside the measured figures at its end."""

    device_peak_gib: float | None = None
    """Device peak per GPU (CUDA; the CPU's counted working set is not what the model describes)."""
    host_offload_gib: float | None = None
    """Host bytes the offload holds per node (the host stash and checkpoints)."""
    step_time_s: float | None = None
    """Seconds per optimizer step on this GPU (CUDA with a GPU the planner knows)."""


def summary(records: list[StepRecord], start: int, wall_s: float, saved: str | None, exported: str | None,
            predicted: Predicted | None = None) -> str:
    """The run's last line: steps, tokens, wall time, first and last loss, peak device memory, the
    host's peak (stash, process RSS), the median step time, what was written where; with
    ``predicted``, fpdt-plan's figures beside the measured ones."""
    if not records:
        return f"fpdt-train: done: no steps to take (the checkpoint is at step {start}) in {wall_s:.0f} s"
    p = predicted or Predicted()
    tokens = sum(r.tokens for r in records)
    peaks = [r.peak_mem_gib for r in records if r.peak_mem_gib is not None]
    stash = max((r.host_stash_gib or 0.0) for r in records)
    rss = max(r.host_rss_gib for r in records)
    step = sorted(r.step_time_s for r in records)[len(records) // 2]
    parts = [f"fpdt-train: done: steps {start + 1}-{records[-1].step}, {tokens:,} tokens in {wall_s:.0f} s",
             f"loss {records[0].loss:.4f} -> {records[-1].loss:.4f}",
             f"peak device memory {f'{max(peaks):.3g} GiB' if peaks else 'n/a'}" + _beside(p.device_peak_gib, " GiB")
             + (f", host stash {stash:.3g} GiB" + _beside(p.host_offload_gib, " GiB") if stash or p.host_offload_gib
                else ""),
             f"host process {rss:.3g} GiB (RSS)",
             f"step {step:.3g} s (median)" + _beside(p.step_time_s, " s")]
    if saved:
        parts.append(f"saved {saved}")
    if exported:
        parts.append(f"exported {exported}")
    return "; ".join(parts)


def _beside(value: float | None, unit: str) -> str:
    return "" if value is None else f" (fpdt-plan: {value:.3g}{unit})"


def read_log(path: str) -> list[dict]:
    """The records of a ``--log-json`` file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

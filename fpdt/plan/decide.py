"""What ``fpdt-train`` decides from the planner's model before it builds the model, in one call
(:func:`decide_run`): whether to stream the layers, how many layers go to the NVMe tier, which
layers save their attention output, and the host-memory check that refuses a run the node
cannot hold (``docs/train.md``, "Memory before the run"). Every rank reaches the same answer:
the choices are agreed with one collective each (:class:`Ranks`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from fpdt.model import ModelConfig
from fpdt.model.layer_checkpoints import NVMeBytes
from fpdt.plan import trainer_run
from fpdt.plan.memory_model import nvme_step_bytes, saved_attention_bytes
from fpdt.train.config import RunLayout, TrainerOptions, validate


@dataclass(frozen=True)
class Node:
    """What a run sees of its node (``fpdt-train`` measures it; a test gives it)."""

    device_type: str
    capacity_bytes: float | None    # one GPU's memory; None off CUDA
    ranks: int                      # the run's processes on this node
    available_bytes: float          # host memory available


class Ranks:
    """The agreement of every rank on a choice: one collective each (nothing on one process)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @staticmethod
    def _many() -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def reduce(self, value: int, op) -> int:
        """``value`` reduced by ``op`` (``dist.ReduceOp.MIN`` / ``MAX``) over the ranks."""
        if not self._many():
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def worst_node(self, need: float, available: float, ranks: int) -> tuple[int, float, float, int]:
        """``(rank, need, available, ranks on its node)`` of the rank whose node's offload exceeds
        its available memory the most (one all-gather)."""
        if not self._many():
            return 0, need, available, ranks
        mine = torch.tensor([need, available, float(ranks)], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        figures = [tuple(float(x) for x in row.tolist()) for row in rows]
        worst = max(range(len(figures)), key=lambda r: figures[r][0] - figures[r][1])
        n, a, k = figures[worst]
        return worst, n, a, int(k)

    @staticmethod
    def rank() -> int:
        return dist.get_rank() if dist.is_initialized() else 0


@dataclass(frozen=True)
class MemoryCheck:
    """The planner's view of the run and the choices made from it."""

    estimate: Any                   # MemoryEstimate; None when the model cannot describe the run
    capacity_bytes: float | None
    recommend: Callable[[], Any] | None   # on CUDA: the planner's Recommendation, searched on first call
    lines: tuple[str, ...]          # start-up lines: the streaming choice, the prediction, a warning or a note
    attention: trainer_run.AttentionCheckpoint | None = None
    nvme: trainer_run.NVMeLayers | None = None

    def words(self, num_layers: int, device_layers: int) -> str:
        """The start-up line's words for the choices, and why."""
        words = [self.attention.line(num_layers)] if self.attention is not None else []
        if self.nvme is not None:
            words.append(self.nvme.line(num_layers - device_layers))
        return "".join(f" {w}" for w in words)


@dataclass(frozen=True)
class Decision:
    """The run as decided: its options and layout with every choice made, and the check."""

    opts: TrainerOptions
    plan: RunLayout
    memory: MemoryCheck


@dataclass(frozen=True)
class _Run:
    """The arguments every step of :func:`decide_run` shares."""

    model: ModelConfig
    ds_config: Mapping[str, Any]
    dtype_name: str
    node: Node
    expands_gqa: bool | None
    lora_rank: int
    ranks: Ranks

    def estimate(self, plan: RunLayout, opts: TrainerOptions):
        return trainer_run.estimate(self.model, plan, opts, self.ds_config, self.dtype_name, self.node.device_type,
                                    self.node.ranks, self.expands_gqa, self.lora_rank)


def decide_run(model: ModelConfig, plan: RunLayout, opts: TrainerOptions, ds_config: Mapping[str, Any],
               dtype_name: str, node: Node, kernel_expands_gqa: bool | None = None, lora_rank: int = 0,
               ranks: Ranks | None = None) -> Decision:
    """``stream_layers``, ``nvme_layers`` and the attention checkpoint as given, else chosen from
    the predicted memory (:mod:`fpdt.plan.trainer_run`), and the host check on the node that
    exceeds its memory the most (a :class:`~fpdt.train.config.ConfigError` on every rank).
    A run the planner's model cannot describe goes on as given, with a note."""
    run = _Run(model, ds_config, dtype_name, node, kernel_expands_gqa, lora_rank, ranks or Ranks())
    opts, plan, streaming = _streaming(run, plan, opts)
    memory = _memory_check(run, plan, opts)
    memory = replace(memory, lines=(*streaming, *memory.lines))
    if memory.attention is not None:
        opts = replace(opts, attention_checkpoint=memory.attention.mode,
                       save_attention_layers=memory.attention.layers if memory.attention.mode == "save" else None)
    if memory.nvme is not None:
        opts = replace(opts, nvme_layers=memory.nvme.layers)
    return Decision(opts, plan, memory)


def nvme_need(model: ModelConfig, plan: RunLayout, opts: TrainerOptions, ds_config: Mapping[str, Any],
              dtype_name: str) -> NVMeBytes:
    """What the run's NVMe tier writes per micro-batch and rank (the planner's count of its setup)."""
    setup = trainer_run.planned_setup(plan, opts, ds_config, dtype_name, "cpu", True, model.head_dim)
    return nvme_step_bytes(model, setup)


def _streaming(run: _Run, plan: RunLayout, opts: TrainerOptions) -> tuple[TrainerOptions, RunLayout, tuple[str, ...]]:
    """The run with ``stream_layers`` as given, or on CUDA chosen by the predicted device peak."""
    if opts.stream_layers is not None or run.node.capacity_bytes is None:
        return opts, plan, ()
    streamed_opts = replace(opts, stream_layers=True)
    try:
        unstreamed = run.estimate(plan, opts)
        streamed_plan = validate(streamed_opts, plan.seq_len, plan.world_size, run.node.device_type, run.ds_config)
    except Exception:  # noqa: BLE001 -- a run the planner's model cannot describe, or not streamable: as given
        return opts, plan, ()
    chosen, why = trainer_run.stream_layers(None, unstreamed, lambda: run.estimate(streamed_plan, streamed_opts),
                                            run.node.capacity_bytes)
    return (streamed_opts, streamed_plan, (f"fpdt-train: {why}",)) if chosen else (opts, plan, ())


def _memory_check(run: _Run, plan: RunLayout, opts: TrainerOptions) -> MemoryCheck:
    """The choices of ``nvme_layers`` and the attention checkpoint, then the host check."""
    node, est, notes = run.node, None, []
    try:
        est = run.estimate(plan, opts)
    except Exception as e:  # noqa: BLE001 -- a limit of the planner's model never stops a run the trainer can run
        notes.append(f"note: fpdt-plan's model cannot describe this run ({type(e).__name__}: {e}); no memory "
                     f"prediction or host check")
    nvme, est = _nvme_layers(run, plan, opts, est)
    if nvme is not None:
        opts = replace(opts, nvme_layers=nvme.layers)
    attention, est = _attention_checkpoint(run, plan, opts, est)
    parts = trainer_run.host_offload_bytes(est) if est is not None else {}
    worst, need, available, ranks = run.ranks.worst_node(sum(parts.values()), node.available_bytes, node.ranks)
    error = trainer_run.host_memory_error(need, available, ranks, plan.seq_len,
                                          parts if worst == run.ranks.rank() else None,
                                          "this node" if plan.world_size == 1 else f"rank {worst}'s node")
    if error is not None:
        raise error
    if est is None:
        return MemoryCheck(None, node.capacity_bytes, None, tuple(notes), attention, nvme)
    recommend = None
    if node.capacity_bytes is not None:
        recommend = functools.cache(functools.partial(_recommend, run.model, plan, opts, run.ds_config, node.ranks,
                                                      node.capacity_bytes, node.available_bytes, run.lora_rank))
    lines = (trainer_run.prediction_line(est, node.capacity_bytes),
             trainer_run.device_memory_warning(est, node.capacity_bytes, recommend) if node.capacity_bytes else None)
    return MemoryCheck(est, node.capacity_bytes, recommend, tuple(line for line in lines if line), attention, nvme)


def _nvme_layers(run: _Run, plan: RunLayout, opts: TrainerOptions, est) -> tuple[trainer_run.NVMeLayers | None, Any]:
    """``nvme_layers`` (None without ``nvme_path``) and the estimate with it: as given, else the
    fewest that bring every node's predicted host offload within its available memory."""
    if opts.nvme_path is None:
        return None, est
    given = opts.nvme_layers
    if est is None:
        why = (f"--nvme-layers {given}" if given is not None else
               "fpdt-plan's model cannot describe this run, so every offloaded layer goes to disk")
        return trainer_run.NVMeLayers(given, why), est
    estimate_with = functools.cache(lambda k: run.estimate(plan, replace(opts, nvme_layers=k)))
    choice = trainer_run.nvme_layers(given, run.model.num_layers - opts.checkpoint_device_layers,
                                     lambda k: sum(trainer_run.host_offload_bytes(estimate_with(k)).values()),
                                     run.node.available_bytes)
    if given is not None:
        return choice, est
    k = run.ranks.reduce(choice.layers, dist.ReduceOp.MAX)
    if k != choice.layers:
        choice = trainer_run.NVMeLayers(k, f"the fewest first layers on disk that bring every node's predicted host "
                                           f"offload within its available memory ({choice.layers} would do on this one)")
    return choice, estimate_with(k)


def _attention_checkpoint(run: _Run, plan: RunLayout, opts: TrainerOptions,
                          est) -> tuple[trainer_run.AttentionCheckpoint, Any]:
    """The attention checkpoint and the estimate with it: as given, else ``"save"`` for as many
    layers as every node's host and GPU hold beside the recompute estimate ``est``."""
    cfg, node = run.model, run.node
    choose = (plan.checkpoint != "off" and opts.attention_checkpoint != "recompute"
              and opts.save_attention_layers is None)
    fit, per_layer = 0, None
    if choose and est is not None:
        setup = trainer_run.planned_setup(plan, opts, run.ds_config, run.dtype_name, node.device_type,
                                          run.expands_gqa, cfg.head_dim)
        per_layer = saved_attention_bytes(cfg, setup)
        fit = trainer_run.saving_layers_that_fit(cfg, setup, est, node.available_bytes, node.capacity_bytes,
                                                 node.ranks)
    if choose:
        fit = run.ranks.reduce(fit, dist.ReduceOp.MIN)
    if choose and est is None:
        mode = "save" if opts.attention_checkpoint == "save" else "recompute"
        why = "fpdt-plan's model cannot describe this run, so nothing predicts room for saved outputs"
        return trainer_run.AttentionCheckpoint(mode, None, f"{opts.attention_checkpoint or 'default'}: {why}"), est
    attention = trainer_run.attention_checkpoint(opts.attention_checkpoint, opts.save_attention_layers,
                                                 plan.checkpoint, fit, cfg.num_layers, per_layer)
    if choose and attention.mode == "save":
        est = run.estimate(plan, replace(opts, attention_checkpoint="save", save_attention_layers=attention.layers))
    return attention, est


def _recommend(*args) -> trainer_run.Recommendation:
    """:func:`fpdt.plan.trainer_run.recommend`, or why there is no suggestion."""
    try:
        return trainer_run.recommend(*args)
    except Exception as e:  # noqa: BLE001 -- advice only
        return trainer_run.Recommendation(None, f"fpdt-plan cannot suggest settings ({type(e).__name__}: {e})")

"""``fpdt.plan.decide.decide_run``, the one call in which ``fpdt-train`` decides from the
planner's model: streamed layers, the NVMe tier's layers, the saved attention outputs, and the
host check, each agreed by every rank (here with a stand-in for the other ranks)."""

from dataclasses import replace

import pytest
import torch.distributed as dist

from fpdt.plan import load_model_config
from fpdt.plan import trainer_run as mp
from fpdt.plan.decide import Node, Ranks, decide_run
from fpdt.train.config import ConfigError, TrainerOptions, load_ds_config, validate

GIB = 2 ** 30
CFG = load_model_config("llama-3-8b")
S = 2 ** 21
DS = load_ds_config(None, "cuda")[0]


def _run(**options):
    opts = TrainerOptions(sp=8, **options)
    return opts, validate(opts, S, 8, "cuda", DS)


def _peak(opts, plan):
    return mp.estimate(CFG, plan, opts, DS, "bf16", "cuda", 8).device_peak_bytes


def test_streams_only_when_the_device_needs_it():
    opts, plan = _run(attention_checkpoint="recompute")
    streamed_opts = replace(opts, stream_layers=True)
    unstreamed, streamed = _peak(opts, plan), _peak(streamed_opts, validate(streamed_opts, S, 8, "cuda", DS))
    assert streamed < unstreamed
    between = Node("cuda", (streamed + unstreamed) / 2, 8, 4096 * GIB)
    d = decide_run(CFG, plan, opts, DS, "bf16", between)
    assert d.opts.stream_layers is True and (d.plan.offload, d.plan.checkpoint) == (True, "offload")
    assert d.memory.lines[0].startswith("fpdt-train: stream_layers on: the predicted device peak is ")
    roomy = decide_run(CFG, plan, opts, DS, "bf16", replace(between, capacity_bytes=unstreamed + GIB))
    assert roomy.opts.stream_layers is None and roomy.plan == plan
    refused = decide_run(CFG, plan, replace(opts, stream_layers=False), DS, "bf16", between)   # given: kept
    assert refused.opts.stream_layers is False and any(line.startswith("warning: fpdt-plan's model predicts a "
                                                                       "device peak") for line in refused.memory.lines)
    cpu = decide_run(CFG, plan, opts, DS, "bf16", replace(between, device_type="cpu", capacity_bytes=None))
    assert cpu.opts.stream_layers is None            # no device capacity known: nothing to decide by


def test_the_choices_reach_the_options_the_model_gets():
    opts, plan = _run(nvme_path="/mnt/nvme")
    d = decide_run(CFG, plan, opts, DS, "bf16", Node("cuda", 80 * GIB, 8, 1024 * GIB))
    assert d.opts.nvme_layers == d.memory.nvme.layers is not None
    assert (d.opts.attention_checkpoint, d.opts.save_attention_layers) == (d.memory.attention.mode,
                                                                           d.memory.attention.layers)
    model = d.opts.model_options(d.plan)
    assert (model.nvme_layers, model.attention_checkpoint) == (d.opts.nvme_layers, d.opts.attention_checkpoint)


def test_a_node_that_cannot_hold_the_offload_is_refused():
    opts, plan = _run(attention_checkpoint="recompute")
    with pytest.raises(ConfigError, match=r"the 8 rank\(s\) on rank 0's node would offload .* GiB to host memory"):
        decide_run(CFG, plan, opts, DS, "bf16", Node("cuda", 80 * GIB, 8, 64 * GIB))


class OtherRanks(Ranks):
    """Another rank's answers: its fit, its choice of layers, its node the shortest."""

    def __init__(self, smallest=None, largest=None, worst=None):
        super().__init__()
        self.smallest, self.largest, self.worst = smallest, largest, worst

    def reduce(self, value, op):
        other = self.smallest if op == dist.ReduceOp.MIN else self.largest
        return value if other is None else (min if op == dist.ReduceOp.MIN else max)(value, other)

    def worst_node(self, need, available, ranks):
        return (3, need, self.worst, ranks) if self.worst is not None else (0, need, available, ranks)


def test_every_rank_takes_the_agreed_choice():
    node = Node("cuda", 80 * GIB, 8, 1024 * GIB)
    opts, plan = _run()
    mine = decide_run(CFG, plan, opts, DS, "bf16", node).memory.attention.layers
    assert 1 < mine < CFG.num_layers
    agreed = decide_run(CFG, plan, opts, DS, "bf16", node, ranks=OtherRanks(smallest=1))
    assert agreed.opts.save_attention_layers == 1 and agreed.memory.attention.layers == 1
    tier, tier_plan = _run(nvme_path="/mnt/nvme", attention_checkpoint="recompute")
    own = decide_run(CFG, tier_plan, tier, DS, "bf16", Node("cuda", 80 * GIB, 8, 512 * GIB)).opts.nvme_layers
    more = decide_run(CFG, tier_plan, tier, DS, "bf16", Node("cuda", 80 * GIB, 8, 512 * GIB),
                      ranks=OtherRanks(largest=own + 2))
    assert more.opts.nvme_layers == own + 2 and f"({own} would do on this one)" in more.memory.nvme.reason
    with pytest.raises(ConfigError, match=r"on rank 3's node would offload .* but it has 1\.0 GiB available"):
        decide_run(CFG, plan, replace(opts, attention_checkpoint="recompute"), DS, "bf16", node,
                   ranks=OtherRanks(worst=1.0 * GIB))

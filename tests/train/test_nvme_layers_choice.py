"""fpdt-train --nvme-path without --nvme-layers: the memory check puts the fewest first layers on
disk that bring its predicted host offload within the node's available memory, and says why; a
given --nvme-layers is taken as is, and accounted (docs/nvme.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fpdt.plan import load_model_config
from fpdt.plan import trainer_run as mp
from fpdt.train.config import ConfigError, TrainerOptions, load_ds_config, validate
from fpdt.plan.decide import MemoryCheck, decide_run
from tests.train.helpers import node

GIB = 2 ** 30
CFG = load_model_config("llama-3-8b")
S = 2 ** 21


def test_the_choice_and_its_reason():
    need = {k: (10 - k) * GIB for k in range(9)}.__getitem__       # 1 GiB per layer on disk, 8 offloaded
    assert mp.nvme_layers(None, 8, need, 6.5 * GIB) == mp.NVMeLayers(4, (
        "the fewest first layers on disk that bring the predicted host offload within the 6.50 GiB available: "
        "6.00 GiB with 4, 7.00 GiB with 3"))
    assert mp.nvme_layers(None, 8, need, 6 * GIB).layers == 4                 # exactly at the limit fits
    assert mp.nvme_layers(None, 8, need, 9 * GIB).layers == 1
    assert mp.nvme_layers(None, 8, need, 2 * GIB).layers == 8
    assert mp.nvme_layers(None, 8, need, 10 * GIB) == mp.NVMeLayers(0, (
        "the predicted host offload, 10.00 GiB, fits the 10.00 GiB available without it"))
    over = mp.nvme_layers(None, 8, need, 1 * GIB)
    assert over.layers == 8 and over.reason.startswith("even with every offloaded layer on disk")
    assert mp.nvme_layers(3, 8, need, 1 * GIB) == mp.NVMeLayers(3, "--nvme-layers 3")
    assert mp.NVMeLayers(4, "why").line(8) == "nvme_layers=4/8 (why)"
    assert mp.NVMeLayers(None, "why").line(8) == "nvme_layers=8/8 (why)"


def _run():
    ds = load_ds_config(None, "cuda")[0]
    opts = TrainerOptions(sp=8, nvme_path="/mnt/nvme", attention_checkpoint="recompute")
    return ds, opts, validate(opts, S, 8, "cuda", ds)


def _need(opts, plan, ds, k):
    est = mp.estimate(CFG, plan, replace(opts, nvme_layers=k), ds, "bf16", "cuda", 8)
    return sum(mp.host_offload_bytes(est).values())


def test_the_memory_check_puts_the_fewest_layers_on_disk():
    """Llama-3-8B at 2M on 8 x 80 GiB: a node whose available memory is the predicted host offload
    with K layers on disk gets K (K - 1 would not fit), and the host check gates on the tier."""
    ds, opts, plan = _run()
    k = 9
    need = {n: _need(opts, plan, ds, n) for n in (0, k - 1, k, k + 1, k + 3)}
    assert need[0] > need[k - 1] > need[k] > need[k + 1]
    check = decide_run(CFG, plan, opts, ds, "bf16", node(need[k])).memory
    assert check.nvme.layers == k, check.nvme
    assert check.nvme.reason.startswith("the fewest first layers on disk"), check.nvme.reason
    assert sum(mp.host_offload_bytes(check.estimate).values()) == need[k]
    # a byte less: one more layer; the options the model gets hold the choice
    assert decide_run(CFG, plan, opts, ds, "bf16", node(need[k] - 1)).opts.nvme_layers == k + 1
    check = decide_run(CFG, plan, opts, ds, "bf16", node(need[0])).memory    # the host holds the run: nothing on disk
    assert check.nvme.layers == 0 and "without it" in check.nvme.reason
    # given: taken as is and accounted, so too few on disk is the host check's error
    check = decide_run(CFG, plan, replace(opts, nvme_layers=k + 3), ds, "bf16", node(need[k])).memory
    assert check.nvme == mp.NVMeLayers(k + 3, f"--nvme-layers {k + 3}")
    assert sum(mp.host_offload_bytes(check.estimate).values()) == need[k + 3]
    with pytest.raises(ConfigError, match="would offload .* to host memory"):
        decide_run(CFG, plan, replace(opts, nvme_layers=k - 1), ds, "bf16", node(need[k]))
    # without the tier: no choice
    assert decide_run(CFG, plan, replace(opts, nvme_path=None), ds, "bf16", node(4096 * GIB)).memory.nvme is None


def test_the_start_up_words():
    memory = MemoryCheck(None, None, None, (), None, mp.NVMeLayers(5, "why"))
    assert memory.words(32, 2) == " nvme_layers=5/30 (why)"


def test_the_line_docs_quote():
    """docs/nvme.md's example: Llama-3-8B at 6M on 8 GPUs of a node with 1000 GiB available."""
    import os
    ds = load_ds_config(None, "cuda")[0]
    opts = TrainerOptions(sp=8, nvme_path="/mnt/nvme/fpdt")
    plan = validate(opts, 6 * 2 ** 20, 8, "cuda", ds)
    line = mp.nvme_layers(None, CFG.num_layers, lambda k: _need(opts, plan, ds, k), 1000 * GIB).line(CFG.num_layers)
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "nvme.md")) as f:
        assert f"\n{line}\n" in f.read(), line

"""2D mesh options of fpdt-train: --hp/--cp/--placement/--inner-ring and the "fpdt" JSON keys."""

from __future__ import annotations

import pytest

from fpdt.cli.train import build_parser, fpdt_flags
from fpdt.train.config import ConfigError, TrainerOptions, merge_options, validate

FP32 = {"train_micro_batch_size_per_gpu": 1}


def test_sp_is_shorthand_for_hp():
    assert TrainerOptions().degrees() == (1, 1)
    assert TrainerOptions(sp=4).degrees() == (4, 1)
    assert TrainerOptions(cp=4).degrees() == (1, 4)
    assert TrainerOptions(hp=2, cp=2).degrees() == (2, 2)
    assert TrainerOptions(sp=4, hp=2, cp=2).degrees() == (2, 2)  # consistent: allowed
    with pytest.raises(ConfigError, match=r"sp=2 does not match hp=2 x cp=2 = 4"):
        validate(TrainerOptions(sp=2, hp=2, cp=2), 64, 4, "cpu", FP32)


def test_flags_and_json_reach_the_plan():
    args = build_parser().parse_args(["--model-config", "c", "--data", "d", "--seq-len", "64", "--steps", "1",
                                      "--hp", "2", "--placement", "context_first"])
    opts = merge_options(fpdt_flags(args), {"cp": 2, "inner_ring": 1, "placement": "head_first"})
    assert (opts.hp, opts.cp, opts.placement, opts.inner_ring) == (2, 2, "context_first", 1)
    plan = validate(opts, 64, 8, "cpu", FP32)
    assert (plan.sp, plan.dp, plan.hp, plan.cp, plan.placement, plan.inner_ring) == (4, 2, 2, 2, "context_first", 1)
    plan = validate(TrainerOptions(sp=2), 64, 2, "cpu", FP32)  # --sp alone: plain Ulysses, as before
    assert (plan.hp, plan.cp) == (2, 1)


@pytest.mark.parametrize("opts, seq_len, world, match", [
    (TrainerOptions(hp=2, cp=2, chunk_size=12), 36, 4, r"seq_len=36 is not divisible by 2 x hp x cp x chunks = "
                                                    r"2 x 2 x 2 x 3 = 24"),
    (TrainerOptions(hp=2, cp=3), 48, 4, r"--hp 2 x --cp 3 = 6 does not divide the world size 4"),
    (TrainerOptions(cp=4, inner_ring=3), 64, 4, r"inner_ring=3 must divide cp=4"),
])
def test_bad_mesh_names_the_fix(opts, seq_len, world, match):
    with pytest.raises(ConfigError, match=match):
        validate(opts, seq_len, world, "cpu", FP32)


def test_bad_json_mesh_keys():
    with pytest.raises(ConfigError, match=r"placement='rows' must be one of"):
        validate(merge_options({}, {"placement": "rows"}), 64, 1, "cpu", {})
    with pytest.raises(ConfigError, match=r"cp=0 must be an integer >= 1"):
        validate(merge_options({}, {"cp": 0}), 64, 1, "cpu", {})

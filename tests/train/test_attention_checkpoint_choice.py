"""fpdt-train --attention-checkpoint save|recompute [--save-attention-layers K]: flags, JSON keys,
and the default, save for as many layers as the run's own memory check predicts room for."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from fpdt.plan import load_model_config
from fpdt.plan import trainer_run as mp
from fpdt.plan.memory_model import saved_attention_bytes
from fpdt.train.config import ConfigError, TrainerOptions, load_ds_config, merge_options, validate
from fpdt.train.parallel import LAUNCHER_VARIABLES
from fpdt.plan.decide import decide_run
from tests.train.helpers import node, write_fixture

GIB = 2 ** 30


def _args(*extra):
    from fpdt.cli.train import build_parser, fpdt_flags
    args = build_parser().parse_args(["--model-config", "c.json", "--data", "d", "--seq-len", "64", "--steps", "1",
                                      *extra])
    return fpdt_flags(args)


def test_flags_and_json_keys():
    opts = merge_options(_args("--attention-checkpoint", "save", "--save-attention-layers", "3"), {})
    assert (opts.attention_checkpoint, opts.save_attention_layers) == ("save", 3)
    section = {"attention_checkpoint": "save", "save_attention_layers": 2}
    assert merge_options(_args(), section).save_attention_layers == 2
    assert merge_options(_args("--save-attention-layers", "5"), section).save_attention_layers == 5   # flags win
    assert merge_options(_args(), {}).attention_checkpoint is None                                    # to choose
    with pytest.raises(ConfigError, match="attention_checkpoint='maybe' must be one of"):
        validate(merge_options(_args(), {"attention_checkpoint": "maybe"}), 64, 1, "cpu", {})
    with pytest.raises(ConfigError, match="save_attention_layers=-1 must be an integer >= 0"):
        validate(merge_options(_args(), {"save_attention_layers": -1}), 64, 1, "cpu", {})
    with pytest.raises(ConfigError, match="needs attention_checkpoint='save' \\(now 'recompute'\\)"):
        validate(merge_options(_args("--attention-checkpoint", "recompute", "--save-attention-layers", "1"), {}),
                 64, 1, "cpu", {})


def test_save_needs_a_recompute_to_skip():
    ds = load_ds_config(None, "cpu")[0]
    with pytest.raises(ConfigError, match="set checkpointing='on' or 'offload'.*fpdt-train's default on cpu"):
        validate(TrainerOptions(attention_checkpoint="save"), 64, 1, "cpu", ds)      # the CPU default is off
    assert validate(TrainerOptions(attention_checkpoint="save", checkpointing="on"), 64, 1, "cpu", ds).checkpoint == "on"


def test_the_choice_and_its_reason():
    choose = mp.attention_checkpoint
    assert choose(None, None, "offload", 32, 32, 2 * GIB).line(32) == (
        "attention_checkpoint=save layers=32/32 (default: the predicted host and device memory hold every layer's "
        "attention output and lse (2.00 GiB per rank and layer))")
    assert choose(None, None, "offload", 24, 32).line(32) == (
        "attention_checkpoint=save layers=24/32 (default: the predicted host and device memory hold the attention "
        "outputs of the first 24 layers, not more)")
    assert choose(None, None, "offload", 0, 32).mode == "recompute"
    assert choose("save", None, "offload", 0, 32).layers == 0            # asked for: kept, saving none
    assert choose("recompute", None, "offload", 32, 32).line(32) == (
        "attention_checkpoint=recompute (--attention-checkpoint recompute)")
    assert choose("save", 7, "on", 0, 32).line(32) == "attention_checkpoint=save layers=7/32 (--save-attention-layers 7)"
    assert choose(None, None, "off", 32, 32).line(32) == (
        "attention_checkpoint=recompute (checkpointing is off: no layer runs a recompute)")


def test_default_saves_as_many_layers_as_the_node_holds():
    """Llama-3-8B at 2M on 8 x 80 GiB with 1 TiB available: every layer input offloaded, the
    host holds the outputs of the first K layers; K + 1 would not fit, K is what the model gets."""
    from fpdt.train import preflight
    n = node(1024 * GIB)
    cfg, s = load_model_config("llama-3-8b"), 2 ** 21
    source = preflight.ModelSource("llama-3-8b", cfg)
    ds = load_ds_config(None, "cuda")[0]
    opts = TrainerOptions(sp=8)
    plan = validate(opts, s, 8, "cuda", ds)
    check = decide_run(source.config, plan, opts, ds, "bf16", n).memory
    recompute = mp.estimate(cfg, plan, TrainerOptions(sp=8, attention_checkpoint="recompute"), ds, "bf16", "cuda", 8)
    per = saved_attention_bytes(cfg, mp.planned_setup(plan, opts, ds, "bf16", "cuda"))
    assert per == (2 * s * 32 * 128 + 4 * s * 32) // 8
    room = 1024 * GIB - sum(mp.host_offload_bytes(recompute).values())
    k = math.floor(room / (8 * per))
    assert 0 < k < 32 and check.attention.mode == "save" and check.attention.layers == k
    assert "the attention outputs of the first" in check.attention.reason
    assert check.estimate.breakdown["attention_saved_host"] == 8 * k * per      # what the host check gated on
    more = mp.estimate(cfg, plan, TrainerOptions(sp=8, attention_checkpoint="save", save_attention_layers=k + 1), ds,
                       "bf16", "cuda", 8)
    assert sum(mp.host_offload_bytes(more).values()) > 1024 * GIB
    # asked for more than fit: refused before the model is built, with the lever
    with pytest.raises(ConfigError, match="fewer --save-attention-layers"):
        decide_run(source.config, plan, TrainerOptions(sp=8, attention_checkpoint="save", save_attention_layers=32),
                   ds, "bf16", n)
    told = decide_run(source.config, plan, TrainerOptions(sp=8, attention_checkpoint="recompute"), ds, "bf16",
                      n).memory
    assert told.attention.mode == "recompute" and told.estimate.breakdown["attention_saved_host"] == 0


def test_default_with_room_for_every_layer_and_none():
    from fpdt.train import preflight
    cfg, s = load_model_config("llama-3-8b"), 2 ** 21
    source = preflight.ModelSource("llama-3-8b", cfg)
    ds = load_ds_config(None, "cuda")[0]
    opts = TrainerOptions(sp=8)
    plan = validate(opts, s, 8, "cuda", ds)
    assert decide_run(source.config, plan, opts, ds, "bf16", node(2048 * GIB)).memory.attention.layers is None  # all
    check = decide_run(source.config, plan, opts, ds, "bf16", node(610 * GIB)).memory   # inputs fit, no saved output
    assert check.attention.mode == "recompute" and "hold no layer's attention output" in check.attention.reason


@pytest.fixture
def own_process_group(monkeypatch):
    """main() runs in this process here: it starts a 1-process group and sets the launcher's
    variables; both are gone after the test, so later tests see no group."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_start_up_line_prints_the_choice(tmp_path, capsys, own_process_group):
    from fpdt.cli.train import main
    cfg, data = write_fixture(str(tmp_path))
    base = ["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "1", "--chunk-size", "32"]
    assert main([*base, "--checkpoint", "on"]) == 0
    out = capsys.readouterr().err
    assert ("attention_checkpoint=save layers=2/2 (default: the predicted host and device memory hold every layer's "
            "attention output and lse") in out, out
    assert main([*base, "--checkpoint", "on", "--attention-checkpoint", "recompute"]) == 0
    assert "attention_checkpoint=recompute (--attention-checkpoint recompute)" in capsys.readouterr().err


def test_the_choice_reaches_the_models_options():
    ds = load_ds_config(None, "cpu")[0]
    opts = TrainerOptions(attention_checkpoint="save", save_attention_layers=1, checkpointing="on")
    run = validate(opts, 64, 1, "cpu", ds)
    model = opts.model_options(run)
    assert (model.attention_checkpoint, model.save_attention_layers, model.checkpointing) == ("save", 1, "on")

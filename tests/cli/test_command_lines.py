"""The command lines parse, call and print: short functions (checked with ``ast``), and every
shared FPDT flag declared once (:data:`fpdt.options.OPTION_FLAGS`), the same on both."""

import argparse
import ast
import pathlib

import pytest

from fpdt.cli.train import build_parser as train_parser
from fpdt.options import OPTION_FLAGS, add_option_flags, flag_values
from fpdt.plan.cli import PLANNED
from fpdt.plan.cli import build_parser as plan_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 60


@pytest.mark.parametrize("path", ["fpdt/cli/train.py", "fpdt/plan/cli.py"])
def test_no_function_is_longer_than_60_lines(path):
    tree = ast.parse((ROOT / path).read_text())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_LINES}
    assert not long, f"{path}: functions over {MAX_LINES} lines: {long}"


def _actions(parser):
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


@pytest.mark.parametrize("prog, parser, names", [("fpdt-train", train_parser, [n for n in OPTION_FLAGS]),
                                                 ("fpdt-plan", plan_parser, ["seq_len", *PLANNED])])
def test_each_shared_flag_comes_from_the_table(prog, parser, names):
    """Spelling, type or choices, switch form, metavar and None (not given) as the table says."""
    actions = _actions(parser())
    for name in names:
        f, a = OPTION_FLAGS[name], actions[OPTION_FLAGS[name].flag]
        assert a.dest == f.dest and a.default is None and a.metavar == f.metavar, name
        if f.type is bool:
            assert isinstance(a, argparse.BooleanOptionalAction) and a.option_strings[1] == "--no-" + f.flag[2:]
        elif isinstance(f.type, tuple):
            assert tuple(a.choices) == f.type, name
        else:
            assert a.type is f.type, name
        default = f.plan_default if prog == "fpdt-plan" and f.plan_default is not None else f.default
        assert a.help.startswith(f.help) and (not default or a.help.endswith(f"(default: {default})")), name


def test_both_command_lines_read_the_same_values():
    argv = ["--sp", "4", "--checkpoint", "on", "--no-offload", "--attention-backend", "math", "--stream-layers",
            "--save-attention-layers", "2", "--mlp-chunks", "0"]
    train = train_parser().parse_args(["--model-config", "c", "--data", "d", "--seq-len", "64", "--steps", "1", *argv])
    plan = plan_parser().parse_args(["--model", "m", "--seq-len", "64", *argv])
    want = dict(sp=4, checkpointing="on", offload=False, backend="math", stream_layers=True, save_attention_layers=2,
                mlp_chunks=0, hp=None, lm_head_wgrad=None)
    for args in (train, plan):
        got = flag_values(args, PLANNED)
        assert {k: got[k] for k in want} == want


def test_a_switch_and_a_requirement():
    p = argparse.ArgumentParser()
    add_option_flags(p, ["offload", "seq_len"], required=("seq_len",))
    assert flag_values(p.parse_args(["--seq-len", "8"]), ["offload", "seq_len"]) == {"offload": None, "seq_len": 8}
    assert p.parse_args(["--seq-len", "8", "--no-offload"]).offload is False
    with pytest.raises(SystemExit):
        p.parse_args([])


def test_the_table_is_the_options_fields():
    """One entry per option a caller gives (the trainer's options less what the entry points derive), and the length."""
    from dataclasses import fields

    from fpdt.options import DERIVED_OPTIONS
    from fpdt.train.config import TrainerOptions
    given = {f.name for f in fields(TrainerOptions)} - set(DERIVED_OPTIONS)
    assert set(OPTION_FLAGS) == given | {"seq_len"}


def test_layout_errors_name_options_and_both_command_lines_word_them_as_flags(capsys, tmp_path):
    """fpdt.layout words a chunking problem in option names; each command line in its flags."""
    from fpdt.cli.train import main as train
    from fpdt.layout import chunking_problems
    from fpdt.plan.cli import main as plan
    assert chunking_problems(64, 24, 1, 1) == ["seq_len=64 is not divisible by chunk_size=24; pick a chunk size "
                                               "that divides the sequence length"]
    config = ROOT / "examples" / "tiny-llama" / "config.json"
    assert train(["--model-config", str(config), "--data", str(tmp_path), "--seq-len", "64", "--steps", "1",
                  "--chunk-size", "24"]) == 2
    assert capsys.readouterr().err.strip() == ("fpdt-train: error: --seq-len 64 is not divisible by --chunk-size 24; "
                                               "pick a chunk size that divides the sequence length")
    assert plan(["--model", str(config), "--gpu", "h100-80g", "--gpus-per-node", "1", "--seq-len", "64",
                 "--chunk-size", "24"]) == 0
    assert ("cannot run: --seq-len 64 is not divisible by --chunk-size 24; pick a chunk size that divides the "
            "sequence length") in capsys.readouterr().out


def test_this_node_is_what_the_planner_decides_by(monkeypatch):
    """fpdt-train measures the node (the CUDA branch with the GPU faked) and hands it to decide_run."""
    import types

    import torch

    import fpdt.cli.train as cli
    from fpdt.plan.decide import Node
    from fpdt.plan.trainer_run import LOCAL_SIZE_VARS
    for name in LOCAL_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=7 * 2 ** 30))
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(cli.torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80))
    assert cli.this_node(torch.device("cuda"), 16) == Node("cuda", 80, 4, 7 * 2 ** 30)
    assert cli.this_node(torch.device("cpu"), 2) == Node("cpu", None, 2, 7 * 2 ** 30)

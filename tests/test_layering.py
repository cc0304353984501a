"""Imports point down only: train -> model -> attention -> offload, comm, layout, ops; the
planner sits on the trainer's configuration, and only the trainer's command line on the planner.

Also: nothing outside ``fpdt.train`` and ``fpdt.hf`` imports DeepSpeed, and nothing in ``fpdt`` imports
the tests. Checked statically from the source, so a violation fails here rather than
in a user's import graph.
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fpdt")

# package -> fpdt packages it may import
ALLOWED = {
    "layout": set(),
    "ops": set(),        # numerical primitives shared by attention and model
    "comm": {"layout"},  # SequenceMesh owns its token layout
    "offload": set(),
    "memory": {"offload"},
    "profiling": {"memory"},   # the deprecated name of fpdt.memory
    "attention": {"layout", "comm", "offload", "ops"},
    "model": {"layout", "comm", "offload", "attention", "ops"},
    "train": {"layout", "comm", "offload", "attention", "model", "memory", "ops"},
    "plan": {"attention", "comm", "model", "train"},
    "hf": {"layout", "comm", "offload", "attention", "model", "ops"},   # Transformers integration, beside train
}
# may import DeepSpeed (lazily in fpdt.hf: its ZeRO-3 registration, when DeepSpeed is installed)
DEEPSPEED_USERS = {"train", "hf"}
# fpdt-train's command line is the application on top: it checks its run with the
# planner's model (fpdt.plan.trainer_run); no planner module imports it.
ABOVE_PLAN = {os.path.join("train", "cli.py")}


def _imports(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)   # `from fpdt.train import cli`


def _modules():
    for pkg in ALLOWED:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    yield pkg, os.path.join(dirpath, f)


MODULES = list(_modules())


@pytest.mark.parametrize("pkg,path", MODULES, ids=[os.path.relpath(p, ROOT) for _, p in MODULES])
def test_imports_point_down(pkg, path):
    for name in _imports(path):
        parts = name.split(".")
        rel = os.path.relpath(path, ROOT)
        if parts[:2] == ["fpdt", "plan"] and rel in ABOVE_PLAN:
            continue
        if pkg == "plan" and parts[0] == "fpdt" and len(parts) > 1:
            assert os.path.join(*parts[1:]) + ".py" not in ABOVE_PLAN, f"{rel} imports {name}, which imports plan"
        if parts[0] == "fpdt" and len(parts) > 1 and parts[1] in ALLOWED and parts[1] != pkg:
            assert parts[1] in ALLOWED[pkg], f"{os.path.relpath(path, ROOT)} imports {name}: {pkg} may not import {parts[1]}"
        assert parts[0] != "tests", f"{path} imports the tests ({name})"
        if pkg not in DEEPSPEED_USERS:
            assert parts[0] != "deepspeed", f"{path} imports DeepSpeed; only {sorted(DEEPSPEED_USERS)} may"

"""Imports point down only, and no module imports itself back through others.

The layers, bottom up: layout, ops, offload; comm; attention; options; memory; model; hf (the
Transformers integration, beside train); train; plan (the planner sits on the trainer's
configuration); cli (the command lines: ``fpdt-train`` checks its run with the planner); bench
(measurement helpers of the profiling scripts and the tests, beside cli). A
package may import only the packages listed for it in :data:`ALLOWED`, and the import graph of
``fpdt``'s modules has no cycle, counting imports inside functions too. Entry scripts
(``__main__.py``, run by ``python -m``) follow the same rule (``fpdt-train`` is ``python -m
fpdt.cli``), and no module may import one.

Also: nothing outside ``fpdt.train``, ``fpdt.hf`` and ``fpdt.cli`` imports DeepSpeed, and nothing
in ``fpdt`` imports the tests or the measurement scripts (``profiling``, a package of the
repository that the installed ``fpdt`` does not ship). Checked statically from the source, so a violation fails here
rather than in a user's import graph.
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fpdt")

BASE = {"layout", "ops", "offload", "comm"}
# unit (package, or top-level module) -> the fpdt units it may import
ALLOWED = {
    "layout": set(),
    "ops": set(),        # numerical primitives shared by attention and model
    "offload": set(),
    "comm": {"layout"},  # SequenceMesh owns its token layout
    "attention": BASE,
    "options": BASE | {"attention"},
    "memory": {"layout", "offload"},
    "model": BASE | {"attention", "options"},
    "hf": BASE | {"attention", "options", "model"},
    "train": BASE | {"attention", "options", "memory", "model"},
    "plan": BASE | {"attention", "options", "model", "train"},
    "cli": BASE | {"attention", "options", "memory", "model", "train", "plan"},
    "bench": BASE | {"attention", "options", "memory", "model", "train", "plan"},   # measurement; nothing imports it
}
DEEPSPEED_USERS = {"train", "hf", "cli"}   # fpdt.hf lazily: its ZeRO-3 registration, when installed


def _imports(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)   # `from fpdt.cli import train`


def _module_name(path):
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _modules():
    for dirpath, _, files in os.walk(ROOT):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = _module_name(path)
                unit = name.split(".")[1] if name != "fpdt" else None
                yield unit, name, path


MODULES = list(_modules())
NAMES = {name for _, name, _ in MODULES}


def _fpdt_targets(path):
    """The fpdt modules ``path`` imports: ``from fpdt.x import y`` is ``fpdt.x.y`` when that is a
    module, else ``fpdt.x``; an attribute resolves to its module."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in NAMES else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name.startswith("fpdt") and name not in NAMES:
                name = name.rpartition(".")[0]
            if name.startswith("fpdt"):
                yield name


def test_nothing_imports_the_measurement_helpers():
    """``fpdt.bench`` serves the profiling scripts and the tests; the library never needs it."""
    for unit, name, path in MODULES:
        if unit != "bench":
            assert not any(t.startswith("fpdt.bench") for t in _fpdt_targets(path)), f"{name} imports fpdt.bench"


def test_every_unit_is_placed():
    units = {unit for unit, _, _ in MODULES if unit is not None}
    assert units <= set(ALLOWED), f"place {sorted(units - set(ALLOWED))} in ALLOWED"


@pytest.mark.parametrize("unit,name,path", [m for m in MODULES if m[0] is not None],
                         ids=[m[1] for m in MODULES if m[0] is not None])
def test_imports_point_down(unit, name, path):
    for target in _fpdt_targets(path):
        assert not target.endswith(".__main__"), f"{name} imports the entry script {target}"
        parts = target.split(".")
        if len(parts) > 1 and parts[1] != unit:
            assert parts[1] in ALLOWED[unit], f"{name} imports {target}: {unit} may not import {parts[1]}"
    for imported in _imports(path):
        assert imported.split(".")[0] != "tests", f"{name} imports the tests ({imported})"
        assert imported.split(".")[0] != "profiling", f"{name} imports the measurement scripts ({imported})"
        if unit not in DEEPSPEED_USERS:
            assert imported.split(".")[0] != "deepspeed", f"{name} imports DeepSpeed; only {sorted(DEEPSPEED_USERS)} may"


def test_no_import_cycles():
    """No module reaches itself through the modules it imports (a package's ``__init__`` counts
    as the package: importing ``fpdt.offload.stash`` runs ``fpdt.offload`` first)."""
    graph = {name: set() for name in NAMES}
    for _, name, path in MODULES:
        for target in _fpdt_targets(path):
            if target != name:
                graph[name].add(target)
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)

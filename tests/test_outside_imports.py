"""What the code outside ``fpdt`` may import: the tests never import the measurement scripts
(``profiling``: a test of a script runs it as ``python -m profiling.<name>``, or tests the
shared :mod:`fpdt.bench`), and the examples use fpdt's public API only (names a package lists
in ``__all__``; no ``_private`` names or attributes). Checked statically from the source."""

import ast
import glob
import importlib
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True))


def _imported(tree) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in \
                ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append(str(node.args[0].value))
    return out


@pytest.mark.parametrize("path", _files("tests"), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_test_imports_the_measurement_scripts(path):
    tree = ast.parse(open(path).read(), path)
    bad = [m for m in _imported(tree) if m.split(".")[0] == "profiling"]
    assert not bad, f"{os.path.relpath(path, ROOT)} imports {bad}: run the script as `python -m profiling.<name>` " \
                    "or test what it shares through fpdt.bench"


def _public(module: str) -> set[str]:
    mod = importlib.import_module(module)
    return set(getattr(mod, "__all__", ()))


def _uses(tree):
    """``(module, name)`` for each ``from fpdt.x import name`` and each ``fpdt.x.name`` attribute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fpdt":
            yield from ((node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Attribute):
            chain, n = [node.attr], node.value
            while isinstance(n, ast.Attribute):
                chain.append(n.attr)
                n = n.value
            full = ["fpdt"] + chain[::-1]
            if isinstance(n, ast.Name) and n.id == "fpdt" and importlib.util.find_spec(".".join(full)) is None:
                yield _split(full)             # (the chain's inner ``fpdt.hf`` is a module, not a use)


def _split(chain: list[str]) -> tuple[str, str]:
    """``fpdt.hf.apply_fpdt.x`` -> ``("fpdt.hf", "apply_fpdt")``: the longest module, the name in it."""
    k = 1
    while k < len(chain) - 1 and importlib.util.find_spec(".".join(chain[:k + 1])) is not None:
        k += 1
    return ".".join(chain[:k]), chain[k]


@pytest.mark.parametrize("path", _files("examples"), ids=lambda p: os.path.relpath(p, ROOT))
def test_examples_use_the_public_api(path):
    tree = ast.parse(open(path).read(), path)
    for module in _imported(tree):
        if module.split(".")[0] == "fpdt":
            assert not any(part.startswith("_") for part in module.split(".")), f"{path}: imports {module}"
    private = [f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert not private, f"{os.path.relpath(path, ROOT)} reads private attributes: {private}"
    for module, name in _uses(tree):
        assert name in _public(module), f"{os.path.relpath(path, ROOT)}: {module}.{name} is not in {module}.__all__"

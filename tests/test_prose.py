"""Docstrings stay a minority of ``fpdt/``: the share of non-blank lines that are docstrings (of
modules, classes and functions, and the string under an attribute or constant), counted with
``ast``. Run ``python tests/test_prose.py`` for the figures
(the whole package, then the files with the most docstring lines)."""

from __future__ import annotations

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fpdt"

# The target is 20% (torchtitan is about 17%); lower this as docstrings are trimmed, never raise it.
MAX_DOCSTRING_SHARE = 0.20


def docstring_lines(source: str) -> tuple[int, int]:
    """(non-blank docstring lines, non-blank lines) of one module's source."""
    lines = source.splitlines()
    doc = 0
    for node in ast.walk(ast.parse(source)):
        # every statement that is a bare string: the docstrings, and those under attributes and constants
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc += sum(1 for i in range(node.lineno - 1, node.end_lineno) if lines[i].strip())
    return doc, sum(1 for line in lines if line.strip())


def count(root: pathlib.Path = PACKAGE) -> dict[str, tuple[int, int]]:
    """{path relative to ``root``'s parent: (docstring lines, non-blank lines)} of every ``.py``."""
    return {str(p.relative_to(root.parent)): docstring_lines(p.read_text(encoding="utf-8"))
            for p in sorted(root.rglob("*.py"))}


def share(counts: dict[str, tuple[int, int]]) -> float:
    return sum(d for d, _ in counts.values()) / sum(n for _, n in counts.values())


def test_docstrings_are_at_most_the_threshold_share_of_the_package():
    counts = count()
    print(f"docstrings: {share(counts):.1%} of fpdt/'s non-blank lines")
    assert share(counts) <= MAX_DOCSTRING_SHARE, \
        f"docstrings are {share(counts):.1%} of fpdt/ (at most {MAX_DOCSTRING_SHARE:.1%}): move " \
        "derivations and history to docs/ and keep the contract (shapes, layouts, what is saved)"


if __name__ == "__main__":
    counts = count()
    doc, total = sum(d for d, _ in counts.values()), sum(n for _, n in counts.values())
    print(f"fpdt/: {doc} docstring lines of {total} non-blank, {doc / total:.1%}")
    for path, (d, n) in sorted(counts.items(), key=lambda kv: -kv[1][0])[:int(sys.argv[1]) if len(sys.argv) > 1 else 20]:
        print(f"{d:5d} {n:5d} {d / n:6.1%}  {path}")

"""Every stream, event, pinned-memory, record_stream and synchronise call goes through the
device runtime (fpdt/offload/runtime.py). Checked statically over the ``fpdt`` sources, so
a direct ``torch.cuda`` stream call added anywhere else fails here."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fpdt")
RUNTIME = os.path.join(ROOT, "offload", "runtime.py")

CUDA_API = {"Stream", "Event", "ExternalStream", "StreamContext", "stream", "current_stream", "default_stream",
            "set_stream", "synchronize"}
STREAM_METHODS = {"record_stream", "wait_event", "wait_stream", "record_event", "synchronize", "query",
                  "pin_memory"}
RUNTIME_NAMES = {"rt", "runtime"}   # receivers that are a device runtime object


def _receiver_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def violations(source: str, path: str) -> list[str]:
    """Direct stream/event/pinned-memory API uses in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr in CUDA_API:
            base = node.value
            if isinstance(base, ast.Attribute) and base.attr == "cuda" and _receiver_name(base.value) == "torch":
                found.append(f"{where}: torch.cuda.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.cuda", "torch.cuda.streams"):
            names = {a.name for a in node.names} & CUDA_API
            if names:
                found.append(f"{where}: from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in STREAM_METHODS:
                if _receiver_name(func.value) not in RUNTIME_NAMES:
                    found.append(f"{where}: .{func.attr}(...) outside the device runtime")
            torch_alloc = isinstance(func, ast.Attribute) and (_receiver_name(func.value) == "torch"
                                                                or func.attr in ("to", "new_empty"))
            for kw in node.keywords:
                if kw.arg == "pin_memory" and torch_alloc:
                    found.append(f"{where}: pin_memory= outside the device runtime")
    return found


def _sources():
    for dirpath, _, files in os.walk(ROOT):
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            if f.endswith(".py") and path != RUNTIME:
                yield path


SOURCES = list(_sources())


@pytest.mark.parametrize("path", SOURCES, ids=[os.path.relpath(p, ROOT) for p in SOURCES])
def test_stream_api_only_in_the_runtime(path):
    with open(path) as f:
        found = violations(f.read(), path)
    assert not found, "call these through the device runtime (fpdt.offload.resolve_runtime):\n" + "\n".join(found)


def test_the_check_catches_direct_calls():
    bad = ("import torch\nfrom torch.cuda import Stream\ns = torch.cuda.Stream()\nx.record_stream(s)\n"
           "torch.cuda.synchronize()\ne = s.record_event()\nh = torch.empty(3, pin_memory=True)\n"
           "rt.wait_event(s, e)\n")
    lines = {int(v.split(":")[1]) for v in violations(bad, os.path.join(ROOT, "x.py"))}
    assert lines == {2, 3, 4, 5, 6, 7}   # everything but the runtime call on line 8

"""Running a measurement script as its users do: ``python -m profiling.<name>`` from the
repository root, in a fresh process (the tests never import the scripts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(name: str, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m profiling.<name> argv...``; asserts it exits 0 and returns the process."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", f"profiling.{name}", *map(str, argv)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, env=env)
    assert proc.returncode == 0, f"profiling.{name} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def read_json(path) -> object:
    with open(path) as f:
        return json.load(f)

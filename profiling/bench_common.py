"""Shared by the measurement scripts: where results go, device names, trial subprocesses.

Every script writes JSON under ``benchmarks/results/<device-name>/<date>/`` relative to the
repository (whatever the working directory); ``--tiny`` runs go to
``benchmarks/results/<device-name>/cpu-smoke/`` so they never overwrite real results.
``<device-name>`` is the CUDA device name, or ``cpu-<cpu model>`` on the CPU, lower-case
with non-alphanumerics as ``-``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone

import torch

from fpdt.bench.environment import default_device, device_name, software

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def results_dir(tiny: bool, out_dir: str | None = None, device: torch.device | None = None) -> str:
    """``benchmarks/results/<device>/<UTC date>`` (``.../cpu-smoke`` for ``--tiny``), created."""
    if out_dir:
        path = out_dir
    else:
        leaf = "cpu-smoke" if tiny else datetime.now(timezone.utc).strftime("%Y-%m-%d")
        path = os.path.join(RESULTS, device_name(device), leaf)
    os.makedirs(path, exist_ok=True)
    return path


def git_commit() -> str | None:
    """The checkout's short commit; ``FPDT_GIT_COMMIT`` when set (a copy of the tree without
    ``.git``, as the device tool may send)."""
    if os.environ.get("FPDT_GIT_COMMIT"):
        return os.environ["FPDT_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def header(script: str, args) -> dict:
    """The fields every results file starts with (``software``: :func:`software`)."""
    dev = default_device()
    return {"script": script, "device": device_name(dev), "device_type": dev.type,
            "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
            "torch": torch.__version__, "software": software(), "args": vars(args)}


def write_json(path: str, obj: dict) -> str:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    return path


def run_trial(module: str, argv: list[str], timeout_s: float) -> dict:
    """Run ``python -m module --trial argv...`` (``module`` e.g. ``"profiling.max_seqlen"``) in a
    fresh process, with the repository root on its path; its last stdout line is JSON.

    Returns that dict, or ``{"status": "timeout"}`` / ``{"status": "error", "error": ...}``.
    """
    cmd = [sys.executable, "-m", module, "--trial", *argv]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "timeout_s": timeout_s}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"status": "error", "returncode": proc.returncode, "error": " | ".join(tail)}

"""Which device runtime serves a device: :func:`runtime_for`, :func:`use_runtime`.

The selection, in order: the innermost :func:`use_runtime` context; else the environment
variable ``FPDT_RUNTIME`` (``sim``, ``sync`` or ``cuda``; meant for the command-line tools and
tests); else ``cuda`` on a CUDA device and ``sync`` elsewhere. The runtimes themselves live
in :mod:`fpdt.offload.runtime` (sync, CUDA) and :mod:`fpdt.offload.sim` (the simulator).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from fpdt.offload.runtime import ENV_RUNTIME, RUNTIMES, CudaRuntime, Runtime, SyncRuntime
from fpdt.offload.sim import SimRuntime

_override: list[Runtime] = []            # stack of use_runtime(...) contexts
_from_env: dict[tuple, Runtime] = {}     # process-wide instances, by name and the env options they read
SIM_ENV = ("FPDT_SIM_MODE", "FPDT_SIM_FAULT", "FPDT_SIM_SEED")


def _make(name: str, **sim_options) -> Runtime:
    if name == "sync":
        return SyncRuntime()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{ENV_RUNTIME}=cuda needs a CUDA device; on the CPU use "
                               f"{ENV_RUNTIME}=sim (simulated streams) or {ENV_RUNTIME}=sync")
        return CudaRuntime()
    if name == "sim":
        return SimRuntime(**sim_options)
    raise ValueError(f"unknown device runtime {name!r}: {ENV_RUNTIME} must be one of {', '.join(RUNTIMES)}")


def selected_runtime_name(device: torch.device | str) -> tuple[str, bool]:
    """-> (runtime name for ``device``, whether it was chosen explicitly by use_runtime or the env)."""
    if _override:
        return _override[-1].name, True
    env = os.environ.get(ENV_RUNTIME, "").strip()
    if env:
        if env not in RUNTIMES:
            raise ValueError(f"{ENV_RUNTIME}={env!r} is not a device runtime: use one of {', '.join(RUNTIMES)}")
        return env, True
    return ("cuda" if torch.device(device).type == "cuda" else "sync"), False


def runtime_for(device: torch.device | str) -> Runtime:
    """The runtime that serves ``device`` now (see the module docstring for the selection)."""
    if _override:
        return _override[-1]
    name, _ = selected_runtime_name(device)
    # keyed by the sim options too: a runtime made while FPDT_SIM_FAULT was set must not
    # serve (and inject its fault into) code that runs after the variable is gone
    key = (name, *(os.environ.get(k, "").strip() for k in SIM_ENV)) if name == "sim" else (name,)
    if key not in _from_env:
        _from_env[key] = _make(name)
    return _from_env[key]


@contextlib.contextmanager
def use_runtime(name: str, **sim_options) -> Iterator[Runtime]:
    """Run the enclosed code on a fresh runtime ``name`` (``"sim"``, ``"sync"`` or ``"cuda"``).

    ``sim_options`` (``mode``, ``fault``, ``seed``, ``checks``, ``log``, ``max_delay_s``) go to
    :class:`fpdt.offload.sim.SimRuntime`; unset ones come from the environment. On exit every
    issued copy is run and any hazard still pending is raised. Yields the runtime, whose
    ``counters`` the caller can read.
    """
    rt = _make(name, **sim_options) if name == "sim" else _make(name)
    _override.append(rt)
    failed = False
    try:
        yield rt
    except BaseException:
        failed = True
        raise
    finally:
        _override.pop()
        try:
            if not failed:
                rt.drain()
        finally:
            rt.close()

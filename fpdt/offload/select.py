"""Which device runtime serves a device: :func:`resolve_runtime`, :func:`named_runtime`.

The ``runtime`` option (:attr:`fpdt.options.FPDTOptions.runtime`): None (automatic), a name
(one process-wide instance per name) or a :class:`~fpdt.offload.runtime.Runtime`; the library
reads no environment variable for it (``docs/attention.md#device-runtime``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from fpdt.offload.runtime import RUNTIMES, CudaRuntime, Runtime, SyncRuntime
from fpdt.offload.sim import SimRuntime

_named: dict[tuple, Runtime] = {}     # process-wide instances, by name (and, for sim, its env options)
SIM_ENV = ("FPDT_SIM_MODE", "FPDT_SIM_FAULT", "FPDT_SIM_SEED")


def _make(name: str, **sim_options) -> Runtime:
    if name == "sync":
        return SyncRuntime()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("runtime='cuda' needs a CUDA device; on the CPU use runtime='sim' (simulated "
                               "streams) or runtime='sync'")
        return CudaRuntime()
    if name == "sim":
        return SimRuntime(**sim_options)
    raise ValueError(f"unknown device runtime {name!r}: use one of {', '.join(RUNTIMES)}")


def default_runtime_name(device: torch.device | str) -> str:
    """The automatic choice (``runtime=None``): ``"cuda"`` on a CUDA device, ``"sync"`` elsewhere."""
    return "cuda" if torch.device(device).type == "cuda" else "sync"


def named_runtime(name: str) -> Runtime:
    """The process-wide runtime called ``name`` (``"sim"``, ``"sync"`` or ``"cuda"``)."""
    # keyed by the sim options too: a runtime made while FPDT_SIM_FAULT was set must not
    # serve (and inject its fault into) code that runs after the variable is gone
    key = (name, *(os.environ.get(k, "").strip() for k in SIM_ENV)) if name == "sim" else (name,)
    if key not in _named:
        _named[key] = _make(name)
    return _named[key]


def resolve_runtime(runtime: Runtime | str | None, device: torch.device | str) -> Runtime:
    """The runtime the option value ``runtime`` names for ``device`` (see the module docstring)."""
    if isinstance(runtime, Runtime):
        return runtime
    return named_runtime(default_runtime_name(device) if runtime is None else runtime)


def runtime_name(runtime: Runtime | str | None) -> str | None:
    """The name of an option value (None stays None: automatic)."""
    return runtime.name if isinstance(runtime, Runtime) else runtime


@contextlib.contextmanager
def fresh_runtime(name: str, **sim_options) -> Iterator[Runtime]:
    """For tests: a fresh runtime ``name`` (``"sim"``, ``"sync"`` or ``"cuda"``) for the block,
    to pass as ``runtime=`` to the models and stashes built in it; nothing else sees it.

    ``sim_options`` (``mode``, ``fault``, ``seed``, ``checks``, ``log``, ``max_delay_s``) go to
    :class:`fpdt.offload.sim.SimRuntime`; unset ones come from the environment. On exit every
    issued copy is run and any hazard still pending is raised. Yields the runtime, whose
    ``counters`` the caller can read.
    """
    rt = _make(name, **sim_options) if name == "sim" else _make(name)
    failed = False
    try:
        yield rt
    except BaseException:
        failed = True
        raise
    finally:
        try:
            if not failed:
                rt.drain()
        finally:
            rt.close()

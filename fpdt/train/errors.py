"""How ``fpdt-train`` reports a failure: one line, no traceback, non-zero exit.

:data:`USER_ERRORS` (flags, configs, data, checkpoints; alike on every rank): rank 0 prints
``fpdt-train: error: <what, naming the file (and line)>; <the fix>``, exit status 2; a
configuration's in the flags the user types (:func:`fpdt.options.in_flag_terms`).
:class:`RunError` (the run had to stop): rank 0, or the rank that met it alone, exit status 1.
Anything else: its type and message, the attention kernel when raised inside one, exit status 1.
``--debug`` or ``FPDT_DEBUG=1`` re-raises instead.
"""

from __future__ import annotations

import os
import sys

from fpdt.model import UnsupportedConfigError
from fpdt.options import OptionsError, in_flag_terms
from fpdt.train.config import ConfigError
from fpdt.train.data import DataError


class RunError(RuntimeError):
    """A started run had to stop; the message names the step and what to do next.
    ``same_on_every_rank`` (e.g. a non-finite loss, all-reduced): only rank 0 prints it.
    """

    def __init__(self, message: str, same_on_every_rank: bool = False) -> None:
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


USER_ERRORS = (ConfigError, DataError, UnsupportedConfigError, OptionsError)
"""Errors every rank finds the same way before (or without) touching other ranks."""


def debug_enabled(flag: bool = False) -> bool:
    """``--debug`` given, or ``FPDT_DEBUG`` set to anything but empty / ``0``."""
    return flag or os.environ.get("FPDT_DEBUG", "") not in ("", "0")


def this_rank() -> tuple[int, int]:
    """``(rank, world size)`` from the process group, else from the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def one_line(text: str) -> str:
    """``text`` with its line breaks folded, so that a message is one line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


_KERNELS_DIR = os.path.join("fpdt", "attention", "kernels") + os.sep


def kernel_frame(exc: BaseException) -> str | None:
    """``"<module>.<function>"`` of the innermost frame of ``exc``'s traceback that lies in an
    attention kernel adapter (``fpdt/attention/kernels/*.py``), or None."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if _KERNELS_DIR in path:
            found = f"{os.path.splitext(os.path.basename(path))[0]}.{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return found


def report(prog: str, exc: BaseException) -> int:
    """Print ``exc`` as one line on the ranks that should, and return the exit status."""
    rank, world = this_rank()
    if isinstance(exc, USER_ERRORS) or getattr(exc, "same_on_every_rank", False):
        if rank == 0:
            text = one_line(exc)
            if isinstance(exc, (ConfigError, OptionsError)) and not getattr(exc, "worded", False):
                text = in_flag_terms(text)
            print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, USER_ERRORS) else 1
    where = f"rank {rank}: " if world > 1 else ""
    if isinstance(exc, RunError):
        message = one_line(exc)
    else:
        kernel = kernel_frame(exc)
        hint = (f"; raised in the attention kernel adapter {kernel}: --attention-backend runs another kernel "
                f"(see fpdt-train --help)" if kernel else "")
        message = (f"{type(exc).__name__}: {one_line(exc)[:500]} (unexpected{hint}; rerun with --debug or "
                   f"FPDT_DEBUG=1 for the traceback)")
    print(f"{prog}: error: {where}{message}", file=sys.stderr, flush=True)
    return 1

"""Processes, devices and the sequence-parallel / data-parallel groups.

SP-innermost: with SP size P, ranks ``[g*P, (g+1)*P)`` form SP group ``g``, which is also their
data-parallel index (``dp = world_size / P`` groups read distinct windows); the all-to-alls stay
inside a node when P divides its GPUs. DeepSpeed sees every rank as data-parallel: ZeRO-3 shards
over and averages gradients over all ``dp * P`` ranks (loss scaling: :mod:`fpdt.train.loop`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fpdt.comm import SequenceMesh


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the run."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    dp: int
    """Data-parallel size, ``world_size / P``."""
    sp_rank: int
    """Rank inside the SP group (which FPDT-layout slice this process holds)."""
    dp_rank: int
    """Index of the SP group, i.e. of the data-parallel replica."""
    sp_group: dist.ProcessGroup
    """The SP process group (a single-rank group when P = 1)."""
    device: torch.device
    """Where the model runs."""
    mesh: SequenceMesh | None = None
    """The 2D hp x cp mesh when cp > 1 (then ``sp_group`` is ``mesh.sp_group`` and
    ``sp_rank`` is ``mesh.sp_rank``); None for plain Ulysses."""

    @property
    def sp(self) -> int:
        """Sequence-parallel size P, ``world_size / dp``."""
        return self.world_size // self.dp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """World size announced by the launcher (1 when started without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def launcher_environment_restored():
    """Removes, on leaving, the launcher variables :func:`init_distributed` set for a 1-process
    group (a caller running ``fpdt-train``'s ``main`` in its own process keeps its environment)."""
    before = {k: os.environ.get(k) for k in LAUNCHER_VARIABLES}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def init_distributed(device: torch.device, timeout: timedelta | None = None) -> None:
    """Initialise the default process group unless a launcher or a test already did (without
    ``RANK`` in the environment: a 1-process group on a free local port). ``timeout``: how long a
    collective waits (``--dist-timeout-min``; None: torch's default).
    """
    if dist.is_initialized():
        # A caller-made group (e.g. the test harness) may lack the launcher's variables,
        # which DeepSpeed asserts on; one host is assumed, so the local rank is the rank.
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)


def build_parallel_state(sp: int, device: torch.device, *, cp: int = 1, placement: str = "head_first",
                         inner_ring: int | None = None, timeout: timedelta | None = None) -> ParallelState:
    """Create the SP groups (every rank creates all of them, in the same order). With ``cp > 1``
    the SP ranks form a 2D :class:`fpdt.comm.SequenceMesh` of ``hp = sp / cp`` x ``cp`` (replica
    ``g`` is ranks ``[g*sp, (g+1)*sp)``, arranged by ``placement``). ``timeout``: of every group made.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % sp != 0:  # validated earlier from the environment; re-check the real group
        raise ValueError(f"--sp {sp} does not divide the world size {world}")
    if cp > 1:
        mesh = SequenceMesh(hp=sp // cp, cp=cp, placement=placement, inner_ring=inner_ring, timeout=timeout)
        return ParallelState(rank=rank, world_size=world, dp=mesh.dp, sp_rank=mesh.sp_rank,
                             dp_rank=mesh.dp_rank, sp_group=mesh.sp_group, device=device, mesh=mesh)
    mine = None
    for g in range(world // sp):
        group = dist.new_group(list(range(g * sp, (g + 1) * sp)), timeout=timeout)
        if g == rank // sp:
            mine = group
    assert mine is not None
    return ParallelState(rank=rank, world_size=world, dp=world // sp, sp_rank=rank % sp,
                         dp_rank=rank // sp, sp_group=mine, device=device)

"""DeepSpeed's async I/O (DeepNVMe) as a backend of :class:`fpdt.offload.nvme.NVMeStore`, here
because only the trainer's layers may import DeepSpeed. ``aio_backend()`` returns an
:class:`AioBackend`, or None (``aio_unavailable()`` says why: in practice, no libaio).
Building it, ``O_DIRECT`` alignment and how one handle's ``wait()`` completes: ``docs/nvme.md``, Backends.
"""

import errno
import os
import sys

import torch

from fpdt.offload.nvme import ALIGN, PortableBackend, aligned

_REASON = {}


def aio_unavailable():
    """Why :func:`aio_backend` returned None (empty when it did not, or was not called)."""
    return _REASON.get("why", "")


def aio_backend(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1):
    """DeepSpeed's aio as an NVMeStore backend, or None when it cannot build here
    (``aio_unavailable()`` then names the reason and the fix)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as e:          # deepspeed is a dependency; an op_builder without aio is not
        _REASON["why"] = f"deepspeed's AsyncIOBuilder is not importable ({e})"
        return None
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        _REASON["why"] = ("DeepSpeed's async I/O cannot build here: libaio is missing "
                          "(apt-get install -y libaio-dev, as root)")
        return None
    _REASON.pop("why", None)
    if not _built(builder):
        _say(BUILDING)
    handle = builder.load(verbose=False).aio_handle(block_size=block_size, queue_depth=queue_depth,
                                                    single_submit=False, overlap_events=True,
                                                    intra_op_parallelism=intra_op_parallelism)
    return AioBackend(handle)


BUILDING = ("fpdt-train: building DeepSpeed's async I/O op (async_io, for the NVMe tier) once, cached in "
            "~/.cache/torch_extensions: about 3 to 8 minutes on 2 cores; build it ahead (needs libaio-dev) with: "
            "python -c \"from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()\"")
"""The line before the first JIT build (docs/nvme.md, "Backends")."""


def _built(builder):
    """Whether ``builder``'s op is installed prebuilt or in the JIT cache (no build to wait for)."""
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get(builder.name):
            return True
        from torch.utils.cpp_extension import _get_build_directory
        root = _get_build_directory(builder.name, verbose=False)
    except Exception:  # noqa: BLE001 -- only decides whether to say a build is coming
        return False
    return os.path.isfile(os.path.join(root, f"{builder.name}.so"))


def _say(line):
    """Print ``line`` on stderr on rank 0 (before any process group: ``$RANK``)."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(line, file=sys.stderr, flush=True)


def default_backend():
    """``(backend, note)``: DeepSpeed's aio where it builds, else the portable thread pool, with
    the start-up note that names the one in use (and, for the portable one, why)."""
    aio = aio_backend()
    if aio is not None:
        return aio, "NVMe backend: deepspeed-aio"
    return PortableBackend(), f"NVMe backend: portable (os.pwrite/os.pread threads): {aio_unavailable()}"


class _AioOp:
    """A transfer submitted to the shared handle: ``result()`` waits (raising OSError on failure)."""

    def __init__(self, backend, seq, finish=None, error=None):
        self._backend, self.seq, self._finish = backend, seq, finish
        self.error, self.completed = error, error is not None

    def result(self):
        if not self.completed:
            self._backend._drain()
        if self.error is not None:
            raise self.error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class AioBackend:
    """Moves bytes with one DeepSpeed ``aio_handle`` (``async_pwrite`` / ``async_pread``)."""

    name = "deepspeed-aio"

    def __init__(self, handle):
        self.handle = handle
        self.alignment = max(ALIGN, int(handle.get_alignment()))
        self._outstanding = []
        self._seq = 0

    def _submit(self, fn, path, buffer, finish=None):
        self._seq += 1
        rc = fn(buffer, path, 0)
        if rc != 0:
            op = _AioOp(self, self._seq, error=OSError(errno.EIO, f"DeepSpeed aio refused the transfer (rc {rc})"))
            return op
        op = _AioOp(self, self._seq, finish=finish)
        op._buffer = buffer                  # alive until complete
        self._outstanding.append(op)
        return op

    def _drain(self):
        ops, self._outstanding = self._outstanding, []
        if not ops:
            return
        done = self.handle.wait()
        for op in ops:
            op.completed, op._buffer = True, None
            if done != len(ops):
                op.error = OSError(errno.EIO, f"DeepSpeed aio completed {done} of {len(ops)} transfers")

    def _padded(self, view):
        n = view.numel()
        if n % self.alignment == 0:
            return view
        return torch.zeros(aligned(n, self.alignment), dtype=torch.uint8)

    def write(self, path, view, padded):
        buffer = self._padded(view)
        if buffer is not view:
            buffer[:view.numel()].copy_(view)
        return self._submit(self.handle.async_pwrite, path, buffer)

    def read(self, path, view):
        buffer = self._padded(view)
        finish = None if buffer is view else (lambda: view.copy_(buffer[:view.numel()]))
        return self._submit(self.handle.async_pread, path, buffer, finish)

    def close(self):
        self._drain()


def setup_tier(nvme_path, need, rank=0):
    """``fpdt-train``'s NVMe tier before step 1: the backend for the model's stores (DeepSpeed's
    aio where it builds), the free-space preflight for ``need`` (a
    :class:`fpdt.model.layer_checkpoints.NVMeBytes`, per micro-batch and rank), and the start-up
    line naming the backend and those bytes (SSDs have finite write endurance). Returns the line
    and the :class:`NVMeTier` the model's options take; raises NVMeError (one line: directory,
    bytes needed, bytes free) when the drive cannot hold a step. Then, as lines of their own:
    ``rank``'s directory left by a killed run, removed (:func:`fpdt.offload.nvme.reclaim`), and a
    warning when the directory is RAM-backed."""
    from fpdt.offload.nvme import NVMeError, NVMeTier, check_space, filesystem_type, ram_backed, reclaim
    if not os.path.isdir(nvme_path):
        raise NVMeError(f"nvme_path {nvme_path} is not an existing directory; create it (on a local NVMe drive) "
                        "or unset nvme_path")
    check_space(nvme_path, need.total)
    rank_dir = os.path.join(nvme_path, f"rank{rank}")
    lines = [reclaim(rank_dir)] if os.path.lexists(rank_dir) else []
    if ram_backed(nvme_path):
        lines.append(f"warning: nvme_path {nvme_path} is on {filesystem_type(nvme_path)}, which is RAM-backed: what "
                     f"the NVMe tier writes there costs host memory, not disk; point --nvme-path at a local drive")
    backend, note = default_backend()
    first = [backend]
    tier = NVMeTier(lambda: first.pop() if first else default_backend()[0])
    return "\n".join([f"{note}; nvme_path {nvme_path}: layer inputs written {need.total / 2 ** 30:.3g} GiB per "
                       f"micro-batch and rank ({need.words()})", *lines]), tier

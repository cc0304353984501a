"""The device runtime: the one place that talks to streams, events, pinned memory and async copies.

Three implementations of one contract (CUDA semantics): ``cuda`` (``torch.cuda`` streams, events,
pinned memory), ``sync`` (every copy at once, every event complete) and ``sim``
(:mod:`fpdt.offload.sim`). Chosen by the ``runtime`` option (:mod:`fpdt.offload.select`). The
contract of each call: ``docs/attention.md#the-runtimes-contract``.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

RUNTIMES = ("sim", "sync", "cuda")
"""The device runtime names (the ``runtime`` option's strings)."""


class StreamHazardError(RuntimeError):
    """An access the device could run in the wrong order: a missing wait or ``record_stream``."""


@dataclass(frozen=True)
class Role:
    """What a buffer holds: ``kind`` groups counters (``"k"``, ``"layer input"``), ``what``
    names one instance in errors (``"k chunk 3, layer 2"``)."""

    kind: str
    what: str

    def __str__(self) -> str:
        return self.what


@dataclass
class RuntimeCounters:
    """Counters readable by tests and by the memory accountant (all runtimes keep them;
    ``copies_pending`` is only ever non-zero under ``sim``)."""

    bytes_d2h: int = 0
    bytes_h2d: int = 0
    copies_d2h: int = 0
    copies_h2d: int = 0
    host_syncs: int = 0            # host-blocking synchronisations (event or device)
    compute_waits: int = 0         # compute-stream waits on side-stream events (device-side on CUDA)
    copies_pending: int = 0        # issued, not yet run
    peak_copies_pending: int = 0
    fetch_buffers: dict[str, int] = field(default_factory=dict)       # live fetch buffers per role kind
    fetch_bytes: dict[str, int] = field(default_factory=dict)
    peak_fetch_buffers: dict[str, int] = field(default_factory=dict)
    peak_fetch_bytes: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Zero the totals and peaks (live values stay: they describe buffers still held)."""
        self.bytes_d2h = self.bytes_h2d = self.copies_d2h = self.copies_h2d = 0
        self.host_syncs = self.compute_waits = 0
        self.peak_copies_pending = self.copies_pending
        self.peak_fetch_buffers = dict(self.fetch_buffers)
        self.peak_fetch_bytes = dict(self.fetch_bytes)


class Runtime:
    """Base: counters, fetch-buffer tracking and the shared bookkeeping of all runtimes."""

    name = "base"

    def __init__(self) -> None:
        self.counters = RuntimeCounters()
        self._lock = threading.Lock()

    def __copy__(self) -> "Runtime":
        return self

    def __deepcopy__(self, memo) -> "Runtime":
        # a runtime is a shared service (its streams, events and host pool), not a model's
        # state: a copied model (or options object) uses the same one
        return self

    # --- streams and events (implemented per runtime) ---------------------------------
    def new_stream(self, device: torch.device, name: str):
        raise NotImplementedError

    def current_stream(self, device: torch.device):
        raise NotImplementedError

    def record_event(self, stream):
        raise NotImplementedError

    def wait_event(self, stream, event) -> None:
        raise NotImplementedError

    def event_synchronize(self, event) -> None:
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None:
        raise NotImplementedError

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream, role: Role, direction: str) -> None:
        raise NotImplementedError

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A flat host buffer (page-locked when ``pinned``); only :class:`HostBufferPool` calls this."""
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def device_empty(self, shape, dtype: torch.dtype, device: torch.device, role: Role,
                     stream=None) -> torch.Tensor:
        """A fetch buffer allocated on ``stream`` (default: the compute stream, its consumer),
        counted per role kind."""
        t = self._allocate(shape, dtype, device, stream)
        self._track_fetch(t, role)
        return t

    def _allocate(self, shape, dtype, device, stream) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def drain(self) -> None:
        """Run every issued copy (not counted as a host sync; used at context exit and by tests)."""

    def close(self) -> None:
        """Release resources (threads); the runtime is not used afterwards."""

    # --- shared bookkeeping ------------------------------------------------------------
    def _count_copy(self, nbytes: int, direction: str) -> None:
        c = self.counters
        if direction == "d2h":
            c.bytes_d2h += nbytes
            c.copies_d2h += 1
        elif direction == "h2d":
            c.bytes_h2d += nbytes
            c.copies_h2d += 1
        else:
            raise ValueError(f"copy direction {direction!r} must be 'd2h' or 'h2d'")

    def _track_fetch(self, tensor: torch.Tensor, role: Role) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        c, kind = self.counters, role.kind
        with self._lock:
            c.fetch_buffers[kind] = c.fetch_buffers.get(kind, 0) + 1
            c.fetch_bytes[kind] = c.fetch_bytes.get(kind, 0) + nbytes
            c.peak_fetch_buffers[kind] = max(c.peak_fetch_buffers.get(kind, 0), c.fetch_buffers[kind])
            c.peak_fetch_bytes[kind] = max(c.peak_fetch_bytes.get(kind, 0), c.fetch_bytes[kind])
        # the buffer is released when its storage dies (views keep it alive, as on the device)
        weakref.finalize(tensor.untyped_storage(), self._untrack_fetch, kind, nbytes)

    def _untrack_fetch(self, kind: str, nbytes: int) -> None:
        c = self.counters
        with self._lock:
            c.fetch_buffers[kind] -= 1
            c.fetch_bytes[kind] -= nbytes


class _NoStream:
    """A stream of the ``sync`` runtime: everything on it has already run."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<sync stream {self.name}>"


_DONE = object()  # the one event of the sync runtime: always complete


class SyncRuntime(Runtime):
    """Copies run when issued; events are complete; waits are no-ops."""

    name = "sync"

    def __init__(self) -> None:
        super().__init__()
        self._compute = _NoStream("compute")

    def new_stream(self, device, name):
        return _NoStream(name)

    def current_stream(self, device):
        return self._compute

    def record_event(self, stream):
        return _DONE

    def wait_event(self, stream, event) -> None:
        if stream is self._compute:
            self.counters.compute_waits += 1

    def event_synchronize(self, event) -> None:
        self.counters.host_syncs += 1

    def synchronize(self, device) -> None:
        self.counters.host_syncs += 1
        if torch.device(device).type == "cuda":  # sync copies on a GPU still leave kernels queued
            torch.cuda.synchronize(device)

    def record_stream(self, tensor, stream) -> None:
        pass

    def copy(self, dst, src, stream, role, direction) -> None:
        self._count_copy(src.numel() * src.element_size(), direction)
        dst.copy_(src)


class CudaRuntime(Runtime):
    """``torch.cuda`` streams, events and pinned memory."""

    name = "cuda"

    def new_stream(self, device, name):
        return torch.cuda.Stream(device=device)

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def record_event(self, stream):
        return stream.record_event()

    def wait_event(self, stream, event) -> None:
        if stream == torch.cuda.current_stream(stream.device):
            self.counters.compute_waits += 1
        stream.wait_event(event)

    def event_synchronize(self, event) -> None:
        self.counters.host_syncs += 1
        event.synchronize()

    def synchronize(self, device) -> None:
        self.counters.host_syncs += 1
        torch.cuda.synchronize(device)

    def record_stream(self, tensor, stream) -> None:
        tensor.record_stream(stream)

    def _allocate(self, shape, dtype, device, stream) -> torch.Tensor:
        if stream is None:
            return torch.empty(shape, dtype=dtype, device=device)
        with torch.cuda.stream(stream):  # the block belongs to ``stream``'s pool
            return torch.empty(shape, dtype=dtype, device=device)

    def copy(self, dst, src, stream, role, direction) -> None:
        self._count_copy(src.numel() * src.element_size(), direction)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)


# --- selection ------------------------------------------------------------------------

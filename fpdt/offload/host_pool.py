"""A reusable pool of host buffers (pinned when they back a CUDA device), keyed by ``(dtype, numel)``.

Pinning is slow, so offloaded chunks draw their buffers from a process-wide pool; training repeats
its shapes, so after the first step nothing new is allocated. A released buffer carries the event
of the copy that may still read it; the next user's copy stream waits on it. :meth:`HostBufferPool.acquire`
is the one place that allocates host stash memory, which the accountant relies on
(``docs/memory.md``, "What the accountant counts")."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from fpdt.offload.runtime import Runtime
from fpdt.offload.select import resolve_runtime


@dataclass
class PoolStats:
    """Counters for tests and profiling."""

    allocations: int = 0        # host buffers ever created
    reuses: int = 0             # acquisitions served from the free list
    cached_bytes: int = 0       # bytes held in the free list now
    in_use_bytes: int = 0       # bytes acquired and not yet released
    allocated_bytes: int = 0    # bytes of the buffers this pool created and still holds (in use + cached)
    pinned: bool = False


_ALL_POOLS: "weakref.WeakSet[HostBufferPool]" = weakref.WeakSet()
_ALLOCATING = threading.local()


def allocating_host_buffer() -> bool:
    """True while a pool on this thread is creating a host buffer (for memory accounting)."""
    return getattr(_ALLOCATING, "active", False)


def host_bytes_in_use() -> int:
    """Bytes of host buffers currently acquired (not released) from all pools: the host stash."""
    return sum(pool.stats.in_use_bytes for pool in list(_ALL_POOLS))


_PEAKS: "weakref.WeakSet" = weakref.WeakSet()   # open HostPeak / MemoryAccountant objects


def watch_host_peak(watcher) -> None:
    """Call ``watcher._note_host(bytes_in_use)`` at every acquire until :func:`unwatch_host_peak`."""
    _PEAKS.add(watcher)


def unwatch_host_peak(watcher) -> None:
    _PEAKS.discard(watcher)


class HostPeak:
    """The most host-stash bytes in use while it is open: ``with HostPeak() as hp: ...`` then
    ``hp.above_start`` (the peak less what was in use at the start). Exact and cheap; may nest."""

    def __init__(self) -> None:
        self.start = self.peak = host_bytes_in_use()

    def __enter__(self) -> "HostPeak":
        self.start = self.peak = host_bytes_in_use()
        watch_host_peak(self)
        return self

    def __exit__(self, *exc) -> None:
        unwatch_host_peak(self)

    def _note_host(self, in_use: int) -> None:
        self.peak = max(self.peak, in_use)

    @property
    def above_start(self) -> int:
        return max(0, self.peak - self.start)


def _note_host_peak() -> None:
    if _PEAKS:
        live = host_bytes_in_use()
        for watcher in list(_PEAKS):
            watcher._note_host(live)


class HostBufferPool:
    """Free lists of flat host buffers keyed by ``(dtype, numel)``.

    Args:
        pin_memory: allocate page-locked buffers (only meaningful with CUDA present).
        runtime: a :class:`Runtime`, a name, or None (the automatic one: CUDA pinned, CPU pageable)."""

    def __init__(self, pin_memory: bool, runtime: Runtime | str | None = None):
        self.pin_memory = pin_memory
        self.runtime = resolve_runtime(runtime, "cuda" if pin_memory else "cpu")
        self._free: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self.stats = PoolStats(pinned=pin_memory)
        _ALL_POOLS.add(self)

    def acquire(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
                stream=None) -> torch.Tensor:
        """A host tensor of ``shape``/``dtype`` with undefined contents; ``stream`` (the writer) waits
        for the previous user's in-flight copy, else the host waits."""
        numel = 1
        for s in shape:
            numel *= int(s)
        free = self._free[(dtype, numel)]
        if free:
            flat, pending = free.pop()
            self.stats.reuses += 1
            self.stats.cached_bytes -= flat.numel() * flat.element_size()
            if pending is not None:
                if stream is not None:
                    self.runtime.wait_event(stream, pending)   # device-side ordering, host keeps going
                else:
                    self.runtime.event_synchronize(pending)    # rare: a host writer on a buffer still being read
        else:
            _ALLOCATING.active = True
            try:
                flat = self.runtime.host_empty(numel, dtype, self.pin_memory)
            finally:
                _ALLOCATING.active = False
            self.stats.allocations += 1
            self.stats.allocated_bytes += flat.numel() * flat.element_size()
        self.stats.in_use_bytes += flat.numel() * flat.element_size()
        _note_host_peak()
        return flat.view(shape)

    def release(self, tensor: torch.Tensor, after=None) -> None:
        """Return a buffer from :meth:`acquire`; ``after`` marks the last pending copy that reads it."""
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        self._free[(tensor.dtype, flat.numel())].append((flat, after))
        self.stats.cached_bytes += flat.numel() * flat.element_size()
        self.stats.in_use_bytes -= flat.numel() * flat.element_size()

    def empty_cache(self) -> None:
        """Drop every cached buffer (waiting for their pending copies first)."""
        for bufs in self._free.values():
            for _, pending in bufs:
                if pending is not None:
                    self.runtime.event_synchronize(pending)
        self._free.clear()
        self.stats.allocated_bytes -= self.stats.cached_bytes
        self.stats.cached_bytes = 0


_POOLS: "weakref.WeakKeyDictionary[Runtime, dict[bool, HostBufferPool]]" = weakref.WeakKeyDictionary()


def host_pool(device: torch.device | str, runtime: Runtime | str | None = None) -> HostBufferPool:
    """The pool serving ``device`` on ``runtime`` (a :class:`Runtime`, a name, or None), one per runtime."""
    pinned = torch.device(device).type == "cuda"
    runtime = resolve_runtime(runtime, device)
    pools = _POOLS.setdefault(runtime, {})
    if pinned not in pools:
        pools[pinned] = HostBufferPool(pin_memory=pinned, runtime=runtime)
    return pools[pinned]

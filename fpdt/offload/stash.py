"""HostStash: keyed storage of chunks that live on the host between uses.

The FPDT pipelines produce chunks (k̂_j, v̂_j, q̂_i, o_i, lse_i, dô_i, dq_i accumulators,
layer inputs) that are needed again much later. With ``enabled=True`` each ``put``
starts an asynchronous device->host copy into a pooled host buffer, and each
``prefetch``/``get`` brings it back, so at most the chunks the caller is holding live on
the device. With ``enabled=False`` the stash just keeps references to the device
tensors (the "chunking without offload" mode), so callers have one code path.

CUDA ordering (nothing here blocks the host):

* ``put``: the d2h stream waits for an event recorded on the current (compute) stream,
  copies, and records ``done``; ``src.record_stream(d2h)`` keeps the caching allocator
  from handing the source's memory to someone else before the copy has read it.
* ``prefetch``: the h2d stream waits for ``done`` (the host copy must be complete),
  allocates the device tensor *on the h2d stream* and copies into it, recording ``ready``.
* ``get``: the current stream waits for ``ready``; ``dst.record_stream(current)`` so
  freeing it later respects the compute work that reads it.
* host buffers are released to the pool with the event of the last copy reading them.

On CPU the same calls run as plain copies (``put`` copies into a separate pool buffer,
``get`` copies back), so the CPU tests exercise the same bookkeeping.
"""

from __future__ import annotations

from typing import Hashable

import torch

from fpdt.offload.host_pool import HostBufferPool, host_pool
from fpdt.offload.streams import copy_streams


class HostStash:
    """Offload device tensors to host and fetch them back.

    Args:
        device: the compute device of the tensors that will be stored.
        enabled: False keeps device references instead of copying (no offload).
        pool: host buffer pool; defaults to the process-wide pool for ``device``.
    """

    def __init__(self, device: torch.device | str, enabled: bool = True,
                 pool: HostBufferPool | None = None):
        self.device = torch.device(device)
        self.enabled = enabled
        self.pool = pool if pool is not None else host_pool(self.device)
        self._streams = copy_streams(self.device) if enabled else None
        self._host: dict[Hashable, tuple[torch.Tensor, object]] = {}      # key -> (host buf, done event)
        self._inflight: dict[Hashable, tuple[torch.Tensor, object]] = {}  # key -> (device tensor, ready event)
        self._device_refs: dict[Hashable, torch.Tensor] = {}              # enabled=False storage

    def __contains__(self, key: Hashable) -> bool:
        return key in self._host or key in self._device_refs

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under ``key`` (replacing any previous value)."""
        self.discard(key)
        if not self.enabled:
            self._device_refs[key] = tensor
            return
        s = self._streams
        host = self.pool.acquire(tensor.shape, tensor.dtype, stream=s.d2h if s else None)
        if s is None:
            host.copy_(tensor)
            self._host[key] = (host, None)
            return
        produced = torch.cuda.current_stream(self.device).record_event()
        s.d2h.wait_event(produced)  # the copy must see the finished values
        with torch.cuda.stream(s.d2h):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(s.d2h)
        self._host[key] = (host, s.d2h.record_event())

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key`` back to the device (no-op if not offloaded or already in flight)."""
        if not self.enabled or key in self._inflight:
            return
        host, done = self._host[key]
        s = self._streams
        if s is None:
            self._inflight[key] = (host.to(self.device, copy=True), None)
            return
        s.h2d.wait_event(done)  # the device->host copy must have landed
        with torch.cuda.stream(s.h2d):
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
        self._inflight[key] = (dev, s.h2d.record_event())

    def get(self, key: Hashable) -> torch.Tensor:
        """The stored tensor on the device, safe to use on the current stream."""
        if not self.enabled:
            return self._device_refs[key]
        self.prefetch(key)
        dev, ready = self._inflight.pop(key)
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)  # compute must not read before the copy lands
            dev.record_stream(current)
        return dev

    def pop(self, key: Hashable) -> torch.Tensor:
        """:meth:`get` and forget ``key``; its host buffer goes back to the pool."""
        if not self.enabled:
            return self._device_refs.pop(key)
        self.prefetch(key)
        ready = self._inflight[key][1]
        value = self.get(key)
        host, _ = self._host.pop(key)
        self.pool.release(host, after=ready)
        return value

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` without fetching it."""
        self._device_refs.pop(key, None)
        inflight = self._inflight.pop(key, None)
        entry = self._host.pop(key, None)
        if entry is not None:
            host, done = entry
            last = inflight[1] if inflight is not None and inflight[1] is not None else done
            self.pool.release(host, after=last)

    def clear(self) -> None:
        """Forget everything, returning host buffers to the pool."""
        for key in list(self._host) + list(self._device_refs):
            self.discard(key)
        self._inflight.clear()

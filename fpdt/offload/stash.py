"""HostStash: keyed storage of chunks that live on the host between uses.

With ``enabled=True`` each ``put`` starts an asynchronous device->host copy into a pooled host
buffer and each ``prefetch``/``get`` brings it back; with ``enabled=False`` it keeps device
references. Keys are ``(kind, index, ...)``; the kind picks the copy stream
(:mod:`fpdt.offload.streams`) and, with ``label``, names the data in errors. Stream ordering and
the handling of abandoned entries: ``docs/attention.md`` (Device runtime)."""

from __future__ import annotations

from typing import Hashable

import torch

from fpdt.offload.host_pool import HostBufferPool, host_pool
from fpdt.offload.runtime import Role, Runtime
from fpdt.offload.select import resolve_runtime
from fpdt.offload.streams import copy_streams


class HostStash:
    """Offload device tensors to host and fetch them back.

    Args:
        device: the compute device; enabled: False keeps device references (no offload).
        pool: host buffer pool (default: ``device``'s on ``runtime``); label: for errors.
        runtime: a :class:`Runtime`, a name, or None (the ``pool``'s, else ``device``'s automatic one)."""

    def __init__(self, device: torch.device | str, enabled: bool = True,
                 pool: HostBufferPool | None = None, label: str | None = None,
                 runtime: Runtime | str | None = None):
        self.device = torch.device(device)
        self.enabled = enabled
        self.label = label
        if pool is not None and runtime is None:
            runtime = pool.runtime
        self.runtime = resolve_runtime(runtime, self.device)
        if pool is not None and pool.runtime is not self.runtime:
            raise ValueError(f"the host pool runs on the {pool.runtime.name!r} runtime, this stash on "
                             f"{self.runtime.name!r}: pass a pool of the same runtime (fpdt.offload.host_pool("
                             f"device, runtime)), or no pool")
        self.pool = pool if pool is not None else host_pool(self.device, self.runtime)
        self._streams = copy_streams(self.device, self.runtime) if enabled else None
        self._host: dict[Hashable, tuple[torch.Tensor, object]] = {}      # key -> (host buf, done event)
        self._inflight: dict[Hashable, tuple[torch.Tensor, object]] = {}  # key -> (device tensor, ready event)
        self._device_refs: dict[Hashable, torch.Tensor] = {}              # enabled=False storage

    def __contains__(self, key: Hashable) -> bool:
        return key in self._host or key in self._device_refs

    def role(self, key: Hashable) -> Role:
        """What ``key`` holds, for errors and per-kind counters."""
        if isinstance(key, tuple) and len(key) >= 2 and isinstance(key[0], str):
            kind, index = key[0], key[1]
            what = f"{kind}, layer {index}" if kind == "layer input" else f"{kind} chunk {index}"
        else:
            kind, what = "other", f"stash entry {key!r}"
        return Role(kind, what if self.label is None else f"{what}, {self.label}")

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under ``key`` (replacing any value); do not modify ``tensor`` in place afterwards."""
        self.discard(key)
        if not self.enabled:
            self._device_refs[key] = tensor
            return
        rt, role = self.runtime, self.role(key)
        stream = self._streams.for_kind(role.kind)
        host = self.pool.acquire(tensor.shape, tensor.dtype, stream=stream)
        rt.wait_event(stream, rt.record_event(rt.current_stream(self.device)))  # the copy must see the finished values
        rt.copy(host, tensor, stream, role, "d2h")
        rt.record_stream(tensor, stream)  # its memory is not reused before the copy has read it
        done = rt.record_event(stream)
        self._host[key] = (host, done)
        self._streams.after_d2h(done)

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key`` back to the device (no-op if not offloaded or already in flight)."""
        if not self.enabled or key in self._inflight:
            return
        host, done = self._host[key]
        rt, role = self.runtime, self.role(key)
        stream = self._streams.for_kind(role.kind)
        dev = rt.device_empty(host.shape, host.dtype, self.device, role)      # owned by compute, the consumer
        rt.wait_event(stream, rt.record_event(rt.current_stream(self.device)))  # compute is done with this memory
        rt.wait_event(stream, done)                                            # the device->host copy has landed
        rt.copy(dev, host, stream, role, "h2d")
        self._inflight[key] = (dev, rt.record_event(stream))

    def get(self, key: Hashable) -> torch.Tensor:
        """The stored tensor on the device, safe to use on the current stream."""
        if not self.enabled:
            return self._device_refs[key]
        self.prefetch(key)
        dev, ready = self._inflight.pop(key)
        rt = self.runtime
        rt.wait_event(rt.current_stream(self.device), ready)  # compute must not read before the copy lands
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

    def hand_over(self, key: Hashable, dest: "HostStash", dest_key: Hashable) -> None:
        """Move ``key`` into ``dest`` as ``dest_key``: the host buffer itself when both offload into the
        same pool, else pop here and put there."""
        if not (self.enabled and dest.enabled and dest.pool is self.pool) or key in self._inflight:
            dest.put(dest_key, self.pop(key))     # (a fetch in flight reads the buffer: it stays here)
            return
        entry = self._host.pop(key)
        dest.discard(dest_key)
        dest._host[dest_key] = entry

    def token(self, key: Hashable) -> object | None:
        """What ``key`` holds now, as an opaque token for :meth:`discard` (None if nothing)."""
        entry = self._host.get(key)
        return entry[0] if entry is not None else self._device_refs.get(key)

    def discard(self, key: Hashable, token: object | None = None) -> None:
        """Forget ``key`` without fetching it; with ``token``, only if it still holds that value."""
        if token is not None and self.token(key) is not token:
            return
        self._device_refs.pop(key, None)
        inflight = self._inflight.pop(key, None)
        entry = self._host.pop(key, None)
        if entry is None:
            return
        host, done = entry
        last = done
        if inflight is not None:  # a fetch nobody will wait for: its buffer must outlive the copy
            dev, last = inflight
            self.runtime.record_stream(dev, self._streams.for_kind(self.role(key).kind))
        self.pool.release(host, after=last)

    def clear(self) -> None:
        """Forget everything, returning host buffers to the pool."""
        for key in list(self._host) + list(self._device_refs):
            self.discard(key)
        self._inflight.clear()

    def __del__(self) -> None:
        # A stash dropped with entries in it (its backward never ran): its host buffers
        # go back to the pool instead of leaving the pool's books and free lists short.
        try:
            if self._host:
                self.clear()
        except Exception:   # interpreter shutdown: modules may already be gone
            pass

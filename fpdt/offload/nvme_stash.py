"""NVMeStash: a :class:`~fpdt.offload.stash.HostStash` whose entries leave host memory for an
:class:`~fpdt.offload.nvme.NVMeStore`. At most ``2 * staging`` entries hold host buffers however
many are stored; the bytes are those the device->host copy produced (bit-identical results).
An entry's life, ``to_disk``, ``staging=None`` and the flush calls: ``docs/nvme.md#what-goes-to-disk``.
"""

from __future__ import annotations

import itertools
from typing import Callable, Hashable

import torch

from fpdt.offload.nvme import NVMeError, NVMeStore
from fpdt.offload.stash import HostStash

_STASH_IDS = itertools.count()


class NVMeStash(HostStash):
    """A host stash spilling to ``store`` (see the module docstring).

    Args:
        device, runtime, label, pool: as :class:`HostStash` (always offloading).
        store: the :class:`NVMeStore` the entries go to (shared stores are fine: keys are prefixed).
        read_ahead: ``key -> key`` or None, the entry backward fetches after ``key``.
        staging: entries kept landing (and writes kept in flight) before the host waits; None:
            no automatic spill, only :meth:`start_flush` / :meth:`flush` send entries to disk.
        to_disk: ``key -> bool`` or None (every entry), the entries that go to disk.
    """

    def __init__(self, device: torch.device | str, store: NVMeStore, runtime=None, label: str | None = None,
                 read_ahead: Callable[[Hashable], Hashable | None] | None = None, staging: int | None = 2, pool=None,
                 to_disk: Callable[[Hashable], bool] | None = None):
        super().__init__(device, enabled=True, pool=pool, label=label, runtime=runtime)
        self.store, self.read_ahead = store, read_ahead
        self.staging = None if staging is None else max(0, int(staging))
        self.to_disk = to_disk
        self._prefix = ("stash", next(_STASH_IDS))
        self._tokens: dict[Hashable, object] = {}
        self._landing: list[Hashable] = []            # put, not yet confirmed on the host (FIFO)
        self._writing: dict[Hashable, tuple] = {}     # key -> (host, done, handle): write in flight
        self._disk: dict[Hashable, tuple] = {}        # key -> (shape, dtype): on disk only
        self._reading: dict[Hashable, tuple] = {}     # key -> (host, handle): read in flight

    def _skey(self, key):
        return (self._prefix, key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._host or key in self._writing or key in self._disk

    # -- forward: host, then disk

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        super().put(key, tensor)
        self._tokens[key] = object()
        self._landing.append(key)
        if self.staging is not None:
            self._spill(self.staging)

    def _start_writes(self, keep: int) -> None:
        while len(self._landing) > keep:
            key = self._landing.pop(0)
            if key not in self._host or (self.to_disk is not None and not self.to_disk(key)):
                continue                                    # popped already, or kept on the host
            host, done = self._host.pop(key)
            self.runtime.event_synchronize(done)              # the device->host copy has landed
            self._writing[key] = (host, done, self.store.write(self._skey(key), host))

    def _spill(self, keep: int) -> None:
        self._start_writes(keep)
        while len(self._writing) > keep:
            self._retire(next(iter(self._writing)))

    def _retire(self, key: Hashable) -> None:
        host, done, handle = self._writing.pop(key)
        try:
            handle.wait()
        except NVMeError:
            self.pool.release(host, after=done)
            self.store.discard(self._skey(key))
            self._tokens.pop(key, None)
            raise
        self._disk[key] = (host.shape, host.dtype)
        self.pool.release(host, after=done)

    def start_flush(self) -> None:
        """Start the writes of every entry still landing, without waiting for them."""
        self._start_writes(0)

    def flush(self) -> None:
        """Send every entry still on the host to disk and wait for the writes (the host peak
        then holds no entry of this stash)."""
        self._spill(0)

    def read_all(self) -> None:
        """Start reading every entry on disk back to the host (backward's read-ahead of a whole
        layer: the reads run while the caller computes; :meth:`prefetch` waits for each)."""
        for key in list(self._disk):
            self._start_read(key)

    # -- backward: disk, then host, then device

    def _start_read(self, key: Hashable) -> None:
        if key not in self._disk or key in self._reading:
            return
        shape, dtype = self._disk[key]
        host = self.pool.acquire(shape, dtype)            # no stream: the host writes it
        self._reading[key] = (host, self.store.read(self._skey(key), host))

    def _materialize(self, key: Hashable) -> None:
        """Bring ``key`` back into ``self._host`` (no-op if it is there)."""
        if key in self._host:
            return
        if key in self._writing:                            # still has its host buffer
            host, done, handle = self._writing.pop(key)
            handle.wait()
            self.store.discard(self._skey(key))
            self._host[key] = (host, done)
            return
        self._start_read(key)
        host, handle = self._reading.pop(key)
        try:
            handle.wait()
        except NVMeError:
            self.pool.release(host)
            raise
        del self._disk[key]
        self.store.discard(self._skey(key))
        rt = self.runtime
        self._host[key] = (host, rt.record_event(self._streams.for_kind(self.role(key).kind)))

    def prefetch(self, key: Hashable) -> None:
        if key in self._inflight:
            return
        self._materialize(key)
        super().prefetch(key)
        nxt = self.read_ahead(key) if self.read_ahead is not None else None
        if nxt is not None:
            self._start_read(nxt)

    def pop(self, key: Hashable) -> torch.Tensor:
        value = super().pop(key)
        self._forget(key)
        return value

    def hand_over(self, key: Hashable, dest: HostStash, dest_key: Hashable) -> None:
        self._materialize(key)
        super().hand_over(key, dest, dest_key)
        self._forget(key)

    # -- forgetting

    def token(self, key: Hashable) -> object | None:
        return self._tokens.get(key) if key in self else None

    def _forget(self, key: Hashable) -> None:
        self._tokens.pop(key, None)
        if key in self._landing:
            self._landing.remove(key)

    def discard(self, key: Hashable, token: object | None = None) -> None:
        if token is not None and self.token(key) is not token:
            return
        if key in self._writing:
            host, done, handle = self._writing.pop(key)
            try:
                handle.wait()
            except NVMeError:
                pass                     # the entry is being dropped: its failed write does not matter
            self.pool.release(host, after=done)
        if key in self._reading:
            host, handle = self._reading.pop(key)
            try:
                handle.wait()
            except NVMeError:
                pass
            self.pool.release(host)
        self._disk.pop(key, None)
        self.store.discard(self._skey(key))
        self._forget(key)
        super().discard(key)

    def clear(self) -> None:
        for key in list(self._writing) + list(self._disk) + list(self._host):
            self.discard(key)
        super().clear()

    def __del__(self) -> None:
        try:
            if self._host or self._writing or self._disk:
                self.clear()
        except Exception:   # interpreter shutdown, or the store already closed
            pass

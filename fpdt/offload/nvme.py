"""NVMeStore: keyed, asynchronous storage of host tensors in files under ``{nvme_path}/rank{R}/``.

The storage of the NVMe tier alone (what goes there is the caller's choice). ``write`` / ``read``
return an :class:`IOHandle` at once; its ``wait()`` raises :class:`NVMeError` in one line, or under
:meth:`NVMeStore.deferred_faults` records it. One run's stores belong to an :class:`NVMeTier`.
Layout, alignment, cleanup, reclaiming and backends: ``docs/nvme.md``.
"""

import contextlib
import gc
import errno as errno_mod
import itertools
import json
import os
import shutil
import socket
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

ALIGN = 4096
MARKER = ".fpdt-nvme"
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


class NVMeError(RuntimeError):
    """An NVMe tier failure, with one line naming the file and what to do."""


def aligned(nbytes, align=ALIGN):
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-int(nbytes) // align) * align


def _byte_view(t, what):
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise TypeError(f"NVMeStore.{what} takes a contiguous CPU tensor; got "
                        f"{type(t).__name__ if not isinstance(t, torch.Tensor) else f'{t.device} {tuple(t.shape)}'}"
                        " (call .contiguous() / copy it to the host first)")
    return t.reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Preflight


def check_space(path, need_bytes):
    """Raise :class:`NVMeError` (one line: directory, bytes needed, bytes free) unless the
    filesystem holding ``path`` has ``need_bytes`` free. Returns the free bytes."""
    free = shutil.disk_usage(path).free
    if need_bytes > free:
        raise NVMeError(f"nvme_path {path}: needs {int(need_bytes):,} bytes, {free:,} free; "
                        "free space there, point nvme_path at a larger drive, or shorten the sequence")
    return free


def filesystem_type(path, mounts_text=None):
    """The filesystem type of the mount holding ``path`` (the longest mount point that
    contains it) from ``/proc/mounts`` (or ``mounts_text``, the same format); None if unknown."""
    if mounts_text is None:
        try:
            with open("/proc/mounts") as f:
                mounts_text = f.read()
        except OSError:
            return None
    real = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, fields[2]
    return best_type


def ram_backed(path, mounts_text=None):
    """True when ``path`` is on tmpfs or ramfs: files there are host memory."""
    return filesystem_type(path, mounts_text) in RAM_FILESYSTEMS


def warn_if_ram_backed(path, mounts_text=None):
    fs = filesystem_type(path, mounts_text)
    if fs in RAM_FILESYSTEMS:
        warnings.warn(f"nvme_path {path} is on {fs}, which is RAM-backed: what the NVMe tier writes there costs "
                      "host memory, not disk; point nvme_path at a local drive", stacklevel=3)
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Backends


class PortableBackend:
    """Moves bytes with ``os.pwrite`` / ``os.preadv`` on a thread pool (the GIL is released in
    both). Files are opened plainly (buffered), so any filesystem works, tmpfs included."""

    name = "portable"

    def __init__(self, threads=4):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fpdt-nvme")

    @staticmethod
    def _write(path, view, padded):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            mv, done = memoryview(view.numpy()), 0
            while done < len(mv):
                done += os.pwrite(fd, mv[done:], done)
            if padded > len(mv):
                os.ftruncate(fd, padded)
        finally:
            os.close(fd)

    @staticmethod
    def _read(path, view):
        fd = os.open(path, os.O_RDONLY)
        try:
            mv, done = memoryview(view.numpy()), 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], done)
                if n == 0:
                    raise OSError(errno_mod.EIO, f"short read: {done} of {len(mv)} bytes")
                done += n
        finally:
            os.close(fd)

    def write(self, path, view, padded):
        """Start writing the uint8 tensor ``view`` to ``path`` (file size ``padded``); returns a
        waitable whose ``result()`` raises the ``OSError``."""
        return self._pool.submit(self._write, path, view, padded)

    def read(self, path, view):
        return self._pool.submit(self._read, path, view)

    def close(self):
        self._pool.shutdown(wait=True)


class IOHandle:
    """One transfer in flight; ``wait()`` returns once it is complete, or raises NVMeError."""

    def __init__(self, op, key, path, pending, keep=(), store=None):
        self._op, self.key, self.path, self._store = op, key, path, store
        self._pending, self._keep = pending, keep
        self._error, self._done = None, False

    def done(self):
        return self._done

    def wait(self):
        if not self._done:
            try:
                self._pending.result()
            except OSError as e:
                self._error = NVMeError(f"NVMe {self._op} of {self.key!r} to {self.path} failed: "
                                        f"{e.strerror or e} (errno {e.errno}); free space or check the drive, "
                                        "or unset nvme_path")
            finally:
                self._done, self._pending, self._keep = True, None, ()
            if self._error is not None and self._store is not None and self._store.defer_faults:
                self._store.fault = self._store.fault or self._error
                self._error = None
        if self._error is not None:
            raise self._error


# ---------------------------------------------------------------------------------------------
# The store


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_our_file(name):
    return name == MARKER or (name.endswith(".bin") and name[:-4].isdigit())


def reclaim(rank_dir):
    """Remove a ``rank_dir`` left by a killed run: only if it carries our marker, the process
    named there is gone, and it holds nothing but files the store names. Raises NVMeError otherwise.
    Returns the one line that says what was removed."""
    marker = os.path.join(rank_dir, MARKER)
    if not os.path.isfile(marker):
        raise NVMeError(f"nvme_path: {rank_dir} exists and was not created by fpdt (no {MARKER} marker); "
                        "it is left untouched: remove it yourself or choose another nvme_path")
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError):
        info = {}
    pid, host = info.get("pid"), info.get("host")
    if host == socket.gethostname() and pid == os.getpid():
        raise NVMeError(f"nvme_path: {rank_dir} is in use by another NVMeStore of this process; "
                        "share that store (one NVMeTier) or give each its own nvme_path")
    if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
        raise NVMeError(f"nvme_path: {rank_dir} is in use by running process {pid} on {host}; "
                        "give each run its own nvme_path")
    names = os.listdir(rank_dir)
    foreign = sorted(n for n in names if not _is_our_file(n))
    if foreign:
        raise NVMeError(f"nvme_path: {rank_dir} carries fpdt's marker but also holds files fpdt did not write "
                        f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); it is left untouched: "
                        "remove it yourself or choose another nvme_path")
    size = 0
    for n in names:
        if n != MARKER:
            size += os.path.getsize(os.path.join(rank_dir, n))
            os.unlink(os.path.join(rank_dir, n))
    os.unlink(marker)
    os.rmdir(rank_dir)
    return (f"nvme_path: removed {rank_dir}, left by a run that did not end cleanly (process {pid} on {host}): "
            f"{len(names) - 1} file(s), {size / 2 ** 30:.3g} GiB")


class NVMeStore:
    """Keyed asynchronous storage of CPU tensors in ``{nvme_path}/rank{rank}/`` (module docstring).

    ``need_bytes``, when given, is checked against the free space first (:func:`check_space`).
    ``backend`` defaults to a :class:`PortableBackend`; a backend passed in is closed with the store.
    Counters: ``bytes_written`` / ``bytes_read`` (padded bytes, as the drive sees them)."""

    def __init__(self, nvme_path, rank=0, backend=None, need_bytes=None):
        if not isinstance(nvme_path, (str, os.PathLike)):
            raise TypeError(f"nvme_path must be a directory path (str); got {type(nvme_path).__name__}")
        nvme_path = os.fspath(nvme_path)
        if not os.path.isdir(nvme_path):
            raise NVMeError(f"nvme_path {nvme_path} is not an existing directory; create it (on a local NVMe drive) "
                            "or unset nvme_path")
        self.nvme_path, self.rank = nvme_path, int(rank)
        self.dir = os.path.join(nvme_path, f"rank{self.rank}")
        self._files, self._writes, self._pending = {}, {}, set()
        self._names = itertools.count()
        self._closed = True
        self.bytes_written = self.bytes_read = 0
        if need_bytes is not None:
            check_space(nvme_path, need_bytes)
        self.ram_backed = warn_if_ram_backed(nvme_path)
        if os.path.lexists(self.dir):
            gc.collect()        # a store of this process no longer referenced removes its directory
        if os.path.lexists(self.dir):
            warnings.warn(reclaim(self.dir), stacklevel=2)
        os.mkdir(self.dir, 0o700)
        with open(os.path.join(self.dir, MARKER), "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "created": time.time()}, f)
        self.backend = backend if backend is not None else PortableBackend()
        self.defer_faults, self.fault = False, None
        self._closed = False
        # closes what is left at interpreter exit; holds no reference to the store
        self._finalizer = weakref.finalize(self, _remove_files, self.dir, self._files, self.backend)

    # -- faults

    @contextlib.contextmanager
    def deferred_faults(self):
        """Within it, a failed transfer's :meth:`IOHandle.wait` records its :class:`NVMeError`
        (the first one, for :meth:`take_fault`) and returns instead of raising, so that a rank
        whose drive fails runs its step to the end and every collective still lines up; the
        caller checks once per step (``fpdt-train`` does, before the optimizer step)."""
        before, self.defer_faults = self.defer_faults, True
        try:
            yield self
        finally:
            self.defer_faults = before

    def take_fault(self):
        """The first :class:`NVMeError` recorded under :meth:`deferred_faults` since the last
        call, or None; it is cleared."""
        fault, self.fault = self.fault, None
        return fault

    # -- transfers

    def _check_open(self):
        if self._closed:
            raise NVMeError(f"NVMeStore at {self.dir} is closed")

    def _track(self, handle):
        self._pending.add(handle)
        if len(self._pending) > 64:
            self._pending = {h for h in self._pending if not h.done()}
        return handle

    def write(self, key, tensor):
        """Start writing ``tensor`` (contiguous, CPU) under ``key``, replacing what was there."""
        self._check_open()
        view = _byte_view(tensor, "write")
        previous = self._writes.pop(key, None)
        if previous is not None:
            previous.wait()
        path = self._files.get(key)
        if path is None:
            path = self._files[key] = os.path.join(self.dir, f"{next(self._names)}.bin")
        padded = aligned(view.numel())
        handle = IOHandle("write", key, path, self.backend.write(path, view, padded), keep=(view,), store=self)
        self.bytes_written += padded
        self._writes[key] = handle
        return self._track(handle)

    def read(self, key, out):
        """Start reading ``key`` into ``out`` (contiguous, CPU, as many bytes as were written)."""
        self._check_open()
        path = self._files.get(key)
        if path is None:
            raise KeyError(f"NVMeStore: no key {key!r} stored in {self.dir}")
        view = _byte_view(out, "read")
        pending = self._writes.pop(key, None)
        if pending is not None:
            pending.wait()
        self.bytes_read += aligned(view.numel())
        return self._track(IOHandle("read", key, path, self.backend.read(path, view), keep=(view,), store=self))

    def __contains__(self, key):
        return key in self._files

    def __len__(self):
        return len(self._files)

    def discard(self, key):
        """Remove ``key``'s file (after its write, if in flight). A missing key is a no-op."""
        pending = self._writes.pop(key, None)
        if pending is not None:
            try:
                pending.wait()
            finally:
                path = self._files.pop(key, None)
                if path is not None:
                    _unlink(path)
            return
        path = self._files.pop(key, None)
        if path is not None:
            _unlink(path)

    # -- lifetime

    def close(self, raise_errors=True):
        """Wait for transfers in flight, then remove every file this store created, its marker
        and its directory. Idempotent. The first transfer error is raised after the cleanup
        (unless ``raise_errors`` is False)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        first = None
        for h in list(self._pending):
            try:
                h.wait()
            except NVMeError as e:
                first = first or e
        self._pending.clear()
        self._writes.clear()
        try:
            self.backend.close()
        finally:
            for path in self._files.values():
                _unlink(path)
            self._files.clear()
            _unlink(os.path.join(self.dir, MARKER))
            try:
                os.rmdir(self.dir)
            except OSError:
                pass        # something foreign was put there meanwhile: leave it
        if first is not None and raise_errors:
            raise first

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(raise_errors=exc_type is None)
        return False

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close(raise_errors=False)


class NVMeTier:
    """The NVMe stores of one model or run: one :class:`NVMeStore` per ``(nvme_path, rank)``,
    opened on first use with ``backend_factory()`` (None: :class:`PortableBackend`). Callers
    that share a store keep their keys apart (each prefixes its own). A context manager: the
    exit closes every store it opened (their files removed)."""

    def __init__(self, backend_factory=None):
        self.backend_factory = backend_factory or PortableBackend
        self._stores = {}

    def store(self, nvme_path, rank=0):
        """The open store of ``(nvme_path, rank)``, opened now if it is not."""
        key = (os.path.realpath(os.fspath(nvme_path)), int(rank))
        store = self._stores.get(key)
        if store is None or store._closed:
            store = self._stores[key] = NVMeStore(nvme_path, rank, backend=self.backend_factory())
        return store

    def open_stores(self):
        """The stores opened and not yet closed."""
        return [s for s in self._stores.values() if not s._closed]

    def close(self, raise_errors=True):
        """Close every store of this tier; the first error is raised after all are closed."""
        first = None
        for store in self._stores.values():
            try:
                store.close(raise_errors=raise_errors)
            except NVMeError as e:
                first = first or e
        self._stores.clear()
        if first is not None:
            raise first

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(raise_errors=exc_type is None)
        return False


def _remove_files(rank_dir, files, backend):
    """What :meth:`NVMeStore.close` removes, for a store left open at interpreter exit."""
    try:
        backend.close()
    finally:
        for path in files.values():
            _unlink(path)
        _unlink(os.path.join(rank_dir, MARKER))
        try:
            os.rmdir(rank_dir)
        except OSError:
            pass


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""Device-memory accountant: live tensor bytes, split into device working set and host stash.

``with MemoryAccountant() as acct: with acct.phase("fwd"): ...``, then
``acct.phases["fwd"].peak_above_start`` is the working set in bytes. Counts every storage created
inside the context (earlier tensors are the baseline), host stash apart from device;
``limit_bytes`` raises :class:`SimulatedOutOfMemoryError` past a simulated capacity. What is and
is not seen: ``docs/memory.md`` (What the accountant counts).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fpdt.layout import hidden_bytes
from fpdt.offload import HostPeak, allocating_host_buffer, host_bytes_in_use, unwatch_host_peak, watch_host_peak


def chunk_unit(chunk_tokens: int, hidden: int, itemsize: int = 2) -> int:
    """``U``: bytes of one chunk of ``chunk_tokens`` hidden states (bf16 by default)."""
    return hidden_bytes(chunk_tokens, hidden, itemsize)


def sequence_unit(seq_tokens: int, hidden: int, itemsize: int = 2) -> int:
    """``Nd``: bytes of one full-sequence hidden tensor of ``seq_tokens`` tokens (bf16 by default)."""
    return hidden_bytes(seq_tokens, hidden, itemsize)


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """The counted device bytes passed the accountant's simulated capacity (``limit_bytes``)."""


@dataclass
class PhaseMemory:
    """Memory of one named phase (aggregated over every time it ran). Bytes throughout.

    ``start``/``end``/``peak``: counted device bytes live when the phase (last) began, when
    it (last) ended, and the highest while it ran; ``peak_above_start``: the largest
    ``peak - start`` of any single run (the phase's own working set). ``host_peak``: the
    most host-stash bytes in use while it ran. ``cuda_allocated_peak`` /
    ``cuda_reserved_peak``: the CUDA allocator's peaks while it ran (None off CUDA).
    """

    name: str
    calls: int = 0
    start: int = 0
    end: int = 0
    peak: int = 0
    peak_above_start: int = 0
    host_peak: int = 0
    cuda_allocated_peak: int | None = None
    cuda_reserved_peak: int | None = None
    peak_tensors: list[tuple[str, tuple, torch.dtype, int]] | None = None
    """With ``detail=True``: ``(op, shape, dtype, bytes)`` of every counted device storage live
    at the phase's highest ``peak - start`` (op = the aten op that created it)."""
    _run_peak: int = field(default=0, repr=False)


class _CountingMode(TorchDispatchMode):
    """Reports every op's output tensors to the accountant."""

    def __init__(self, accountant: "MemoryAccountant"):
        super().__init__()
        self._acct = accountant

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._acct._on_op(func, args, kwargs, out)
        return out


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in an aten op's arguments or result: a tensor, or (nested) lists/tuples."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _tensors(e)]
    return []


_ACTIVE: list["MemoryAccountant"] = []   # accountants inside their ``with`` block
_RESIZE = torch.UntypedStorage.resize_


def _counting_resize(storage, size):
    out = _RESIZE(storage, size)
    for acct in list(_ACTIVE):
        acct._on_resize(storage._cdata, storage.nbytes())
    return out


def _storage_key(t: torch.Tensor):
    if t.is_meta or t.layout != torch.strided:
        return None, None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None, None
    return storage._cdata, storage


class MemoryAccountant:
    """Count live tensor bytes created inside the ``with`` block on ``device`` (default: cuda if
    available, else cpu; elsewhere only host-stash buffers). ``detail``: each storage's creating op,
    listed at every phase's peak (slower). Bytes: ``device_live``/``_peak``, ``host_live``/``_peak``,
    :attr:`phases`; :meth:`summary` as a dict.
    """

    def __init__(self, device: torch.device | str | None = None, detail: bool = False,
                 limit_bytes: int | None = None):
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.limit_bytes = limit_bytes
        self.limit_exceeded = False
        self.device_live = 0
        self.device_peak = 0
        self.host_peak = 0
        self._host_base: int | None = None   # host-stash bytes already in use at the first __enter__
        self.phases: dict[str, PhaseMemory] = {}
        self._tracked: dict[int, tuple[int, bool]] = {}   # storage key -> (bytes, is host stash)
        self._detail: dict[int, tuple[str, tuple, torch.dtype, int]] | None = {} if detail else None
        self._active: list[PhaseMemory] = []
        self._lock = threading.Lock()
        self._mode: _CountingMode | None = None
        self._cuda = self.device.type == "cuda"
        self._cpu = self.device.type == "cpu"
        self.cuda_allocated_peak: int | None = None
        self.cuda_reserved_peak: int | None = None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "MemoryAccountant":
        if self._mode is not None:
            raise RuntimeError("MemoryAccountant is already active; use one `with` block at a time")
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_allocated_peak = self.cuda_reserved_peak = 0
        if self._host_base is None:  # buffers a previous user left acquired are baseline too
            self._host_base = host_bytes_in_use()
        self.host_peak = max(self.host_peak, self.host_live)
        watch_host_peak(self)
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _counting_resize
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._fold_cuda()   # while still active: _fold_cuda does nothing once _mode is None
        self._mode.__exit__(*exc)
        self._mode = None
        unwatch_host_peak(self)
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _RESIZE

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseMemory]:
        """Record the peak of the enclosed work under ``name`` (phases may nest and repeat)."""
        ph = self.phases.setdefault(name, PhaseMemory(name))
        self._fold_cuda()
        ph.calls += 1
        ph.start = ph._run_peak = self.device_live
        ph.peak = max(ph.peak, self.device_live)
        ph.host_peak = max(ph.host_peak, self.host_live)
        self._active.append(ph)
        try:
            yield ph
        finally:
            self._fold_cuda()
            self._active.remove(ph)
            ph.end = self.device_live
            ph.peak_above_start = max(ph.peak_above_start, ph._run_peak - ph.start)

    def set_limit(self, limit_bytes: int | None) -> None:
        """Simulated capacity for the counted device bytes from now on (None: no limit)."""
        self.limit_bytes = limit_bytes

    def reset_peak(self) -> None:
        """Restart :attr:`device_peak`/:attr:`host_peak` from the live values (phases are kept)."""
        self._fold_cuda()
        self.device_peak, self.host_peak = self.device_live, self.host_live
        if self._cuda:
            self.cuda_allocated_peak = self.cuda_reserved_peak = 0

    # ------------------------------------------------------------------ figures
    @property
    def host_live(self) -> int:
        """Host-stash bytes in use now beyond those in use at the first ``__enter__``
        (acquired from a host pool and not released)."""
        return max(0, host_bytes_in_use() - (self._host_base or 0))

    def summary(self) -> dict:
        """All figures in bytes: ``device_live``, ``device_peak``, ``host_live``, ``host_peak``,
        ``cuda_allocated_peak``/``cuda_reserved_peak`` (None off CUDA), and per phase
        ``{name: {start, end, peak, peak_above_start, host_peak, calls, cuda_*}}``."""
        self._fold_cuda()
        return {
            "device_live": self.device_live, "device_peak": self.device_peak,
            "host_live": self.host_live, "host_peak": self.host_peak,
            "cuda_allocated_peak": self.cuda_allocated_peak, "cuda_reserved_peak": self.cuda_reserved_peak,
            "phases": {n: {k: v for k, v in vars(p).items() if not k.startswith("_") and k != "name"}
                       for n, p in self.phases.items()},
        }

    # ------------------------------------------------------------------ internals
    def _counts(self, t: torch.Tensor) -> bool:
        if self._cpu:
            return t.is_cpu
        return t.device == self.device or (t.device.type == self.device.type and self.device.index is None)

    def _on_op(self, func, args, kwargs, out) -> None:
        outs = _tensors(out)
        if not outs:
            return
        seen = None   # storage keys of the inputs: an output sharing one is a view or in-place result
        grew = False
        is_host = allocating_host_buffer()
        for t in outs:
            key, storage = _storage_key(t)
            if key is None or key in self._tracked or not (is_host or self._counts(t)):
                continue
            if seen is None:
                seen = {_storage_key(a)[0] for a in _tensors(args)}
                if kwargs:
                    seen.update(_storage_key(a)[0] for a in _tensors(list(kwargs.values())))
            if key in seen:
                continue
            seen.add(key)
            nbytes = storage.nbytes()
            with self._lock:
                self._tracked[key] = (nbytes, is_host)
                if not is_host:
                    self.device_live += nbytes
                    if self._detail is not None:
                        self._detail[key] = (str(func.overloadpacket.__name__), tuple(t.shape), t.dtype, nbytes)
            weakref.finalize(storage, self._on_free, key)
            grew = grew or not is_host
        if grew:
            live = self.device_live
            if live > self.device_peak:
                self.device_peak = live
            if self.limit_bytes is not None and live > self.limit_bytes:
                self.limit_exceeded = True
                raise SimulatedOutOfMemoryError(
                    f"simulated device capacity: {live} counted bytes > limit {self.limit_bytes} "
                    f"(aten.{func.overloadpacket.__name__} output {tuple(outs[0].shape)})")
            for ph in self._active:
                ph.peak = max(ph.peak, live)
                if live > ph._run_peak:
                    ph._run_peak = live
                    if self._detail is not None and live - ph.start > ph.peak_above_start:
                        ph.peak_tensors = sorted(self._detail.values(), key=lambda r: -r[3])

    def _note_host(self, in_use: int) -> None:
        """Called by the host pool at every acquire (the only place host stash grows)."""
        host = max(0, in_use - (self._host_base or 0))
        self.host_peak = max(self.host_peak, host)
        for ph in self._active:
            ph.host_peak = max(ph.host_peak, host)

    def _on_resize(self, key: int, nbytes: int) -> None:
        with self._lock:
            if key not in self._tracked:
                return
            old, is_host = self._tracked[key]
            self._tracked[key] = (nbytes, is_host)
            if self._detail is not None and key in self._detail:
                self._detail[key] = self._detail[key][:3] + (nbytes,)
            if is_host:
                return
            self.device_live += nbytes - old
        if nbytes > old:  # growing in place is an allocation like any other
            live = self.device_live
            self.device_peak = max(self.device_peak, live)
            for ph in self._active:
                ph.peak = max(ph.peak, live)
                ph._run_peak = max(ph._run_peak, live)

    def _on_free(self, key: int) -> None:
        with self._lock:
            nbytes, is_host = self._tracked.pop(key, (0, True))
            if self._detail is not None:
                self._detail.pop(key, None)
            if not is_host:
                self.device_live -= nbytes

    def _fold_cuda(self) -> None:
        """Fold the CUDA allocator's peaks into every active phase, then restart them."""
        if not self._cuda or self._mode is None:
            return
        alloc = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        self.cuda_allocated_peak = max(self.cuda_allocated_peak or 0, alloc)
        self.cuda_reserved_peak = max(self.cuda_reserved_peak or 0, reserved)
        for ph in self._active:
            ph.cuda_allocated_peak = max(ph.cuda_allocated_peak or 0, alloc)
            ph.cuda_reserved_peak = max(ph.cuda_reserved_peak or 0, reserved)
        torch.cuda.reset_peak_memory_stats(self.device)


# ---------------------------------------------------------------------------- one region's peaks

GIB = 2 ** 30


@dataclass(frozen=True)
class MemoryPeaks:
    """Peak memory of one region, bytes (see :class:`RegionMemory` for what each one counts)."""

    allocated: int | None
    """CUDA: ``max_memory_allocated`` (absolute: weights and everything else allocated before
    the region included). CPU: the accountant's device peak, i.e. the most bytes of storages
    created inside the region that were live at once (what existed before is not counted).
    ``None`` on the CPU without counting."""
    reserved: int | None
    """CUDA: ``max_memory_reserved`` (the caching allocator's segments, >= allocated). ``None`` off CUDA."""
    host_stash: int
    """Most host-stash bytes in use (host pool buffers acquired) above those in use at entry."""
    allocated_at_start: int = 0
    """CUDA: ``memory_allocated`` at entry (so ``allocated - allocated_at_start`` is the
    region's own working set); 0 on the CPU, where ``allocated`` already excludes it."""
    source: str = "off"
    """``"cuda"`` (allocator counters), ``"accountant"`` (CPU live-bytes count) or ``"off"``."""
    counted: int | None = None
    """The accountant's device peak (bytes of storages created inside the region live at
    once) where it ran: always on the CPU with counting, on CUDA only with ``count_cuda``."""

    @property
    def working_set(self) -> int | None:
        """Device bytes above what was allocated at entry (same meaning on CUDA and CPU)."""
        return None if self.allocated is None else self.allocated - self.allocated_at_start

    def gib(self) -> dict:
        """``{"peak_mem_gib", "peak_reserved_gib", "host_stash_gib"}`` (None where not measured)."""
        def f(b):
            return None if b is None else b / GIB
        return {"peak_mem_gib": f(self.allocated), "peak_reserved_gib": f(self.reserved),
                "host_stash_gib": f(self.host_stash)}

    def describe(self, above_start: bool = False) -> str:
        """One table cell: ``"1.23 GiB (reserved 1.50 GiB)"`` on CUDA, ``"5.2 MiB (counted)"`` on
        the CPU, ``"n/a"`` when not measured; ``above_start`` uses :attr:`working_set` (reserved
        stays absolute)."""
        alloc = self.working_set if above_start else self.allocated
        if alloc is None:
            return "n/a"
        if self.reserved is not None:
            return f"{format_bytes(alloc)} (reserved {format_bytes(self.reserved)})"
        return f"{format_bytes(alloc)} (counted)"


def format_bytes(n: int) -> str:
    """``"1.50 GiB"`` from 1 GiB up, else ``"12.3 MiB"``."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2 ** 20:.1f} MiB"


class RegionMemory:
    """Peak device and host-stash memory of a ``with`` block, in ``peaks`` (``allocated``,
    ``reserved``, ``host_stash``). CUDA: the allocator's counters, reset on entry (not nestable;
    ``fresh_cache`` empties the cache first); CPU: a :class:`MemoryAccountant` (``count=False``
    skips it, ``count_cuda=True`` runs it on CUDA too), kept as :attr:`accountant`.
    """

    def __init__(self, device: torch.device | str, count: bool = True, count_cuda: bool = False,
                 fresh_cache: bool = False):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._counting = count_cuda if self._cuda else count
        self._fresh_cache = fresh_cache
        self.accountant: MemoryAccountant | None = None
        self.peaks: MemoryPeaks | None = None
        self._host = HostPeak()
        self._start = 0

    def __enter__(self) -> "RegionMemory":
        if self._cuda:
            if self._fresh_cache:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        self._host.__enter__()
        if self._counting:
            self.accountant = MemoryAccountant(self.device).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        acct = self.accountant
        if acct is not None:
            acct.__exit__(*exc)   # on CUDA it folds the allocator's peaks, then resets them
        self._host.__exit__(*exc)
        host, counted = self._host.above_start, None if acct is None else acct.device_peak
        if self._cuda:
            alloc = max(torch.cuda.max_memory_allocated(self.device), (acct and acct.cuda_allocated_peak) or 0)
            reserved = max(torch.cuda.max_memory_reserved(self.device), (acct and acct.cuda_reserved_peak) or 0)
            self.peaks = MemoryPeaks(alloc, reserved, host, self._start, "cuda", counted)
        else:
            self.peaks = MemoryPeaks(counted, None, host, 0, "off" if acct is None else "accountant", counted)

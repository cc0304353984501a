"""The simulated CUDA runtime (``runtime="sim"``): stream semantics on the CPU, hostile by construction.

Copies run as late as CUDA allows (``mode="lazy"``, or ``"threaded"`` with seeded delays), their
destinations hold NaN until then, and unordered or use-after-free accesses raise
:class:`~fpdt.offload.runtime.StreamHazardError` naming the data. What it models, the hazards it
raises, its faults (``fault=``, ``FPDT_SIM_FAULT``) and counters: ``docs/attention.md#the-simulated-runtime``.
"""

from __future__ import annotations

import os
import random
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from fpdt.offload.runtime import Role, Runtime, StreamHazardError

MODES = ("lazy", "threaded")
FAULTS = ("drop_wait", "drop_record_stream")
WAIT_TIMEOUT_S = 60.0
COMPUTE = 0  # index of the compute stream in every vector clock


def _use_count(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


class SimStream:
    """A side (or the compute) stream: a FIFO of copies and a vector clock.

    ``vc[s]`` = how many ops of stream ``s`` the next op issued here is ordered after
    (for the compute stream: its event epoch).
    """

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name
        self.last_kind: str | None = None          # role kind of the last copy issued here
        self.vc: dict[int, int] = {index: 0}
        self.issued = 0
        self.done = 0
        self.queue: deque[_Op] = deque()
        self.retired: deque[_Op] = deque()   # threaded: run, but the host has not seen them complete

    def __repr__(self) -> str:
        return f"<sim stream {self.name}>"


@dataclass(frozen=True)
class SimEvent:
    stream: SimStream
    vc: dict
    kind: str | None = None     # role kind of the stream's last copy when recorded

    @property
    def target(self) -> int:
        return self.vc.get(self.stream.index, 0)


@dataclass
class _View:
    """A tensor kept as (storage, geometry): holding the storage object alone lets the
    simulator see, through its use count, when the program dropped the tensor."""

    storage: object
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> "_View":
        return _View(t.untyped_storage(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def tensor(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(self.storage, self.offset, self.size,
                                                                          self.stride)


@dataclass
class _Op:
    stream: SimStream
    n: int
    vc: dict
    dst: _View
    src: _View
    role: Role
    direction: str

    def desc(self) -> str:
        return f"{self.direction} copy of '{self.role}' on stream '{self.stream.name}'"


@dataclass
class _Info:
    """What the simulator knows about one storage."""

    host: bool = False
    alloc_stream: int = COMPUTE
    recorded: set = field(default_factory=set)     # streams passed to record_stream
    pending: int = 0                               # issued, not yet run ops touching it
    last_write: tuple | None = None                # (stream index, op n, desc)
    reads: dict = field(default_factory=dict)      # stream index -> (op n, desc) since last write


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class SimRuntime(Runtime):
    """See the module docstring. Options left ``None`` come from ``FPDT_SIM_MODE``,
    ``FPDT_SIM_FAULT`` and ``FPDT_SIM_SEED``; ``checks=False`` turns the hazard checks off
    (to show that the hostile data alone catches a fault); ``log=True`` keeps
    ``self.log``, one ``(stream, direction, role)`` entry per issued copy."""

    name = "sim"

    def __init__(self, mode: str | None = None, fault: str | None = None, seed: int | None = None,
                 checks: bool = True, log: bool = False, max_delay_s: float = 0.002,
                 fault_kinds: frozenset | set | None = None):
        super().__init__()
        self.mode = mode or os.environ.get("FPDT_SIM_MODE", "").strip() or "lazy"
        self.fault = fault or os.environ.get("FPDT_SIM_FAULT", "").strip() or None
        self.seed = int(seed if seed is not None else os.environ.get("FPDT_SIM_SEED", "0") or 0)
        if self.mode not in MODES:
            raise ValueError(f"FPDT_SIM_MODE={self.mode!r} must be one of {', '.join(MODES)}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"FPDT_SIM_FAULT={self.fault!r} must be one of {', '.join(FAULTS)} (or unset)")
        self.checks, self.max_delay_s = checks, max_delay_s
        self.fault_kinds = None if fault_kinds is None else frozenset(fault_kinds)
        self.log: list[tuple[str, str, str]] | None = [] if log else None
        self._cond = threading.Condition(threading.RLock())
        self._compute = SimStream(COMPUTE, "compute")
        self._streams: list[SimStream] = [self._compute]
        self._epoch = 0                          # compute events recorded so far
        self._info: dict[int, _Info] = {}        # id(storage object) -> info, dropped when it dies
        self._failure: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._closed = False

    # --- streams and events ------------------------------------------------------------
    def new_stream(self, device, name):
        with self._cond:
            s = SimStream(len(self._streams), name)
            self._streams.append(s)
            if self.mode == "threaded":
                t = threading.Thread(target=self._worker, args=(s, random.Random(self.seed * 7919 + s.index)),
                                     name=f"fpdt-sim-{name}", daemon=True)
                self._threads.append(t)
                t.start()
            return s

    def current_stream(self, device):
        return self._compute

    def record_event(self, stream):
        with self._cond:
            self._check()
            if stream is self._compute:
                self._epoch += 1
                stream.vc[COMPUTE] = self._epoch
            return SimEvent(stream, dict(stream.vc), stream.last_kind)

    def wait_event(self, stream, event) -> None:
        with self._cond:
            self._check()
            if event.stream is stream:
                return  # same-stream order is FIFO already
            if self.fault == "drop_wait" and self._faulty(event.kind):
                return
            if stream is self._compute:
                self.counters.compute_waits += 1
                self._complete(event.stream, event.target)
            for s, k in event.vc.items():
                stream.vc[s] = max(stream.vc.get(s, 0), k)

    def event_synchronize(self, event) -> None:
        with self._cond:
            self.counters.host_syncs += 1
            self._check()
            self._complete(event.stream, event.target)

    def synchronize(self, device) -> None:
        with self._cond:
            self.counters.host_syncs += 1
            self._run_all()

    def drain(self) -> None:
        with self._cond:
            self._run_all()

    def record_stream(self, tensor, stream) -> None:
        if (self.fault == "drop_record_stream" and self._faulty(stream.last_kind)) or stream is self._compute:
            return
        with self._cond:
            self._info_of(tensor.untyped_storage()).recorded.add(stream.index)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)

    # --- memory ------------------------------------------------------------------------
    def host_empty(self, numel, dtype, pinned):
        t = torch.empty(numel, dtype=dtype)  # "pinned" in the model; plain CPU memory here
        with self._cond:
            self._info_of(t.untyped_storage()).host = True
        _poison(t)
        return t

    def device_empty(self, shape, dtype, device, role, stream=None):
        t = super().device_empty(shape, dtype, device, role)
        if stream is not None and stream is not self._compute:
            with self._cond:
                self._info_of(t.untyped_storage()).alloc_stream = stream.index
        _poison(t)  # fresh device memory holds garbage
        return t

    # --- copies ------------------------------------------------------------------------
    def copy(self, dst, src, stream, role, direction) -> None:
        if stream is self._compute:
            raise ValueError("sim: issue copies on a side stream (the compute stream is the host thread)")
        nbytes = src.numel() * src.element_size()
        with self._cond:
            self._check()
            stream.issued += 1
            stream.last_kind = role.kind
            stream.vc[stream.index] = stream.issued
            op = _Op(stream, stream.issued, dict(stream.vc), _View.of(dst), _View.of(src), role, direction)
            if self.checks:
                self._check_order(op, op.src, "reads")
                self._check_order(op, op.dst, "writes")
            self._count_copy(nbytes, direction)
            dst_info = self._info_of(op.dst.storage)
            if dst_info.pending == 0:
                _poison(dst)  # nothing pending touches it: the destination is undefined from now on
            for v in (op.src, op.dst):
                self._info_of(v.storage).pending += 1
            c = self.counters
            c.copies_pending += 1
            c.peak_copies_pending = max(c.peak_copies_pending, c.copies_pending)
            if self.log is not None:
                self.log.append((stream.name, direction, role.what))
            stream.queue.append(op)
            self._cond.notify_all()

    # --- internals (all called with self._cond held) -------------------------------------
    def _faulty(self, kind: str | None) -> bool:
        return self.fault_kinds is None or kind in self.fault_kinds

    def _info_of(self, storage) -> _Info:
        key = id(storage)
        info = self._info.get(key)
        if info is None:
            info = self._info[key] = _Info()
            weakref.finalize(storage, self._forget, key)
        return info

    def _forget(self, key: int) -> None:
        with self._cond:
            self._info.pop(key, None)

    def _check(self) -> None:
        """Raise a failure seen by a worker thread, or a tensor freed under a pending copy."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self.checks:
            for s in self._streams:
                for op in s.queue:
                    self._check_alive(op)

    def _check_alive(self, op: _Op) -> None:
        for view, verb in ((op.src, "reads"), (op.dst, "writes")):
            info = self._info_of(view.storage)
            if info.host or _use_count(view.storage) > 1:
                continue  # host buffers belong to the pool; a live tensor is not reusable
            if op.stream.index == info.alloc_stream or op.stream.index in info.recorded:
                continue  # the allocator keeps it until the copy has run
            raise StreamHazardError(
                f"'{op.role}' was freed while the {op.desc()}, which {verb} it, had not run; its memory can be "
                f"reused by the caching allocator before the copy runs: call record_stream(tensor, "
                f"'{op.stream.name}') or keep the tensor until the copy's event completes")

    def _check_order(self, op: _Op, view: _View, verb: str) -> None:
        info = self._info_of(view.storage)
        prior = [info.last_write] if info.last_write else []
        if verb == "writes":
            prior += [(s, n, d) for s, (n, d) in info.reads.items()]
        for s, n, desc in prior:
            if s != op.stream.index and op.vc.get(s, 0) < n:
                raise StreamHazardError(
                    f"the {op.desc()} {verb} memory that the {desc} also touches, and nothing orders the two: "
                    f"make stream '{op.stream.name}' wait on an event recorded after that copy")
        if not info.host and info.alloc_stream != op.stream.index and op.vc.get(COMPUTE, 0) < self._epoch:
            raise StreamHazardError(
                f"the {op.desc()} {verb} device memory of '{op.role}' without waiting for the compute stream's "
                f"latest event: record an event on the compute stream after the tensor is ready and make "
                f"'{op.stream.name}' wait on it before the copy")
        entry = (op.stream.index, op.n, op.desc())
        if verb == "writes":
            info.last_write, info.reads = entry, {}
        else:
            info.reads[op.stream.index] = entry[1:]

    def _execute(self, op: _Op) -> None:
        if self.checks:
            self._check_alive(op)
        op.dst.tensor().copy_(op.src.tensor())
        for v in (op.src, op.dst):
            self._info_of(v.storage).pending -= 1
        op.stream.done += 1
        op.stream.queue.popleft()
        if self.mode == "threaded":  # the host drops it (_release): a worker never frees memory
            op.stream.retired.append(op)
        self.counters.copies_pending -= 1
        self._cond.notify_all()

    def _ready(self, op: _Op) -> bool:
        return all(s == COMPUTE or s == op.stream.index or self._streams[s].done >= k for s, k in op.vc.items())

    def _complete(self, stream: SimStream, target: int) -> None:
        """Block the host until ``stream`` has run its first ``target`` ops."""
        if stream is self._compute:
            return
        if self.mode == "lazy":
            while stream.done < target:
                op = stream.queue[0]
                for s, k in op.vc.items():  # what the op waited on runs first
                    if s != stream.index:
                        self._complete(self._streams[s], k)
                self._execute(op)
            return
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while stream.done < target:
            self._check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise StreamHazardError(f"sim: stream '{stream.name}' did not reach op {target} within "
                                        f"{WAIT_TIMEOUT_S:.0f}s (a wait that can never complete?)")
            self._cond.wait(timeout=min(left, 1.0))
        self._release(stream, target)

    def _release(self, stream: SimStream, target: int) -> None:
        """Threaded mode: drop the run ops the host now knows complete (the first ``target`` of
        ``stream`` and what they waited on), where the lazy mode would have run and dropped them."""
        while stream.retired and stream.retired[0].n <= target:
            op = stream.retired.popleft()
            for s, k in op.vc.items():
                if s not in (COMPUTE, stream.index):
                    self._release(self._streams[s], k)

    def _run_all(self) -> None:
        self._check()
        for s in self._streams[1:]:
            self._complete(s, s.issued)
        self._check()

    def _worker(self, stream: SimStream, rng: random.Random) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closed and not (stream.queue and self._ready(stream.queue[0])):
                        self._cond.wait(timeout=1.0)
                    if self._closed:
                        return
                delay = rng.uniform(0.0, self.max_delay_s)
                if delay:
                    time.sleep(delay)
                with self._cond:
                    self._execute(stream.queue[0])
        except BaseException as e:  # handed to the host at its next runtime call
            with self._cond:
                self._failure = e
                self._cond.notify_all()

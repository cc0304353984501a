"""RegionMemory / HostPeak: the per-region figures the trainer and the profiling scripts
report (CPU: the accountant's device peak; any device: the host-stash peak at the pool)."""

from __future__ import annotations

import pytest
import torch

from fpdt.offload import HostBufferPool, HostPeak
from fpdt.memory.accountant import GIB, MemoryAccountant, MemoryPeaks, RegionMemory

MIB = 2 ** 20


def test_host_peak_is_the_highest_in_use_sum_above_start():
    pool = HostBufferPool(pin_memory=False)
    held = pool.acquire((64,), torch.float32)                    # 256 B in use before: baseline
    with HostPeak() as outer:
        with HostPeak() as inner:
            a = pool.acquire((100,), torch.float32)              # 400
            b = pool.acquire((50,), torch.float64)               # 400: 800 above start
            pool.release(a)
            c = pool.acquire((10,), torch.float32)               # 440 above start
            pool.release(b)
            pool.release(c)
        d = pool.acquire((100,), torch.float32)                  # reused buffer: 400 above start
        pool.release(d)
    pool.release(held)
    assert inner.above_start == 800
    assert outer.above_start == 800
    with HostPeak() as later:                                    # closed ones no longer move
        pool.release(pool.acquire((1000,), torch.float32))
    assert inner.above_start == 800 and later.above_start == 4000


def test_accountant_sees_a_host_acquire_without_a_following_op():
    pool = HostBufferPool(pin_memory=False)
    pool.release(pool.acquire((256,), torch.bfloat16))           # cached: reuse runs no aten op
    with MemoryAccountant("cpu") as acct:
        buf = pool.acquire((256,), torch.bfloat16)
        pool.release(buf)
    assert acct.host_peak == 512 and acct.device_peak == 0


def test_region_memory_on_cpu_is_the_accountant_peak():
    keep = torch.ones(10_000)                                    # baseline: not counted
    with RegionMemory("cpu") as rm:
        x = torch.empty(1000)                                    # 4000 B
        y = torch.empty(500)                                     # 2000 B: 6000 live
        del x
        z = keep[:10] * 2                                        # 40 B: 2040 live
    peaks = rm.peaks
    assert (peaks.allocated, peaks.reserved, peaks.host_stash, peaks.source) == (6000, None, 0, "accountant")
    assert peaks.counted == 6000
    assert peaks.working_set == 6000
    assert peaks.gib() == {"peak_mem_gib": 6000 / GIB, "peak_reserved_gib": None, "host_stash_gib": 0.0}
    assert "counted" in peaks.describe()
    del y, z


def test_region_memory_without_counting():
    with RegionMemory("cpu", count=False) as rm:
        torch.empty(1000)
    assert rm.peaks == MemoryPeaks(None, None, 0, 0, "off")
    assert rm.peaks.describe() == "n/a" and rm.peaks.gib()["peak_mem_gib"] is None


def test_describe_on_cuda_shows_reserved_beside_allocated():
    p = MemoryPeaks(allocated=3 * GIB, reserved=4 * GIB, host_stash=0, allocated_at_start=GIB, source="cuda")
    assert p.describe() == "3.00 GiB (reserved 4.00 GiB)"
    assert p.describe(above_start=True) == "2.00 GiB (reserved 4.00 GiB)"
    small = MemoryPeaks(allocated=5 * 2 ** 20 + 2 ** 19, reserved=None, host_stash=0, source="accountant")
    assert small.describe() == "5.5 MiB (counted)"


class FakeCudaAllocator:
    """Stands in for the torch.cuda memory counters, so the CUDA branch runs on the CPU."""

    def __init__(self):
        self.allocated = self.peak = self.reserved = self.reserved_peak = 0

    def malloc(self, n):
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak, self.reserved_peak = max(self.peak, self.allocated), max(self.reserved_peak, self.reserved)

    def free(self, n):
        self.allocated -= n

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.reserved_peak)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def reset(self, device=None):
        self.peak, self.reserved_peak = self.allocated, self.reserved

    def empty_cache(self):
        self.reserved = self.allocated


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCudaAllocator()
    fake.install(monkeypatch)
    fake.malloc(1000 * MIB)        # weights: allocated before the region
    fake.malloc(500 * MIB)
    fake.free(500 * MIB)           # a cached block: reserved 1500 MiB
    return fake


@pytest.mark.parametrize("count_cuda", [False, True])
def test_region_memory_on_cuda_reads_allocated_and_reserved(fake_cuda, count_cuda):
    with RegionMemory("cuda", count_cuda=count_cuda, fresh_cache=True) as rm:   # reserved back to 1000
        fake_cuda.malloc(300 * MIB)
        fake_cuda.free(300 * MIB)
        fake_cuda.malloc(50 * MIB)
    p = rm.peaks
    assert (p.allocated, p.reserved, p.allocated_at_start, p.working_set, p.source) == \
        (1300 * MIB, 1300 * MIB, 1000 * MIB, 300 * MIB, "cuda")
    assert (p.counted is not None) == count_cuda        # CPU tensors: not counted on a cuda accountant
    assert p.describe(above_start=True) == "300.0 MiB (reserved 1.27 GiB)"


def test_accountant_on_cuda_folds_the_allocator_peak_at_exit(fake_cuda):
    with MemoryAccountant("cuda") as acct:          # no phase: only __exit__ folds
        fake_cuda.malloc(700 * MIB)
        fake_cuda.free(700 * MIB)
    assert acct.cuda_allocated_peak == 1700 * MIB and acct.cuda_reserved_peak == 1700 * MIB

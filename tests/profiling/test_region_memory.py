"""RegionMemory / HostPeak: the per-region figures the trainer and the profiling scripts
report (CPU: the accountant's device peak; any device: the host-stash peak at the pool)."""

from __future__ import annotations

import torch

from fpdt.offload import HostBufferPool, HostPeak
from fpdt.profiling.memory import GIB, MemoryAccountant, MemoryPeaks, RegionMemory


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
    assert p.describe() == "3.00 GiB (reserved 4.00)"
    assert p.describe(above_start=True) == "2.00 GiB (reserved 4.00)"

"""The accountant counts exactly what it claims: new storages once, frees, host stash apart."""

import pytest
import torch

from fpdt.offload import HostBufferPool, HostStash
import fpdt.memory.accountant as memory_module
from fpdt.memory.accountant import MemoryAccountant, chunk_unit, sequence_unit


def test_counts_new_storages_once_and_frees_them():
    pre = torch.zeros(1000)                         # baseline: never counted
    with MemoryAccountant("cpu") as acct:
        a = torch.empty(256, dtype=torch.float32)   # 1024 bytes
        view = a[10:20].view(2, 5)                  # a view: no new bytes
        a.add_(1.0)                                 # in place: no new bytes
        b = pre + 1.0                               # 4000 bytes
        assert acct.device_live == 1024 + 4000
        del b
        assert acct.device_live == 1024
        del a
        assert acct.device_live == 1024             # the view still holds the storage
        del view
        assert acct.device_live == 0
    assert acct.device_peak == 1024 + 4000


def test_phase_peaks_nest_and_repeat():
    with MemoryAccountant("cpu") as acct:
        keep = torch.empty(100, dtype=torch.uint8)
        with acct.phase("outer") as outer:
            for n in (300, 200):
                with acct.phase("inner"):
                    tmp = torch.empty(n, dtype=torch.uint8)
                    del tmp
        del keep
    inner = acct.phases["inner"]
    assert inner.calls == 2 and inner.start == 100 and inner.peak == 400 and inner.peak_above_start == 300
    assert outer.peak == 400 and outer.peak_above_start == 300 and outer.end == 100


def test_host_pool_buffers_are_host_stash_not_device():
    pool = HostBufferPool(pin_memory=False)
    x = torch.randn(64, 16)                         # 4096 bytes, baseline
    with MemoryAccountant("cpu") as acct:
        stash = HostStash("cpu", enabled=True, pool=pool)
        stash.put("x", x)                           # one pool buffer: host stash, not device
        assert acct.device_live == 0 and pool.stats.in_use_bytes == 4096
        assert acct.host_live >= 4096
        y = stash.pop("x")                          # the copy back is device working set
        assert acct.device_live == 4096 and pool.stats.in_use_bytes == 0
        del y
    assert acct.host_peak >= 4096 and acct.device_peak == 4096
    assert pool.stats.allocated_bytes == 4096 and pool.stats.cached_bytes == 4096


def test_units():
    assert chunk_unit(1024, 256) == 1024 * 256 * 2
    assert sequence_unit(4096, 512, itemsize=4) == 4096 * 512 * 4


def test_summary_is_plain_numbers_off_cuda():
    with MemoryAccountant("cpu") as acct, acct.phase("p"):
        t = torch.ones(8)
    s = acct.summary()
    assert s["device_peak"] == 32 and s["cuda_allocated_peak"] is None and s["phases"]["p"]["peak"] == 32
    del t


@pytest.mark.cuda
def test_cuda_peaks_are_reported_beside_the_count():
    dev = torch.device("cuda")
    with MemoryAccountant(dev) as acct, acct.phase("p"):
        t = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        del t
    ph = acct.phases["p"]
    assert ph.peak == 1 << 20
    assert ph.cuda_allocated_peak >= 1 << 20 and ph.cuda_reserved_peak >= ph.cuda_allocated_peak


def test_host_buffers_acquired_before_entry_are_baseline():
    """Stash buffers another user still holds are not this measurement's host tier."""
    from fpdt.offload import HostBufferPool
    from fpdt.memory.accountant import MemoryAccountant

    pool = HostBufferPool(pin_memory=False)
    held = pool.acquire((1024,), torch.float32)
    with MemoryAccountant(device="cpu") as acct:
        mine = pool.acquire((256,), torch.float32)
        pool.release(mine)
    pool.release(held)
    assert acct.host_peak == 256 * 4


def test_storage_resize_is_counted():
    """``UntypedStorage.resize_`` is not an aten op: the accountant hooks it while active (a
    recomputed layer output shrunk to 0 bytes is gone; growing in place is a new peak)."""
    with MemoryAccountant("cpu") as acct:
        y = torch.empty(1000)
        assert acct.device_live == 4000
        y.untyped_storage().resize_(0)
        assert acct.device_live == 0
        y.untyped_storage().resize_(8000)
        assert acct.device_live == acct.device_peak == 8000
        outside = torch.empty(10)   # existed before? no: created inside, counted
    before = torch.empty(100)       # created outside: resizing it inside is not counted
    with MemoryAccountant("cpu") as acct:
        before.untyped_storage().resize_(0)
        assert acct.device_live == 0
    assert torch.UntypedStorage.resize_ is memory_module._RESIZE  # unhooked on exit
    del y, outside


def test_simulated_capacity_raises_at_the_allocation():
    """With a limit the accountant acts as a device of that size: the op that passes it raises
    an out-of-memory error (forward or backward), what fitted before is untouched."""
    from fpdt.memory.accountant import SimulatedOutOfMemoryError
    assert issubclass(SimulatedOutOfMemoryError, torch.OutOfMemoryError)
    with MemoryAccountant("cpu", limit_bytes=1000) as acct:
        a = torch.empty(200)                                   # 800 B: fits
        with pytest.raises(SimulatedOutOfMemoryError, match="limit 1000"):
            torch.empty(100)                                   # 1200 B would not
        assert acct.limit_exceeded and acct.device_live == 800
        acct.set_limit(None)
        b = torch.empty(1000)                                  # no limit any more
        assert acct.device_live == 800 + 4000
        del a, b
    x = torch.randn(64, 64, requires_grad=True)
    with MemoryAccountant("cpu") as acct:
        y = (x @ x).sin().sum()                                # forward fits without a limit
        acct.set_limit(acct.device_live + 100)                 # backward's gradients will not
        with pytest.raises(torch.OutOfMemoryError, match="simulated device capacity"):
            y.backward()
    assert acct.limit_exceeded

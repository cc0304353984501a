import pytest
import torch

from fpdt.attention import fpdt_attention
from fpdt.offload import HostBufferPool, HostStash, fresh_runtime, host_pool, named_runtime


def test_stash_roundtrip_copies_to_separate_host_memory():
    pool = HostBufferPool(pin_memory=False)
    stash = HostStash("cpu", enabled=True, pool=pool)
    x = torch.randn(3, 4)
    want = x.clone()
    stash.put("a", x)                # x must not change until the copy has read it (as on CUDA)
    stash.prefetch("a")
    got = stash.pop("a")             # waits for the copies
    x.add_(1.0)                      # the stash gave back a copy, not a reference
    torch.testing.assert_close(got, want)
    assert got.data_ptr() != x.data_ptr()
    assert "a" not in stash and pool.stats.cached_bytes == x.numel() * 4


def test_disabled_stash_keeps_references():
    stash = HostStash("cpu", enabled=False)
    x = torch.randn(2)
    stash.put("k", x)
    assert stash.get("k") is x and stash.pop("k") is x


def test_pool_reuses_buffers_across_calls():
    """Offloaded attention draws host buffers from the pool: a second identical call allocates nothing new."""
    pool = host_pool("cpu")
    q, k = torch.randn(1, 16, 4, 8, requires_grad=True), torch.randn(1, 16, 2, 8, requires_grad=True)
    fpdt_attention(q, k, k, num_chunks=4, offload=True).sum().backward()
    before = pool.stats.allocations
    fpdt_attention(q, k, k, num_chunks=4, offload=True).sum().backward()
    assert pool.stats.allocations == before
    assert pool.stats.reuses > 0


def test_no_grad_pass_leaves_nothing_in_host_memory():
    """A no-grad forward (first pass of a checkpointed layer) offloads only what the forward itself needs."""
    import fpdt.offload.stash as stash_mod
    seen = []
    original = stash_mod.HostStash.put

    def spy(self, key, tensor):
        seen.append(key[0])
        return original(self, key, tensor)

    stash_mod.HostStash.put = spy
    try:
        q = torch.randn(1, 16, 4, 8, requires_grad=True)
        with torch.no_grad():
            out = fpdt_attention(q, q, q, num_chunks=4, offload=True)
    finally:
        stash_mod.HostStash.put = original
    assert out.shape == q.shape and set(seen) == {"k", "v"}


def test_stash_and_pool_share_the_runtime_given():
    """runtime= picks the stash's runtime and its pool (one pool per runtime); a given pool
    brings its own runtime, and a pool of another runtime is refused."""
    with fresh_runtime("sim") as rt:
        pool = host_pool("cpu", rt)
        assert pool is not host_pool("cpu") and host_pool("cpu") is host_pool("cpu", "sync")
        assert HostStash("cpu", runtime=rt).pool is pool and HostStash("cpu", pool=pool).runtime is rt
        assert HostStash("cpu").runtime is named_runtime("sync")          # the automatic one on the CPU
        with pytest.raises(ValueError, match="the host pool runs on the 'sim' runtime, this stash on 'sync'"):
            HostStash("cpu", pool=pool, runtime="sync")

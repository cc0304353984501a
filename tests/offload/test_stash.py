import torch

from fpdt.attention import fpdt_attention
from fpdt.offload import HostBufferPool, HostStash, host_pool


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

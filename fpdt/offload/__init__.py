"""Host offload machinery: pinned buffer pool, copy streams and the chunk stash."""

from fpdt.offload.host_pool import HostBufferPool, PoolStats, host_pool
from fpdt.offload.stash import HostStash
from fpdt.offload.streams import CopyStreams, copy_streams

__all__ = ["CopyStreams", "HostBufferPool", "HostStash", "PoolStats", "copy_streams", "host_pool"]

"""Host offload machinery: the device runtime, pinned buffer pool, copy streams and the chunk stash."""

from fpdt.offload.host_pool import (HostBufferPool, HostPeak, PoolStats, allocating_host_buffer, host_bytes_in_use,
                                    host_pool, unwatch_host_peak, watch_host_peak)
from fpdt.offload.runtime import Role, Runtime, RuntimeCounters, StreamHazardError
from fpdt.offload.select import default_runtime_name, fresh_runtime, named_runtime, resolve_runtime, runtime_name
from fpdt.offload.stash import HostStash
from fpdt.offload.streams import CopyStreams, copy_streams

__all__ = ["CopyStreams", "HostBufferPool", "HostPeak", "HostStash", "PoolStats", "Role", "Runtime",
           "RuntimeCounters", "StreamHazardError", "allocating_host_buffer", "copy_streams", "default_runtime_name",
           "fresh_runtime", "host_bytes_in_use", "host_pool", "named_runtime", "resolve_runtime", "runtime_name",
           "unwatch_host_peak", "watch_host_peak"]

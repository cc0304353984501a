"""The offload side streams of one device, and the bound on how far the host runs ahead.

Three streams (FPDT, arXiv 2408.16978, Fig. 7's double buffer): compute; ``chunks`` (the attention
chunks, both directions); ``inputs`` (layer inputs and hidden-state chunks ``T_i``). Created once
per device and runtime. After every device->host copy the compute stream waits for the copy
issued ``D2H_RUN_AHEAD`` earlier, so the memory in flight is a fixed number of chunks.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch

from fpdt.offload.runtime import Runtime

D2H_RUN_AHEAD = 6           # device->host copies in flight before compute waits (one chunk's put of T, k, v, q, o, lse)
# role kinds carried by the ``inputs`` stream: hidden-state chunks (the streamed residual, fpdt.model.streaming)
INPUT_KINDS = frozenset({"T", "layer input", "residual", "residual grad", "branch grad"})


class CopyStreams:
    """The side streams owned by the offload machinery for one device on one runtime."""

    def __init__(self, runtime: Runtime, device: torch.device):
        self.runtime, self.device = runtime, device
        self.chunks = runtime.new_stream(device, "chunks")
        self.inputs = runtime.new_stream(device, "inputs")
        self._d2h_done: deque = deque()

    def for_kind(self, kind: str):
        """The stream that copies data of role ``kind``."""
        return self.inputs if kind in INPUT_KINDS else self.chunks

    def after_d2h(self, done) -> None:
        """Register a device->host copy's completion event; keep at most ``D2H_RUN_AHEAD`` in flight."""
        self._d2h_done.append(done)
        if len(self._d2h_done) > D2H_RUN_AHEAD:
            rt = self.runtime
            # compute waits (device-side on CUDA) for the copy D2H_RUN_AHEAD copies back
            rt.wait_event(rt.current_stream(self.device), self._d2h_done.popleft())


_STREAMS: "weakref.WeakKeyDictionary[Runtime, dict[tuple, CopyStreams]]" = weakref.WeakKeyDictionary()


def copy_streams(device: torch.device | str, runtime: Runtime) -> CopyStreams:
    """The shared copy streams of ``device`` on ``runtime``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    per_device = _STREAMS.setdefault(runtime, {})
    key = (device.type, device.index)
    if key not in per_device:
        per_device[key] = CopyStreams(runtime, device)
    return per_device[key]

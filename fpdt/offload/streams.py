"""Copy streams: one device->host and one host->device side stream per CUDA device.

Created once per device and reused by every call (creating streams per call is both
slow and a source of unordered work). On CPU there are no streams: every helper
degrades to plain synchronous behaviour so the same code path runs in CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CopyStreams:
    """The side streams owned by the offload machinery for one CUDA device."""

    d2h: "torch.cuda.Stream"
    h2d: "torch.cuda.Stream"


_STREAMS: dict[int, CopyStreams] = {}


def copy_streams(device: torch.device) -> CopyStreams | None:
    """The shared copy streams of a CUDA ``device``; ``None`` for non-CUDA devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        with torch.cuda.device(index):
            _STREAMS[index] = CopyStreams(d2h=torch.cuda.Stream(), h2d=torch.cuda.Stream())
    return _STREAMS[index]

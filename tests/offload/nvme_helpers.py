"""What the NVMe store's tests share (tests/offload/test_nvme.py, tests/train/test_nvme_aio.py):
tensors of every dtype, and the two backends."""

import os

import pytest
import torch

from fpdt.offload.nvme import PortableBackend

BACKENDS = ("portable", pytest.param("deepspeed-aio", marks=pytest.mark.slow))
"""Parameters of a test run on both backends: DeepSpeed's aio JIT-builds its op at first use
(minutes; cached in ~/.cache/torch_extensions), hence ``slow``."""


def tensor(dtype, n, seed=0):
    """``n`` random values of ``dtype`` (int64 over its whole range)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-2**62, 2**62, (n,), generator=g, dtype=torch.int64)
    return torch.randn(n, generator=g).to(dtype)


def aio_factory():
    """A maker of DeepSpeed aio backends. Skips, with the reason, only where the op cannot build
    (libaio missing); with ``FPDT_REQUIRE_AIO=1`` (set by ``.ci/run`` where it installed libaio)
    that is a failure instead."""
    from fpdt.train.nvme_aio import aio_backend, aio_unavailable
    first = aio_backend()
    if first is None:
        if os.environ.get("FPDT_REQUIRE_AIO") == "1":
            pytest.fail(f"FPDT_REQUIRE_AIO=1 but {aio_unavailable()}")
        pytest.skip(aio_unavailable())
    made = [first]

    def make():
        return made.pop() if made else aio_backend()
    return make


def backend_factory(name):
    """A maker of ``name``'s backends (one of :data:`BACKENDS`)."""
    return PortableBackend if name == "portable" else aio_factory()

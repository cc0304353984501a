import os

import pytest
import torch

# pytest puts the repository root on sys.path (tests/ is a package), so `tests.distributed` and
# the `profiling` scripts import here and in spawned workers (which copy sys.path); processes
# started with a fresh interpreter find them through PYTHONPATH.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("PYTHONPATH", ROOT)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fp32_gemms():
    """bf16 matrix products on the CPU computed in fp32, below any counting mode (``tests/fp32_gemms.py``):
    for tests that count memory or ops, on CPUs whose bf16 GEMM is 30-40x slower than fp32."""
    from tests.fp32_gemms import Fp32Gemms

    with Fp32Gemms():
        yield


@pytest.fixture
def outputs_only_attention(monkeypatch):
    """The CPU attention op allocates its outputs and computes nothing (``tests/outputs_only.py``):
    for tests that count memory, the same bytes without the quadratic FLOPs."""
    from tests.outputs_only import outputs_only

    outputs_only(monkeypatch)

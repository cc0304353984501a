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

"""NVMeStore through DeepSpeed's async I/O (fpdt/train/nvme_aio.py).

Skipped, with the reason, only where DeepSpeed's aio cannot build (libaio missing); with
``FPDT_REQUIRE_AIO=1`` (set by ``.ci/run`` where it installed libaio) that is a failure instead
(tests/offload/nvme_helpers.py). The first use JIT-builds the op (minutes; cached in
~/.cache/torch_extensions), hence ``slow``. The round trip of every dtype and size runs on both
backends in tests/offload/test_nvme.py."""

import os
import warnings

import pytest
import torch

from fpdt.offload.nvme import NVMeStore, PortableBackend
from fpdt.train.nvme_aio import AioBackend, aio_backend, aio_unavailable, default_backend
from tests.offload.nvme_helpers import aio_factory, tensor


def test_without_libaio_none_with_the_reason(monkeypatch):
    """Where the op cannot build: None and the fix named; the default falls back to the portable backend."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    assert aio_backend() is None
    assert "libaio is missing (apt-get install -y libaio-dev, as root)" in aio_unavailable()
    backend, note = default_backend()
    try:
        assert isinstance(backend, PortableBackend) and note.startswith("NVMe backend: portable") and "libaio" in note
    finally:
        backend.close()


@pytest.fixture(scope="module")
def backend_factory():
    """DeepSpeed's aio (its first load JIT-builds the op, minutes, hence the tests' ``slow`` mark)."""
    return aio_factory()


@pytest.fixture
def store(tmp_path, backend_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = NVMeStore(tmp_path, rank=0, backend=backend_factory())
    assert s.backend.name == "deepspeed-aio" and isinstance(s.backend, AioBackend)
    yield s
    s.close()


@pytest.mark.slow
def test_aio_many_keys_in_flight(store):
    ts = {("layer", i, j): tensor(torch.bfloat16, 5000 + 4096 * i + j, seed=10 * i + j) for i in range(6) for j in range(3)}
    handles = [store.write(k, t) for k, t in ts.items()]
    for h in reversed(handles):
        h.wait()
    outs = {k: torch.empty_like(t) for k, t in ts.items()}
    reads = [store.read(k, outs[k]) for k in ts]
    for h in reads:
        h.wait()
    for k, t in ts.items():
        assert torch.equal(outs[k].view(torch.int16), t.view(torch.int16)), k


@pytest.mark.slow
def test_aio_read_after_unwaited_write_and_close_cleans(tmp_path, backend_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = NVMeStore(tmp_path, rank=5, backend=backend_factory())
    t = tensor(torch.float32, 123_457)
    s.write("k", t)
    out = torch.empty_like(t)
    s.read("k", out).wait()
    assert torch.equal(out, t)
    s.write("j", t)                       # in flight at close
    s.close()
    assert os.listdir(tmp_path) == []


def test_trainer_setup_line_and_preflight(tmp_path, monkeypatch):
    """fpdt-train's tier set-up: the start-up line names the backend and the bytes per step; too
    little space, or no directory, is one ConfigError line before step 1."""
    from types import SimpleNamespace

    from deepspeed.ops.op_builder import AsyncIOBuilder

    import fpdt.offload.nvme as nvme
    from fpdt.cli.train import _nvme_tier
    from fpdt.train.config import ConfigError
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)   # no JIT build here
    plan = SimpleNamespace(seq_len=4096, sp=2)
    config = SimpleNamespace(num_layers=5, hidden_size=64)
    opts = SimpleNamespace(nvme_path=str(tmp_path), checkpoint_device_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tier, (line,) = _nvme_tier(opts, plan, config, "bf16")
    per_layer = 2048 * 64 * 2
    assert line.startswith("NVMe backend: portable") and f"4 layers x {per_layer:,} bytes" in line, line
    assert isinstance(tier, nvme.NVMeTier) and not tier.open_stores()      # opened by the model, on first use
    store = tier.store(tmp_path, 0)
    assert isinstance(store.backend, PortableBackend)
    tier.close()
    assert _nvme_tier(SimpleNamespace(nvme_path=None), plan, config, "bf16") == (None, ())
    # nvme_layers=2 of the 4 offloaded, saving the first 3 layers' attention outputs (2 files per chunk)
    config = SimpleNamespace(num_layers=5, hidden_size=64, num_heads=4, head_dim=16)
    plan2 = SimpleNamespace(seq_len=4096, sp=2, num_chunks=2)
    saving = SimpleNamespace(nvme_path=str(tmp_path), checkpoint_device_layers=1, nvme_layers=2,
                             attention_checkpoint="save", save_attention_layers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tier, (line,) = _nvme_tier(saving, plan2, config, "bf16")
    per_saved = 2048 * 4 * (16 * 2 + 4) + 2 * 2 * 4096
    assert f"(2 layers x {per_layer:,} bytes + 2 saved attention outputs x {per_saved:,} bytes)" in line, line
    tier.close()
    huge = SimpleNamespace(seq_len=2 ** 50, sp=1)
    with pytest.raises(ConfigError, match=f"nvme_path {tmp_path}: needs .* bytes, .* free"):
        _nvme_tier(opts, huge, config, "bf16")
    with pytest.raises(ConfigError, match="not an existing directory"):
        _nvme_tier(SimpleNamespace(nvme_path=str(tmp_path / "nope"), checkpoint_device_layers=0), plan, config, "bf16")

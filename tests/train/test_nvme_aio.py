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


HF_CFG = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2 ** 41)


def _tier(tmp_path, seq_len=4096, micro=1, **options):
    """fpdt-train's tier set-up for a 5-layer model (hidden 64, 4 heads of 16) on 2 ranks, 2 chunks."""
    from fpdt.cli.train import _nvme_tier
    from fpdt.plan import load_model_config
    from fpdt.train.config import TrainerOptions, load_ds_config, validate
    cfg = load_model_config(HF_CFG)
    ds = {**load_ds_config(None, "cpu")[0], "train_micro_batch_size_per_gpu": micro}
    opts = TrainerOptions(sp=2, chunk_size=seq_len // 2, checkpointing="offload", offload=True, runtime="sim",
                          nvme_path=str(tmp_path), **options)
    plan = validate(opts, seq_len, 2, "cpu", ds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _nvme_tier(opts, plan, cfg, ds, "bf16"), (cfg, plan, opts, ds)


def test_trainer_setup_line_and_preflight(tmp_path, monkeypatch):
    """fpdt-train's tier set-up: the start-up line names the backend and the bytes per micro-batch;
    too little space, or no directory, is one ConfigError line before step 1."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    import fpdt.offload.nvme as nvme
    from fpdt.train.config import ConfigError
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)   # no JIT build here
    (tier, (line,)), _ = _tier(tmp_path, checkpoint_device_layers=1)
    per_layer = 2048 * 64 * 2
    assert line.startswith("NVMe backend: portable") and f"(4 layers x {per_layer:,} bytes)" in line, line
    assert isinstance(tier, nvme.NVMeTier) and not tier.open_stores()      # opened by the model, on first use
    store = tier.store(tmp_path, 0)
    assert isinstance(store.backend, PortableBackend)
    tier.close()
    # nvme_layers=2 of the 4 offloaded, saving the first 3 layers' attention outputs (2 files per chunk)
    (tier, (line,)), _ = _tier(tmp_path, checkpoint_device_layers=1, nvme_layers=2, attention_checkpoint="save",
                               save_attention_layers=3)
    per_saved = 2048 * 4 * (16 * 2 + 4) + 2 * 2 * 4096
    assert f"(2 layers x {per_layer:,} bytes + 2 saved attention outputs x {per_saved:,} bytes)" in line, line
    tier.close()
    with pytest.raises(ConfigError, match=f"nvme_path {tmp_path}: needs .* bytes, .* free"):
        _tier(tmp_path, seq_len=2 ** 40)
    with pytest.raises(ConfigError, match="not an existing directory"):
        _tier(tmp_path / "nope")


def test_the_nvme_bytes_count_the_micro_batch_and_streaming(tmp_path, monkeypatch):
    """One count (:func:`fpdt.model.layer_checkpoints.nvme_bytes`) for the planner's disk figure,
    the free-space preflight and the start-up line: a micro-batch of 2 writes twice the tokens;
    streamed, the last layer stays on the host and each layer input is one file per chunk."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from fpdt.plan import trainer_run
    from fpdt.plan.decide import nvme_need
    from fpdt.plan.memory_model import nvme_tier_bytes
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    (tier, (line,)), (cfg, plan, opts, ds) = _tier(tmp_path, micro=2, attention_checkpoint="save")
    tier.close()
    per_layer, per_saved = 2 * 2048 * 64 * 2, 2 * 2048 * 4 * (16 * 2 + 4) + 2 * 2 * 4096
    assert f"(5 layers x {per_layer:,} bytes + 5 saved attention outputs x {per_saved:,} bytes)" in line, line
    need = nvme_need(cfg, plan, opts, ds, "bf16")
    assert need.total == 5 * (per_layer + per_saved)
    setup = trainer_run.planned_setup(plan, opts, ds, "bf16", "cpu")
    assert setup.batch == 2 and nvme_tier_bytes(cfg, setup)[0] == need.total           # the planner's figure
    one = nvme_need(cfg, plan, opts, {**ds, "train_micro_batch_size_per_gpu": 1}, "bf16")
    assert 2 * one.per_layer == need.per_layer and 2 * (one.per_saved - 4 * 4096) == need.per_saved - 4 * 4096
    (tier, (line,)), _ = _tier(tmp_path, micro=2, stream_layers=True)
    tier.close()
    assert f"(4 layers x {per_layer:,} bytes)" in line, line        # the last layer: read first, on the host

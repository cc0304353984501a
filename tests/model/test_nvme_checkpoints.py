"""``nvme_path``: the offloaded layer-input checkpoints go on to files (fpdt/offload/nvme_stash.py),
with loss and gradients bit-identical (``torch.equal``) to the host-only run, on the simulated
CUDA runtime on the CPU; files read back one layer ahead and removed once popped."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import fpdt.model as fm
from fpdt.offload.nvme import MARKER, NVMeStore, NVMeTier
from fpdt.offload.nvme_stash import NVMeStash
from tests.model.helpers import hf_config, tokens



_TIERS: dict = {}


def _tier(path, backend_factory=None):
    """The test's NVMeTier of ``path`` (the model's ``nvme_tier``); the fixture closes it."""
    if path not in _TIERS:
        _TIERS[path] = NVMeTier(backend_factory)
    return _TIERS[path]

def _step(name, layers, nvme_path, ids, labels, **options):
    cfg = hf_config(name).to_dict() | {"num_hidden_layers": layers}
    torch.manual_seed(3)
    model = fm.from_config(cfg, checkpointing="offload", offload=True, runtime="sim", nvme_path=nvme_path,
                          nvme_tier=_tier(nvme_path) if nvme_path else None, **options)
    loss = model(**model.prepare_inputs(ids, labels=labels))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model


@pytest.fixture
def nvme_dir(tmp_path):
    yield str(tmp_path)
    _TIERS.pop(str(tmp_path), NVMeTier()).close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name,layers,u,attention", [("llama_gqa", 6, 2, "recompute"), ("llama_bias", 5, 3, "save"),
                                                     ("qwen2_tied", 5, 1, "recompute")])
def test_bit_identical_to_host_only(nvme_dir, name, layers, u, attention):
    vocab = hf_config(name).vocab_size
    ids, labels = tokens(vocab, 2, 12 * u)
    opts = dict(num_chunks=u, attention_checkpoint=attention)
    ref_loss, ref_grads, _ = _step(name, layers, None, ids, labels, **opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # tmp_path may be on tmpfs
        loss, grads, model = _step(name, layers, nvme_dir, ids, labels, **opts)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), n
    stash = model._checkpoints.stash
    assert isinstance(stash, NVMeStash)
    store = stash.store
    assert isinstance(store, NVMeStore) and store.dir == os.path.join(nvme_dir, "rank0")
    # with the default staging of 2, the first layers - 4 inputs went to disk and were read back
    x_bytes = 2 * 12 * u * hf_config(name).hidden_size * 4   # [B, S, hidden] fp32, one rank
    assert store.bytes_written >= (layers - 2) * x_bytes
    assert store.bytes_read >= (layers - 4) * x_bytes > 0
    assert len(stash._disk) == len(stash._writing) == len(stash._host) == 0
    assert sorted(os.listdir(store.dir)) == [MARKER]         # every popped entry's file is gone


def test_flush_leaves_no_entry_on_the_host(nvme_dir):
    """NVMeStash.flush sends everything to disk; the values come back exact."""
    from fpdt.offload import fresh_runtime
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = _tier(nvme_dir).store(nvme_dir, 0)
    with fresh_runtime("sim") as rt:
        stash = NVMeStash("cpu", store, runtime=rt, read_ahead=lambda k: (k[0], k[1] - 1) if k[1] > 0 else None)
        xs = [torch.randn(3, 17, generator=torch.Generator().manual_seed(i)) for i in range(5)]
        for i, x in enumerate(xs):
            stash.put(("layer input", i), x)
        stash.flush()
        assert not stash._host and len(stash._disk) == 5
        for i in reversed(range(5)):
            assert torch.equal(stash.pop(("layer input", i)), xs[i])
        assert not stash._disk and not stash._reading
        stash.put(("layer input", 9), xs[0])
        stash.flush()
        stash.discard(("layer input", 9))
    assert sorted(os.listdir(store.dir)) == [MARKER]


@pytest.mark.slow
def test_bit_identical_through_deepspeed_aio(nvme_dir, monkeypatch):
    """The same, with the model's store on DeepSpeed's aio (O_DIRECT) where it builds (its first
    use JIT-builds the op, hence slow; FPDT_REQUIRE_AIO=1 turns the skip into a failure)."""
    from fpdt.train.nvme_aio import AioBackend, aio_backend, aio_unavailable
    if aio_backend() is None:
        if os.environ.get("FPDT_REQUIRE_AIO") == "1":
            pytest.fail(f"FPDT_REQUIRE_AIO=1 but {aio_unavailable()}")
        pytest.skip(aio_unavailable())
    _tier(nvme_dir, aio_backend)
    ids, labels = tokens(hf_config("llama_gqa").vocab_size, 2, 24)
    ref_loss, ref_grads, _ = _step("llama_gqa", 6, None, ids, labels, num_chunks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, grads, model = _step("llama_gqa", 6, nvme_dir, ids, labels, num_chunks=2)
    assert isinstance(model._checkpoints.stash.store.backend, AioBackend)
    assert model._checkpoints.stash.store.bytes_read > 0
    assert torch.equal(loss, ref_loss)
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), n

"""The NVMe tier beyond the layer inputs (``docs/nvme.md``): saved attention outputs
(``attention_checkpoint="save"``), the streamed residual stream (``stream_layers``), packed
documents, ``nvme_layers``, 2 ranks and both backends, each with loss and every gradient
bit-identical (``torch.equal``) to the host-only run; and the host peak, counted by the memory
accountant, independent of depth with the tier."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import fpdt.model as fm
from fpdt.memory.accountant import MemoryAccountant
from fpdt.offload import fresh_runtime
from fpdt.offload.nvme import MARKER, NVMeTier
from fpdt.offload.nvme_stash import NVMeStash
from fpdt.options import OptionsError
from tests.distributed import run_distributed
from tests.model.helpers import hf_config, tokens

S_DOCS = [0, 5, 6, 17, 24, 32]      # packed documents of 5, 1, 11, 7 and 8 tokens (one of a single token)


def _docs(S: int) -> torch.Tensor:
    doc = torch.zeros(S, dtype=torch.long)
    for d, (a, b) in enumerate(zip(S_DOCS, S_DOCS[1:])):
        doc[a * S // 32:b * S // 32] = d
    return doc.expand(2, S)



_TIERS: dict = {}


def _tier(path, backend_factory=None):
    """The test's NVMeTier of ``path`` (the model's ``nvme_tier``); the fixture closes it."""
    if path not in _TIERS:
        _TIERS[path] = NVMeTier(backend_factory)
    return _TIERS[path]

def _step(layers, nvme_path, ids, labels, docs=None, name="llama_gqa", steps=1, **options):
    """Loss and gradients of the last of ``steps`` steps, the model, and the store's written bytes per step."""
    cfg = hf_config(name).to_dict() | {"num_hidden_layers": layers}
    torch.manual_seed(3)
    group = dist.group.WORLD if dist.is_initialized() else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # tmp_path may be on tmpfs
        model = fm.from_config(cfg, checkpointing="offload", offload=True, runtime="sim", nvme_path=nvme_path,
                               nvme_tier=_tier(nvme_path) if nvme_path else None, group=group, **options)
        written = []
        for _ in range(steps):
            before = _tier(nvme_path).store(nvme_path, _rank()).bytes_written if nvme_path else 0
            model.zero_grad(set_to_none=True)
            loss = model(**model.prepare_inputs(ids, labels=labels, doc_ids=docs))
            loss.backward()
            written.append((_tier(nvme_path).store(nvme_path, _rank()).bytes_written if nvme_path else 0) - before)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model, written


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _assert_identical(got, ref, what):
    assert torch.equal(got[0], ref[0]), (what, got[0], ref[0])
    assert got[1].keys() == ref[1].keys(), what
    for n, g in got[1].items():
        assert torch.equal(g, ref[1][n]), (what, n)


def _check(nvme_dir, layers, u, S, docs=False, **options):
    ids, labels = tokens(hf_config("llama_gqa").vocab_size, 2, S)
    d = _docs(S) if docs else None
    host = {k: v for k, v in options.items() if k != "nvme_layers"}
    ref = _step(layers, None, ids, labels, d, num_chunks=u, **host)
    got = _step(layers, nvme_dir, ids, labels, d, num_chunks=u, **options)
    _assert_identical(got, ref, options)
    return got


@pytest.fixture
def nvme_dir(tmp_path):
    yield str(tmp_path)
    _TIERS.pop(str(tmp_path), NVMeTier()).close()
    assert os.listdir(tmp_path) == []


def _store_is_empty(nvme_dir, rank=0):
    assert sorted(os.listdir(os.path.join(nvme_dir, f"rank{rank}"))) == [MARKER]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("attention", ["save", "recompute"])
def test_bit_identical_packed(nvme_dir, stream, attention):
    """Packed documents, both attention checkpoints, streamed or not: every layer's input (and
    saved output) made the round trip through the files, and none is left."""
    layers = 5
    loss, grads, model, written = _check(nvme_dir, layers, 2, 32, docs=True, attention_checkpoint=attention,
                                         stream_layers=stream)
    x_bytes = 2 * 32 * hf_config("llama_gqa").hidden_size * 4          # one layer's input, fp32, B = 2
    on_disk = layers - 1 if stream else layers - 2                      # the last input(s) stay on the host
    assert written[0] >= on_disk * x_bytes
    if attention == "save":       # the outputs [B, C, H, D] and lse of every chunk of those layers too
        H, D = hf_config("llama_gqa").num_attention_heads, hf_config("llama_gqa").head_dim
        assert written[0] >= on_disk * (x_bytes + 2 * (32 * H * D + H * 32) * 4)
    _store_is_empty(nvme_dir)


def test_saved_outputs_go_to_disk_unstreamed(nvme_dir):
    """The saved attention outputs of the first layers are NVMeStash entries, and each backward
    reads the next layer's ahead."""
    ids, labels = tokens(hf_config("llama_gqa").vocab_size, 2, 24)
    ref = _step(4, None, ids, labels, num_chunks=3, attention_checkpoint="save")
    seen = []
    put = NVMeStash.put

    def spy(self, key, tensor):
        seen.append((self.label, key[0]))
        return put(self, key, tensor)
    NVMeStash.put = spy
    try:
        got = _step(4, nvme_dir, ids, labels, num_chunks=3, attention_checkpoint="save")
    finally:
        NVMeStash.put = put
    _assert_identical(got, ref, "saved outputs on disk")
    assert {("layer 0", "attn out"), ("layer 3", "attn lse")} <= set(seen)
    _store_is_empty(nvme_dir)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("nvme_layers", [0, 2])
def test_nvme_layers_counts_the_first_layers(nvme_dir, stream, nvme_layers):
    """``nvme_layers=K``: only the first K layers' checkpoints touch the disk; bit-identical."""
    layers, u, S = 4, 2, 16
    *_, written = _check(nvme_dir, layers, u, S, attention_checkpoint="save", stream_layers=stream,
                         nvme_layers=nvme_layers)
    hidden = hf_config("llama_gqa").hidden_size
    H, D = hf_config("llama_gqa").num_attention_heads, hf_config("llama_gqa").head_dim
    x_pad = -(-(2 * S * hidden * 4) // 4096) * 4096                     # one layer input, padded
    if stream:
        x_pad = u * -(-(2 * S // u * hidden * 4) // 4096) * 4096        # u chunks
    saved_pad = u * (-(-(2 * S // u * H * D * 4) // 4096) + -(-(2 * H * S // u * 4) // 4096)) * 4096
    assert written[0] == nvme_layers * (x_pad + saved_pad)


def test_nvme_layers_option_names_the_fix(tmp_path):
    cfg = hf_config("llama_gqa").to_dict() | {"num_hidden_layers": 2}
    with pytest.raises(OptionsError, match="nvme_layers=1 counts the layers .* it needs nvme_path"):
        fm.from_config(cfg, checkpointing="offload", nvme_layers=1)
    with pytest.raises(OptionsError, match="nvme_layers=-1 must be an integer >= 0"):
        fm.from_config(cfg, checkpointing="offload", nvme_path=str(tmp_path), nvme_layers=-1)
    with pytest.raises(OptionsError, match="nvme_layers=3 is more than the model's 2 decoder layers"):
        fm.from_config(cfg, checkpointing="offload", nvme_path=str(tmp_path), nvme_layers=3)


def _host_peak(nvme_path, layers, stream):
    ids, labels = tokens(hf_config("llama_gqa").vocab_size, 1, 32)
    cfg = hf_config("llama_gqa").to_dict() | {"num_hidden_layers": layers}
    with fresh_runtime("sim") as rt, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = fm.from_config(cfg, checkpointing="offload", offload=True, runtime=rt, nvme_path=nvme_path,
                               nvme_tier=_tier(nvme_path) if nvme_path else None, num_chunks=4,
                               attention_checkpoint="save", stream_layers=stream)
        inputs = model.prepare_inputs(ids, labels=labels)
        model(**inputs).backward()                 # the first step fills the pools
        with MemoryAccountant("cpu") as acct:
            model.zero_grad(set_to_none=True)
            model(**inputs).backward()
    return acct.host_peak


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.long)])
def test_host_peak_is_independent_of_depth(nvme_dir, stream):
    """Counted by the memory accountant (the pooled host buffers, the stash and staging ones):
    with the tier the host peak is the same at 4, 6 and 8 layers; without it, it grows by one
    layer's input and saved outputs per layer."""
    depths = (4, 6, 8)
    host = [_host_peak(None, n, stream) for n in depths]
    tier = [_host_peak(nvme_dir, n, stream) for n in depths]
    hidden = hf_config("llama_gqa").hidden_size
    H, D = hf_config("llama_gqa").num_attention_heads, hf_config("llama_gqa").head_dim
    per_layer = 32 * hidden * 4 + 32 * H * D * 4 + H * 32 * 4           # input + saved output and lse, fp32
    assert host[1] - host[0] == host[2] - host[1] == 2 * per_layer, host
    assert tier[0] == tier[1] == tier[2], tier
    assert tier[2] < host[2]


def _two_ranks(rank, world, path, backend, stream, attention, docs):
    if backend == "aio":
        from fpdt.train.nvme_aio import aio_backend
        _tier(path, aio_backend)
    try:
        ids, labels = tokens(hf_config("llama_gqa").vocab_size, 2, 32)
        d = _docs(32) if docs else None
        layers = 4 if stream else 6        # unstreamed, the last four inputs need not make the round trip
        ref = _step(layers, None, ids, labels, d, num_chunks=2, attention_checkpoint=attention, stream_layers=stream)
        got = _step(layers, path, ids, labels, d, num_chunks=2, attention_checkpoint=attention, stream_layers=stream)
        _assert_identical(got, ref, (rank, backend, stream, attention))
        store = _tier(path).store(path, rank)
        assert store.backend.name == ("deepspeed-aio" if backend == "aio" else "portable")
        assert got[3][0] > 0 and store.bytes_read > 0
        dist.barrier()
        assert sorted(os.listdir(path)) == ["rank0", "rank1"]   # each rank its own directory
        _store_is_empty(path, rank)
        dist.barrier()                                           # both have looked before either closes
        store.close()
    finally:
        _TIERS.pop(path).close()


def _require_aio():
    from fpdt.train.nvme_aio import aio_backend, aio_unavailable
    backend = aio_backend()
    if backend is None:
        if os.environ.get("FPDT_REQUIRE_AIO") == "1":
            pytest.fail(f"FPDT_REQUIRE_AIO=1 but {aio_unavailable()}")
        pytest.skip(aio_unavailable())
    backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend,stream,attention,docs", [
    ("portable", False, "save", True),
    ("portable", True, "recompute", True),
    ("portable", True, "save", False),
    ("aio", False, "recompute", False),
    ("aio", True, "save", True),
])
def test_two_ranks_bit_identical(tmp_path, backend, stream, attention, docs):
    if backend == "aio":
        _require_aio()
    run_distributed(_two_ranks, 2, args=(str(tmp_path), backend, stream, attention, docs), timeout=300)
    assert os.listdir(tmp_path) == []

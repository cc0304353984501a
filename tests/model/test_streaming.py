"""Streamed layers (``stream_layers=True``, :mod:`fpdt.model.streaming`) against the same model unstreamed.

Loss and every gradient within 1e-5 (fp32), the loss scaled by a random factor so that the
backward's incoming gradient is not 1; 1, 2 and 4 ranks, the 2D mesh (ring and double ring),
GQA and MHA, packed documents, both attention checkpoints, LoRA with dropout, every runtime.
The simulated runtime proves the ordering: no hazard on clean runs, a named hazard or wrong
numbers under each injected fault on each of the streamed buffers' roles, copies in flight
while compute runs, and no host synchronisation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fpdt.model as fm
from fpdt.comm import SequenceMesh
from fpdt.offload import fresh_runtime
from fpdt.offload.runtime import StreamHazardError
from fpdt.options import OptionsError
from tests.distributed import run_distributed
from tests.model.helpers import compare, fpdt_from_hf, hf_model, tokens

STREAMED = dict(offload=True, checkpointing="offload")


def _pair(name: str, **options):
    """(unstreamed, streamed) models with the same weights."""
    ref = hf_model(name)        # built twice, not copied: a mesh's process groups do not deep-copy
    return fpdt_from_hf(ref, **STREAMED, **options), fpdt_from_hf(ref, **STREAMED, stream_layers=True, **options)


def _step(model, inputs, scale: torch.Tensor, group=None):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs)
    (loss * scale).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if group is not None or (dist.is_initialized() and dist.get_world_size() > 1):
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return loss.detach(), grads


def check_parity(name: str, S: int, what: str, B: int = 2, docs: bool = False, lora: fm.LoraSpec | None = None,
                 group=None, device: str = "cpu", **options):
    base, streamed = (m.to(device) for m in _pair(name, **options))
    if lora is not None:
        for m in (base, streamed):
            fm.add_lora(m, lora)
        with torch.no_grad():       # random A and B, so that every adapter gradient is nonzero
            for p in fm.adapter_state_dict(base).values():
                p.normal_(0.0, 0.1)
        streamed.load_state_dict(base.state_dict())
        for m in (base, streamed):
            m.train()
    ids, labels = tokens(base.config.vocab_size, B, S)
    position_ids = None
    if docs:    # three packed documents per row, one of a single token
        cuts = [0, S // 3, S // 3 + 1, S]
        position_ids = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).expand(B, S)
    inputs = base.prepare_inputs(ids.to(device), labels=labels.to(device),
                                 position_ids=None if position_ids is None else position_ids.to(device))
    scale = (torch.randn((), generator=torch.Generator().manual_seed(S)) + 2.0).to(device)
    ref = _step(base, inputs, scale, group)
    got = _step(streamed, inputs, scale, group)
    compare(*got, *ref, f"streamed vs not: {what}")


@pytest.mark.parametrize("name,u,save,runtime", [
    ("llama_gqa", 3, "recompute", "sim"),
    ("qwen2_tied", 2, "save", "sync"),
    ("llama_bias", 1, "recompute", "sim"),
    ("mistral", 4, "save", "sim"),
    ("llama_mqa", 2, "recompute", "sync"),
])
def test_single_rank_parity(name, u, save, runtime):
    check_parity(name, 8 * u, f"{name} u={u} {save} {runtime}", num_chunks=u, attention_checkpoint=save,
                 runtime=runtime)


@pytest.mark.cuda
@pytest.mark.parametrize("save", ["recompute", "save"])
def test_cuda_runtime_parity(save):
    """On a GPU, where the runtime is CUDA's own (copy streams, events, pinned host buffers), fp32;
    profiling/gpu_evidence.sh runs the streamed and offload CUDA tests under TORCH_CUDA_SANITIZER."""
    check_parity("llama_gqa", 48, f"cuda u=3 {save}", num_chunks=3, attention_checkpoint=save, device="cuda")


@pytest.mark.parametrize("save", ["recompute", "save"])
def test_packed_documents(save):
    check_parity("llama_gqa", 24, f"packed documents {save}", docs=True, num_chunks=3, attention_checkpoint=save,
                 runtime="sim")


def test_lora():
    check_parity("llama_gqa", 16, "LoRA r=4", lora=fm.LoraSpec(4), num_chunks=2, runtime="sim")


def test_lora_dropout_masks_are_replayed_in_backward(monkeypatch):
    """Dropout's masks are drawn per call (so the streamed ones differ from the unstreamed); what
    must hold is that the backward's recompute draws exactly the masks its forward drew: every
    ``(seed, stream, chunk, size)`` a mask was made for in backward was made in forward, and
    every forward mask is made again."""
    import fpdt.ops.lora as lora_ops

    calls, phase = {"forward": set(), "backward": set()}, ["forward"]
    made = lora_ops.drop_mask

    def recording(shape, device, p, seed, stream, chunk):
        calls[phase[0]].add((torch.Size(shape).numel(), p, seed, stream, chunk))   # a view: the same mask
        return made(shape, device, p, seed, stream, chunk)

    monkeypatch.setattr(lora_ops, "drop_mask", recording)
    _, model = _pair("llama_gqa", num_chunks=2, runtime="sim")
    fm.add_lora(model, fm.LoraSpec(4, dropout=0.3))
    model.train()
    ids, labels = tokens(model.config.vocab_size, 1, 16)
    loss = model(**model.prepare_inputs(ids, labels=labels))
    phase[0] = "backward"
    loss.backward()
    assert calls["forward"] and calls["backward"] == calls["forward"], \
        (len(calls["forward"]), len(calls["backward"]), len(calls["forward"] ^ calls["backward"]))


def test_evaluation_without_grad_matches_and_frees_the_host():
    base, streamed = _pair("llama_gqa", num_chunks=2, runtime="sim")
    ids, labels = tokens(base.config.vocab_size, 1, 16)
    inputs = base.prepare_inputs(ids, labels=labels)
    with torch.no_grad():
        assert torch.equal(streamed(**inputs), streamed(**inputs))
        compare(streamed(**inputs), {}, base(**inputs), {}, "no-grad loss")


def test_refusals_name_the_fix():
    with pytest.raises(OptionsError, match="checkpointing='offload'"):
        fm.FPDTOptions(stream_layers=True, offload=True).validate()
    with pytest.raises(OptionsError, match="offload=True"):
        fm.FPDTOptions(stream_layers=True, checkpointing="offload").validate()
    with pytest.raises(OptionsError, match="checkpoint_device_layers=0"):
        fm.FPDTOptions(stream_layers=True, **STREAMED, checkpoint_device_layers=1).validate()
    _, streamed = _pair("llama_gqa", num_chunks=2, runtime="sim")
    ids, labels = tokens(streamed.config.vocab_size, 1, 8)
    with pytest.raises(ValueError, match="stream_layers=False to get logits"):
        streamed(**streamed.prepare_inputs(ids, labels=labels), return_logits=True)


@pytest.mark.parametrize("save", ["recompute", "save"])
def test_host_bytes_between_the_passes_follow_the_formula(save):
    """From the end of the forward to the start of the backward the host holds exactly every
    layer's input and the final hidden state's gradient, ``(l + 1) B S_local hidden e``, plus each
    saving layer's output and lse (``saved_attention_bytes``); nothing is left after the backward."""
    from fpdt.attention.offload_volume import saved_attention_bytes
    from fpdt.offload import host_bytes_in_use
    with fresh_runtime("sim", checks=True) as rt:
        _, model = _pair("llama_gqa", num_chunks=3, runtime=rt, attention_checkpoint=save)
        cfg = model.config
        B, S = 2, 24
        ids, labels = tokens(cfg.vocab_size, B, S)
        inputs = model.prepare_inputs(ids, labels=labels)
        before = host_bytes_in_use()
        loss = model(**inputs)
        held = host_bytes_in_use() - before
        want = (cfg.num_layers + 1) * B * S * cfg.hidden_size * 4
        if save == "save":
            want += cfg.num_layers * saved_attention_bytes(batch=B, seq_local=S, num_heads=cfg.num_heads,
                                                           head_dim=cfg.head_dim, dtype=torch.float32)
        assert held == want, (held, want)
        loss.backward()
        assert host_bytes_in_use() == before


# ---------------------------------------------------------------------- the simulated streams
def _sim_step(**sim):
    with fresh_runtime("sim", **sim) as rt:
        base, streamed = _pair("llama_gqa", num_chunks=3, runtime=rt, attention_checkpoint="save")
        ids, labels = tokens(base.config.vocab_size, 1, 24)
        inputs = base.prepare_inputs(ids, labels=labels)
        got = _step(streamed, inputs, torch.tensor(1.0))
        if sim.get("fault") is None:
            compare(*got, *_step(base, inputs, torch.tensor(1.0)), f"sim {sim}")
    return rt, got


@pytest.mark.parametrize("mode", ["lazy", "threaded"])
def test_clean_runs_have_no_hazard_overlap_and_no_host_sync(mode):
    rt, _ = _sim_step(mode=mode, checks=True, seed=1)
    c = rt.counters
    assert c.host_syncs == 0, f"{c.host_syncs} host-blocking syncs in a streamed step"
    assert c.peak_copies_pending >= 2, "no copy was ever in flight beside another: nothing overlapped compute"


def test_the_next_chunk_is_in_flight_while_a_chunk_computes(monkeypatch):
    """Every streamed fetch of chunk ``i`` returns with chunk ``i + 1``'s copy already issued
    (when it exists): its host->device copy runs beside chunk ``i``'s compute."""
    from fpdt.model import streaming
    fetched, overlapped = [], []
    fetch = streaming.StreamedRun.fetch

    def watched(self, stash, kind, i, keep):
        value = fetch(self, stash, kind, i, keep)
        fetched.append((kind, i))
        if (kind, i + 1) in stash:
            overlapped.append((kind, i + 1) in stash._inflight)
        return value

    monkeypatch.setattr(streaming.StreamedRun, "fetch", watched)
    _sim_step(mode="lazy", checks=True)
    kinds = {k for k, _ in fetched}
    assert kinds == {"residual", "residual grad", "o grad", "branch grad"}, kinds
    assert overlapped and all(overlapped), f"{overlapped.count(False)} of {len(overlapped)} fetches had no next copy"


@pytest.mark.parametrize("kind", ["residual", "residual grad", "o grad", "branch grad"])
@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_each_streamed_role_catches_each_fault(kind, fault):
    """The fault only on ``kind``'s copies: a hazard naming that role, or NaN where it was read."""
    try:
        _, (loss, grads) = _sim_step(mode="lazy", fault=fault, fault_kinds={kind}, checks=True, seed=2)
    except StreamHazardError as e:
        assert f"{kind} chunk" in str(e), f"the hazard names another role: {e}"
        return
    finite = torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert not finite, f"{fault} on {kind!r} went unnoticed"


# ---------------------------------------------------------------------- several ranks
def _ranks(rank, world):
    if world == 2:
        check_parity("llama_gqa", 16, "sp=2 u=2 recompute", num_chunks=2, runtime="sim")
        check_parity("llama_gqa", 24, "sp=2 u=3 save, packed", docs=True, num_chunks=3, attention_checkpoint="save",
                     runtime="sync")
        check_parity("llama_mqa", 16, "sp=2 MQA, LoRA", lora=fm.LoraSpec(2), num_chunks=2, runtime="sim")
    else:
        check_parity("llama_sp4", 16, "sp=4 u=2 save", num_chunks=2, attention_checkpoint="save", runtime="sim")
        for kw in (dict(hp=2, cp=2), dict(hp=1, cp=4, inner_ring=2)):
            mesh = SequenceMesh(**kw)
            check_parity("llama_sp4", 32, f"mesh {kw}", num_chunks=2, mesh=mesh, runtime="sim", group=mesh.sp_group)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_parity(world):
    run_distributed(_ranks, world, timeout=600)


# ---------------------------------------------------------------------- device memory, counted
STREAM_CHUNK_U = 18.0
"""Chunk units ``U`` (one bf16 ``[L, hidden]`` chunk) a streamed step holds per unit of chunk length:
the attention pipeline's backward working set (16.5 U, ``docs/memory.md``) and the layer-input chunk
and its gradient chunk beside it; measured 17.6 between 2K- and 4K-token chunks."""


def _streamed_peak(seq: int, chunk: int) -> int:
    from fpdt.bench.streamed_peak import measure
    return measure(seq, chunk, stream=True)["device_peak_bytes"]


@pytest.mark.long
@pytest.mark.slow
def test_device_peak_is_flat_in_the_sequence_and_within_the_chunk_budget():
    from fpdt.memory.accountant import chunk_unit
    peaks = [_streamed_peak(seq, 256) for seq in (1024, 2048, 4096)]
    assert max(peaks) <= 1.10 * min(peaks), f"streamed peaks {peaks} grow with the sequence"
    slope = (_streamed_peak(4 * 1024, 1024) - _streamed_peak(4 * 512, 512)) / (chunk_unit(1024, 256) - chunk_unit(512, 256))
    assert slope <= STREAM_CHUNK_U, f"{slope:.2f} U per chunk unit > {STREAM_CHUNK_U}"

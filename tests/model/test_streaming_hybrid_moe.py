"""Streamed layers (``stream_layers=True``) on Qwen3.5 (Gated DeltaNet + gated attention) and Qwen3-MoE,
through ``fpdt.model``, against Transformers: the loss (with the balancing loss) and every gradient,
the loss scaled by a random factor so that the backward's incoming gradient is not 1; 1, 2 and 4
ranks, packed documents, both attention checkpoints, the NVMe tier; the simulated copy streams. The
hybrid compares fp32 against a float64 Transformers run (``tests/model/qwen35.py``), the MoE model
against Transformers' fp32 run within 1e-5. The device peak of a streamed step, flat in the
sequence length: ``test_streamed_peak_*``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fpdt.model as fm
from fpdt.offload import fresh_runtime
from fpdt.offload.runtime import StreamHazardError
from tests.distributed import run_distributed
from tests.model.helpers import compare, hf_loss_and_grads, rel_err, tokens
from tests.model.qwen35 import compare_hybrid, fpdt_qwen35, qwen35_model, reference
from tests.model.test_moe_model import hf_moe

STREAMED = dict(offload=True, checkpointing="offload", stream_layers=True)
ROWS = ([5, 1, 13, 1, 1, 20, 7], [16, 16, 16], [2, 30, 9, 7])    # 48 tokens: across chunk and rank edges


def _scale(seed: int) -> float:
    """A random factor for the loss (not 1), the same for the reference."""
    return float(torch.randn((), generator=torch.Generator().manual_seed(seed))) + 2.0


def _step(model, inputs: dict, scale: float):
    """Loss and the SP-summed gradients of ``loss * scale``, divided by ``scale``."""
    model.zero_grad(set_to_none=True)
    loss = model(**inputs)
    (loss * scale).backward()
    grads = {n: p.grad.detach() / scale for n, p in model.named_parameters()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        for g in grads.values():
            dist.all_reduce(g)
    return loss.detach(), grads


def hybrid_case(name: str, rank: int, world: int, *, num_chunks: int, rows=None, runtime="sim", **options):
    ref = qwen35_model(name)
    if rows is None:
        ids, labels = tokens(ref.config.vocab_size, 2, 4 * world * num_chunks)
        pos = None
    else:
        ids, labels = tokens(ref.config.vocab_size, len(rows), sum(rows[0]), seed=5)
        pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    refs = reference(ref, ids, labels, rows, _scale(ids.shape[1]))
    model = fpdt_qwen35(ref, num_chunks=num_chunks, runtime=runtime, group=dist.group.WORLD if world > 1 else None,
                        **STREAMED, **options)
    loss, grads = _step(model, model.prepare_inputs(ids, labels=labels, position_ids=pos), _scale(ids.shape[1]))
    return compare_hybrid(loss, grads, refs, f"streamed {name} rank {rank}/{world} u={num_chunks} {options} "
                                             f"rows={rows is not None}")


def moe_case(rank: int, world: int, *, num_chunks: int, mlp_chunks=None, runtime="sim", overrides=None, **options):
    ref = hf_moe(**(overrides or {}))
    ids, labels = tokens(ref.config.vocab_size, 2, 4 * world * num_chunks)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model = fm.from_config(ref.config, num_chunks=num_chunks, mlp_chunks=mlp_chunks, runtime=runtime,
                           group=dist.group.WORLD if world > 1 else None, **STREAMED, **options)
    fm.load_hf_state_dict(model, ref.state_dict())
    loss, grads = _step(model, model.prepare_inputs(ids, labels=labels), _scale(ids.shape[1]))
    compare(loss, grads, ref_loss, ref_grads, f"streamed qwen3_moe rank {rank}/{world} u={num_chunks} "
                                              f"mlp={mlp_chunks} {options} {overrides}")
    return model


@pytest.mark.parametrize("num_chunks,save,runtime", [(2, "recompute", "sim"), (3, "save", "sync")])
def test_hybrid_single_rank(num_chunks, save, runtime):
    hybrid_case("qwen35", 0, 1, num_chunks=num_chunks, attention_checkpoint=save, runtime=runtime)


def test_hybrid_packed_documents():
    """Each document's state and conv window reset inside a chunk and across chunk edges: every
    document as if run alone by Transformers."""
    hybrid_case("qwen35", 0, 1, num_chunks=3, rows=ROWS, attention_checkpoint="save")


@pytest.mark.parametrize("num_chunks,mlp_chunks,save", [(2, 3, "recompute"), (3, None, "save")])
def test_moe_single_rank(num_chunks, mlp_chunks, save):
    """The balancing loss (coefficient 0.3) and its gradient; the expert load of every token."""
    model = moe_case(0, 1, num_chunks=num_chunks, mlp_chunks=mlp_chunks, attention_checkpoint=save)
    load = model.router_stats.expert_load()
    assert sorted(load) == [0, 2] and all(v["mean"] == 2 * 4 * num_chunks * 2 / 8 for v in load.values())


def test_moe_without_router_logits():
    moe_case(0, 1, num_chunks=2, mlp_chunks=1, overrides=dict(output_router_logits=False))


@pytest.mark.slow
def test_nvme_tier(tmp_path):
    """The streamed layer inputs (and saved attention outputs) of the first layers on files."""
    for name in ("hybrid", "moe"):
        (tmp_path / name).mkdir()
    hybrid_case("qwen35", 0, 1, num_chunks=2, attention_checkpoint="save", nvme_path=str(tmp_path / "hybrid"))
    moe_case(0, 1, num_chunks=2, nvme_path=str(tmp_path / "moe"))


def test_evaluation_without_grad_matches_unstreamed():
    """No-grad passes: the hybrid's and the MoE model's loss as unstreamed, the host stashes emptied."""
    from fpdt.offload import host_bytes_in_use
    ref = qwen35_model()
    ids, labels = tokens(ref.config.vocab_size, 1, 12)
    base, streamed = (fpdt_qwen35(ref, num_chunks=3, runtime="sim", offload=True, checkpointing="offload",
                                  stream_layers=s) for s in (False, True))
    ref_moe = hf_moe()
    moe = [fm.from_config(ref_moe.config, num_chunks=3, runtime="sim", offload=True, checkpointing="offload",
                          stream_layers=s) for s in (False, True)]
    for m in moe:
        fm.load_hf_state_dict(m, ref_moe.state_dict())
    before = host_bytes_in_use()
    with torch.no_grad():
        for plain, s in ((base, streamed), tuple(moe)):
            inputs = plain.prepare_inputs(ids, labels=labels)
            assert rel_err(s(**inputs), plain(**inputs)) <= 1e-6
    assert host_bytes_in_use() == before


def _sim_step(kind: str, **sim):
    """One streamed step of the hybrid or the MoE model (3 chunks, saved attention outputs) on the
    simulated CUDA streams; the runtime, the loss and the gradients."""
    with fresh_runtime("sim", **sim) as rt:
        if kind == "qwen35":
            ref = qwen35_model()
            model = fpdt_qwen35(ref, num_chunks=3, runtime=rt, attention_checkpoint="save", **STREAMED)
        else:
            ref = hf_moe()
            model = fm.from_config(ref.config, num_chunks=3, runtime=rt, attention_checkpoint="save", **STREAMED)
            fm.load_hf_state_dict(model, ref.state_dict())
        ids, labels = tokens(ref.config.vocab_size, 1, 24)
        loss, grads = _step(model, model.prepare_inputs(ids, labels=labels), 1.0)
    return rt, loss, grads


@pytest.mark.parametrize("kind", ["qwen35", "qwen3_moe"])
def test_simulated_streams_no_hazard_and_no_host_sync(kind):
    """The Gated DeltaNet chunk stash, the gate's gradient chunks and the MoE passes on simulated
    copy streams: no hazard, copies in flight beside compute, no host-blocking synchronisation."""
    rt, loss, _ = _sim_step(kind, mode="lazy", checks=True, seed=1)
    assert torch.isfinite(loss)
    assert rt.counters.host_syncs == 0 and rt.counters.peak_copies_pending >= 2


@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_the_gate_gradient_chunks_catch_each_fault(fault):
    """The fault only on the output gate's gradient chunks: a hazard naming them, or NaN where read."""
    try:
        _, loss, grads = _sim_step("qwen35", mode="lazy", fault=fault, fault_kinds={"gate grad"}, checks=True, seed=2)
    except StreamHazardError as e:
        assert "gate grad chunk" in str(e), f"the hazard names another role: {e}"
        return
    finite = torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert not finite, f"{fault} on the gate gradient went unnoticed"


def _ranks(rank, world):
    if world == 2:
        hybrid_case("qwen35", rank, world, num_chunks=2, attention_checkpoint="save")
        hybrid_case("qwen35", rank, world, num_chunks=2, rows=ROWS, runtime="sync")
        moe_case(rank, world, num_chunks=2, mlp_chunks=3, attention_checkpoint="save")
    else:
        hybrid_case("qwen35_sp4", rank, world, num_chunks=2, rows=ROWS[:2])
        moe_case(rank, world, num_chunks=1)
        from tests.model.test_moe_families_ranks import four_rank_cases    # Qwen3.5-MoE, Qwen3-Next, Mixtral
        four_rank_cases(rank, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel(world):
    """The GDN heads split over the ranks (state carried chunk to chunk in global order), the router
    statistics all-reduced over the SP group: the global balancing loss on every rank. On 4 ranks
    also Qwen3.5-MoE, Qwen3-Next and Mixtral, streamed and not (``test_moe_families_ranks.py``)."""
    run_distributed(_ranks, world, timeout=600)


# ---------------------------------------------------------------------- device memory, counted
@pytest.mark.slow
@pytest.mark.parametrize("model,lengths", [("qwen35", (256, 512, 1024)), ("qwen3_moe", (256, 1024))])
def test_streamed_peak_is_flat_in_the_sequence(model, lengths):
    """A whole streamed step (bf16, 64-token chunks, ``fpdt.bench.streamed_peak``): the device peak, counted
    by the accountant, the same within 10% at every length, and apart by less than one bf16 hidden
    state of the longest sequence (a full-length tensor left on the device would show)."""
    from fpdt.bench.streamed_peak import CONFIGS, measure
    peaks = [measure(seq, 64, True, model)["device_peak_bytes"] for seq in lengths]
    assert max(peaks) <= 1.10 * min(peaks), f"streamed peaks {peaks} grow with the sequence"
    assert max(peaks) - min(peaks) < max(lengths) * CONFIGS[model]["hidden_size"] * 2, peaks

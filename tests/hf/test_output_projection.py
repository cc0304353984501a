"""``o_proj`` of a Transformers attention after ``fpdt.hf.apply_fpdt``, applied a chunk at a
time inside the attention's pipeline (:mod:`fpdt.attention.output_projection`).

Each layer's ``o_proj`` (plain, or PEFT LoRA) runs on each attention output chunk as the pipeline
emits it, with or without offload and a layer checkpoint, so no full-length attention output
exists. Checked against the unchanged Transformers / PEFT model (loss, every parameter and
adapter gradient, fp32 within 1e-5) on 1 and 2 ranks and the 2 x 2 mesh, GQA, u = 2 and 4;
against ``o_proj`` run as its module on the full-length attention output (the path of a
projection fpdt cannot read): loss bitwise, gradients within 1e-6, under every checkpoint mode.
The memory it saves is counted in ``tests/memory/test_hf_budget.py``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import fpdt.hf
import fpdt.attention.module
import fpdt.hf.attention
from fpdt.comm import SequenceMesh
from tests.distributed import run_distributed
from tests.hf.test_apply_fpdt import run_case
from tests.hf.test_peft import lora_config, peft_model, run_lora_case
from tests.model.helpers import compare, hf_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@contextlib.contextmanager
def o_proj_sources():
    """Record each attention call from the HF attention: True when ``o_proj`` runs inside it."""
    calls, original = [], fpdt.attention.module.projected_fpdt_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("o_proj") is not None)
        return original(*args, **kwargs)

    fpdt.attention.module.projected_fpdt_attention = spy
    try:
        yield calls
    finally:
        fpdt.attention.module.projected_fpdt_attention = original


@contextlib.contextmanager
def as_its_module():
    """The HF attention's ``o_proj`` run as its module on the full-length attention output (what
    the attention does with a projection it cannot read)."""
    original = fpdt.attention.module.read_output_projection
    fpdt.attention.module.read_output_projection = lambda module, owner, training=True: None
    try:
        yield
    finally:
        fpdt.attention.module.read_output_projection = original


# (model, u, lora): llama_gqa is GQA 6:2, llama_bias MHA with biases (o_proj's bias read directly)
CASES = [("llama_gqa", 2, False), ("llama_gqa", 4, False), ("llama_bias", 2, False), ("llama_gqa", 4, True)]


def _matches_reference(rank, world, cases):
    for name, u, lora in cases:
        with o_proj_sources() as sources:
            if lora:
                run_lora_case(name, rank, world, num_chunks=u, offload=True)
            else:
                run_case(name, rank, world, num_chunks=u, mlp_chunks=None, loss_chunks=None, offload=True,
                         checkpointing=False, wgrad="recompute")
        assert sources == [True] * hf_model(name).config.num_hidden_layers, (name, u, lora, sources)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-u{c[1]}{'-lora' if c[2] else ''}" for c in CASES])
def test_one_rank_matches_transformers(case):
    _matches_reference(0, 1, [case])


@pytest.mark.slow
def test_two_ranks_match_transformers():
    run_distributed(_matches_reference, 2, args=([c for c in CASES if c[0] == "llama_gqa"],), timeout=300)


def _mesh(rank, world):
    """The 2 x 2 mesh: o chunks go back through the head-parallel all-to-all."""
    mesh = SequenceMesh(hp=2, cp=2)
    with o_proj_sources() as sources:
        run_case("llama_sp4", rank, world, num_chunks=2, mlp_chunks=None, loss_chunks=None, offload=True,
                 checkpointing=False, wgrad="recompute", mesh=mesh)
        run_lora_case("llama_sp4", rank, world, num_chunks=2, offload=True, mesh=mesh)
    assert sources == [True] * 4, sources


@pytest.mark.slow
def test_four_ranks_on_the_2d_mesh_match_transformers():
    run_distributed(_mesh, 4, timeout=300)


def _run(model, ids, labels, seed=0):
    torch.manual_seed(seed)                 # the LoRA dropout seeds
    model.zero_grad(set_to_none=True)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_as_its_module(lora):
    """The same loss (bitwise) and gradients (1e-6) as ``o_proj`` run as its module (a PEFT LoRA
    one without dropout, whose masks PEFT draws itself)."""
    ref = peft_model("llama_gqa", lora_config(dropout=0.0)) if lora else hf_model("llama_gqa")
    ids, labels = tokens(256, 1 if lora else 2, 32)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=4, offload=True)
    model.train()
    with o_proj_sources() as sources:
        loss, grads = _run(model, ids, labels)
    assert sources == [True, True]
    with as_its_module():
        old_loss, old_grads = _run(model, ids, labels)
    assert torch.equal(loss, old_loss), (loss, old_loss)
    compare(loss, grads, old_loss, old_grads, f"lora={lora} against o_proj as its module", tol=1e-6)


def _checkpointed(mode):
    model = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), num_chunks=2, offload=mode != "no offload",
                               checkpointing=mode if mode in ("on", "offload") else "off")
    model.train()
    if mode == "hf":
        model.gradient_checkpointing_enable()
    elif mode == "hf, every 2nd layer":        # layer 0 checkpointed, layer 1 not
        model.activation_checkpointing_enable(every_n_layers=2)
    return model


@pytest.mark.parametrize("mode", ["no offload", *(pytest.param(m, marks=pytest.mark.slow)     # ~4-8 s each
                                                  for m in ("on", "offload", "hf", "hf, every 2nd layer"))])
def test_unchanged_under_a_checkpoint_or_without_offload(mode):
    """Under every checkpoint (fpdt's, Transformers', per layer) and without offload ``o_proj``
    runs inside the attention: loss and gradients as with it run as its module."""
    ids, labels = tokens(256, 2, 16)
    model = _checkpointed(mode)
    with o_proj_sources() as sources:
        loss, grads = _run(model, ids, labels)
    assert sources and all(sources), (mode, sources)
    with as_its_module():
        old_loss, old_grads = _run(_checkpointed(mode), ids, labels)
    assert torch.equal(loss, old_loss), mode
    compare(loss, grads, old_loss, old_grads, mode, tol=1e-6)


def test_no_grad_forward_gives_the_same_loss():
    """Without autograd (nothing saved for backward) ``o_proj`` still runs a chunk at a time inside."""
    ids, labels = tokens(256, 1, 16)
    model = fpdt.hf.apply_fpdt(peft_model("llama_gqa"), num_chunks=2, offload=True).eval()
    with o_proj_sources() as sources, torch.no_grad():
        loss = model(input_ids=ids, labels=labels).loss
    assert sources == [True, True]
    assert torch.equal(loss, model(input_ids=ids, labels=labels).loss.detach())


def test_zero3_registers_o_proj_where_the_attention_reads_it():
    """o_proj's weight (and bias) is read inside the attention's forward: registered with the
    attention for ZeRO-3's gather, with or without a checkpoint."""
    pytest.importorskip("deepspeed")
    for checkpointing, registered in (("off", True), ("offload", True)):
        model = fpdt.hf.apply_fpdt(hf_model("llama_bias"), num_chunks=2, offload=True, checkpointing=checkpointing)
        for layer in model.model.layers:
            attn = layer.self_attn
            want = {p for n in ("q_proj", "k_proj", "v_proj") + (("o_proj",) if registered else ())
                    for p in getattr(attn, n).parameters()}
            assert set(attn._external_params.values()) == want, checkpointing


@pytest.mark.slow
@pytest.mark.parametrize("sim", [dict(mode="lazy"), dict(mode="threaded", seed=1)], ids=["lazy", "threaded"])
def test_simulated_streams_find_no_hazard(sim):
    """The stash reads of o_proj's backward under the simulated CUDA streams (copies issued as
    late as CUDA allows, or on a thread with random delays): the same gradients as Transformers,
    and no stream hazard at the end of the block (fresh_runtime raises one)."""
    from fpdt.offload import fresh_runtime

    with fresh_runtime("sim", **sim) as rt, o_proj_sources() as sources:
        run_case("llama_gqa", 0, 1, num_chunks=4, mlp_chunks=None, loss_chunks=None, offload=True,
                 checkpointing=False, wgrad="recompute", options={"runtime": rt})
    assert sources == [True] * hf_model("llama_gqa").config.num_hidden_layers
    assert rt.counters.copies_h2d > 0 and rt.counters.host_syncs == 0

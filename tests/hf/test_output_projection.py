"""``o_proj`` of a Transformers attention after ``fpdt.hf.apply_fpdt`` reading its input back from
the attention's stash (:func:`fpdt.hf.attention.o_proj_stash_layers`,
:mod:`fpdt.attention.output_projection`).

With ``offload=True`` and no layer checkpoint (``checkpointing="off"``, and not Transformers'
own on the layer) each layer's ``o_proj`` (plain, or PEFT LoRA) keeps no copy of the attention
output. Checked against the unchanged Transformers / PEFT model (loss, every parameter and
adapter gradient, fp32 within 1e-5) on 1 and 2 ranks and the 2 x 2 mesh, GQA, u = 2 and 4;
against the HF path before the change (``o_proj`` as its module, a LoRA ``o_proj`` as
``lora_linear`` over ``2 u`` chunks; the same dropout masks with one sequence): loss bitwise,
gradients within 1e-6; and that
under a checkpoint (fpdt's, Transformers', per layer) or without offload nothing changes. The
memory it saves is counted in ``tests/memory/test_hf_budget.py``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import fpdt.hf
import fpdt.attention.module
import fpdt.hf.attention
from fpdt.comm import SequenceMesh
from fpdt.ops.lora import lora_linear
from tests.distributed import run_distributed
from tests.hf.test_apply_fpdt import run_case
from tests.hf.test_peft import lora_config, peft_model, run_lora_case
from tests.model.helpers import compare, hf_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@contextlib.contextmanager
def o_proj_sources():
    """Record each call of the chunked output projection from the HF attention: True when it
    reads its input from the attention's stash, False when it saves it."""
    calls, original = [], fpdt.attention.module.output_projection

    def spy(x, weight, bias, adapters, num_chunks, source=None):
        calls.append(source is not None)
        return original(x, weight, bias, adapters, num_chunks, source)

    fpdt.attention.module.output_projection = spy
    try:
        yield calls
    finally:
        fpdt.attention.module.output_projection = original


@contextlib.contextmanager
def before_the_change():
    """The HF attention's ``o_proj`` as it was: the module's own ``F.linear``, or a LoRA ``o_proj``
    through ``lora_linear`` over ``2 u`` token chunks, saving the attention output."""
    original = fpdt.attention.module.output_projection

    def old(x, weight, bias, adapters, num_chunks, source=None):
        return F.linear(x, weight, bias) if adapters is None else lora_linear(x, weight, bias, adapters,
                                                                              2 * num_chunks)

    fpdt.attention.module.output_projection = old
    try:
        yield
    finally:
        fpdt.attention.module.output_projection = original


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
def test_as_before_the_change(lora):
    """The same loss (bitwise) and gradients (1e-6) as the HF path before: a plain o_proj's are
    the module's; a LoRA o_proj with dropout over one sequence draws lora_linear's masks."""
    ref = peft_model("llama_gqa", lora_config(dropout=0.25)) if lora else hf_model("llama_gqa")
    ids, labels = tokens(256, 1 if lora else 2, 32)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=4, offload=True)
    model.train()
    with o_proj_sources() as sources:
        loss, grads = _run(model, ids, labels)
    assert sources == [True, True]
    with before_the_change():
        old_loss, old_grads = _run(model, ids, labels)
    assert torch.equal(loss, old_loss), (loss, old_loss)
    compare(loss, grads, old_loss, old_grads, f"lora={lora} against before the change", tol=1e-6)


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
    """A plain o_proj runs as its module wherever its layer is checkpointed or offload is off;
    Transformers' checkpoint is decided per layer. Loss and gradients as without the change."""
    ids, labels = tokens(256, 2, 16)
    model = _checkpointed(mode)
    with o_proj_sources() as sources:
        loss, grads = _run(model, ids, labels)
    assert sources == ([True] if mode == "hf, every 2nd layer" else []), (mode, sources)
    with before_the_change():
        old_loss, old_grads = _run(_checkpointed(mode), ids, labels)
    assert torch.equal(loss, old_loss), mode
    compare(loss, grads, old_loss, old_grads, mode, tol=1e-6)


def test_no_grad_and_eval_forwards_keep_nothing():
    """Without autograd there is no backward to read for: no stash is handed over."""
    ids, labels = tokens(256, 1, 16)
    model = fpdt.hf.apply_fpdt(peft_model("llama_gqa"), num_chunks=2, offload=True)
    with o_proj_sources() as sources, torch.no_grad():
        model(input_ids=ids, labels=labels)
    assert sources == [False, False]


def test_zero3_registers_o_proj_where_the_attention_reads_it():
    """With offload and no fpdt checkpoint, o_proj's weight is read inside the attention's forward
    (and its bias): registered with the attention for ZeRO-3's gather; with a checkpoint it is not."""
    pytest.importorskip("deepspeed")
    for checkpointing, registered in (("off", True), ("offload", False)):
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

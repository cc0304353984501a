"""PEFT LoRA models through ``fpdt.hf.apply_fpdt``, against the same PEFT models unchanged.

The chunked q/k/v projection and the chunked MLP compute PEFT's LoRA layers themselves
(``fpdt.ops.projections``). A single-process PEFT model (eager attention, Transformers' loss)
gives the loss and the adapters' gradients; the patched copy runs on 1, 2 and 4 gloo ranks
(and the 2 x 2 mesh) with its per-rank gradients summed over the SP group. fp32 within 1e-5.
Adapters start with random ``B`` (``init_lora_weights=False``) so every gradient is nonzero.
With dropout in training mode the masks are fpdt's: checked against the op-level reference
(``tests/ops/test_lora.py``), and here for replay under every checkpointing mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fpdt.hf
import fpdt.hf.model
import fpdt.model.mlp
from fpdt.comm import SequenceMesh
from tests.distributed import run_distributed
from tests.hf.test_apply_fpdt import _qwen3, count_calls
from tests.model.helpers import compare, hf_model, rel_err, tokens

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(targets=ALL_LINEARS, r=4, dropout=0.0, bias=False, **kw):
    return peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=dropout,
                           init_lora_weights=False, lora_bias=bias, **kw)


def peft_model(name, config=None, second=None):
    """A seeded tiny model with LoRA adapters (and a second adapter, both active, if given)."""
    base = _qwen3() if name == "qwen3" else hf_model(name)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, config or lora_config())
    if second is not None:
        model.add_adapter("second", second)
        model.base_model.set_adapter(["default", "second"])
    return model


def trainable_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), trainable_grads(model)


def run_lora_case(name, rank, world, *, num_chunks, checkpointing=False, offload=False, config=None, second=None,
                  mesh=None, B=2, tol=1e-5, options=None):
    ref = peft_model(name, config, second)
    model = copy.deepcopy(ref)
    S = max(16, 4 * world * num_chunks * (2 if mesh is not None else 1))
    ids, labels = tokens(ref.config.vocab_size, B, S)
    ref_loss, ref_grads = reference(ref, ids, labels)
    assert fpdt.hf.apply_fpdt(model, mesh=mesh, num_chunks=num_chunks, offload=offload, **(options or {}),
                              checkpointing=checkpointing if checkpointing in ("on", "offload") else "off") is model
    model.train()
    if checkpointing == "hf":
        model.gradient_checkpointing_enable()
    inputs = fpdt.hf.prepare_inputs(model, ids, labels=labels)
    o_proj_inside = []
    original = fpdt.attention.module.projected_fpdt_attention

    def spy(*args, **kwargs):
        o_proj_inside.append(kwargs["o_proj"] is not None)
        return original(*args, **kwargs)

    fpdt.attention.module.projected_fpdt_attention = spy
    try:
        with count_calls(fpdt.model.mlp.ChunkedSwiGLUFunction, "apply") as mlp_calls:
            loss = model(**inputs).loss
            loss.backward()
    finally:
        fpdt.attention.module.projected_fpdt_attention = original
    layers = ref.config.num_hidden_layers * (2 if checkpointing else 1)
    assert len(o_proj_inside) == layers and len(mlp_calls) == layers     # the chunked paths ran
    assert all(o_proj_inside)           # o_proj (a PEFT LoRA one or not) runs inside the attention
    grads = trainable_grads(model)
    assert grads and all("lora_" in n for n in grads)
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"{name} rank {rank}/{world} u={num_chunks} ckpt={checkpointing} offload={offload} mesh={mesh}"
    return compare(loss, grads, ref_loss, ref_grads, what, tol=tol)


CASES = [  # (model, u, checkpointing, offload, lora config kwargs, second adapter kwargs)
    ("llama_gqa", 1, False, False, {}, None),
    ("llama_gqa", 4, "offload", True, {}, None),
    ("llama_bias", 2, "hf", False, dict(bias=True), None),                      # adapter biases, model biases
    ("qwen2_tied", 2, "on", True, dict(targets=["q_proj", "v_proj", "down_proj"], r=2), None),
    ("mistral", 2, False, True, dict(use_rslora=True), dict(targets=["k_proj", "up_proj"], r=3)),   # two adapters
    ("qwen3", 2, "offload", False, {}, None),                                   # LoRA before the per-head norms
]


def _kwargs(spec):
    return None if spec is None else lora_config(**spec)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-u{c[1]}-{c[2]}" for c in CASES])
def test_one_process_matches_peft(case):
    name, u, ckpt, offload, cfg, second = case
    run_lora_case(name, 0, 1, num_chunks=u, checkpointing=ckpt, offload=offload, config=_kwargs(cfg),
                  second=_kwargs(second))


def _ranks(rank, world, cases, mesh_shape=None):
    mesh = SequenceMesh(hp=mesh_shape[0], cp=mesh_shape[1]) if mesh_shape else None
    for name, u, ckpt, offload, cfg, second in cases:
        run_lora_case(name, rank, world, num_chunks=u, checkpointing=ckpt, offload=offload, config=_kwargs(cfg),
                      second=_kwargs(second), mesh=mesh)


@pytest.mark.slow
def test_two_ranks_match_peft():
    run_distributed(_ranks, 2, args=([CASES[1], CASES[3], CASES[4], CASES[5]],), timeout=300)


@pytest.mark.slow
def test_four_ranks_and_the_2d_mesh_match_peft():
    case = ("llama_sp4", 2, "offload", True, dict(bias=True), None)
    run_distributed(_ranks, 4, args=([case],), timeout=300)
    run_distributed(_ranks, 4, args=([case], (2, 2)), timeout=300)


def test_merged_and_disabled_adapters_are_the_base_layer():
    """Merged: the base weight holds the adapters; disabled: the base alone. Both as PEFT computes."""
    ids, labels = tokens(256, 2, 16)
    for state in ("merged", "disabled"):
        ref = peft_model("llama_gqa")
        if state == "merged":
            ref.merge_adapter()
        model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2)
        with (ref.disable_adapter() if state == "disabled" else torch.enable_grad()):
            want = ref(input_ids=ids, labels=labels).loss
        with (model.disable_adapter() if state == "disabled" else torch.enable_grad()):
            got = model(input_ids=ids, labels=labels).loss
        assert rel_err(got, want) <= 1e-5, state
    plain = hf_model("llama_gqa")(input_ids=ids, labels=labels).loss
    assert rel_err(got, plain) <= 1e-5        # disabled: the base model


def test_eval_mode_turns_the_adapters_dropout_off():
    """In eval mode PEFT's dropout does nothing, and neither does fpdt's: exact against PEFT."""
    ids, labels = tokens(256, 2, 16)
    ref = peft_model("llama_gqa", lora_config(dropout=0.3))
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2)
    ref.eval()
    model.eval()
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels).loss
        got = model(input_ids=ids, labels=labels).loss
    assert rel_err(got, want) <= 1e-5
    model.train()
    with torch.no_grad():
        dropped = model(input_ids=ids, labels=labels).loss
    assert rel_err(dropped, want) > 1e-3        # in training mode the masks drop something


def _dropout_runs(rank, world):
    """With dropout in training mode, every checkpointing mode replays the forward's masks: the same
    loss and gradients as no checkpointing, from the same seed."""
    ref = peft_model("llama_gqa", lora_config(dropout=0.25))
    ids, labels = tokens(256, 2, 8 * world)
    runs = {}
    for ckpt in (False, "hf", "on", "offload"):
        model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2, offload=True,
                                   checkpointing=ckpt if ckpt in ("on", "offload") else "off")
        model.train()
        if ckpt == "hf":
            model.gradient_checkpointing_enable()
        torch.manual_seed(11)
        loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
        loss.backward()
        runs[ckpt] = (loss.detach(), trainable_grads(model))
    for ckpt in ("hf", "on", "offload"):
        compare(*runs[ckpt], *runs[False], f"rank {rank}: dropout under checkpointing={ckpt}", tol=1e-6)


@pytest.mark.slow
def test_dropout_masks_replay_under_every_checkpoint_mode():
    _dropout_runs(0, 1)
    run_distributed(_dropout_runs, 2, timeout=240)


def test_refusals_name_the_fix():
    ids, labels = tokens(256, 1, 16)
    dora = peft_model("llama_gqa", lora_config(use_dora=True))
    with pytest.raises(fpdt.hf.FPDTHFError, match="LoRA variant.*DoRA.*chunked_qkv=False"):
        fpdt.hf.apply_fpdt(dora)
    dora_mlp = peft_model("llama_gqa", lora_config(targets=["gate_proj"], use_dora=True))
    with pytest.raises(fpdt.hf.FPDTHFError, match="LoRA variant.*mlp_chunks=0"):
        fpdt.hf.apply_fpdt(dora_mlp, num_chunks=2)
    fpdt.hf.apply_fpdt(peft_model("llama_gqa", lora_config(targets=["gate_proj"], use_dora=True)), num_chunks=2,
                       mlp_chunks=0)(input_ids=ids, labels=labels)        # the fix works
    head = fpdt.hf.apply_fpdt(peft_model("llama_gqa", lora_config(targets=["q_proj", "lm_head"])), num_chunks=2)
    with pytest.raises(fpdt.hf.FPDTHFError, match="lm_head is peft.tuners.lora.layer.Linear.*loss_chunks=0"):
        head(input_ids=ids, labels=labels)
    merged = peft_model("llama_gqa")
    merged.merge_adapter()
    model = fpdt.hf.apply_fpdt(merged, num_chunks=2)
    with pytest.raises(fpdt.hf.FPDTHFError, match="unmerge_adapter"), model.disable_adapter():
        model(input_ids=ids, labels=labels)


def test_zero3_registers_the_adapters_with_the_module_that_reads_them():
    pytest.importorskip("deepspeed")
    model = fpdt.hf.apply_fpdt(peft_model("llama_gqa", lora_config(bias=True)), num_chunks=2)
    for layer in model.base_model.model.model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),   # o_proj: lean LoRA
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            want = {p for n in names for p in getattr(owner, n).parameters()}
            assert len(want) == 4 * len(names)          # base weight, A, B, B's bias
            assert set(owner._external_params.values()) == want


def test_every_adapter_draws_its_own_dropout_masks():
    """As PEFT's separate dropout modules do: one mask stream per (projection, adapter) of a function."""
    from fpdt.ops.projections import read_projections

    model = peft_model("llama_gqa", lora_config(dropout=0.1), second=lora_config(targets=["q_proj"], dropout=0.2))
    attn = model.base_model.model.model.layers[0].self_attn
    proj = read_projections({n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}, "attn", "fix")
    terms = [t for row in proj.adapters.layout.terms for t in row]
    assert [len(row) for row in proj.adapters.layout.terms] == [2, 1, 1]
    assert sorted(t.stream for t in terms) == [0, 1, 2, 3]
    assert sorted(t.dropout for t in terms) == [0.1, 0.1, 0.1, 0.2]
    model.eval()
    proj = read_projections({n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}, "attn", "fix")
    assert all(t.dropout == 0.0 for row in proj.adapters.layout.terms for t in row)


def test_what_would_differ_from_peft_is_refused():
    ids, labels = tokens(256, 2, 16)
    model = peft_model("llama_gqa", second=lora_config(targets=["q_proj"]))
    fpdt.hf.apply_fpdt(model, num_chunks=2)
    model.eval()
    with pytest.raises(fpdt.hf.FPDTHFError, match="adapter_names.*chunked_qkv=False"), torch.no_grad():
        model(input_ids=ids, labels=labels, adapter_names=["default", "second"])   # mixed-adapter batch
    # (PEFT leaves its hooks in place when a forward raises: a fresh model for the next checks)
    model = fpdt.hf.apply_fpdt(peft_model("llama_gqa", second=lora_config(targets=["q_proj"])), num_chunks=2)
    attn = model.base_model.model.model.layers[0].self_attn
    attn.q_proj.lora_A["second"].to(torch.bfloat16)                                 # two dtypes on one layer
    with pytest.raises(fpdt.hf.FPDTHFError, match="different dtypes"):
        model(input_ids=ids, labels=labels)
    attn.q_proj.lora_A["second"].float()
    model(input_ids=ids, labels=labels)
    attn.k_proj.use_dora["default"] = True            # how PEFT before its LoRA variants marked DoRA
    with pytest.raises(fpdt.hf.FPDTHFError, match="LoRA variant \\(DoRA"):
        model(input_ids=ids, labels=labels)
    bf16 = fpdt.hf.apply_fpdt(peft_model("llama_gqa").to(torch.bfloat16), num_chunks=2)
    for m in bf16.modules():
        if hasattr(m, "cast_input_dtype_enabled"):
            m.lora_A["default"].float()
            m.lora_B["default"].float()
            m.cast_input_dtype_enabled = False         # peft.helpers.disable_input_dtype_casting
    with pytest.raises(fpdt.hf.FPDTHFError, match="input casting is disabled"):
        bf16(input_ids=ids, labels=labels)


def test_bf16_model_with_fp32_adapters_no_worse_than_peft():
    """The usual setup: a bf16 model, PEFT's fp32 adapters. Against a float64 copy of the PEFT
    model, fpdt's loss and adapter gradients are within 2e-2 or within 1.25x PEFT's own bf16
    error (the adapters' terms in their own dtype: computing them in bf16 fails this)."""
    ref = peft_model("llama_gqa")
    ref.to(torch.bfloat16)
    for n, p in ref.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()                      # as get_peft_model's autocast_adapter_dtype makes them
    truth = copy.deepcopy(ref).double()
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2, offload=True, checkpointing="offload")
    ids, labels = tokens(256, 2, 64)
    (truth_loss, truth_g), (peft_loss, peft_g) = reference(truth, ids, labels), reference(ref, ids, labels)
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    got = trainable_grads(model)

    def err(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()
    errors = {"loss": (err(loss, truth_loss), err(peft_loss, truth_loss))}
    errors.update({n: (err(got[n], truth_g[n]), err(peft_g[n], truth_g[n])) for n in truth_g})
    bad = {n: e for n, e in errors.items() if not e[0] <= max(2e-2, 1.25 * e[1])}
    assert not bad, f"(fpdt, PEFT bf16) errors against float64 beyond the yardstick: {bad}"
    assert errors["loss"][0] <= max(1e-3, 1.25 * errors["loss"][1])


def test_adapters_save_and_load_back_as_plain_peft(tmp_path):
    """After training through apply_fpdt, PEFT's save_pretrained writes the adapters as always; a
    fresh PEFT model loads them and computes the trained model's loss without fpdt."""
    ids, labels = tokens(256, 2, 16)
    model = fpdt.hf.apply_fpdt(peft_model("llama_gqa", lora_config(dropout=0.1)), num_chunks=2,
                               checkpointing="offload")
    model.train()
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        sgd.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        sgd.step()
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(hf_model("llama_gqa"), tmp_path)
    for n, p in loaded.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, dict(model.named_parameters())[n]), n
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss) <= 1e-5

"""``fpdt.hf.apply_fpdt`` on Transformers' own models, against the same models unchanged.

A reference copy of each tiny Transformers model (eager attention, its own loss on
unshifted labels) gives the loss and every parameter gradient; the patched copy runs on
1, 2 and 4 gloo ranks with its inputs from ``fpdt.hf.prepare_inputs``, and its per-rank
gradients are summed over the SP group (the documented convention). fp32 within 1e-5
relative; bf16 within 2e-2 of Transformers' bf16.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import transformers

import fpdt.hf
import fpdt.hf.attention
import fpdt.hf.apply_steps
import fpdt.model.mlp
from fpdt.attention import FPDTAttention
from fpdt.comm import SequenceMesh
from fpdt.model.llama import RMSNorm
from fpdt.model.mlp import ChunkedSwiGLU
from tests.distributed import run_distributed
from tests.model.helpers import compare, compare_bf16, hf_config, hf_loss_and_grads, hf_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def checkpoint_stash(model):
    """The host stash of the layer inputs apply_fpdt(checkpointing="offload") keeps, if any."""
    return model.model.layers[0]._fpdt_checkpoints.stash


@contextlib.contextmanager
def count_calls(owner, name):
    """Record each call of ``owner.name`` (so a patch that silently did nothing fails)."""
    calls, original = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, spy)
    try:
        yield calls
    finally:
        setattr(owner, name, original)

# (model, num_chunks, mlp_chunks, loss_chunks, offload, activation checkpointing, lm_head_wgrad, options);
# checkpointing: False, "hf" (Transformers' own, non-reentrant), or apply_fpdt's "on" / "offload";
# options: apply_fpdt's chunked_qkv / lean_norms when not the defaults (True)
HF_QKV = dict(chunked_qkv=False)
HF_NORMS = dict(lean_norms=False)
HF_BOTH = dict(chunked_qkv=False, lean_norms=False)
CASES_1 = [
    ("llama_gqa", 1, None, None, False, False, "recompute", {}),
    ("llama_gqa", 4, 3, 5, True, "hf", "accumulate", {}),
    ("qwen2_tied", 2, None, 0, False, "hf", "recompute", {}),     # full logits, tied head
    ("llama_bias", 4, 0, 3, True, "offload", "recompute", {}),    # plain MLP, biases, head_dim != hidden/heads
    ("mistral", 2, 2, None, True, "on", "accumulate", {}),
    ("qwen2_tied", 4, None, None, True, "offload", "accumulate", {}),
    # Transformers' own q/k/v projections and RoPE (FPDT attention on their output), or its own norms
    ("llama_gqa", 4, 3, 5, True, "hf", "accumulate", HF_BOTH),
    ("llama_bias", 2, None, None, False, "offload", "recompute", HF_QKV),
    ("mistral", 2, None, 0, True, "hf", "recompute", HF_NORMS),
]


def _reference_model(name):
    """The fp32 Transformers model of a case: the shared tiny configs, or this file's Qwen3 and
    position-dependent RoPE variants."""
    if name == "qwen3":
        return _qwen3()
    return _rope_variant(name) if name in ROPE_VARIANTS else hf_model(name)


def run_case(name, rank, world, *, num_chunks, mlp_chunks, loss_chunks, offload, checkpointing, wgrad,
             options=None, mesh=None, B=2, S=None, dtype=torch.float32, tol=1e-5, device="cpu",
             against_float64=None):
    ref = _reference_model(name).to(device, dtype)
    # at least 16 tokens: with 4, only position 0 has a label (tokens() masks spans from 2 on), whose
    # attention is over itself alone, so q and k would get no gradient at all
    S = S or max(16, 4 * world * num_chunks * (2 if mesh is not None else 1))
    ids, labels = (t.to(device) for t in tokens(ref.config.vocab_size, B, S))
    model = copy.deepcopy(ref)          # before the reference runs: dynamic RoPE keeps state from a forward
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    fpdt.hf.apply_fpdt(model, mesh=mesh, num_chunks=num_chunks, offload=offload, mlp_chunks=mlp_chunks,
                       loss_chunks=loss_chunks, lm_head_wgrad=wgrad, **(options or {}),
                       checkpointing=checkpointing if checkpointing in ("on", "offload") else "off")
    model.train()
    if checkpointing == "hf":
        model.gradient_checkpointing_enable()    # Transformers' default: non-reentrant
    inputs = fpdt.hf.prepare_inputs(model, ids, labels=labels)
    with count_calls(fpdt.hf.attention, "fpdt_attention") as interface_calls, \
            count_calls(fpdt.attention.module, "projected_fpdt_attention") as projected_calls, \
            count_calls(fpdt.model.mlp.ChunkedSwiGLUFunction, "apply") as mlp_calls, \
            count_calls(fpdt.model.llama, "rms_norm") as norm_calls:
        out = model(**inputs)
        assert out.logits is None if loss_chunks != 0 else out.logits.shape[:2] == (B, S // world)
        stash = checkpoint_stash(model) if checkpointing == "offload" else None
        if checkpointing == "offload":        # every layer's input on the host until backward
            assert len(stash._host) == ref.config.num_hidden_layers
        out.loss.backward()
        if checkpointing == "offload":
            assert len(stash._host) == 0 and not stash._inflight
    layers = ref.config.num_hidden_layers
    options = options or {}
    chunked_qkv = options.get("chunked_qkv", True)
    attention_calls, unused = (projected_calls, interface_calls) if chunked_qkv else (interface_calls, projected_calls)
    assert len(attention_calls) == layers * (2 if checkpointing else 1)    # the checkpoint recomputes
    assert not unused
    # two norms per layer (twice under a checkpoint) and the final norm; Qwen3's q/k norms run as
    # modules only with Transformers' projections (the chunked path reads their weights). Under fpdt's
    # layer checkpoint, the chunked attention and the chunked MLP apply their layer's norm inside
    fpdt_branches = checkpointing in ("on", "offload")
    per_layer = (2 if name == "qwen3" and not chunked_qkv else 0) + (0 if fpdt_branches and chunked_qkv else 1) \
        + (0 if fpdt_branches and mlp_chunks != 0 else 1)
    assert len(norm_calls) == (per_layer * len(attention_calls) + 1 if options.get("lean_norms", True) else 0)
    assert len(mlp_calls) == (0 if mlp_chunks == 0 else len(attention_calls))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = (f"{name} rank {rank}/{world} u={num_chunks} mlp={mlp_chunks} loss={loss_chunks} offload={offload} "
            f"ckpt={checkpointing} wgrad={wgrad} {options} mesh={mesh and (mesh.hp, mesh.cp)} {dtype}")
    if against_float64 or (against_float64 is None and dtype == torch.bfloat16):
        return _no_worse_than_transformers_bf16(name, ids, labels, out.loss, grads, ref_loss, ref_grads, what)
    return compare(out.loss, grads, ref_loss, ref_grads, what, tol=tol)


def _no_worse_than_transformers_bf16(name, ids, labels, loss, grads, ref_loss, ref_grads, what):
    """bf16 against the float64 truth, with Transformers' own bf16 error as the yardstick
    (:func:`tests.model.helpers.compare_bf16`)."""
    truth = _reference_model(name).to(ids.device, torch.float64)
    truth_loss, truth_grads = hf_loss_and_grads(truth, ids, labels)
    return compare_bf16(loss, grads, ref_loss, ref_grads, truth_loss, truth_grads, what)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES_1, ids=[f"{c[0]}-u{c[1]}-{'-'.join(c[7]) or 'defaults'}" for c in CASES_1])
def test_single_process_matches_transformers(case):
    name, u, mlp, loss, offload, ckpt, wgrad, options = case
    run_case(name, 0, 1, num_chunks=u, mlp_chunks=mlp, loss_chunks=loss, offload=offload, checkpointing=ckpt,
             wgrad=wgrad, options=options)


def test_unshifted_labels_without_sequence_parallelism():
    """With one rank, Transformers' own ``labels=`` (shifted inside) gives the same loss."""
    ref = hf_model("llama_gqa")
    ids, labels = tokens(256, 2, 32)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=4)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    compare(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads, "labels=")


def test_logits_without_labels():
    ref = hf_model("qwen2_tied")
    ids, _ = tokens(256, 1, 32)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2)(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_bf16_close_to_transformers_bf16():
    run_case("llama_gqa", 0, 1, num_chunks=2, mlp_chunks=None, loss_chunks=None, offload=True, checkpointing="offload",
             wgrad="recompute", S=64, dtype=torch.bfloat16)


def _multi_rank(rank, world, cases, mesh_shape=None):
    mesh = SequenceMesh(hp=mesh_shape[0], cp=mesh_shape[1]) if mesh_shape else None
    for name, u, mlp, loss, offload, ckpt, wgrad, options in cases:
        run_case(name, rank, world, num_chunks=u, mlp_chunks=mlp, loss_chunks=loss, offload=offload,
                 checkpointing=ckpt, wgrad=wgrad, options=options, mesh=mesh)


@pytest.mark.slow
def test_two_ranks():
    cases = [("llama_gqa", 1, None, None, False, False, "recompute", {}),
             ("llama_gqa", 2, 3, 5, True, "hf", "accumulate", {}),
             ("qwen2_tied", 2, None, 0, True, "offload", "recompute", {}),
             ("mistral", 4, 2, 3, False, "hf", "recompute", {}),
             ("llama_gqa", 2, None, None, True, "on", "recompute", {}),
             ("qwen2_tied", 2, 3, 5, True, "hf", "recompute", HF_BOTH)]
    run_distributed(_multi_rank, 2, args=(cases,), timeout=240)


@pytest.mark.slow
def test_four_ranks_ulysses_and_2d_mesh():
    """Ulysses over 4 ranks (KV heads replicated: 2 < 4), and the 2 x 2 mesh (ring over cp)."""
    run_distributed(_multi_rank, 4, args=([("llama_sp4", 2, None, None, True, "hf", "recompute", {})],),
                    timeout=240)
    run_distributed(_multi_rank, 4, args=([("llama_sp4", 2, 3, 5, True, "offload", "recompute", {}),
                                           ("llama_sp4", 1, None, None, False, "hf", "recompute", HF_BOTH)], (2, 2)),
                    timeout=240)


# ---------------------------------------------------------------- refusals, each naming the fix
def _patched(name="llama_gqa", **kw):
    return fpdt.hf.apply_fpdt(hf_model(name), **kw)


def test_padding_other_than_right_padding_with_ignored_labels_is_refused():
    model = _patched(num_chunks=2)
    ids, labels = tokens(256, 1, 16, ignore=False)
    mask = torch.ones_like(ids)
    model(input_ids=ids, attention_mask=mask)                 # hides nothing: fine
    left = mask.clone()
    left[0, :3] = 0
    with pytest.raises(fpdt.hf.FPDTHFError, match="not right padding.*padding_side='right'"):
        model(input_ids=ids, attention_mask=left, labels=labels)
    right = mask.clone()
    right[0, -3:] = 0
    with pytest.raises(fpdt.hf.FPDTHFError, match="without labels"):
        model(input_ids=ids, attention_mask=right)
    with pytest.raises(fpdt.hf.FPDTHFError, match="targets other than -100.*label -100"):
        model(input_ids=ids, attention_mask=right, labels=labels)
    with pytest.raises(fpdt.hf.FPDTHFError, match="targets other than -100"):
        fpdt.hf.prepare_inputs(model, ids, labels=labels, attention_mask=right)
    labels[0, -3:] = -100
    model(input_ids=ids, attention_mask=right, labels=labels)          # right padding, ignored: accepted


def test_kv_cache_is_refused():
    model = _patched()
    ids, _ = tokens(256, 1, 16)
    with pytest.raises(fpdt.hf.FPDTHFError, match="use_cache=False"):
        model(input_ids=ids, use_cache=True)


def test_only_attention_registered_refuses_a_cache_too():
    """The registered attention alone (no forward patch): generation with a cache is refused by its mask."""
    from fpdt.hf.attention import register_settings
    from fpdt.hf.patches import Patches
    from fpdt.options import FPDTOptions

    model, patches = hf_model("llama_gqa"), Patches()
    model.set_attn_implementation(register_settings(FPDTOptions(num_chunks=1), patches))
    ids, _ = tokens(256, 1, 16)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            with pytest.raises(fpdt.hf.FPDTHFError, match="KV cache"):
                model(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    finally:
        patches.undo()


def test_unsupported_configs_are_refused():
    cfg = hf_config("mistral")
    cfg.sliding_window = 8
    with pytest.raises(fpdt.hf.FPDTHFError, match="sliding-window .*window 8"):
        fpdt.hf.apply_fpdt(transformers.MistralForCausalLM(cfg))
    cfg = hf_config("llama_gqa")
    cfg.attention_dropout = 0.1
    with pytest.raises(fpdt.hf.FPDTHFError, match="attention_dropout=0.1.*set it to 0"):
        fpdt.hf.apply_fpdt(transformers.LlamaForCausalLM(cfg))
    cfg = hf_config("llama_gqa")
    cfg.hidden_act = "gelu"
    with pytest.raises(fpdt.hf.FPDTHFError, match="hidden_act='gelu': pass mlp_chunks=0"):
        fpdt.hf.apply_fpdt(transformers.LlamaForCausalLM(cfg))
    fpdt.hf.apply_fpdt(transformers.LlamaForCausalLM(cfg), mlp_chunks=0)
    with pytest.raises(fpdt.hf.FPDTHFError, match="already applied"):
        fpdt.hf.apply_fpdt(_patched())
    with pytest.raises(fpdt.hf.FPDTHFError, match="checkpointing='sometimes' must be one of"):
        _patched(checkpointing="sometimes")
    both = _patched(checkpointing="offload")
    both.train()
    both.activation_checkpointing_enable()
    with pytest.raises(fpdt.hf.FPDTHFError, match="activation_checkpointing_disable"):
        both(input_ids=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(fpdt.hf.FPDTHFError, match="not a decoder-only causal LM"):
        fpdt.hf.apply_fpdt(hf_model("llama_gqa").model)
    with pytest.raises(fpdt.hf.FPDTHFError, match="before fpdt.hf.prepare_inputs"):
        fpdt.hf.prepare_inputs(hf_model("llama_gqa"), torch.zeros(1, 8, dtype=torch.long))


def test_sequence_not_divisible_names_the_fix():
    model = _patched(num_chunks=3)
    ids, _ = tokens(256, 1, 16)
    with pytest.raises(ValueError, match="divisible"):
        fpdt.hf.prepare_inputs(model, ids)
    with pytest.raises(ValueError, match=r"16 tokens is not a multiple of sp\*num_chunks=1\*3=3: .*"
                                         r"fpdt.hf.FlatteningCollator\(model\)"):
        model(input_ids=ids)


def _num_items_is_the_group_count(rank, world):
    """``num_items_in_batch`` = the valid-label count over the SP group gives the default loss;
    a per-rank count would not (it must be the group's)."""
    model = _patched(num_chunks=2)
    ids, labels = tokens(256, 1, 16)
    inputs = fpdt.hf.prepare_inputs(model, ids, labels=labels)
    default = model(**inputs).loss
    count = inputs["shift_labels"].ne(-100).sum()
    local_only = model(**inputs, num_items_in_batch=count).loss
    dist.all_reduce(count)
    assert torch.equal(model(**inputs, num_items_in_batch=count).loss, default)
    assert not torch.allclose(local_only, default)


@pytest.mark.slow
def test_num_items_in_batch_on_two_ranks():
    run_distributed(_num_items_is_the_group_count, 2)


def _labels_refused_with_sp(rank, world):
    model = _patched(num_chunks=1)
    ids, labels = tokens(256, 1, 16)
    inputs = fpdt.hf.prepare_inputs(model, ids)
    with pytest.raises(fpdt.hf.FPDTHFError, match="shift_labels= from fpdt.hf.prepare_inputs"):
        model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], labels=labels[:, :8])
    with pytest.raises(fpdt.hf.FPDTHFError, match="position_ids are required"):
        model(input_ids=inputs["input_ids"], shift_labels=inputs["shift_labels"])


@pytest.mark.slow
def test_labels_and_missing_positions_refused_with_sequence_parallelism():
    with warnings.catch_warnings():
        run_distributed(_labels_refused_with_sp, 2)


def test_save_pretrained_loads_back_as_a_plain_transformers_model(tmp_path):
    """The patched model's weights and config load back unchanged, with a standard attention
    implementation and the KV cache setting the model had."""
    ref = hf_model("qwen2_tied")
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2)
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.config._attn_implementation in ("sdpa", "eager")
    assert back.config.use_cache == ref.config.use_cache
    ids, _ = tokens(256, 1, 16)
    with torch.no_grad():
        got, want = back(input_ids=ids).logits, ref(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()     # sdpa there, eager here
    for (n, p), (n2, p2) in zip(back.state_dict().items(), ref.state_dict().items()):
        assert n == n2 and torch.equal(p, p2), n


@pytest.mark.parametrize("loss_chunks", [None, 0])
def test_return_dict_false_gives_the_loss_first(loss_chunks):
    model = _patched(num_chunks=2, loss_chunks=loss_chunks)
    ids, labels = tokens(256, 1, 16)
    out = model(input_ids=ids, labels=labels)
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out.loss)
    assert out.loss is out["loss"]


def test_a_deep_copy_runs_its_own_weights():
    """EMA / reference-model copies made after apply_fpdt: each copy's forward (loss, logits and
    fpdt's layer checkpoint) runs the copy's layers, not the original's."""
    ids, labels = tokens(256, 1, 16)
    for checkpointing in ("off", "offload"):
        model = _patched(num_chunks=2, checkpointing=checkpointing, loss_chunks=0)
        model.train()
        before = model(input_ids=ids, labels=labels)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        after = twin(input_ids=ids, labels=labels)
        assert torch.equal(after.loss, before.loss) and torch.equal(after.logits, before.logits), checkpointing
        after.loss.backward()
        assert all(p.grad is not None for p in twin.parameters()) and \
            all(p.grad is None for p in model.parameters()), checkpointing


class _Adapter(torch.nn.Linear):
    """Stands in for a PEFT/LoRA or quantised linear: not a plain nn.Linear."""


def test_adapters_on_the_chunked_weights_are_refused():
    ids, labels = tokens(256, 1, 16)
    model = _patched(num_chunks=2)
    mlp = model.model.layers[0].mlp
    mlp.gate_proj = _Adapter(mlp.gate_proj.in_features, mlp.gate_proj.out_features, bias=False)
    with pytest.raises(fpdt.hf.FPDTHFError, match="_Adapter, Linear, Linear .*mlp_chunks=0"):
        model(input_ids=ids, labels=labels)
    model = _patched(num_chunks=2)
    model.lm_head = _Adapter(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    with pytest.raises(fpdt.hf.FPDTHFError, match="lm_head is tests.hf.test_apply_fpdt._Adapter.*loss_chunks=0"):
        model(input_ids=ids, labels=labels)
    model(input_ids=ids)          # logits only: the LM head runs as a module


def test_jumping_positions_and_a_global_mask_are_refused():
    model = _patched(num_chunks=2)
    ids, _ = tokens(256, 1, 16)
    jumping = torch.cat([torch.arange(8), torch.arange(8) + 3]).unsqueeze(0)   # neither +1 nor a restart at 0
    with pytest.raises(fpdt.hf.FPDTHFError, match="step from 7 to 3 .*restart at 0"):
        fpdt.hf.prepare_inputs(model, ids, position_ids=jumping)
    with pytest.raises(fpdt.hf.FPDTHFError, match="step from 7 to 3 .*restart at 0"):
        model(input_ids=ids, position_ids=jumping)
    with pytest.raises(fpdt.hf.FPDTHFError, match="mask covers 16 tokens but this rank holds 8"):
        model(input_ids=ids[:, :8], attention_mask=torch.ones(1, 16, dtype=torch.long))


def _seeded(model_class, cfg, seed):
    """``model_class(cfg)`` with seeded weights and non-trivial norm weights (their gradients tested too)."""
    torch.manual_seed(seed)
    model = model_class(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _qwen3(seed=0):
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-3,
                                   attn_implementation="eager", initializer_range=0.05)
    return _seeded(transformers.Qwen3ForCausalLM, cfg, seed)


QWEN3_CASES = [("qwen3", 1, None, None, False, False, "recompute", {}),
               ("qwen3", 4, 3, 5, True, "offload", "accumulate", {}),
               ("qwen3", 2, None, 0, True, "hf", "recompute", {}),
               ("qwen3", 2, None, None, False, "hf", "recompute", HF_QKV)]   # Transformers' projections


@pytest.mark.slow
@pytest.mark.parametrize("case", QWEN3_CASES, ids=[f"u{c[1]}-{'-'.join(c[7]) or 'defaults'}" for c in QWEN3_CASES])
def test_qwen3_per_head_qk_norms(case):
    """Qwen3 RMS-normalises q and k per head between the projection and RoPE: inside the chunked
    projection (its backward recomputes the pre-norm q/k and accumulates the norm weights'
    gradients), or with ``chunked_qkv=False`` as Transformers' modules running the lean norm."""
    name, u, mlp, loss, offload, ckpt, wgrad, options = case
    run_case(name, 0, 1, num_chunks=u, mlp_chunks=mlp, loss_chunks=loss, offload=offload, checkpointing=ckpt,
             wgrad=wgrad, options=options)


def _qwen3_two_ranks(rank, world):
    run_case("qwen3", rank, world, num_chunks=2, mlp_chunks=None, loss_chunks=None, offload=True,
             checkpointing="offload", wgrad="recompute")
    run_case("qwen3", rank, world, num_chunks=2, mlp_chunks=None, loss_chunks=None, offload=True,
             checkpointing="hf", wgrad="recompute", S=64, dtype=torch.bfloat16)


@pytest.mark.slow
def test_qwen3_on_two_ranks_fp32_and_bf16():
    run_distributed(_qwen3_two_ranks, 2, timeout=240)


def test_qwen3_norms_that_are_not_transformers_own_are_refused():
    model = _qwen3()
    model.model.layers[0].self_attn.k_norm = _OtherNorm(16)
    with pytest.raises(fpdt.hf.FPDTHFError, match="q_norm/k_norm weights directly.*_OtherNorm.*chunked_qkv=False"):
        fpdt.hf.apply_fpdt(model, lean_norms=False)


def test_adapters_on_the_projections_are_refused():
    ids, labels = tokens(256, 1, 16)
    model = hf_model("llama_gqa")
    attn = model.model.layers[1].self_attn
    attn.k_proj = _Adapter(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    with pytest.raises(fpdt.hf.FPDTHFError, match="Linear, _Adapter, Linear .*chunked_qkv=False"):
        fpdt.hf.apply_fpdt(model)
    fpdt.hf.apply_fpdt(model, chunked_qkv=False)(input_ids=ids, labels=labels)
    model = _patched(num_chunks=2)                            # an adapter added after apply_fpdt
    attn = model.model.layers[0].self_attn
    attn.q_proj = _Adapter(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    with pytest.raises(fpdt.hf.FPDTHFError, match="chunked_qkv=False"):
        model(input_ids=ids, labels=labels)


class _OtherNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """Stands in for an RMSNorm variant fpdt does not know (e.g. Gemma's 1 + weight)."""


def test_unknown_norm_classes_are_refused():
    model = hf_model("llama_gqa")
    for layer in model.model.layers:
        layer.input_layernorm = _OtherNorm(model.config.hidden_size)
    with pytest.raises(fpdt.hf.FPDTHFError, match="layer norm is .*_OtherNorm.*lean_norms=False"):
        fpdt.hf.apply_fpdt(model)
    fpdt.hf.apply_fpdt(model, lean_norms=False)


class LlamaAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """A remote-code class that only shares Transformers' name."""


def test_classes_are_matched_by_identity_not_name():
    model = hf_model("llama_gqa")
    old = model.model.layers[0].self_attn
    new = LlamaAttention(model.config, 0)
    new.load_state_dict(old.state_dict())
    model.model.layers[0].self_attn = new
    with pytest.raises(fpdt.hf.FPDTHFError, match="test_apply_fpdt.LlamaAttention may compute something else"):
        fpdt.hf.apply_fpdt(model)


def test_a_config_window_llama_never_uses_is_not_refused():
    """Llama's attention passes no window whatever the config carries (ported checkpoints may
    have a sliding_window key); only Mistral's reads the config's."""
    cfg = hf_config("llama_gqa")
    cfg.sliding_window = 4096
    ref = transformers.LlamaForCausalLM(cfg)
    ids, labels = tokens(256, 1, 16)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2)
    model.zero_grad(set_to_none=True)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    compare(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads, "llama with a config window")


@pytest.mark.parametrize("chunked_qkv", [True, False])
def test_settings_changed_after_apply_are_refused_in_forward(chunked_qkv):
    """What the attention would be asked at call time (dropout switched on later) is refused there, on both
    attention paths; packed-sequence kwargs that reach the attention itself too (the model's forward takes the
    collator's cu_seq_lens_q/k as packed documents, tests/hf/test_packed_documents.py)."""
    ids, labels = tokens(256, 1, 16)
    model = _patched(num_chunks=2, chunked_qkv=chunked_qkv).train()
    model.model.layers[1].self_attn.attention_dropout = 0.1
    with pytest.raises(fpdt.hf.FPDTHFError, match="attention dropout 0.1 .*attention_dropout to 0"):
        model(input_ids=ids, labels=labels)
    model.model.layers[1].self_attn.attention_dropout = 0.0
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    attn = model.model.layers[0].self_attn
    with pytest.raises(fpdt.hf.FPDTHFError, match="cu_seq_lens_k, cu_seq_lens_q .*packed sequences"):
        fpdt.hf.attention._refuse_unhonoured(attn, "fpdt", None, 0.0, None, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu))
    model(input_ids=ids, labels=labels).loss.backward()


def test_autocast_is_refused_with_the_fix():
    model = _patched(num_chunks=2)
    ids, labels = tokens(256, 1, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(fpdt.hf.FPDTHFError, match=r"torch.autocast: cast the model .*model.to\(torch.bfloat16\)"):
            model(input_ids=ids, labels=labels)


# RoPE that picks its frequencies from the largest position a forward sees. With 32 tokens on 2 ranks
# and u = 4, rank 0 holds positions up to 27 and rank 1 up to 31: dynamic NTK scaling (past 16)
# would give each rank other frequencies, and longrope (past 28) rank 0 the short factors.
ROPE_VARIANTS = {
    "llama_dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 16),
    "llama_longrope": ({"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 28,
                        "short_factor": [1.0 + 0.1 * i for i in range(8)],
                        "long_factor": [2.0 + 0.5 * i for i in range(8)]}, 64),
}


def _rope_variant(name, seed=0):
    rope, max_positions = ROPE_VARIANTS[name]
    cfg = hf_config("llama_gqa")                              # head_dim 16: 8 frequencies
    cfg.rope_parameters, cfg.max_position_embeddings = dict(rope), max_positions
    return _seeded(transformers.LlamaForCausalLM, cfg, seed)


@pytest.mark.slow
def test_position_dependent_rope_on_two_ranks_sees_the_whole_window():
    """Each rank's RoPE picks the frequencies one process holding the window would: the largest
    position is the window's (one all-reduce per forward), not the rank's."""
    run_distributed(_multi_rank, 2, args=([("llama_dynamic", 4, None, None, False, False, "recompute", {}),
                                           ("llama_longrope", 4, None, None, True, "offload", "recompute", {})],))


def _rope_state_over_steps(rank, world):
    from fpdt.layout.fpdt_layout import shard
    for name in ROPE_VARIANTS:
        ref = _rope_variant(name)
        model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=2)          # the world as the SP group
        ours, theirs = model.model.rotary_emb, ref.model.rotary_emb
        # growth, a reset below the original length, regrowth; position ids [B, S] and [1, S]
        for S, B, rows in ((32, 1, 1), (8, 2, 2), (48, 2, 1), (24, 1, 1), (12, 2, 2), (64, 2, 2)):
            positions = torch.arange(S).expand(rows, S)
            x = torch.randn(B, S, ref.config.hidden_size)
            want = theirs(x, positions)                                        # one process, the whole window
            local = shard(positions, world, 2, rank, dim=1)
            got = ours(shard(x, world, 2, rank, dim=1), local)
            for g, w in zip(got, want):
                assert torch.equal(g, w.index_select(1, local[0])), f"{name} S={S} rows={rows}"
            assert torch.equal(ours.inv_freq, theirs.inv_freq) and ours.attention_scaling == theirs.attention_scaling
            assert getattr(ours, "max_seq_len_cached", None) == getattr(theirs, "max_seq_len_cached", None)


@pytest.mark.slow
def test_position_dependent_rope_state_follows_one_process_over_steps():
    run_distributed(_rope_state_over_steps, 2)


@pytest.mark.slow
def test_position_dependent_rope_on_one_process():
    for name in ROPE_VARIANTS:
        run_case(name, 0, 1, num_chunks=4, mlp_chunks=None, loss_chunks=None, offload=False, checkpointing=False,
                 wgrad="recompute")


def test_zero3_external_parameters_registered():
    """The weights the chunked functions read without their module's forward are registered
    with the module whose forward reads them (DeepSpeed's route for ZeRO-3's gather)."""
    pytest.importorskip("deepspeed")
    model = _patched(num_chunks=2)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert set(attn._external_params.values()) == {attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                                       attn.o_proj.weight}
        assert set(mlp._external_params.values()) == {mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight}
    assert set(model._external_params.values()) == {model.lm_head.weight}
    qwen3 = fpdt.hf.apply_fpdt(_qwen3(), num_chunks=2)
    for layer in qwen3.model.layers:
        attn = layer.self_attn
        assert set(attn._external_params.values()) == {attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                                       attn.o_proj.weight, attn.q_norm.weight, attn.k_norm.weight}
    plain = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), chunked_qkv=False, mlp_chunks=0, loss_chunks=0)
    assert not any(hasattr(m, "_external_params") for m in plain.modules())


def _bf16_two_ranks(rank, world):
    for name, u in (("llama_gqa", 2), ("qwen2_tied", 1)):
        run_case(name, rank, world, num_chunks=u, mlp_chunks=None, loss_chunks=None, offload=True,
                 checkpointing="hf", wgrad="recompute", S=64, dtype=torch.bfloat16)


@pytest.mark.slow
def test_bf16_on_two_ranks_close_to_transformers_bf16():
    run_distributed(_bf16_two_ranks, 2, timeout=240)


@pytest.mark.cuda
@pytest.mark.parametrize("checkpointing", ["offload", "hf"])
def test_cuda_bf16_with_offload_close_to_transformers(checkpointing):
    """On a GPU: real CUDA streams and pinned host buffers for the attention chunks (and, with
    fpdt's checkpoint, the layer inputs), against the unchanged model on the same GPU."""
    run_case("llama_gqa", 0, 1, num_chunks=4, mlp_chunks=None, loss_chunks=None, offload=True,
             checkpointing=checkpointing, wgrad="recompute", S=256, dtype=torch.bfloat16, device="cuda")


def _right_padded(vocab, S):
    """Two rows, the second right-padded (its last S/4 + 1 tokens), labels -100 there."""
    ids, labels = tokens(vocab, 2, S)
    mask = torch.ones_like(ids)
    mask[1, S - S // 4 - 1:] = 0
    labels[mask == 0] = -100
    return ids, labels, mask


def _padding_case(rank, world, u, checkpointing):
    ref = hf_model("llama_gqa")
    ids, labels, mask = _right_padded(ref.config.vocab_size, 8 * world * u)
    model = copy.deepcopy(ref)
    ref.zero_grad(set_to_none=True)
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss     # Transformers with the mask
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    fpdt.hf.apply_fpdt(model, num_chunks=u, offload=True, checkpointing=checkpointing)
    model.train()
    if world == 1:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    else:
        loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels, attention_mask=mask)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    compare(loss, grads, ref_loss, ref_grads, f"right padding rank {rank}/{world} u={u} {checkpointing}")


@pytest.mark.slow
def test_right_padding_matches_transformers_with_its_mask():
    """Right padding labelled -100, as padding collators make it: Transformers applies the mask,
    fpdt needs none (real tokens never see the padding); loss and every gradient within 1e-5."""
    _padding_case(0, 1, 2, "off")
    run_distributed(_padding_case, 2, args=(2, "offload"))


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_remove_fpdt_restores_the_model(checkpointing):
    """apply_fpdt puts fpdt.model's own modules in place (FPDTAttention, ChunkedSwiGLU, RMSNorm) holding
    the model's parameters under the same names; remove_fpdt undoes every patch apply_fpdt made (each
    went through fpdt.hf.patches): the original modules are back, no instance attribute is left on
    any module, the attention name is the model's own again,
    Transformers' attention and mask registries hold the entries they held, and the model
    computes the same logits, loss and gradients, bit for bit; it can then be applied again."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def registries():
        return {cls.__name__: dict(cls._global_mapping) for cls in (AttentionInterface, AttentionMaskInterface)}

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach(), [p.grad.clone() for p in model.parameters()]

    model = hf_model("llama_gqa")
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    modules = dict(model.named_modules())
    attention, registered = model.config._attn_implementation, registries()
    ids = torch.randint(0, model.config.vocab_size, (1, 32))
    ref = run()
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    fpdt.hf.apply_fpdt(model, num_chunks=2, checkpointing=checkpointing)
    assert model.config._attn_implementation != attention
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys    # the same tensors, the same names
    for layer in model.model.layers:
        assert isinstance(layer.self_attn, FPDTAttention) and type(layer.mlp) is ChunkedSwiGLU
        assert type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
    assert type(model.model.norm) is RMSNorm
    assert {n: set(r) - set(registered[n]) for n, r in registries().items()} == \
        {n: {model.config._attn_implementation} for n in registered}
    fpdt.hf.remove_fpdt(model)
    assert all(modules[n] is m for n, m in model.named_modules()) and len(modules) == len(dict(model.named_modules()))
    after = {name: dict(m.__dict__) for name, m in model.named_modules()}
    assert {n: sorted(d) for n, d in after.items()} == {n: sorted(d) for n, d in before.items()}
    assert model.config._attn_implementation == attention and getattr(model, "fpdt", None) is None
    assert registries() == registered
    logits, loss, grads = run()
    assert torch.equal(logits, ref[0]) and torch.equal(loss, ref[1])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref[2]))
    fpdt.hf.apply_fpdt(model, num_chunks=2)                     # applies again
    with pytest.raises(fpdt.hf.FPDTHFError, match="apply_fpdt was not applied"):
        fpdt.hf.remove_fpdt(hf_model("llama_gqa"))
    with pytest.raises(fpdt.hf.FPDTHFError, match="a copy"):
        fpdt.hf.remove_fpdt(copy.deepcopy(model))

"""LoRA on hybrid and mixture-of-experts models, fpdt's own (``fpdt.model.add_lora``) against PEFT on
the Transformers model: Qwen3.5's Gated DeltaNet projections (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``, ``out_proj``), its gated attention and MLP; Qwen3-MoE's attention on 2
ranks (its fused experts carry no fpdt adapter; one rank: ``tests/model/test_moe_model.py``). Same
base weights and adapters (PEFT's, random ``B``: every gradient nonzero, copied into fpdt's); fpdt
on 1 and 2 gloo ranks, per-rank gradients summed over the SP group. Qwen3.5 is judged as
``tests/model/qwen35.py`` says (float64 reference: within 1e-5, or twice Transformers' own fp32
error), and the loss and every adapter gradient but ``in_proj_a``'s within 1e-5. ``in_proj_a``
feeds the decay gate ``g = -exp(A_log) softplus(a + dt_bias)``, whose gradients are sums with
cancellation: PEFT's own fp32 run lands 1e-5 to 2e-4 from float64 on its adapters (as on ``A_log``).
Qwen3-MoE: fp32 within 1e-5 of PEFT's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fpdt.model as fm
from fpdt.model.lora import GDN_TARGETS, LORA_TARGETS, LoraSpec
from tests.distributed import run_distributed
from tests.model.helpers import TOL, compare, tokens
from tests.model.qwen35 import compare_hybrid, float64_delta_rule, fpdt_qwen35, qwen35_model
from tests.model.test_lora_model import peft_name

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def hybrid_models(name: str, spec: LoraSpec, **options):
    """(PEFT model, fpdt model) of the tiny Qwen3.5 ``name``, same base and adapters."""
    base = qwen35_model(name)
    torch.manual_seed(3)
    ref = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=spec.rank, lora_alpha=spec.lora_alpha, target_modules=list(spec.targets), lora_dropout=spec.dropout,
        use_rslora=spec.rslora, init_lora_weights=False))
    with torch.no_grad():                  # B small, as after a few steps: the hybrid stays well conditioned
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    ours = fm.add_lora(fpdt_qwen35(base, **options), spec)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in fm.adapter_state_dict(ours).items():
            p.copy_(params[peft_name(n)])
    return ref, ours


def peft_references(ref, ids, labels):
    """``(fp32, float64)`` PEFT results, each ``(loss, {name: adapter grad})``. float64: the float64
    token recurrence in Transformers' Gated DeltaNet, and the loss taken from the float64 logits
    (Transformers' own loss casts them to fp32, an fp32 floor of about 3e-6 on these gradients)."""
    out = []
    for dtype in (torch.float32, torch.float64):
        model = copy.deepcopy(ref).to(dtype)
        with float64_delta_rule():
            if dtype == torch.float32:
                loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            else:
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
                loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
            loss.backward()
        out.append((loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    return tuple(out)


def run_hybrid(name, rank, world, *, spec, num_chunks=2, checkpointing="off", offload=False, B=2):
    S = 8 * world * num_chunks
    ref, ours = hybrid_models(name, spec, num_chunks=num_chunks, checkpointing=checkpointing, offload=offload,
                              runtime="sim" if offload else None, group=dist.group.WORLD if world > 1 else None)
    ids, labels = tokens(ref.config.vocab_size, B, S)
    refs = peft_references(ref, ids, labels)
    loss = ours(**ours.prepare_inputs(ids, labels=labels))
    loss.backward()
    frozen = [n for n, p in ours.named_parameters() if not fm.lora.is_adapter(n) and (p.requires_grad or p.grad is not None)]
    assert not frozen, f"base parameters got gradients: {frozen[:3]}"
    grads = {peft_name(n): p.grad.detach().clone() for n, p in fm.adapter_state_dict(ours).items()}
    assert any(".in_proj_a." in n for n in grads) == ("in_proj_a" in spec.targets)
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"{name} fpdt LoRA rank {rank}/{world} u={num_chunks} ckpt={checkpointing} offload={offload} {spec}"
    errs = compare_hybrid(loss, grads, refs, what)
    worst = max(((n, e) for n, e in errs.items() if ".in_proj_a." not in n), key=lambda kv: kv[1][0])
    assert worst[1][0] <= TOL, f"{what}: {worst}"
    return errs


@pytest.mark.parametrize("num_chunks,checkpointing,offload", [(1, "off", False), (3, "offload", True)])
def test_gdn_and_gated_attention_against_peft(num_chunks, checkpointing, offload):
    run_hybrid("qwen35", 0, 1, spec=LoraSpec(3, alpha=5.0, targets=LORA_TARGETS), num_chunks=num_chunks,
               checkpointing=checkpointing, offload=offload)


def test_gdn_targets_only_rslora_layer_checkpoints():
    run_hybrid("qwen35", 0, 1, spec=LoraSpec(2, targets=("in_proj_qkv", "in_proj_b", "out_proj"), rslora=True),
               num_chunks=2, checkpointing="on")


def run_moe(rank, world, *, num_chunks=2, checkpointing="off", offload=False):
    """fpdt's LoRA on Qwen3-MoE's attention (its default there) against PEFT's: loss with the
    balancing loss and every adapter gradient, fp32 within 1e-5."""
    from fpdt.model.lora import ATTENTION_TARGETS
    from tests.model.test_moe_model import hf_moe
    spec = LoraSpec(3, alpha=4.0, targets=ATTENTION_TARGETS)
    torch.manual_seed(3)
    ref = peft.get_peft_model(hf_moe(), peft.LoraConfig(r=3, lora_alpha=4.0, target_modules=list(spec.targets),
                                                         init_lora_weights=False))
    ours = fm.from_config(ref.config, num_chunks=num_chunks, checkpointing=checkpointing, offload=offload,
                          runtime="sim" if offload else None, group=dist.group.WORLD if world > 1 else None)
    fm.load_hf_state_dict(ours, hf_moe().state_dict())
    fm.add_lora(ours, spec)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in fm.adapter_state_dict(ours).items():
            p.copy_(params[peft_name(n)])
    ids, labels = tokens(ref.config.vocab_size, 2, 8 * world * num_chunks)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    loss = ours(**ours.prepare_inputs(ids, labels=labels))
    loss.backward()
    grads = {peft_name(n): p.grad.detach().clone() for n, p in fm.adapter_state_dict(ours).items()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    compare(loss, grads, ref_loss.detach(), {n: p.grad for n, p in ref.named_parameters() if p.requires_grad},
            f"qwen3_moe fpdt LoRA rank {rank}/{world} u={num_chunks} ckpt={checkpointing}")


STREAMED = dict(offload=True, checkpointing="offload", stream_layers=True, runtime="sim")


def _adapter_grads(model, scale: float, ids, labels, world: int):
    """Loss and the SP-summed adapter gradients (PEFT's names) of ``loss * scale``, divided by ``scale``."""
    loss = model(**model.prepare_inputs(ids, labels=labels))
    (loss * scale).backward()
    grads = {peft_name(n): p.grad.detach() / scale for n, p in fm.adapter_state_dict(model).items()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    return loss.detach(), grads


def run_streamed(rank, world, *, spec, num_chunks=3, B=2):
    """fpdt's LoRA on every Qwen3.5 projection (Gated DeltaNet included) with ``stream_layers``, the loss
    scaled by a random factor: against PEFT (float64, :func:`compare_hybrid`) and against the same model
    unstreamed (fp32, within 1e-5); returns the errors against the unstreamed run."""
    group = dict(group=dist.group.WORLD) if world > 1 else {}
    ref, streamed = hybrid_models("qwen35", spec, num_chunks=num_chunks, **STREAMED, **group)
    _, plain = hybrid_models("qwen35", spec, num_chunks=num_chunks, **group)
    ids, labels = tokens(ref.config.vocab_size, B, 4 * world * num_chunks)
    scale = 2.0 + float(torch.randn((), generator=torch.Generator().manual_seed(ids.shape[1])))
    loss, grads = _adapter_grads(streamed, scale, ids, labels, world)
    assert any(".linear_attn.in_proj_qkv." in n for n in grads) and all(g.abs().max() > 0 for g in grads.values())
    what = f"streamed fpdt LoRA rank {rank}/{world} u={num_chunks} {spec}"
    compare_hybrid(loss, grads, peft_references(ref, ids, labels), what)
    return compare(loss, grads, *_adapter_grads(plain, scale, ids, labels, world), what + " vs unstreamed")


def test_streamed_gdn_lora_against_peft_and_unstreamed():
    """The streamed Gated DeltaNet pass with adapters on ``in_proj_*`` and ``out_proj`` (and on the
    attention and MLP): forward and every A/B gradient."""
    run_streamed(0, 1, spec=LoraSpec(3, alpha=5.0, targets=LORA_TARGETS), num_chunks=3)


def test_streamed_gdn_lora_dropout_masks_replayed():
    """Dropout on the Gated DeltaNet adapters only (one seed drawn per layer, in layer order, streamed
    or not): the streamed step, whose backward redraws the seed under the layer's replayed random
    state, gives the unstreamed step's loss and adapter gradients: float64 within 1e-6 (another seed's
    masks move the gradients by 0.3 or more; without dropout the two runs differ by 1.7e-7: the
    chunked loss runs in fp32 whatever the model's dtype); eval mode differs (the masks act)."""
    from tests.model.helpers import rel_err
    spec = LoraSpec(2, dropout=0.3, targets=GDN_TARGETS)
    ids, labels = tokens(256, 2, 24)
    results = []
    for options in (STREAMED, dict(checkpointing="offload", offload=True, runtime="sim")):
        model = hybrid_models("qwen35", spec, num_chunks=3, **options)[1].double()
        torch.manual_seed(11)
        results.append(_adapter_grads(model, 1.0, ids, labels, 1))
    compare(*results[0], *results[1], "streamed GDN LoRA dropout vs unstreamed", tol=1e-6)
    model.eval()
    with torch.no_grad():
        assert rel_err(model(**model.prepare_inputs(ids, labels=labels)), results[1][0]) > 1e-4


def _two_ranks(rank, world):
    from tests.model.test_lora_shared_expert import STREAMED as SHARED_STREAMED
    from tests.model.test_lora_shared_expert import shared_expert_case
    run_hybrid("qwen35", rank, world, spec=LoraSpec(3, targets=LORA_TARGETS), num_chunks=2, checkpointing="offload",
               offload=True)
    run_moe(rank, world, num_chunks=2, checkpointing="offload", offload=True)
    run_streamed(rank, world, spec=LoraSpec(3, alpha=5.0, targets=LORA_TARGETS), num_chunks=2)
    shared_expert_case("qwen35moe_sp2", rank, world, 2, checkpointing="offload", offload=True, runtime="sim")
    shared_expert_case("qwen35moe_sp2", rank, world, 2, **SHARED_STREAMED)


@pytest.mark.slow
def test_two_ranks_against_peft():
    run_distributed(_two_ranks, 2, timeout=600)


def test_refusals_and_defaults():
    from tests.model.helpers import fpdt_from_hf, hf_model
    with pytest.raises(ValueError, match="no Gated DeltaNet layer"):
        fm.add_lora(fpdt_from_hf(hf_model("llama_gqa")), LoraSpec(2, targets=GDN_TARGETS[:1]))
    assert LoraSpec(2).targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = fm.add_lora(fpdt_qwen35(qwen35_model()), LoraSpec(2, targets=("q_proj", "in_proj_z")))
    names = sorted(fm.adapter_state_dict(model))
    assert names == sorted([f"model.layers.{i}.linear_attn.in_proj_z.lora_{k}.weight" for i in range(3) for k in "AB"]
                           + [f"model.layers.3.self_attn.q_proj.lora_{k}.weight" for k in "AB"])


def test_targets_per_model_kind_and_adapter_shapes():
    """fpdt-train's targets per model (train.lora.for_model) and the shapes it checks a --lora-init
    directory against (train.lora.adapter_shapes) are those add_lora attaches: Qwen3.5 (gated q_proj
    twice as wide, the Gated DeltaNet projections by default), Qwen3-MoE (attention only, the dense
    layer's MLP neither: MLP targets refused)."""
    from fpdt.model.lora import ATTENTION_TARGETS, DEFAULT_TARGETS
    from fpdt.train.config import ConfigError
    from fpdt.train.lora import adapter_shapes, for_model
    from tests.model.test_moe_model import hf_moe
    hybrid = fpdt_qwen35(qwen35_model())
    moe = fm.from_config(hf_moe().config)
    assert for_model(LoraSpec(2), hybrid.config, False).targets == LORA_TARGETS
    assert for_model(LoraSpec(2, targets=("q_proj",)), hybrid.config, True).targets == ("q_proj",)
    assert for_model(LoraSpec(2), moe.config, False).targets == ATTENTION_TARGETS
    with pytest.raises(ConfigError, match="mixture-of-experts model"):
        for_model(LoraSpec(2, targets=("q_proj", "up_proj")), moe.config, True)
    from tests.model.helpers import hf_model
    llama = fm.ModelConfig.from_hf(hf_model("llama_gqa").config)
    assert for_model(LoraSpec(2), llama, False).targets == DEFAULT_TARGETS
    with pytest.raises(ConfigError, match="no Gated DeltaNet layer"):
        for_model(LoraSpec(2, targets=("out_proj",)), llama, True)
    with pytest.raises(ValueError, match="mixture-of-experts model"):
        fm.add_lora(fm.from_config(hf_moe().config), LoraSpec(2))
    for model, spec in ((hybrid, LoraSpec(3, targets=LORA_TARGETS)), (moe, LoraSpec(3, targets=ATTENTION_TARGETS))):
        fm.add_lora(model, spec)
        got = {n: tuple(p.shape) for n, p in fm.adapter_state_dict(model).items()}
        assert got == adapter_shapes(model.config, spec)


def test_gdn_dropout_replayed_by_every_checkpoint_mode():
    """LoRA dropout on every Qwen3.5 projection: the masks differ from step to step but not between
    a layer's forward and its recompute (every checkpointing mode gives the same loss and adapter
    gradients from the same seed, bit for bit), and they do act (training mode differs from eval)."""
    from tests.model.helpers import rel_err
    spec = LoraSpec(2, dropout=0.3, targets=LORA_TARGETS)
    ids, labels = tokens(256, 2, 24)
    results = {}
    for mode in ("off", "on", "offload"):
        _, model = hybrid_models("qwen35", spec, num_chunks=3, checkpointing=mode, offload=mode == "offload",
                                 runtime="sim" if mode == "offload" else None)
        torch.manual_seed(11)
        loss = model(**model.prepare_inputs(ids, labels=labels))
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad.clone() for n, p in fm.adapter_state_dict(model).items()})
    for mode in ("on", "offload"):
        compare(*results[mode], *results["off"], f"GDN dropout replay, checkpointing={mode}", tol=0.0)
    model.eval()
    with torch.no_grad():
        assert rel_err(model(**model.prepare_inputs(ids, labels=labels)), results["off"][0]) > 1e-4


def test_lora_flops_count_each_layer_kind():
    """The trainer's LoRA FLOPs (train.metrics.adapter_flops, per layer on average) are ``2 r (in + out)``
    summed over the adapters add_lora attaches, on a hybrid and on an MoE model."""
    from fpdt.model.lora import ATTENTION_TARGETS
    from fpdt.train.metrics import ModelShape, adapter_flops
    from tests.model.test_moe_model import hf_moe
    for model, spec in ((fpdt_qwen35(qwen35_model()), LoraSpec(3, targets=LORA_TARGETS)),
                        (fm.from_config(hf_moe().config), LoraSpec(3, targets=ATTENTION_TARGETS))):
        fm.add_lora(model, spec)
        want = sum(2 * p.numel() for p in fm.adapter_state_dict(model).values()) / model.config.num_layers
        assert adapter_flops(ModelShape.from_config(model.config), spec) == pytest.approx(want)

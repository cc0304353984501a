"""fpdt's own LoRA (``fpdt.model.add_lora``) on a mixture-of-experts layer's shared expert
(``shared_expert.gate_proj`` / ``up_proj`` / ``down_proj`` and the sigmoid ``shared_expert_gate``)
of a tiny Qwen3.5-MoE, beside attention and Gated DeltaNet targets, against PEFT with the same
``target_modules`` on the Transformers model: the loss (balancing loss included) and every adapter
gradient of ``loss * s`` for a random ``s`` (so the backward's incoming gradient is not 1), fp32
within 1e-5 of PEFT's fp32 run and within ``tests/model/qwen35.py``'s criterion of its float64 run,
unstreamed and with ``stream_layers``, one rank here and two in ``tests/model/test_lora_hybrid.py``'s
two-rank body. The target names and their refusals: the last tests."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fpdt.model as fm
from fpdt.model.lora import SHARED_EXPERT_TARGETS, LoraSpec
from tests.model.helpers import compare, tokens
from tests.model.hybrid_moe import hybrid_moe_model
from tests.model.qwen35 import compare_hybrid, float64_delta_rule
from tests.model.test_lora_model import peft_name

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

SPEC = LoraSpec(3, alpha=5.0, targets=("q_proj", "v_proj", "in_proj_z", "out_proj") + SHARED_EXPERT_TARGETS)
STREAMED = dict(offload=True, checkpointing="offload", stream_layers=True, runtime="sim")


def models(spec: LoraSpec, name: str = "qwen35moe_odd", **options):
    """(PEFT model, fpdt model) of the tiny Qwen3.5-MoE ``name`` (default 3 query heads on 1 kv head,
    shared expert 11 wide), same base and adapters (PEFT's, ``lora_B`` random: every gradient nonzero)."""
    base = hybrid_moe_model(name)
    torch.manual_seed(3)
    ref = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=spec.rank, lora_alpha=spec.lora_alpha, target_modules=list(spec.targets), lora_dropout=spec.dropout,
        init_lora_weights=False))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    ours = fm.from_config(base.config, **options)
    fm.load_hf_state_dict(ours, base.state_dict())
    fm.add_lora(ours, spec)
    params = dict(ref.named_parameters())
    assert {peft_name(n) for n in fm.adapter_state_dict(ours)} == {n for n, p in params.items() if p.requires_grad}
    with torch.no_grad():
        for n, p in fm.adapter_state_dict(ours).items():
            p.copy_(params[peft_name(n)])
    return ref, ours


def peft_run(ref, ids, labels, scale: float):
    """``(fp32, float64)`` PEFT results ``(loss, {name: adapter grad of loss * scale, / scale})``; the
    float64 run with the float64 delta rule (``tests/model/qwen35.py``)."""
    out = []
    for dtype in (torch.float32, torch.float64):
        model = copy.deepcopy(ref).to(dtype)
        with float64_delta_rule():
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            (loss * scale).backward()
        out.append((loss.detach(), {n: p.grad.detach() / scale for n, p in model.named_parameters() if p.requires_grad}))
    return tuple(out)


def fpdt_run(model, ids, labels, scale: float, world: int = 1):
    """fpdt's loss and adapter gradients (PEFT's names) of ``loss * scale``, divided by ``scale``,
    summed over the sequence-parallel ranks."""
    loss = model(**model.prepare_inputs(ids, labels=labels))
    (loss * scale).backward()
    frozen = [n for n, p in model.named_parameters() if not fm.lora.is_adapter(n) and p.grad is not None]
    assert not frozen, f"base parameters got gradients: {frozen[:3]}"
    grads = {peft_name(n): p.grad.detach() / scale for n, p in fm.adapter_state_dict(model).items()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    return loss.detach(), grads


def shared_expert_case(name: str, rank: int, world: int, num_chunks: int, spec: LoraSpec = SPEC, **options) -> None:
    """fpdt's adapters (``spec``) against PEFT's on ``name``, ``world`` ranks: fp32 within 1e-5 of
    PEFT's fp32 run, and of its float64 run by :func:`tests.model.qwen35.compare_hybrid`."""
    group = dict(group=dist.group.WORLD) if world > 1 else {}
    ref, ours = models(spec, name, num_chunks=num_chunks, **options, **group)
    ids, labels = tokens(ref.config.vocab_size, 2, 8 * world * num_chunks)
    scale = 2.0 + float(torch.randn((), generator=torch.Generator().manual_seed(num_chunks)))
    refs = peft_run(ref, ids, labels, scale)
    loss, grads = fpdt_run(ours, ids, labels, scale, world)
    for part in (t for t in spec.targets if t in SHARED_EXPERT_TARGETS):
        assert any(f".{part}.lora_B" in n for n in grads), part
    assert all(g.abs().max() > 0 for g in grads.values())
    what = f"{name} fpdt LoRA on the shared expert rank {rank}/{world} u={num_chunks} {options}"
    compare_hybrid(loss, grads, refs, what)
    compare(loss, grads, *refs[0], what + " vs PEFT fp32")


@pytest.mark.parametrize("num_chunks,options", [
    (2, dict()),
    (3, dict(checkpointing="offload", offload=True, runtime="sim")),
    (3, STREAMED),
], ids=["plain", "offloaded-checkpoints", "streamed"])
def test_shared_expert_lora_matches_peft(num_chunks, options):
    shared_expert_case("qwen35moe_odd", 0, 1, num_chunks, **options)


def test_qwen3_next_with_a_dense_layer_matches_peft():
    """Qwen3-Next (layer 1 dense by ``mlp_only_layers``, top-k not renormalised): the sigmoid gate's
    adapters on its three MoE layers (its shared expert's projections are refused: PEFT maps their
    names onto the fused experts there), beside the attention's, against PEFT's, 2 chunks with layer checkpoints."""
    spec = LoraSpec(3, alpha=5.0, targets=("q_proj", "o_proj", "shared_expert_gate"))
    shared_expert_case("qwen3next_odd", 0, 1, 2, spec, checkpointing="on")


def test_dropout_masks_replayed_by_every_checkpoint_mode():
    """Dropout on the shared expert's adapters: the masks do not differ between a layer's forward and
    its recompute (every checkpointing mode gives the same loss and adapter gradients from the same
    seed, bit for bit), and they act (eval mode differs)."""
    from tests.model.helpers import rel_err
    spec = LoraSpec(2, dropout=0.3, targets=SHARED_EXPERT_TARGETS)
    ids, labels = tokens(256, 2, 24)
    results = {}
    for mode in ("off", "on", "offload"):
        model = models(spec, num_chunks=3, checkpointing=mode, offload=mode == "offload",
                       runtime="sim" if mode == "offload" else None)[1]
        torch.manual_seed(11)
        results[mode] = fpdt_run(model, ids, labels, 1.0)
    for mode in ("on", "offload"):
        compare(*results[mode], *results["off"], f"shared-expert dropout replay, checkpointing={mode}", tol=0.0)
    model.eval()
    with torch.no_grad():
        assert rel_err(model(**model.prepare_inputs(ids, labels=labels)), results["off"][0]) > 1e-4


def test_streamed_dropout_masks_replayed():
    """Dropout on the shared expert's adapters with ``stream_layers`` (its masks drawn per attention
    chunk, so not the unstreamed run's), float64: the last layer's adapter gradients along a random
    direction ``v`` match the central difference of the loss, each forward seeded alike, within 5e-3
    (the fp32 loss's rounding over the step; perturbing earlier layers flips routing decisions
    downstream); the gradient of a run seeded otherwise (other masks) misses it by more than 5e-2."""
    from tests.model.helpers import rel_err
    spec = LoraSpec(2, dropout=0.3, targets=SHARED_EXPERT_TARGETS)
    ids, labels = tokens(256, 2, 24)
    model = models(spec, num_chunks=3, **STREAMED)[1].double()
    params = {n: p for n, p in fm.adapter_state_dict(model).items() if ".layers.3." in n}
    gen = torch.Generator().manual_seed(5)
    v = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in params.items()}
    slopes = []
    for seed in (11, 12):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        grads = fpdt_run(model, ids, labels, 1.0)[1]
        slopes.append(sum((grads[peft_name(n)] * v[n]).sum() for n in params))
    eps, moved = 1e-2, []
    for sign in (1, -1):
        with torch.no_grad():
            for n, p in params.items():
                p.add_(sign * eps * v[n])
        torch.manual_seed(11)
        moved.append(model(**model.prepare_inputs(ids, labels=labels)).detach().double())
        with torch.no_grad():
            for n, p in params.items():
                p.sub_(sign * eps * v[n])
    difference = (moved[0] - moved[1]) / (2 * eps)
    assert rel_err(slopes[0], difference) <= 5e-3, (float(slopes[0]), float(difference))
    assert rel_err(slopes[1], difference) > 5e-2, (float(slopes[1]), float(difference))


def test_targets_and_refusals():
    """Shared-expert adapters go on every MoE layer (not a Qwen3-Next dense layer); their names and
    shapes are what fpdt-train checks (``adapter_shapes``); dense MLP names on an MoE model, shared-expert
    names on a model without one and the shared expert's projections on Qwen3-Next (PEFT would load
    them onto the fused experts) are refused in one line naming the fix."""
    from fpdt.train.config import ConfigError
    from fpdt.train.lora import adapter_shapes, for_model
    from tests.model.test_moe_model import hf_moe
    moe35 = fm.from_config(hybrid_moe_model("qwen35moe_odd").config)
    spec = LoraSpec(2, targets=("k_proj",) + SHARED_EXPERT_TARGETS)
    assert for_model(spec, moe35.config, True) == spec
    fm.add_lora(moe35, spec)
    got = {n: tuple(p.shape) for n, p in fm.adapter_state_dict(moe35).items()}
    assert got == adapter_shapes(moe35.config, spec)
    assert got["model.layers.0.mlp.shared_expert_gate.lora_B.weight"] == (1, 2)
    assert got["model.layers.0.mlp.shared_expert.down_proj.lora_A.weight"] == (2, 11)
    with pytest.raises(ConfigError, match="shared_expert.gate_proj, .* target_parameters with fpdt.hf"):
        for_model(LoraSpec(2, targets=("q_proj", "up_proj")), moe35.config, True)
    next_model = fm.from_config(hybrid_moe_model("qwen3next_odd").config)       # layer 1 dense (mlp_only_layers)
    spec = LoraSpec(2, targets=("k_proj", "shared_expert_gate"))
    assert for_model(spec, next_model.config, True) == spec
    fm.add_lora(next_model, spec)
    got = {n: tuple(p.shape) for n, p in fm.adapter_state_dict(next_model).items()}
    assert got == adapter_shapes(next_model.config, spec)
    assert {n.split(".")[2] for n in got if ".mlp." in n} == {"0", "2", "3"}
    with pytest.raises(ConfigError, match="onto this model's fused experts"):
        for_model(LoraSpec(2, targets=("shared_expert.up_proj", "shared_expert_gate")), next_model.config, True)
    with pytest.raises(ConfigError, match="sigmoid gate as shared_expert_gate"):
        for_model(LoraSpec(2, targets=("down_proj",)), next_model.config, True)
    qwen3_moe = fm.from_config(hf_moe().config)
    with pytest.raises(ValueError, match="this model has none"):
        fm.add_lora(qwen3_moe, LoraSpec(2, targets=("shared_expert_gate",)))
    with pytest.raises(ConfigError, match="this model has none"):
        for_model(LoraSpec(2, targets=("shared_expert.up_proj",)), qwen3_moe.config, True)


def test_flops_and_planner_count_the_shared_expert_adapters():
    """The trainer's LoRA FLOPs (``train.metrics.adapter_flops``, per layer on average) are ``2 r (in +
    out)`` over the adapters add_lora attaches, and the planner's adapter count
    (``plan.models.lora_param_count``, every projection) is their number, on Qwen3.5-MoE with every
    attention, Gated DeltaNet and shared-expert target."""
    from fpdt.model.lora import ATTENTION_TARGETS, GDN_TARGETS
    from fpdt.plan.models import lora_param_count
    from fpdt.train.metrics import ModelShape, adapter_flops
    model = fm.from_config(hybrid_moe_model("qwen35moe_odd").config)
    spec = LoraSpec(3, targets=ATTENTION_TARGETS + GDN_TARGETS + SHARED_EXPERT_TARGETS)
    fm.add_lora(model, spec)
    count = sum(p.numel() for p in fm.adapter_state_dict(model).values())
    assert adapter_flops(ModelShape.from_config(model.config), spec) == pytest.approx(2 * count / model.config.num_layers)
    assert lora_param_count(model.config, 3) == count


def test_peft_adapter_directory_round_trip(tmp_path):
    """A PEFT adapter directory with shared-expert targets (PEFT's ``save_pretrained``) loads into
    fpdt's model (``read_adapter_config``, ``add_lora``, ``load_adapter``) tensor for tensor, and
    ``save_adapter`` writes it back in PEFT's layout (``PeftModel.from_pretrained`` reads the same tensors)."""
    from fpdt.model.lora import read_adapter_config
    ref, _ = models(SPEC)
    ref.save_pretrained(tmp_path / "peft")
    spec = read_adapter_config(tmp_path / "peft")
    assert (spec.rank, spec.lora_alpha, spec.targets) == (SPEC.rank, SPEC.lora_alpha, SPEC.targets)
    ours = fm.add_lora(fm.from_config(ref.config), spec)
    fm.load_adapter(ours, tmp_path / "peft")
    theirs = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    for n, p in fm.adapter_state_dict(ours).items():
        assert torch.equal(p, theirs[peft_name(n)]), n
    fm.save_adapter(fm.adapter_state_dict(ours), ours.lora, tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(hybrid_moe_model("qwen35moe_odd"), tmp_path / "ours")
    loaded = {n: p for n, p in back.named_parameters() if ".lora_" in n}
    assert loaded.keys() == theirs.keys() and all(torch.equal(loaded[n], theirs[n]) for n in theirs)

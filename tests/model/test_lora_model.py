"""LoRA on fpdt's own model (``fpdt.model.add_lora``) against PEFT on the Transformers model.

Both start from the same base weights and the same adapters (PEFT's drawn with
``init_lora_weights=False`` so that ``B`` is random and every gradient nonzero, then copied into
fpdt's). fpdt runs on 1 and 2 gloo ranks (and the 2 x 2 mesh on 4), under every checkpointing
mode, with its per-rank gradients summed over the SP group; the loss and every adapter gradient
must be within 1e-5 (fp32) of PEFT's, and the base must get no gradient at all. With dropout in
training mode the masks are fpdt's: checked here for replay under every checkpointing mode and
against the op-level reference in ``tests/ops/test_lora.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fpdt.model as fm
from fpdt.comm import SequenceMesh
from fpdt.model.lora import PEFT_PREFIX, LoraSpec, read_adapter_config
from tests.distributed import run_distributed
from tests.model.helpers import compare, fpdt_from_hf, hf_model, rel_err, tokens

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_name(ours: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> PEFT's parameter name."""
    head, kind, tail = ours.rpartition(".lora_")[0], ours.rpartition(".lora_")[2].split(".")[0], "weight"
    return f"{PEFT_PREFIX}{head}.lora_{kind}.default.{tail}"


def models(name, spec: LoraSpec, **options):
    """(PEFT model, fpdt model) with the same base weights and the same adapters."""
    torch.manual_seed(3)
    ref = peft.get_peft_model(hf_model(name), peft.LoraConfig(
        r=spec.rank, lora_alpha=spec.lora_alpha, target_modules=list(spec.targets), lora_dropout=spec.dropout,
        use_rslora=spec.rslora, init_lora_weights=False))
    ours = fm.add_lora(fpdt_from_hf(hf_model(name), **options), spec)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in fm.adapter_state_dict(ours).items():
            p.copy_(params[peft_name(n)])
    return ref, ours


def peft_loss_and_grads(ref, ids, labels):
    ref.zero_grad(set_to_none=True)
    loss = ref(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}


def run_case(name, rank, world, *, spec=LoraSpec(4), num_chunks=2, checkpointing="off", offload=False, mesh=False,
             mlp_chunks=None, B=2):
    mesh = SequenceMesh(hp=2, cp=2) if mesh else None
    S = 4 * world * num_chunks * (2 if mesh is not None else 1)
    opts = dict(num_chunks=num_chunks, checkpointing=checkpointing, offload=offload, mlp_chunks=mlp_chunks)
    if mesh is not None:
        opts["mesh"] = mesh
    ref, ours = models(name, spec, **opts)
    ids, labels = tokens(ref.config.vocab_size, B, S)
    ref_loss, ref_grads = peft_loss_and_grads(ref, ids, labels)
    inputs = ours.prepare_inputs(ids, labels=labels)
    loss = ours(**inputs)
    loss.backward()
    frozen = [n for n, p in ours.named_parameters() if not fm.lora.is_adapter(n) and (p.requires_grad or p.grad is not None)]
    assert not frozen, f"base parameters got gradients: {frozen[:3]}"
    grads = {peft_name(n): p.grad.detach().clone() for n, p in fm.adapter_state_dict(ours).items()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    return compare(loss, grads, ref_loss, ref_grads, f"{name} LoRA rank {rank}/{world} {opts} {spec}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied", "llama_bias", "mistral"])
@pytest.mark.parametrize("checkpointing", ["off", "on", "offload"])
def test_single_rank_against_peft(name, checkpointing):
    run_case(name, 0, 1, checkpointing=checkpointing, offload=checkpointing == "offload")


def test_targets_rslora_and_chunkings():
    """Adapters on some projections only (o_proj plain, then o_proj alone), rsLoRA, uneven chunks."""
    run_case("llama_gqa", 0, 1, spec=LoraSpec(3, alpha=5.0, targets=("v_proj", "q_proj", "up_proj"), rslora=True),
             num_chunks=4, mlp_chunks=3)
    run_case("llama_bias", 0, 1, spec=LoraSpec(2, targets=("o_proj",)), num_chunks=1)
    run_case("qwen2_tied", 0, 1, spec=LoraSpec(5, targets=("down_proj", "k_proj")), num_chunks=2, mlp_chunks=1)


def _sp_worker(rank, world):
    run_case("llama_sp4" if world == 4 else "llama_gqa", rank, world, checkpointing="offload", offload=True)
    run_case("llama_sp4" if world == 4 else "qwen2_tied", rank, world, num_chunks=1, spec=LoraSpec(3, dropout=0.0))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_against_peft(world):
    run_distributed(_sp_worker, world)


def _mesh_worker(rank, world):
    run_case("llama_sp4", rank, world, mesh=True, checkpointing="on")


@pytest.mark.slow
def test_mesh_against_peft():
    run_distributed(_mesh_worker, 4)


def _step(model, ids, labels, train=True):
    model.train(train)
    model.zero_grad(set_to_none=True)
    loss = model(**model.prepare_inputs(ids, labels=labels))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in fm.adapter_state_dict(model).items()}


def test_dropout_replayed_by_every_checkpoint_mode():
    """With dropout the masks differ from step to step but not between a layer's forward and its
    recompute: every checkpointing mode gives the same loss and gradients from the same seed, and
    those are not the dropout-free ones; in eval mode there is no dropout (PEFT's numbers)."""
    spec = LoraSpec(4, dropout=0.3)
    ids, labels = tokens(256, 2, 16)
    results = {}
    for mode in ("off", "on", "offload"):
        _, model = models("llama_gqa", spec, num_chunks=2, checkpointing=mode, offload=mode == "offload")
        torch.manual_seed(11)
        results[mode] = _step(model, ids, labels)
    for mode in ("on", "offload"):
        compare(results[mode][0], results[mode][1], *results["off"], f"dropout replay, checkpointing={mode}", tol=0.0)
    ref, model = models("llama_gqa", spec, num_chunks=2)
    ref.eval()
    ref_loss, _ = peft_loss_and_grads(ref, ids, labels)
    eval_loss, _ = _step(model, ids, labels, train=False)
    assert rel_err(eval_loss, ref_loss) < 1e-5
    assert rel_err(results["off"][0], ref_loss) > 1e-3, "dropout had no effect in training mode"


def test_saved_adapter_loads_into_peft_and_back(tmp_path):
    spec = LoraSpec(4, alpha=6.0, dropout=0.05, targets=("q_proj", "o_proj", "gate_proj"), rslora=True)
    ref, ours = models("mistral", spec, num_chunks=2)
    ours.eval()
    ids, labels = tokens(256, 2, 16)
    fm.save_adapter(fm.adapter_state_dict(ours), spec, tmp_path / "adapter", base_model_name_or_path="base")
    assert read_adapter_config(tmp_path / "adapter") == spec
    loaded = peft.PeftModel.from_pretrained(hf_model("mistral"), tmp_path / "adapter").eval()
    with torch.no_grad():
        ours_loss = ours(**ours.prepare_inputs(ids, labels=labels))
        assert rel_err(loaded(input_ids=ids, labels=labels).loss, ours_loss) < 1e-5
    # PEFT's own save loads into fpdt's model
    ref.save_pretrained(tmp_path / "peft")
    again = fm.add_lora(fpdt_from_hf(hf_model("mistral"), num_chunks=2), read_adapter_config(tmp_path / "peft"))
    fm.load_adapter(again, tmp_path / "peft")
    again.eval()
    with torch.no_grad():
        assert rel_err(again(**again.prepare_inputs(ids, labels=labels)), ours_loss) < 1e-5
    # the base checkpoint leaves the adapters out
    ours.save_pretrained(tmp_path / "base")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "base" / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lora" in k]


def test_refusals(tmp_path):
    for bad in (dict(rank=0), dict(rank=2, dropout=1.0), dict(rank=2, targets=("qkv",)), dict(rank=2, targets=()),
                dict(rank=2, alpha=0.0)):
        with pytest.raises(ValueError):
            LoraSpec(**bad)
    model = fm.add_lora(fpdt_from_hf(hf_model("llama_gqa"), num_chunks=1, mlp_chunks=0), LoraSpec(2))
    with pytest.raises(ValueError, match="twice|already"):
        fm.add_lora(model, LoraSpec(2))
    ids, labels = tokens(256, 1, 8)
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        model(**model.prepare_inputs(ids, labels=labels))
    other = fm.add_lora(fpdt_from_hf(hf_model("llama_gqa")), LoraSpec(3))
    fm.save_adapter(fm.adapter_state_dict(other), other.lora, tmp_path / "r3")
    with pytest.raises(ValueError, match="rank 3"):
        fm.load_adapter(model, tmp_path / "r3")

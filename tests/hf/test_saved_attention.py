"""``apply_fpdt(attention_checkpoint="save")`` on every architecture fpdt.hf supports.

Against the same model with ``"recompute"``: loss and every gradient within 1e-6 (fp32), and
the attention-kernel calls counted through the kernel table (one forward per block with
``"save"``, two with ``"recompute"``, backwards equal). Llama (GQA), Qwen2 (biases, tied),
Mistral, Qwen3 (per-head q/k norms), Transformers' own q/k/v projections
(``chunked_qkv=False``), PEFT LoRA with dropout, ``save_attention_layers`` below the layer
count, checkpointing ``"on"`` and ``"offload"`` (simulated runtime), 2 ranks.
"""

from __future__ import annotations

import contextlib
import copy

import peft
import pytest
import torch
import torch.distributed as dist

import fpdt.hf
from fpdt.offload import fresh_runtime
from tests.distributed import run_distributed
from tests.hf.test_apply_fpdt import _qwen3
from tests.model.helpers import compare, hf_model, tokens
from tests.model.test_saved_attention import counting

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
EXACT = 1e-6


def _base(name):
    return _qwen3() if name == "qwen3" else hf_model(name)


def _run(base, ids, labels, counter, world, offload, **options):
    with fresh_runtime("sim", mode="threaded") if offload else contextlib.nullcontext() as rt:
        model = fpdt.hf.apply_fpdt(copy.deepcopy(base), backend="cpu", offload=offload, runtime=rt, **options)
        model.train()
        counter.forward = counter.backward = 0
        torch.manual_seed(11)          # LoRA dropout masks
        loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    return loss.detach(), grads, counter.forward, counter.backward


def _case(rank, world, counter, name, *, u, checkpointing, save_layers=None, lora=None, **options):
    base = _base(name)
    if lora is not None:
        torch.manual_seed(3)
        base = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=lora, init_lora_weights=False,
                                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    ids, labels = tokens(256, 2, 4 * world * u)
    offload = checkpointing == "offload"
    common = dict(num_chunks=u, checkpointing=checkpointing, **options)
    ref_loss, ref_grads, ref_f, ref_b = _run(base, ids, labels, counter, world, offload, **common)
    loss, grads, f, b = _run(base, ids, labels, counter, world, offload, attention_checkpoint="save",
                             save_attention_layers=save_layers, **common)
    what = f"rank {rank} {name} u={u} {checkpointing} K={save_layers} lora={lora} {options}"
    compare(loss, grads, ref_loss, ref_grads, what, tol=EXACT)
    layers = base.config.num_hidden_layers
    K = layers if save_layers is None else save_layers
    assert b == ref_b and b > 0 and ref_f == 2 * b and f == b // layers * (2 * layers - K), (what, f, b, ref_f)


HEAD_DIM = {"llama_gqa": 16, "qwen2_tied": 16, "mistral": 8, "qwen3": 32, "llama_bias": 8}
CASES = [
    ("llama_gqa", dict(u=2, checkpointing="offload")),
    ("qwen2_tied", dict(u=3, checkpointing="on")),
    ("mistral", dict(u=1, checkpointing="offload", save_layers=1)),
    ("qwen3", dict(u=2, checkpointing="on")),
    ("llama_bias", dict(u=2, checkpointing="offload", chunked_qkv=False)),     # Transformers' projections
    ("llama_gqa", dict(u=2, checkpointing="on", lora=0.3)),                    # PEFT LoRA with dropout
]


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"
                                                for n, kw in CASES])
def test_save_matches_recompute_with_one_forward_per_block(monkeypatch, name, kw):
    counter = counting(monkeypatch, "cpu", head_dim=HEAD_DIM[name])
    _case(0, 1, counter, name, **kw)


def test_refusals_name_the_fix():
    with pytest.raises(fpdt.hf.FPDTHFError, match="must be one of"):
        fpdt.hf.apply_fpdt(hf_model("llama_bias"), checkpointing="on", attention_checkpoint="always")
    with pytest.raises(fpdt.hf.FPDTHFError, match="more than the model's 2 decoder layers"):
        fpdt.hf.apply_fpdt(hf_model("llama_bias"), checkpointing="on", attention_checkpoint="save",
                           save_attention_layers=3)


def _two_ranks(rank, world):
    monkeypatch = pytest.MonkeyPatch()
    counter = counting(monkeypatch, "cpu", head_dim=16)
    _case(rank, world, counter, "llama_gqa", u=2, checkpointing="offload")
    _case(rank, world, counter, "qwen2_tied", u=1, checkpointing="on", save_layers=1, lora=0.2)
    monkeypatch.undo()


@pytest.mark.slow
def test_two_ranks():
    run_distributed(_two_ranks, 2, timeout=300)

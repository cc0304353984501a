"""fpdt-train on a tiny Qwen3.5 (Gated DeltaNet + gated attention) and a tiny Qwen3-MoE checkpoint,
2 gloo ranks with sp=2 under ZeRO-3, AdamW: full training and ``--lora-rank`` each run 3 steps
uninterrupted and 2 steps resumed to 3, whose step 3 loss is the uninterrupted one bit for bit; the
LoRA runs' ``--export-hf`` is a PEFT adapter directory (the Gated DeltaNet projections among its
targets on Qwen3.5, the attention's only on Qwen3-MoE) that loads with ``PeftModel.from_pretrained``
on the Transformers model and gives fpdt's loss with the same adapters within 1e-5 (fp32)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import fpdt.model as fm
from tests.distributed import run_distributed
from tests.train.helpers import (ADAMW, ADAMW_CLIP, causal_lm_loss, ds_config, logged_losses, quiet, windows_batch,
                                 write_fixture, write_json)

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")

SEQ_LEN, CHUNK = 64, 16
MODELS = ("qwen35", "moe")
MODES = ("full", "lora")


def _argv(tmp: str, model: str, mode: str, name: str, *extra: str) -> list[str]:
    lora = ["--lora-rank", "2", "--lora-alpha", "3"] if mode == "lora" else []
    return ["--model", os.path.join(tmp, model), "--data", os.path.join(tmp, "tokens.npy"), "--seq-len", str(SEQ_LEN),
            "--sp", "2", "--chunk-size", str(CHUNK), "--deepspeed", os.path.join(tmp, "adamw.json"), "--log-json",
            os.path.join(tmp, f"{model}-{mode}-{name}.jsonl"), "--seed", "0", "--no-mem-accounting", "--steps", "3",
            *lora, *extra]


def _body(rank: int, world: int, tmp: str) -> None:
    quiet()
    from fpdt.cli.train import main

    for model in MODELS:
        for mode in MODES:
            ckpt = os.path.join(tmp, f"ckpt-{model}-{mode}")
            export = ["--export-hf", os.path.join(tmp, f"export-{model}")] if mode == "lora" else []
            assert main(_argv(tmp, model, mode, "whole", "--save-dir", ckpt, "--save-every", "2", *export)) == 0
            assert main(_argv(tmp, model, mode, "resumed", "--resume", os.path.join(ckpt, "step2"))) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.model.qwen35 import qwen35_model
    from tests.model.test_moe_model import hf_moe

    tmp = str(tmp_path_factory.mktemp("hybrid_moe_train"))
    write_fixture(tmp)
    qwen35_model("qwen35").save_pretrained(os.path.join(tmp, "qwen35"))
    hf_moe().save_pretrained(os.path.join(tmp, "moe"))
    write_json(os.path.join(tmp, "adamw.json"), ds_config(ADAMW, ADAMW_CLIP, stage=3))
    run_distributed(_body, world_size=2, args=(tmp,), timeout=900)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_identical(runs, model, mode):
    whole = logged_losses(os.path.join(runs, f"{model}-{mode}-whole.jsonl"))
    resumed = logged_losses(os.path.join(runs, f"{model}-{mode}-resumed.jsonl"))
    assert len(whole) == 3 and resumed == whole[2:], f"{model} {mode}: resumed {resumed} vs uninterrupted {whole}"


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_lora_export_loads_into_peft(runs, model):
    from fpdt.model.lora import ATTENTION_TARGETS, GDN_TARGETS, read_adapter_config

    out = os.path.join(runs, f"export-{model}")
    spec = read_adapter_config(out)
    want = ATTENTION_TARGETS + (("gate_proj", "up_proj", "down_proj") + GDN_TARGETS if model == "qwen35" else ())
    assert (spec.rank, set(spec.targets)) == (2, set(want)), spec
    batch = windows_batch(np.load(os.path.join(runs, "tokens.npy")).astype(np.int64), SEQ_LEN, [0, 1])
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(runs, model), dtype=torch.float32,
                                                             attn_implementation="eager")
    base.config._experts_implementation = "eager"        # Transformers' grouped GEMM wants CUDA-aligned strides
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        theirs = causal_lm_loss(loaded, batch)            # the language-model loss, no balancing loss
    ours_model = fm.add_lora(fm.from_pretrained(os.path.join(runs, model), dtype=torch.float32), spec)
    fm.load_adapter(ours_model, out)
    ours_model.eval()
    assert any(p.abs().sum() > 0 for n, p in fm.adapter_state_dict(ours_model).items() if ".lora_B." in n)
    with torch.no_grad():
        ours = ours_model(batch[:, :-1], labels=batch[:, 1:], output_router_logits=False)
    assert abs(float(ours) - float(theirs)) <= 1e-5 * abs(float(theirs)), (model, float(ours), float(theirs))


@pytest.mark.slow
def test_qwen35_lora_steps_match_peft_training(runs):
    """The uninterrupted Qwen3.5 LoRA run (adapters on every projection, Gated DeltaNet's included,
    drawn from --seed 0; AdamW, clipping at 1.0) step by step against PEFT training the same adapters on
    the Transformers model: each loss within 1e-5."""
    from fpdt.model.lora import LORA_TARGETS, LoraSpec
    from tests.train.helpers import peft_model, peft_reference_losses

    spec = LoraSpec(2, alpha=3.0, targets=LORA_TARGETS)
    base = os.path.join(runs, "qwen35")
    drawn = fm.add_lora(fm.from_pretrained(base, dtype=torch.float32), spec, seed=0)
    model = peft_model(base, spec=spec, adapters={n: p.detach() for n, p in fm.adapter_state_dict(drawn).items()})
    want = peft_reference_losses(model, os.path.join(runs, "tokens.npy"), SEQ_LEN, 3, 1, ADAMW, ADAMW_CLIP)
    got = logged_losses(os.path.join(runs, "qwen35-lora-whole.jsonl"))
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert len(got) == 3 and max(rel) < 1e-5, f"fpdt-train {got} vs PEFT {want} (rel. err {rel})"

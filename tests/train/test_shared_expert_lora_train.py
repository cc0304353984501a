"""``fpdt-train --lora-rank 2 --lora-targets`` with the shared expert's projections and sigmoid gate
(and an attention and a Gated DeltaNet projection) on a tiny Qwen3.5-MoE checkpoint, one process
under ZeRO-3, AdamW with clipping: 3 steps match PEFT training the same adapters on the Transformers
model (balancing loss included) within 1e-5; 2 steps resumed to 3 repeat step 3 bit for bit; a
resume with other targets is refused; the export is a PEFT adapter directory that loads with
``PeftModel.from_pretrained``, gives fpdt's loss with the same adapters within 1e-5 (fp32), and
merges into the base weights (``merge_and_unload``) with the same logits."""

from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import pytest
import torch

import fpdt.model as fm
from fpdt.model.lora import LoraSpec
from tests.distributed import run_distributed
from tests.train.helpers import (ADAMW, ADAMW_CLIP, ds_config, logged_losses, peft_name, quiet, windows_batch,
                                 write_fixture, write_json)

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")

SEQ_LEN, CHUNK, STEPS = 32, 8, 3
TARGETS = ("q_proj", "in_proj_z", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
           "shared_expert_gate")
SPEC = LoraSpec(2, alpha=3.0, targets=TARGETS)


def _argv(tmp: str, name: str, targets: tuple[str, ...], *extra: str) -> list[str]:
    return ["--model", os.path.join(tmp, "base"), "--data", os.path.join(tmp, "tokens.npy"), "--seq-len", str(SEQ_LEN),
            "--chunk-size", str(CHUNK), "--mlp-chunks", "2", "--deepspeed", os.path.join(tmp, "adamw.json"), "--log-json",
            os.path.join(tmp, f"{name}.jsonl"), "--seed", "0", "--no-mem-accounting", "--lora-rank", "2",
            "--lora-alpha", "3", "--lora-targets", ",".join(targets), *extra]


def _body(rank: int, world: int, tmp: str) -> None:
    quiet()
    torch.set_num_threads(1)            # tiny kernels: a second thread only waits on a busy machine
    from fpdt.cli.train import main

    ck = os.path.join(tmp, "ckpt")
    assert main(_argv(tmp, "whole", TARGETS, "--steps", str(STEPS), "--save-dir", ck, "--save-every", "2",
                      "--export-hf", os.path.join(tmp, "export"))) == 0
    assert main(_argv(tmp, "resumed", TARGETS, "--steps", str(STEPS), "--resume", os.path.join(ck, "step2"))) == 0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(_argv(tmp, "other", TARGETS[:-1], "--steps", str(STEPS), "--resume", os.path.join(ck, "step2")))
    with open(os.path.join(tmp, "refused.txt"), "w") as f:
        f.write(f"{status}\n{err.getvalue()}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.model.hybrid_moe import hybrid_moe_model

    tmp = str(tmp_path_factory.mktemp("shared_expert_lora"))
    write_fixture(tmp)
    hybrid_moe_model("qwen35moe_odd").save_pretrained(os.path.join(tmp, "base"))
    write_json(os.path.join(tmp, "adamw.json"), ds_config(ADAMW, ADAMW_CLIP, stage=3))
    run_distributed(_body, world_size=1, args=(tmp,), timeout=600)
    return tmp


def _transformers(base: str):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager",
                                                              experts_implementation="eager")
    return model


def _loss(model, batch: torch.Tensor) -> torch.Tensor:
    """fpdt's training loss on ``batch [B, S + 1]``: next-token cross-entropy plus ``router_aux_loss_coef``
    times Transformers' balancing loss of the window."""
    out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    return ce + model.config.router_aux_loss_coef * out.aux_loss


@pytest.mark.slow
def test_steps_match_peft_and_resume_is_exact(run):
    base = os.path.join(run, "base")
    drawn = fm.add_lora(fm.from_pretrained(base, dtype=torch.float32), SPEC, seed=0)
    model = peft.get_peft_model(_transformers(base), peft.LoraConfig(r=2, lora_alpha=3.0, target_modules=list(TARGETS)))
    params = dict(model.named_parameters())
    adapters = fm.adapter_state_dict(drawn)
    assert {peft_name(n) for n in adapters} == {n for n, p in params.items() if p.requires_grad}
    with torch.no_grad():
        for name, value in adapters.items():
            params[peft_name(name)].copy_(value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    kw = {k: v for k, v in ADAMW["params"].items() if k != "torch_adam"}
    opt = torch.optim.AdamW(trainable, **kw)
    tokens = np.load(os.path.join(run, "tokens.npy")).astype(np.int64)
    want = []
    for t in range(STEPS):
        loss = _loss(model, windows_batch(tokens, SEQ_LEN, [t]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, ADAMW_CLIP)
        opt.step()
        want.append(loss.item())
    got = logged_losses(os.path.join(run, "whole.jsonl"))
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert len(got) == STEPS and max(rel) < 1e-5, f"fpdt-train {got} vs PEFT {want} (rel. err {rel})"
    resumed = logged_losses(os.path.join(run, "resumed.jsonl"))
    assert resumed == got[2:], f"resumed {resumed} vs uninterrupted {got}"
    with open(os.path.join(run, "refused.txt")) as f:
        status, text = f.read().split("\n", 1)
    assert status == "2" and "resume with the --lora-* flags it was trained with" in text, text


@pytest.mark.slow
def test_export_loads_into_peft_and_merges(run):
    from fpdt.model.lora import read_adapter_config

    out, base = os.path.join(run, "export"), os.path.join(run, "base")
    assert read_adapter_config(out) == SPEC
    batch = windows_batch(np.load(os.path.join(run, "tokens.npy")).astype(np.int64), SEQ_LEN, [0, 1])
    loaded = peft.PeftModel.from_pretrained(_transformers(base), out).eval()
    assert {n.split(".lora_")[0].split(".mlp.")[-1] for n, _ in loaded.named_parameters() if ".mlp." in n and
            ".lora_" in n} == set(TARGETS[2:])           # the shared expert's adapters only, no routed expert's
    ours_model = fm.add_lora(fm.from_pretrained(base, dtype=torch.float32), SPEC)
    fm.load_adapter(ours_model, out)
    ours_model.eval()
    assert all(p.abs().sum() > 0 for n, p in fm.adapter_state_dict(ours_model).items() if ".lora_B." in n)
    with torch.no_grad():
        theirs = _loss(loaded, batch)
        ours = ours_model(batch[:, :-1], labels=batch[:, 1:])
        logits = loaded(input_ids=batch[:, :-1], use_cache=False).logits
        merged = loaded.merge_and_unload()(input_ids=batch[:, :-1], use_cache=False).logits
    assert abs(float(ours) - float(theirs)) <= 1e-5 * abs(float(theirs)), (float(ours), float(theirs))
    assert (merged - logits).abs().max() <= 1e-5 * logits.abs().max()

"""fpdt-train --model DIR on tiny Qwen3.5-MoE (both checkpoint layouts), Qwen3-Next and Mixtral
checkpoints: 3 SGD steps on 2 gloo processes with sp=2 under ZeRO-3 (the balancing loss included)
give the losses of the same steps on one process without sharding, and each export loads in
Transformers as its causal LM."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.train.helpers import SGD, SGD_CLIP, ds_config, quiet, reference_losses, write_fixture, write_json

SEQ_LEN, CHUNK, STEPS = 64, 16, 3
RTOL = 1e-5      # fp32, as tests/train/test_zero_load.py
MODELS = ("qwen35moe", "qwen35moe-vl", "qwen3next", "mixtral")


def _body(rank: int, world_size: int, tmp: str) -> None:
    quiet()
    from fpdt.cli.train import main

    for name in MODELS:
        argv = ["--model", os.path.join(tmp, name), "--data", os.path.join(tmp, "tokens.npy"),
                "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--sp", "2", "--chunk-size", str(CHUNK),
                "--deepspeed", os.path.join(tmp, "sgd.json"), "--log-json", os.path.join(tmp, f"{name}.jsonl"),
                "--save-dir", os.path.join(tmp, f"save-{name}")]
        assert main(argv) == 0


@pytest.mark.long
@pytest.mark.slow
def test_fpdt_train_hybrid_moe_and_mixtral(tmp_path):
    import transformers

    from fpdt.train.export import export_checkpoint
    from tests.model.hybrid_moe import hybrid_moe_model, mixtral_model
    from tests.model.test_hybrid_moe_parity import _conditional

    tmp = str(tmp_path)
    _, data_path = write_fixture(tmp)
    refs = {"qwen35moe": hybrid_moe_model("qwen35moe_sp2"), "qwen3next": hybrid_moe_model("qwen3next_sp2"),
            "mixtral": mixtral_model("mixtral_sp2")}
    for name, model in refs.items():
        model.save_pretrained(os.path.join(tmp, name))
    _conditional(refs["qwen35moe"], os.path.join(tmp, "qwen35moe-vl"))
    write_json(os.path.join(tmp, "sgd.json"), ds_config(SGD, SGD_CLIP))
    run_distributed(_body, world_size=2, args=(tmp,), timeout=600)
    for name in MODELS:
        text = name.removesuffix("-vl")
        want = reference_losses(None, data_path, SEQ_LEN, STEPS, 1, SGD, SGD_CLIP, pretrained=os.path.join(tmp, text))
        with open(os.path.join(tmp, f"{name}.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        got = [r["loss"] for r in records]
        rel = [abs(g - r) / abs(r) for g, r in zip(got, want)]
        assert len(got) == STEPS and max(rel) < RTOL, f"{name}: {got} vs {want} (rel. err {rel})"
        assert records[-1]["expert_load"]
        out = export_checkpoint(os.path.join(tmp, f"save-{name}"), os.path.join(tmp, f"export-{name}"))
        # eager experts: Transformers' grouped_mm kernel wants 16-byte-aligned widths (these are odd)
        back = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager")
        assert type(back) is type(refs[text])
        assert torch.isfinite(back(input_ids=torch.arange(16)[None], use_cache=False).logits).all()

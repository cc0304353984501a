"""fpdt-train --model DIR on a tiny Qwen3.5 checkpoint (Gated DeltaNet + gated attention), in both
layouts (Qwen3_5ForCausalLM, and the hub's Qwen3_5ForConditionalGeneration with a vision tower it
leaves out), and with streamed layers: 3 SGD steps on 2 gloo processes with sp=2 under ZeRO-3 give the
losses of the same steps on one process without sharding, and the export loads in Transformers as Qwen3_5ForCausalLM."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.train.helpers import SGD, SGD_CLIP, ds_config, quiet, reference_losses, write_fixture, write_json

SEQ_LEN, CHUNK, STEPS = 64, 16, 3
RTOL = 1e-5      # fp32, as tests/train/test_zero_load.py


def _body(rank: int, world_size: int, tmp: str) -> None:
    quiet()
    from fpdt.cli.train import main

    for layout in ("text", "vl"):
        argv = ["--model", os.path.join(tmp, layout), "--data", os.path.join(tmp, "tokens.npy"),
                "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--sp", "2", "--chunk-size", str(CHUNK),
                "--deepspeed", os.path.join(tmp, "sgd.json"), "--log-json", os.path.join(tmp, f"{layout}.jsonl"),
                "--save-dir", os.path.join(tmp, f"save-{layout}")]
        assert main(argv) == 0
    argv = ["--model", os.path.join(tmp, "text"), "--data", os.path.join(tmp, "tokens.npy"), "--seq-len",
            str(SEQ_LEN), "--steps", str(STEPS), "--sp", "2", "--chunk-size", str(CHUNK), "--deepspeed",
            os.path.join(tmp, "sgd.json"), "--log-json", os.path.join(tmp, "streamed.jsonl"), "--stream-layers"]
    assert main(argv) == 0


@pytest.mark.slow
def test_fpdt_train_qwen35_both_layouts(tmp_path):
    import transformers

    from fpdt.train.export import export_checkpoint
    from tests.model.qwen35 import qwen35_model
    from tests.model.test_qwen35_parity import _conditional

    tmp = str(tmp_path)
    _, data_path = write_fixture(tmp)
    ref = qwen35_model("qwen35")
    ref.save_pretrained(os.path.join(tmp, "text"))
    _conditional(ref, os.path.join(tmp, "vl"))
    write_json(os.path.join(tmp, "sgd.json"), ds_config(SGD, SGD_CLIP))
    run_distributed(_body, world_size=2, args=(tmp,), timeout=600)
    want = reference_losses(None, data_path, SEQ_LEN, STEPS, 1, SGD, SGD_CLIP, pretrained=os.path.join(tmp, "text"))
    for layout in ("text", "vl", "streamed"):
        with open(os.path.join(tmp, f"{layout}.jsonl")) as f:
            got = [json.loads(line)["loss"] for line in f if line.strip()]
        rel = [abs(g - r) / abs(r) for g, r in zip(got, want)]
        assert len(got) == STEPS and max(rel) < RTOL, f"{layout}: {got} vs {want} (rel. err {rel})"
        if layout == "streamed":
            continue
        out = export_checkpoint(os.path.join(tmp, f"save-{layout}"), os.path.join(tmp, f"export-{layout}"))
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert type(back) is transformers.Qwen3_5ForCausalLM
        ids = torch.arange(16)[None]
        assert torch.isfinite(back(input_ids=ids, use_cache=False).logits).all()

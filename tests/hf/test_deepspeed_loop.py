"""The example loop (``examples/hf_deepspeed/train.py``: a Transformers model, ``fpdt.hf``,
DeepSpeed ZeRO-3 with AdamW and clipping) on 2 gloo ranks, against single-process
Transformers training on the same windows: every step's loss within 1e-4 relative (fp32),
which a wrong gradient scale, a mis-sharded sequence or a missing ZeRO-3 gather breaks.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "hf_deepspeed", "train.py")
SEQ_LEN, CHUNKS, STEPS, RTOL = 128, 2, 3, 1e-4

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _example():
    spec = importlib.util.spec_from_file_location("hf_deepspeed_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _argv(tmp: str) -> list[str]:
    return ["--model-config", os.path.join(tmp, "config.json"),
            "--tokenizer", os.path.join(ROOT, "examples", "tiny-llama", "tokenizer.json"),
            "--data", os.path.join(ROOT, "examples", "data", "jargon-file-4.4.7.txt"),
            "--seq-len", str(SEQ_LEN), "--chunks", str(CHUNKS), "--steps", str(STEPS),
            "--deepspeed", os.path.join(ROOT, "examples", "hf_deepspeed", "ds_zero3.json")]


def _write_config(tmp: str) -> None:
    with open(os.path.join(ROOT, "examples", "tiny-llama", "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)   # smaller, faster
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)


def _rank(rank, world, tmp, out):
    for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)):
        os.environ[k] = str(v)
    losses = _example().main(_argv(tmp))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


def _reference(tmp: str) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    mod = _example()
    args = mod.parse_args(_argv(tmp))
    with open(args.deepspeed) as f:
        opt = json.load(f)["optimizer"]["params"]
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config), dtype=torch.float32)
    adam = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]),
                             weight_decay=opt["weight_decay"])
    windows = mod.token_windows(args, model.config.eos_token_id)
    losses = []
    for step in range(STEPS):
        ids = windows[step % len(windows)].unsqueeze(0)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        adam.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the JSON's gradient_clipping
        adam.step()
        losses.append(loss.item())
    return losses


def test_example_loop_on_two_ranks_matches_single_process_transformers(tmp_path):
    tmp = str(tmp_path)
    _write_config(tmp)
    out = os.path.join(tmp, "losses.json")
    run_distributed(_rank, 2, args=(tmp, out), timeout=300)
    with open(out) as f:
        got = json.load(f)
    want = _reference(tmp)
    assert len(got) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step + 1}: {g} vs single-process {w}"
    assert got[-1] < got[0]

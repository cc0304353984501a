"""The example loop (``examples/hf_deepspeed/train.py``: a Transformers model, ``fpdt.hf``,
DeepSpeed ZeRO-3) on 2 gloo ranks, against single-process Transformers training on the
same windows: every step's loss within 1e-4 relative (fp32). The optimizer is plain SGD
without clipping, so that a wrong gradient scale (e.g. a missing ``loss * sp``) changes
the next step's loss, as would a mis-sharded sequence. (A weight read without its module's
forward is gathered by DeepSpeed 0.19 even unregistered: ZeRO-3's parameter dict gathers on
attribute access. ``apply_fpdt`` registers those weights as external parameters anyway, as
DeepSpeed documents, so the gather happens in the module's pre-forward hook.)
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
            "--deepspeed", os.path.join(tmp, "ds.json")]


SGD_LR = 0.5
DS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}}, "zero_allow_untested_optimizer": True,
      "gradient_clipping": 0.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
      "steps_per_print": 10 ** 9}


def _write_config(tmp: str) -> None:
    with open(os.path.join(ROOT, "examples", "tiny-llama", "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)   # smaller, faster
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(tmp, "ds.json"), "w") as f:
        json.dump(DS, f)


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
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config), dtype=torch.float32)
    sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    windows = mod.hf_common.token_windows(args, model.config.eos_token_id)
    losses = []
    for step in range(STEPS):
        ids = windows[step % len(windows)].unsqueeze(0)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
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

"""fpdt-train on a Qwen3-MoE config: under ZeRO-3 on 1 (streamed layers) and 2 SP ranks with offloaded checkpoints,
the start-up line names the experts' kernel, the log records each layer's expert load, and the
export loads in Transformers as Qwen3MoeForCausalLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(path) -> str:
    cfg = transformers.Qwen3MoeConfig(vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                      output_router_logits=True, router_aux_loss_coef=0.01)
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(d))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes(open(os.path.join(ROOT, "examples", "tiny-llama", name), "rb").read())
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,stream", [(1, True), pytest.param(2, False, marks=pytest.mark.long)])
def test_trains_logs_expert_load_and_exports(tmp_path, ranks, stream):
    model = _config(tmp_path / "model")
    log, hf = str(tmp_path / "run.jsonl"), str(tmp_path / "hf")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    cmd = [*launch, "-m", "fpdt.cli", "--model-config", os.path.join(model, "config.json"), "--data",
           "examples/data/jargon-file-4.4.7.txt", "--seq-len", "256", "--sp", str(ranks), "--steps", "3",
           "--deepspeed", "examples/tiny-llama/ds_cpu.json", "--checkpoint", "offload", "--runtime", "sim", "--log-json", log,
           "--save-dir", str(tmp_path / "ckpt"), "--export-hf", hf] + (["--stream-layers"] if stream else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "experts=8/top2 (loop)" in proc.stderr
    records = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] < records[0]["loss"]
    for r in records:                 # layers 0 and 2 route; 4 windows x 256 tokens x k = 2 slots over 8 experts
        assert sorted(r["expert_load"]) == ["0", "2"]
        assert all(v["mean"] == 4 * 256 * 2 / 8 and v["max"] >= v["mean"] for v in r["expert_load"].values())
    back = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert type(back).__name__ == "Qwen3MoeForCausalLM"


def _zero3_body(rank, world_size, model_dir):
    import deepspeed
    import torch

    import fpdt.model as fm
    from fpdt.train.zero_load import from_pretrained_zero3
    from tests.train.helpers import SGD, SGD_CLIP, ds_config, quiet
    quiet()
    os.environ.setdefault("LOCAL_RANK", str(rank))      # what a launcher sets; zero.Init reads it
    model = from_pretrained_zero3(model_dir, ds_config(SGD, SGD_CLIP), dtype=torch.float32, device=torch.device("cpu"))
    reference = dict(fm.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    named = list(model.named_parameters())
    assert [n for n, _ in named] == list(reference)
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        for name, p in named:
            assert torch.equal(p.data, reference[name]), name


@pytest.mark.slow
def test_zero3_loads_the_hub_per_expert_layout(tmp_path):
    """``fpdt-train --model DIR`` under ZeRO-3 reads the hub's per-expert tensors, spread over
    shards, into the partitioned fused parameters: gathered, they equal ``from_pretrained``'s."""
    import torch

    import fpdt.model as fm
    from tests.distributed import run_distributed
    torch.manual_seed(0)
    model = fm.from_config(os.path.join(_config(tmp_path / "cfg"), "config.json"))
    model.save_pretrained(tmp_path / "hub", max_shard_size=60_000)
    index = json.loads((tmp_path / "hub" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in index
    run_distributed(_zero3_body, 2, args=(str(tmp_path / "hub"),), timeout=240)

"""``fpdt-train --model DIR`` under ZeRO-3: the checkpoint is loaded into parameters that
are partitioned as the model is built (``fpdt.train.zero_load``), not into a full model
per rank.

On 2 gloo processes (fp32, SGD, 3 steps) for sp=2 with a sharded untied checkpoint, sp=2
with a tied-embeddings bf16 checkpoint that also stores the (ignored) duplicated
``lm_head.weight`` and a ``rotary_emb.inv_freq``, and sp=1 / dp=2: right before
``deepspeed.initialize`` every parameter must already be a ZeRO-3 shard, gathered it must
equal ``fpdt.model.from_pretrained`` of the same directory, and the per-step losses must
match single-process training from that model within 1e-5 relative. The header checks
(unknown / missing names, shapes) are compared with ``from_pretrained``'s errors in-process.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.train.helpers import SGD, SGD_CLIP, TINY_CONFIG, ds_config, quiet, reference_losses, write_fixture, write_json

SEQ_LEN = 64
CHUNK = 32
STEPS = 3
RTOL = 1e-5    # fp32; measured at most 3.9e-7 (test_parity), 1.7e-7 (test_zero_load), 8.8e-8 (LoRA) on the CPU
# (run name, model directory, sp)
RUNS = (("untied_sp2", "untied", 2), ("tied_sp2", "tied", 2), ("untied_dp2", "untied", 1))


def _save_models(tmp: str) -> None:
    import fpdt.model as fm
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    untied = fm.from_config(TINY_CONFIG)
    untied.save_pretrained(os.path.join(tmp, "untied"), max_shard_size="40KB")  # several shards + index
    assert os.path.exists(os.path.join(tmp, "untied", "model.safetensors.index.json"))

    torch.manual_seed(4)
    tied = fm.from_config({**TINY_CONFIG, "tie_word_embeddings": True})
    path = os.path.join(tmp, "tied")
    tied.save_pretrained(path, dtype=torch.bfloat16)  # loaded into fp32: a dtype conversion
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # duplicated, as some files are
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # skipped by the loader
    save_file(tensors, file, metadata={"format": "pt"})


def _check_partitioned_and_loaded(model, world_size: int, model_dir: str) -> None:
    import deepspeed

    import fpdt.model as fm
    from fpdt.model.rope_scaling import rope_inv_freq

    named = list(model.named_parameters())
    for name, p in named:
        assert getattr(p, "ds_tensor", None) is not None, f"{name} is not a ZeRO-3 parameter (loaded in full?)"
        assert p.numel() == 0, f"{name} holds {p.numel()} elements locally: not partitioned"
        assert p.ds_numel == math.prod(p.ds_shape)
        assert p.ds_tensor.numel() == math.ceil(p.ds_numel / world_size), f"{name}: shard of {p.ds_tensor.numel()}"
        assert p.dtype == torch.float32
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, rope_inv_freq(*model.model._rope_args)[0])

    reference = dict(fm.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    assert [n for n, _ in named] == list(reference)
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        for name, p in named:
            assert torch.equal(p.data, reference[name]), f"{name} differs from from_pretrained's"


def _body(rank: int, world_size: int, tmp: str) -> None:
    quiet()
    from fpdt.train import zero
    from fpdt.cli.train import main

    original = zero.build_engine
    checked = []

    def build_engine_after_checks(model, cfg):
        _check_partitioned_and_loaded(model, world_size, current["dir"])
        checked.append(current["dir"])
        return original(model, cfg)

    current = {}
    zero.build_engine = build_engine_after_checks
    try:
        for name, model_dir, sp in RUNS:
            current["dir"] = os.path.join(tmp, model_dir)
            argv = ["--model", current["dir"], "--data", os.path.join(tmp, "tokens.npy"),
                    "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--sp", str(sp), "--chunk-size", str(CHUNK),
                    "--deepspeed", os.path.join(tmp, "sgd.json"), "--log-json", os.path.join(tmp, f"{name}.jsonl")]
            assert main(argv) == 0
    finally:
        zero.build_engine = original
    assert len(checked) == len(RUNS)


@pytest.mark.slow
def test_zero3_partitioned_loading_matches_single_process(tmp_path):
    tmp = str(tmp_path)
    _, data_path = write_fixture(tmp)
    _save_models(tmp)
    write_json(os.path.join(tmp, "sgd.json"), ds_config(SGD, SGD_CLIP))
    run_distributed(_body, world_size=2, args=(tmp,), timeout=240)
    for name, model_dir, sp in RUNS:
        ref = reference_losses(None, data_path, SEQ_LEN, STEPS, 2 // sp, SGD, SGD_CLIP,
                               pretrained=os.path.join(tmp, model_dir))
        with open(os.path.join(tmp, f"{name}.jsonl")) as f:
            got = [json.loads(line)["loss"] for line in f if line.strip()]
        assert len(got) == STEPS
        rel = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
        print(f"{name}: fpdt-train {got} reference {ref} rel.err {rel}")
        assert max(rel) < RTOL, f"{name}: losses {got} vs reference {ref} (rel. err {rel})"


def _broken_checkpoints(tmp: str) -> dict[str, str]:
    import fpdt.model as fm
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    good = os.path.join(tmp, "good")
    fm.from_config(TINY_CONFIG).save_pretrained(good)
    tensors = load_file(os.path.join(good, "model.safetensors"))
    variants = {
        "unexpected": {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)},
        "missing": {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "shape": {**tensors, "model.norm.weight": torch.ones(65)},
    }
    out = {}
    for name, variant in variants.items():
        path = os.path.join(tmp, name)
        os.makedirs(path)
        with open(os.path.join(good, "config.json")) as src, open(os.path.join(path, "config.json"), "w") as dst:
            dst.write(src.read())
        save_file(variant, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        out[name] = path
    return out


def test_checkpoint_plan_refuses_what_from_pretrained_refuses(tmp_path):
    """The header-only checks run on every rank before any collective, with the same errors."""
    import fpdt.model as fm
    from fpdt.model.build import construct
    from fpdt.train.zero_load import checkpoint_plan

    for name, path in _broken_checkpoints(str(tmp_path)).items():
        with pytest.raises(ValueError) as expected:
            fm.from_pretrained(path)
        with torch.device("meta"):
            model = construct(path)
        with pytest.raises(ValueError) as got:
            checkpoint_plan(path, model)
        assert str(got.value) == str(expected.value), name
    with torch.device("meta"):
        model = construct(os.path.join(str(tmp_path), "good"))
    (file, names), = checkpoint_plan(os.path.join(str(tmp_path), "good"), model)
    assert file.endswith("model.safetensors") and sorted(names) == sorted(n for n, _ in model.named_parameters())

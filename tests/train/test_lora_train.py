"""``fpdt-train --lora-rank`` against PEFT LoRA on the Transformers model.

* sp=2 with ZeRO-3 and ``--model`` (the base streamed into ``zero.Init`` parameters, the
  adapters converted by ``deepspeed.initialize``), fresh adapters drawn from ``--seed``, plain
  SGD (a wrong gradient scale shows at once): each step's loss against PEFT training the same
  adapters on the same base, within 1e-5 relative (fp32); the base unchanged and the adapters
  changed afterwards; ``--export-hf`` a PEFT adapter directory that loads with
  ``PeftModel.from_pretrained`` and gives the trained model's loss; the MFU of a LoRA step.
* sp=1 / dp=2 with ZeRO-2 and ``--model``, started with ``--lora-init`` from an adapter PEFT
  wrote (some targets, rsLoRA, its own alpha), AdamW with clipping at 1.0.
* sp=2 with ZeRO-3 and ``--model-config`` (random base), dropout: 2 steps saved and resumed to
  4 give the uninterrupted run's losses bit for bit; the checkpoint holds no base weight;
  ``fpdt-export`` of it loads into PEFT; a resume with another spec, full training or another
  base seed is refused.
* Refused flag combinations, each one line naming the fix.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

import fpdt.model as fm
from fpdt.model.lora import LoraSpec
from tests.distributed import run_distributed
from tests.train.helpers import (ADAMW, ADAMW_CLIP, SGD, SGD_CLIP, TINY_CONFIG, causal_lm_loss, ds_config,
                                 peft_model, peft_reference_losses, quiet, windows_batch, write_fixture, write_json)

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")

SEQ_LEN = 64
RTOL = 1e-5    # fp32; measured at most 3.9e-7 (test_parity), 1.7e-7 (test_zero_load), 8.8e-8 (LoRA) on the CPU


def _losses(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _base(tmp: str, seed: int = 0) -> str:
    """A Hugging Face checkpoint of the tiny model with seeded random weights."""
    torch.manual_seed(seed)
    path = os.path.join(tmp, "base")
    fm.save_pretrained(fm.from_config(TINY_CONFIG, dtype=torch.float32), path)
    return path


def _argv(tmp: str, name: str, *extra: str) -> list[str]:
    return ["--data", os.path.join(tmp, "tokens.npy"), "--seq-len", str(SEQ_LEN), "--deepspeed",
            os.path.join(tmp, f"{name}.json"), "--log-json", os.path.join(tmp, f"{name}.jsonl"), "--seed", "0",
            "--no-mem-accounting", *extra]


def _fpdt_loss(base: str | None, spec: LoraSpec, adapters: dict, batch: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Single-process fpdt model (eval mode) with these adapters."""
    torch.manual_seed(seed)
    model = fm.from_pretrained(base, dtype=torch.float32) if base else fm.from_config(TINY_CONFIG, dtype=torch.float32)
    fm.add_lora(model, spec)
    with torch.no_grad():
        for n, p in fm.adapter_state_dict(model).items():
            p.copy_(adapters[n])
    model.eval()
    return model(batch[:, :-1], labels=batch[:, 1:]).detach()


def _rel(a, b) -> float:
    return abs(float(a) - float(b)) / abs(float(b))


# ----------------------------------------------------------------------------- sp=2, ZeRO-3, --model, SGD

SP2_SPEC = LoraSpec(4)


def _sp2_body(rank: int, world: int, tmp: str) -> None:
    quiet()
    import deepspeed

    from fpdt.cli import train as cli
    from fpdt.plan import decide

    from fpdt.train import zero
    engines, lora_ranks = [], []
    build, check = zero.build_engine, decide.decide_run
    zero.build_engine = lambda *a, **k: engines.append(build(*a, **k)) or engines[-1]
    decide.decide_run = lambda *a, **k: lora_ranks.append(a[7]) or check(*a, **k)
    argv = _argv(tmp, "sp2", "--model", os.path.join(tmp, "base"), "--steps", "3", "--sp", "2", "--chunk-size", "32",
                 "--lora-rank", "4", "--save-dir", os.path.join(tmp, "ckpt"), "--export-hf", os.path.join(tmp, "export"),
                 "--peak-tflops", "1")
    assert cli.main(argv) == 0
    assert lora_ranks == [4], lora_ranks                         # the memory check saw a LoRA run
    model = engines[0].module
    assert all(hasattr(p, "ds_id") for p in model.parameters()), "a parameter ZeRO-3 did not partition"
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    if rank == 0:
        torch.save({"state": state, "trainable": trainable}, os.path.join(tmp, "live.pt"))


@pytest.fixture(scope="module")
def sp2_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lora_sp2"))
    write_fixture(tmp)
    _base(tmp)
    write_json(os.path.join(tmp, "sp2.json"), ds_config(SGD, SGD_CLIP, stage=3))
    run_distributed(_sp2_body, world_size=2, args=(tmp,), timeout=240)
    return tmp


def _initial_adapters(spec: LoraSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The adapters fpdt-train draws for ``--seed seed`` (before any step)."""
    model = fm.add_lora(fm.from_config(TINY_CONFIG, dtype=torch.float32), spec, seed=seed)
    return {n: p.detach().clone() for n, p in fm.adapter_state_dict(model).items()}


@pytest.mark.slow
def test_sp2_zero3_matches_peft_and_counts_lora_flops(sp2_run):
    from fpdt.train.metrics import ModelShape, train_flops_per_token
    tmp = sp2_run
    ref_model = peft_model(os.path.join(tmp, "base"), spec=SP2_SPEC, adapters=_initial_adapters(SP2_SPEC))
    ref = peft_reference_losses(ref_model, os.path.join(tmp, "tokens.npy"), SEQ_LEN, 3, 1, SGD, SGD_CLIP)
    records = _losses(os.path.join(tmp, "sp2.jsonl"))
    got = [r["loss"] for r in records]
    rel = [_rel(g, r) for g, r in zip(got, ref)]
    assert len(got) == 3 and max(rel) < RTOL, f"fpdt-train {got} vs PEFT {ref} (rel. err {rel})"
    assert _rel(got[2], got[0]) > 1e-3, "the adapters did not change the loss"
    # MFU counts a LoRA step's FLOPs (--peak-tflops 1, two devices)
    flops = train_flops_per_token(ModelShape.from_config(fm.ModelConfig.from_hf(TINY_CONFIG)), SEQ_LEN, lora=SP2_SPEC)
    for r in records:
        assert r["mfu"] * 2 * 1e12 / r["tokens_per_s"] == pytest.approx(flops, rel=1e-9)


@pytest.mark.slow
def test_base_unchanged_and_adapters_trained(sp2_run):
    from safetensors.torch import load_file
    tmp = sp2_run
    live = torch.load(os.path.join(tmp, "live.pt"))
    state = live["state"]
    adapters = {n for n in state if fm.lora.is_adapter(n)}
    assert live["trainable"] == sorted(adapters) and len(adapters) == 2 * 7 * TINY_CONFIG["num_hidden_layers"]
    base = load_file(os.path.join(tmp, "base", "model.safetensors"))
    assert set(base) == set(state) - adapters
    changed = [n for n in base if not torch.equal(base[n], state[n])]
    assert not changed, f"frozen base weights changed: {changed[:3]}"
    init = _initial_adapters(SP2_SPEC)
    unchanged = [n for n in adapters if torch.equal(init[n], state[n])]
    assert not unchanged, f"adapters not trained: {unchanged[:3]}"


@pytest.mark.slow
def test_export_hf_is_a_peft_adapter_with_the_trained_loss(sp2_run):
    from safetensors.torch import load_file
    tmp = sp2_run
    export, base = os.path.join(tmp, "export"), os.path.join(tmp, "base")
    with open(os.path.join(export, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (4, 8.0, os.path.abspath(base))
    assert not os.path.exists(os.path.join(export, "model.safetensors"))
    state = torch.load(os.path.join(tmp, "live.pt"))["state"]
    saved = load_file(os.path.join(export, "adapter_model.safetensors"))
    assert sorted(saved) == sorted(f"base_model.model.{n}" for n in state if fm.lora.is_adapter(n))
    for key, value in saved.items():
        assert torch.equal(value, state[key.removeprefix("base_model.model.")]), key
    tokens = np.load(os.path.join(tmp, "tokens.npy")).astype(np.int64)
    batch = windows_batch(tokens, SEQ_LEN, [5, 6])
    peft_loaded = peft_model(base, adapter_dir=export).eval()
    with torch.no_grad():
        theirs = causal_lm_loss(peft_loaded, batch)
    ours = _fpdt_loss(base, SP2_SPEC, state, batch)
    assert _rel(ours, theirs) < 1e-5, (ours, theirs)


# ----------------------------------------------------------------------------- dp=2, ZeRO-2, --model, --lora-init

INIT_SPEC = LoraSpec(3, alpha=5.0, targets=("q_proj", "v_proj", "down_proj"), rslora=True)


def _dp2_body(rank: int, world: int, tmp: str) -> None:
    quiet()
    from fpdt.cli.train import main
    argv = _argv(tmp, "dp2", "--model", os.path.join(tmp, "base"), "--steps", "3", "--sp", "1",
                 "--lora-init", os.path.join(tmp, "peft_init"), "--lora-rank", "3")
    assert main(argv) == 0


@pytest.mark.slow
def test_dp2_zero2_from_a_peft_adapter_matches_peft(tmp_path):
    """--lora-init from an adapter PEFT saved (lora_B random, so every gradient is live from the
    first step); the spec is read from its adapter_config.json."""
    tmp = str(tmp_path)
    write_fixture(tmp)
    base = _base(tmp, seed=1)
    import transformers
    torch.manual_seed(5)
    init = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=3, lora_alpha=5.0, target_modules=list(INIT_SPEC.targets), use_rslora=True, init_lora_weights=False))
    init.save_pretrained(os.path.join(tmp, "peft_init"))
    write_json(os.path.join(tmp, "dp2.json"), ds_config(ADAMW, ADAMW_CLIP, stage=2))
    run_distributed(_dp2_body, world_size=2, args=(tmp,), timeout=240)
    ref_model = peft_model(base, adapter_dir=os.path.join(tmp, "peft_init"))
    ref = peft_reference_losses(ref_model, os.path.join(tmp, "tokens.npy"), SEQ_LEN, 3, 2, ADAMW, ADAMW_CLIP)
    got = [r["loss"] for r in _losses(os.path.join(tmp, "dp2.jsonl"))]
    rel = [_rel(g, r) for g, r in zip(got, ref)]
    assert len(got) == 3 and max(rel) < RTOL, f"fpdt-train {got} vs PEFT {ref} (rel. err {rel})"


# ----------------------------------------------------------------------------- resume, fpdt-export, refusals

RESUME_FLAGS = ("--lora-rank", "2", "--lora-dropout", "0.1", "--lora-targets", "q_proj,o_proj,up_proj")


def _resume_body(rank: int, world: int, tmp: str) -> None:
    quiet()
    from fpdt.cli.train import main
    common = ("--model-config", os.path.join(tmp, "config.json"), "--sp", "2", "--chunk-size", "32", *RESUME_FLAGS)
    assert main(_argv(tmp, "whole", *common, "--steps", "4", "--save-dir", os.path.join(tmp, "ckpt"),
                      "--save-every", "2")) == 0
    assert main(_argv(tmp, "resumed", *common, "--steps", "4", "--resume", os.path.join(tmp, "ckpt", "step2"))) == 0


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lora_resume"))
    write_fixture(tmp)
    for name in ("whole", "resumed"):
        write_json(os.path.join(tmp, f"{name}.json"), ds_config(ADAMW, ADAMW_CLIP, stage=3))
    run_distributed(_resume_body, world_size=2, args=(tmp,), timeout=240)
    return tmp


@pytest.mark.slow
def test_resume_is_exact_and_saves_no_base_weight(resume_run):
    tmp = resume_run
    whole = [r["loss"] for r in _losses(os.path.join(tmp, "whole.jsonl"))]
    resumed = [r["loss"] for r in _losses(os.path.join(tmp, "resumed.jsonl"))]
    assert len(whole) == 4 and resumed == whole[2:], f"resumed {resumed} vs uninterrupted {whole[2:]}"
    step2 = os.path.join(tmp, "ckpt", "step2")
    for name in os.listdir(step2):
        if name.endswith("model_states.pt"):
            module = torch.load(os.path.join(step2, name), weights_only=False)["module"]
            assert all(fm.lora.is_adapter(n) for n in module if n.endswith("weight")), sorted(module)[:5]
    trainer = torch.load(os.path.join(step2, "fpdt_trainer_rank0.pt"), weights_only=False)
    assert trainer["lora"]["rank"] == 2 and trainer["lora"]["targets"] == ["q_proj", "o_proj", "up_proj"]


@pytest.mark.slow
def test_fpdt_export_of_a_lora_run_loads_into_peft(resume_run, tmp_path):
    from fpdt.model.lora import read_adapter_config
    from fpdt.train.export import main as export_main
    tmp = resume_run
    out = str(tmp_path / "adapter")
    assert export_main([os.path.join(tmp, "ckpt"), out, "--tag", "step4"]) == 0
    spec = read_adapter_config(out)
    assert (spec.rank, spec.targets, spec.dropout) == (2, ("q_proj", "o_proj", "up_proj"), 0.1)
    base = _base(str(tmp_path), seed=0)                      # --model-config's random base, seed 0
    batch = windows_batch(np.load(os.path.join(tmp, "tokens.npy")).astype(np.int64), SEQ_LEN, [0])
    loaded = peft_model(base, adapter_dir=out).eval()
    with torch.no_grad():
        theirs = causal_lm_loss(loaded, batch)
    model = fm.add_lora(fm.from_pretrained(base, dtype=torch.float32), spec)
    fm.load_adapter(model, out)
    ours = _fpdt_loss(None, spec, fm.adapter_state_dict(model), batch)
    assert _rel(ours, theirs) < 1e-5, (ours, theirs)
    assert _rel(ours, _fpdt_loss(None, spec, _initial_adapters(spec), batch)) > 1e-4, "export holds untrained adapters"


@pytest.fixture
def no_process_group(monkeypatch):
    import fpdt.cli.train as cli

    def refuse(*a, **k):
        raise AssertionError("the run got as far as the process group")
    monkeypatch.setattr(cli, "init_distributed", refuse)


def _fails(capsys, argv: list[str], *needles: str) -> None:
    from fpdt.cli.train import main
    assert main(argv) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip() and "[WARNING]" not in l]
    assert len(lines) == 1 and lines[0].startswith("fpdt-train: error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
def test_a_resume_with_another_spec_full_training_or_base_is_refused(resume_run, tmp_path, capsys,
                                                                      no_process_group, monkeypatch):
    from fpdt.train import lora
    from fpdt.train.config import ConfigError
    tmp = resume_run
    ck = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(tmp, "ckpt"), ck)
    monkeypatch.setenv("WORLD_SIZE", "2")
    common = _argv(tmp, "whole", "--model-config", os.path.join(tmp, "config.json"), "--sp", "2", "--chunk-size", "32",
                   "--steps", "5", "--resume", ck)
    _fails(capsys, common + ["--lora-rank", "4", "--lora-dropout", "0.1", "--lora-targets", "q_proj,o_proj,up_proj"],
           "the checkpoint's LoRA adapters are rank 2, alpha 4, dropout 0.1, targets q_proj,o_proj,up_proj; this "
           "run's are rank 4, alpha 8", "resume with the --lora-* flags it was trained with")
    _fails(capsys, common, "the checkpoint is of a LoRA run (rank 2,", "this run trains every weight; resume with "
           "--lora-rank 2")
    _fails(capsys, [*common, "--seed", "7", *RESUME_FLAGS],
           "frozen base was drawn with --seed 0, this run's with --seed 7", "resume with --seed 0")
    base = _base(str(tmp_path))                        # same architecture, but not the checkpoint's base
    _fails(capsys, [base if a == os.path.join(tmp, "config.json") else "--model" if a == "--model-config" else a
                    for a in common] + list(RESUME_FLAGS),
           f"the checkpoint's frozen base came from --model-config {os.path.join(tmp, 'config.json')} (random, "
           f"--seed 0); the checkpoint holds only the adapters, so resume with that base")
    rec = lora.record(LoraSpec(2), None, "c.json", 0)
    with pytest.raises(ConfigError, match=r"the checkpoint is of full training \(every weight\), this run trains "
                                          r"LoRA adapters"):
        lora.check_resume("ck", None, rec)


@pytest.mark.parametrize("extra, needles", [
    (["--lora-alpha", "16", "--lora-rslora"], ["--lora-alpha, --lora-rslora need --lora-rank R (or --lora-init DIR)"]),
    (["--lora-rank", "0", "--lora-dropout", "0.1"], ["--lora-dropout needs --lora-rank R"]),
    (["--lora-rank", "-1"], ["--lora-rank -1 must be >= 1 (LoRA) or 0 (full training)"]),
    (["--lora-rank", "4", "--lora-dropout", "1"], ["--lora-dropout 1.0 must be in [0, 1)"]),
    (["--lora-rank", "4", "--lora-alpha", "0"], ["--lora-alpha 0.0 must be > 0"]),
    (["--lora-rank", "4", "--lora-targets", "q_proj,lm_head"], ["--lora-targets q_proj,lm_head: unknown lm_head"]),
    (["--lora-rank", "4", "--lora-targets", "q_proj,q_proj"], ["a name repeated"]),
    (["--lora-rank", "4", "--mlp-chunks", "0"],
     ["--mlp-chunks 0 (the unchunked MLP", "cannot carry LoRA adapters on gate_proj, up_proj, down_proj",
      "or leave the MLP projections out of --lora-targets"]),
    (["--lora-init", "nowhere"], ["--lora-init nowhere: no such directory; pass a PEFT adapter directory"]),
])
def test_bad_lora_flags_are_refused(tmp_path, capsys, no_process_group, extra, needles):
    cfg, data = write_fixture(str(tmp_path))
    _fails(capsys, ["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "1", *extra], *needles)


def test_lora_init_contradictions_and_misfits_are_refused(tmp_path, capsys, no_process_group):
    from fpdt.model import save_adapter
    cfg, data = write_fixture(str(tmp_path))
    argv = ["--model-config", cfg, "--data", data, "--seq-len", "64", "--steps", "1"]
    spec = LoraSpec(2, targets=("q_proj", "v_proj"))
    adapters = _initial_adapters(spec)
    good = str(tmp_path / "good")
    save_adapter(adapters, spec, good)
    _fails(capsys, argv + ["--lora-init", good, "--lora-rank", "4", "--lora-rslora"],
           f"--lora-init {good}: --lora-rank 4 (its config: 2); --lora-rslora (its config: use_rslora false)",
           "leave those flags out or give its values")
    _fails(capsys, argv + ["--lora-init", good, "--mlp-chunks", "0", "--lora-targets", "v_proj,q_proj", "--sp", "3"],
           "--sp 3")                                 # matching flags pass: the next check fails
    other = {**TINY_CONFIG, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}
    other_cfg = write_json(str(tmp_path / "other.json"), other)
    _fails(capsys, ["--model-config", other_cfg, *argv[2:], "--lora-init", good],
           f"--lora-init {good}: its adapters do not fit the model of {other_cfg}",
           "model.layers.0.self_attn.q_proj.lora_A.weight (2, 64) (the model's (2, 96))")
    os.remove(os.path.join(good, "adapter_model.safetensors"))
    _fails(capsys, argv + ["--lora-init", good], "no adapter_model.safetensors in the directory")


# ----------------------------------------------------------------------------- LoRA and full runs in one --save-dir

def _mixed_body(rank: int, world: int, tmp: str) -> None:
    """One process: step1 of full training, step2 of a LoRA run, step3 of full training, all
    in one save dir (each run's start rewrites its adapter_config.json); the dir as the LoRA run
    left it is copied aside. Then the LoRA step2 resumed for one step, its output kept."""
    import contextlib
    import io
    quiet()
    from fpdt.cli.train import main
    ck = os.path.join(tmp, "ckpt")
    model = ("--model-config", os.path.join(tmp, "config.json"), "--chunk-size", "32")
    assert main(_argv(tmp, "mixed", *model, "--save-dir", ck, "--steps", "1")) == 0
    assert main(_argv(tmp, "mixed", *model, "--save-dir", ck, "--steps", "2", *RESUME_FLAGS)) == 0
    shutil.copytree(ck, os.path.join(tmp, "after_lora"))
    assert main(_argv(tmp, "mixed", *model, "--save-dir", ck, "--steps", "3")) == 0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(_argv(tmp, "mixed", *model, "--steps", "3", "--resume", os.path.join(ck, "step2"), *RESUME_FLAGS))
    with open(os.path.join(tmp, "resumed.txt"), "w") as f:
        f.write(err.getvalue())
    assert status == 0, err.getvalue()[-2000:]


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lora_mixed"))
    write_fixture(tmp)
    write_json(os.path.join(tmp, "mixed.json"), ds_config(SGD, SGD_CLIP, stage=2))
    run_distributed(_mixed_body, world_size=1, args=(tmp,), timeout=240)
    return tmp


@pytest.mark.slow
def test_fpdt_export_takes_lora_or_full_from_the_checkpoint_not_the_save_dir(mixed_run, tmp_path):
    """Each tag exports as what it is, whichever kind of run wrote the save dir last: the full
    step1 while the dir's adapter_config.json is the LoRA run's, the LoRA step2 after a full
    run removed it; the exports are the same from either state of the dir."""
    from safetensors.torch import load_file

    from fpdt.model.lora import read_adapter_config
    from fpdt.train.export import main as export_main
    tmp = mixed_run
    assert os.path.isfile(os.path.join(tmp, "after_lora", "adapter_config.json"))
    assert not os.path.exists(os.path.join(tmp, "ckpt", "adapter_config.json"))
    outs = {}
    for where in ("after_lora", "ckpt"):
        for tag in ("step1", "step2") + (("step3",) if where == "ckpt" else ()):
            out = str(tmp_path / f"{where}_{tag}")
            assert export_main([os.path.join(tmp, where), out, "--tag", tag]) == 0, (where, tag)
            outs[where, tag] = out
    for tag in ("step1", "step3"):                                   # full training: a Transformers checkpoint
        out = outs["ckpt", tag]
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"], os.listdir(out)
        init = _initial_state(0)
        weights = load_file(os.path.join(out, "model.safetensors"))
        assert set(weights) == set(init) and not torch.equal(weights["lm_head.weight"], init["lm_head.weight"])
    spec = read_adapter_config(outs["ckpt", "step2"])                # LoRA: a PEFT adapter directory
    assert spec == LoraSpec(2, alpha=4.0, dropout=0.1, targets=("q_proj", "o_proj", "up_proj"))
    adapters = {k.removeprefix("base_model.model."): v
                for k, v in load_file(os.path.join(outs["ckpt", "step2"], "adapter_model.safetensors")).items()}
    init = _initial_adapters(spec)
    assert set(adapters) == set(init) and all(not torch.equal(adapters[k], init[k]) for k in init if "lora_B" in k)
    for tag in ("step1", "step2"):
        a, b = outs["after_lora", tag], outs["ckpt", tag]
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))
        for name in os.listdir(a):
            with open(os.path.join(a, name), "rb") as f, open(os.path.join(b, name), "rb") as g:
                assert f.read() == g.read(), (tag, name)


def _initial_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v for k, v in fm.from_config(TINY_CONFIG, dtype=torch.float32).state_dict().items()
            if not k.endswith("inv_freq")}


@pytest.mark.slow
def test_a_resumed_lora_run_says_its_adapters_come_from_the_checkpoint(mixed_run):
    with open(os.path.join(mixed_run, "resumed.txt")) as f:
        lines = [line for line in f.read().splitlines() if line.startswith("LoRA: ")]
    step2 = os.path.join(mixed_run, "ckpt", "step2")
    assert len(lines) == 1 and lines[0].endswith(f"), from checkpoint {step2}"), lines


@pytest.mark.slow
def test_a_resume_onto_a_random_base_from_another_config_is_refused(mixed_run, tmp_path, capsys, no_process_group):
    """Same architecture and seed, another initializer_range: the base drawn would be another
    one, which the seed and the architecture alone did not show."""
    from fpdt.train import lora
    tmp = mixed_run
    step2 = os.path.join(tmp, "ckpt", "step2")
    other = write_json(str(tmp_path / "config.json"), {**TINY_CONFIG, "initializer_range": 0.05})
    _fails(capsys, _argv(tmp, "mixed", "--model-config", other, "--chunk-size", "32", "--steps", "3", "--resume", step2,
                         *RESUME_FLAGS),
           f"--resume {step2}: the checkpoint's frozen base was drawn (--seed 0) from a model config with "
           f"initializer_range 0.02 (this run's 0.05), so this run's base would be another",
           f"resume with a --model-config with the checkpoint's values (it was {os.path.join(tmp, 'config.json')})")
    saved = torch.load(os.path.join(step2, "fpdt_trainer_rank0.pt"), weights_only=False)["lora"]
    assert saved["base"]["config"]["initializer_range"] == 0.02
    old = {**saved, "base": {**saved["base"], "config": None}}       # written before the config was recorded
    current = lora.record(lora.spec_from_record(saved), None, os.path.join(tmp, "config.json"), 0,
                          fm.ModelConfig.from_hf(TINY_CONFIG))
    assert lora.check_resume(step2, saved, current) == []
    warning, = lora.check_resume(step2, old, current)
    assert "does not record the model config its random base was drawn from" in warning


@pytest.mark.parametrize("tied", [False, True])
def test_a_lora_resume_loads_the_adapters_only(tied):
    """saving._adapters_only: the module state exclude_frozen_parameters leaves (with tied
    embeddings it keeps lm_head.weight, a second name of the frozen embedding) loads; a state
    that holds the frozen base too, or lacks an adapter, is refused before anything loads."""
    from fpdt.train.saving import _adapters_only
    from fpdt.train.config import ConfigError
    cfg = {**TINY_CONFIG, "tie_word_embeddings": tied}
    spec = LoraSpec(2, targets=("q_proj", "v_proj"))
    saved = fm.add_lora(fm.from_config(cfg, dtype=torch.float32), spec, seed=1)
    with torch.no_grad():
        for p in fm.adapter_state_dict(saved).values():
            p.add_(1.0)
    full = saved.state_dict()
    kept = {k: v for k, v in full.items()
            if k not in {n for n, p in saved.named_parameters() if not p.requires_grad}}  # as DeepSpeed saves it
    assert ("lm_head.weight" in kept) == tied
    model = fm.add_lora(fm.from_config(cfg, dtype=torch.float32), spec)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with pytest.raises(ConfigError, match=r"the checkpoint's model state holds \d+ frozen base weight\(s\) \(e\.g\. "
                                          r"(lm_head|model\.embed_tokens)\.weight\), which a LoRA run's checkpoint leaves out"):
        _adapters_only(full, model)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)  # nothing loaded
    with pytest.raises(ConfigError, match=r"missing \['model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight'\]"):
        _adapters_only({k: v for k, v in kept.items() if k != "model.layers.0.self_attn.q_proj.lora_A.weight"}, model)
    _adapters_only(kept, model)
    for n, p in fm.adapter_state_dict(model).items():
        assert torch.equal(p, fm.adapter_state_dict(saved)[n]), n

"""One options object: the three entry points build the same FPDTOptions for the same inputs,
with one default per field and one validation."""


import re

import pytest

import fpdt.hf
from fpdt import model as fm
from fpdt.options import ATTENTION_CHECKPOINT_MODES, CHECKPOINT_MODES, FPDTOptions, OptionsError
from fpdt.train.config import FPDT_KEYS, TrainerOptions, merge_options, validate
from tests.model.helpers import hf_config, hf_model

pytestmark = pytest.mark.filterwarnings("ignore")

CHOSEN = dict(num_chunks=2, offload=False, checkpointing="on", mlp_chunks=3, loss_chunks=5,
              lm_head_wgrad="accumulate", backend="math", attention_checkpoint="recompute")


def test_defaults_are_the_measured_ones():
    o = FPDTOptions()
    assert o.lm_head_wgrad == "recompute"           # faster on the H100 (benchmarks/README.md)
    assert o.mlp_chunks is None and o.loss_chunks is None   # the budget rules of fpdt.model.chunks
    assert (o.checkpointing, o.attention_checkpoint, o.save_attention_layers) == ("off", "recompute", None)
    assert TrainerOptions().lm_head_wgrad == o.lm_head_wgrad and TrainerOptions().mlp_chunks is None


def test_three_entry_points_build_the_same_options():
    cfg = hf_config("llama_gqa").to_dict()
    direct = fm.from_config(cfg, **CHOSEN).options
    hf = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), **CHOSEN).fpdt.options
    flags = {key: None for key in FPDT_KEYS}
    section = {"chunk_size": 32, "offload": False, "checkpoint": "on", "mlp_chunks": 3, "loss_chunks": 5,
               "lm_head_wgrad": "accumulate", "attention_backend": "math", "attention_checkpoint": "recompute"}
    trainer = merge_options(flags, section)
    run = validate(trainer, 64, 1, "cpu", {})
    built = trainer.model_options(run)
    assert direct == hf == built == FPDTOptions(**CHOSEN)
    # and with nothing given, the same defaults (the trainer resolves its CPU device defaults)
    plain_trainer = merge_options({}, None)
    plain = plain_trainer.model_options(validate(plain_trainer, 64, 1, "cpu", {}))
    assert fm.from_config(cfg).options == fpdt.hf.apply_fpdt(hf_model("llama_gqa")).fpdt.options == plain


def test_options_object_or_keywords():
    cfg = hf_config("llama_gqa").to_dict()
    opts = FPDTOptions(num_chunks=2, checkpointing="on")
    assert fm.from_config(cfg, options=opts).options == opts
    assert fm.from_config(cfg, options=opts, num_chunks=4).options == FPDTOptions(num_chunks=4, checkpointing="on")
    assert fpdt.hf.apply_fpdt(hf_model("llama_gqa"), opts).fpdt.options == opts


@pytest.mark.parametrize("bad,match", [
    (dict(checkpointing="sometimes"), f"checkpointing='sometimes' must be one of {CHECKPOINT_MODES}"),
    (dict(attention_checkpoint="keep"), f"attention_checkpoint='keep' must be one of {ATTENTION_CHECKPOINT_MODES}"),
    (dict(lm_head_wgrad="sliced"), "lm_head_wgrad='sliced' must be one of"),
    (dict(num_chunks=0), "num_chunks=0 must be an integer >= 1"),
    (dict(save_attention_layers=-1), "save_attention_layers=-1 must be an integer >= 0"),
    (dict(checkpoint_device_layers=2), "needs checkpointing='offload'"),
    (dict(nvme_path="/mnt/nvme"), "nvme_path='/mnt/nvme' holds the host-offloaded layer checkpoints: it needs "
                                  "checkpointing='offload' (now 'off')"),
    (dict(nvme_path=3, checkpointing="offload"), "nvme_path=3 must be a directory path"),
    (dict(nvme_path="", checkpointing="offload"), "nvme_path='' must be a directory path"),
    (dict(backend="fast"), "backend='fast' must be one of"),
    (dict(runtime="gpu"), "runtime='gpu' must be one of ('sim', 'sync', 'cuda')"),
])
def test_one_validation_everywhere(bad, match):
    match = re.escape(match)
    with pytest.raises(OptionsError, match=match):
        FPDTOptions(**bad).validate()
    with pytest.raises(ValueError, match=match):
        fm.from_config(hf_config("llama_gqa").to_dict(), **bad)
    with pytest.raises(fpdt.hf.FPDTHFError, match=match):
        fpdt.hf.apply_fpdt(hf_model("llama_gqa"), **bad)


def test_layer_counts_checked_against_the_model():
    cfg = hf_config("llama_gqa").to_dict()
    with pytest.raises(ValueError, match="save_attention_layers=9 is more than the model's"):
        fm.from_config(cfg, checkpointing="on", attention_checkpoint="save", save_attention_layers=9)


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(TypeError, match="unknown FPDT options \\['chunks'\\]"):
        FPDTOptions().updated(chunks=2)


def test_trainer_keys_are_the_options_fields():
    """The JSON section's keys are the options' fields (two spelt as their flags) plus the mesh
    (what a run builds, group, mesh and NVMe tier, is no key)."""
    fields = set(FPDTOptions.__dataclass_fields__) - {"num_chunks", "group", "mesh", "nvme_tier", "checkpointing", "backend"}
    assert fields | {"checkpoint", "attention_backend", "sp", "hp", "cp", "placement", "inner_ring",
                     "chunk_size"} == set(FPDT_KEYS)


def test_the_runtime_is_the_option_not_the_environment(monkeypatch):
    """FPDT_RUNTIME is only fpdt-train's default: a model built without runtime= offloads through
    the automatic runtime (sync on the CPU); runtime="sim" gives every stash the one sim runtime."""
    import torch

    from fpdt.offload import named_runtime

    monkeypatch.setenv("FPDT_RUNTIME", "sim")
    cfg = hf_config("llama_gqa").to_dict()
    ids = torch.randint(0, cfg["vocab_size"], (1, 16))
    for runtime, want in ((None, "sync"), ("sim", "sim")):
        model = fm.from_config(cfg, num_chunks=2, offload=True, checkpointing="offload", runtime=runtime)
        before = {name: named_runtime(name).counters.bytes_d2h for name in ("sync", "sim")}
        model(**model.prepare_inputs(ids, labels=ids)).backward()
        assert model.options.runtime == runtime and model._stash.runtime is named_runtime(want)
        moved = {name for name, n in before.items() if named_runtime(name).counters.bytes_d2h > n}
        assert moved == {want}, (runtime, moved)   # the attention chunks and layer inputs went through it only


def test_a_copied_model_shares_its_runtime_instance():
    """A Runtime instance is a shared service, not model state: deepcopy keeps the same one."""
    import copy

    from fpdt.offload import fresh_runtime

    with fresh_runtime("sim", mode="threaded") as rt:
        model = copy.deepcopy(fm.from_config(hf_config("llama_gqa").to_dict(), offload=True, runtime=rt))
        assert model.options.runtime is rt and {id(layer.self_attn.runtime) for layer in model.model.layers} == {id(rt)}

"""The planner holds the model's FPDTOptions: fpdt-plan's setups carry the object the model
gets from fpdt-train for the same settings, and option values are validated by it."""

import pytest

from fpdt.options import FPDTOptions
from fpdt.plan import GPU_PRESETS, Choice, Cluster, Setup, load_model_config, plan
from fpdt.plan.deepspeed_config import apply_deepspeed_dict
from fpdt.plan.planner import candidates
from fpdt.plan.setup import GPU_OPTIONS
from fpdt.plan.trainer_run import planned_setup
from fpdt.options import device_defaults
from fpdt.train.config import merge_options, validate
from tests.model.helpers import hf_config

SECTION = {"chunk_size": 32, "offload": False, "checkpoint": "on", "mlp_chunks": 3, "loss_chunks": 5,
           "lm_head_wgrad": "accumulate", "attention_backend": "math", "attention_checkpoint": "recompute"}
"""An ``"fpdt"`` JSON section fixing every option the planner would otherwise choose."""


def test_planner_and_trainer_build_the_models_options():
    trainer = merge_options({}, SECTION)
    run = validate(trainer, 64, 1, "cpu", {})
    built = trainer.model_options(run)
    assert planned_setup(run, trainer, {}, "fp32", "cpu").options == built
    [s] = candidates(load_model_config(hf_config("llama_gqa").to_dict()), 64,
                     apply_deepspeed_dict({"fpdt": SECTION}, Choice()), 1)
    assert s.options == built == FPDTOptions(num_chunks=2, offload=False, checkpointing="on", mlp_chunks=3,
                                             loss_chunks=5, lm_head_wgrad="accumulate", backend="math")


def test_setup_options_default_to_fpdt_trains_on_a_gpu_with_the_chunk_count_derived():
    s = Setup(seq_len=2 ** 20, chunk_size=2 ** 16)
    assert (s.options.offload, s.options.checkpointing) == device_defaults("cuda")
    assert s.options == GPU_OPTIONS.updated(num_chunks=16) and s.num_chunks == 16
    assert Setup.build(seq_len=2 ** 20, chunk_size=2 ** 18, lm_head_wgrad="accumulate").options == \
        GPU_OPTIONS.updated(num_chunks=4, lm_head_wgrad="accumulate")
    assert s.updated(chunk_size=2 ** 17, checkpoint_device_layers=3).options.num_chunks == 8
    with pytest.raises(TypeError, match="unknown Setup settings \\['num_chunks'\\]"):
        s.updated(num_chunks=2)      # derived from the chunk size


def test_printed_setup_keeps_fpdt_plans_keys_and_order():
    keys = ["seq_len", "chunk_size", "hp", "cp", "placement", "inner_ring", "checkpoint",
            "checkpoint_device_layers", "offload", "zero_stage", "offload_optimizer", "offload_param", "dtype",
            "batch", "mlp_chunks", "loss_chunks", "lm_head_wgrad", "reduce_bucket_size", "sub_group_size",
            "contiguous_gradients", "kernel_expands_gqa", "attention_checkpoint", "save_attention_layers",
            "doc_len", "lora_rank", "stream_layers", "nvme_path", "nvme_layers"]
    d = Setup.build(seq_len=2 ** 20, chunk_size=2 ** 16, checkpointing="on").as_dict()
    assert list(d) == keys and d["checkpoint"] == "on"


def test_choice_fixes_options_by_name_and_none_leaves_them_open():
    choice = Choice().fix(chunk_size=65536, lm_head_wgrad="accumulate", backend="math")
    assert choice.chunk_size == 65536 and choice.fixed == {"lm_head_wgrad": "accumulate", "backend": "math"}
    assert choice.options == GPU_OPTIONS.updated(lm_head_wgrad="accumulate", backend="math")
    assert not choice.chooses("lm_head_wgrad") and choice.chooses("offload")
    assert choice.fix(lm_head_wgrad=None).fixed == {"backend": "math"}
    with pytest.raises(TypeError, match="unknown Choice settings \\['group'\\]"):
        Choice().fix(group=None)


@pytest.mark.parametrize("fixed, message", [
    (dict(lm_head_wgrad="sliced"), "lm_head_wgrad='sliced' must be one of"),
    (dict(checkpointing="sometimes"), "checkpointing='sometimes' must be one of"),
    (dict(save_attention_layers=40), "save_attention_layers=40 is more than the model's 32 decoder layers"),
    (dict(mlp_chunks=0), "mlp_chunks=0: the planner models the chunked MLP"),
])
def test_bad_option_values_are_refused_by_the_options_checks(fixed, message):
    with pytest.raises(ValueError, match=message):
        plan("llama-3-8b", Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8), seq_len=2 ** 20,
             choice=Choice().fix(**fixed))

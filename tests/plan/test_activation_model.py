"""Validation (a): the planner's activation peak against the memory accountant's count.

Same tiny model and inputs: a bf16 Llama (hidden 64, GQA 4:1... 4 query / 2 KV heads of 16,
2 layers, vocabulary 256), one forward + backward with the gradients allocated before the
step (so, as in the device-memory issue, only what the step creates is counted). The
planner's ``activation_peak_bytes`` (everything beyond model states, communication
buffers and the runtime reserve) must be within 10% of the accountant's device peak, on
every rank, for sp 1 and 2, u 2/4/8, offload on/off, checkpointing on/offload/off. A
vocabulary of 32,000 puts the peak at the loss instead, for both LM-head weight-gradient
modes (there "recompute" measures 2.5x less than "accumulate"), at the default's 128-token loss
chunks and, with an explicit count, at the budget rule's 1-token ones.
"""

import pytest
import torch

import fpdt.model as fm
from fpdt.plan import Cluster, GPU_PRESETS, evaluate, load_model_config
from fpdt.plan.setup import Setup
from fpdt.memory.accountant import MemoryAccountant
from tests.distributed import run_distributed
from tests.fp32_gemms import Fp32Gemms

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
       "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1 << 20,
       "tie_word_embeddings": False, "rope_theta": 10000.0}
TOLERANCE = 0.10

# (sp, seq_len, u, offload, checkpoint[, vocab, lm_head_wgrad[, loss_chunks]])
CASES = [
    (1, 2048, 2, True, "offload"),
    (1, 2048, 8, True, "offload"),
    (1, 2048, 4, False, "on"),
    (1, 2048, 4, True, "on"),
    (1, 2048, 4, False, "offload"),
    (2, 2048, 4, True, "offload"),
    (2, 2048, 2, False, "on"),
    (1, 2048, 2, True, "offload", 32000, "accumulate"),
    (1, 2048, 8, True, "offload", 32000, "recompute"),
    (1, 512, 2, True, "offload", 32000, "recompute"),
    (2, 2048, 4, True, "offload", 32000, "recompute"),
    # ceil(2 u V / hidden): 1-token chunks (the long tier: about 15 s each; the default chunks above)
    pytest.param((1, 2048, 2, True, "offload", 32000, "accumulate", 2000), marks=pytest.mark.long),
    pytest.param((1, 2048, 8, True, "offload", 32000, "recompute", 8000), marks=pytest.mark.long),
    # no layer checkpointing: every layer's saved tensors (the output projection reading its
    # input from the stash under offload)
    (1, 2048, 2, True, "off"),
    (1, 2048, 8, True, "off"),
    (1, 2048, 4, False, "off"),
    (2, 2048, 4, True, "off"),
    (2, 2048, 2, False, "off"),
    (1, 2048, 4, True, "off", 32000, "recompute"),
]


def _config(vocab: int) -> dict:
    return {**CFG, "vocab_size": vocab}


def measured_peak(seq_len: int, u: int, offload: bool, checkpoint: str, vocab: int = 256,
                  wgrad: str = "accumulate", loss_chunks: int | None = None, group=None) -> int:
    torch.manual_seed(0)
    model = fm.from_config(_config(vocab), dtype=torch.bfloat16, num_chunks=u, offload=offload,
                           checkpointing=checkpoint, lm_head_wgrad=wgrad, loss_chunks=loss_chunks, group=group)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = model.prepare_inputs(torch.randint(0, vocab, (1, seq_len)))
    model(**inputs).backward()       # the attention kernel's first-use self-check outside the count
    for p in model.parameters():
        p.grad.zero_()
    with MemoryAccountant("cpu") as acct:
        model(**inputs).backward()
    return acct.device_peak


def planned_peak(sp: int, seq_len: int, u: int, offload: bool, checkpoint: str, vocab: int = 256,
                 wgrad: str = "accumulate", loss_chunks: int | None = None) -> float:
    s = Setup.build(seq_len=seq_len, chunk_size=seq_len // u, hp=sp, checkpointing=checkpoint, offload=offload,
              zero_stage=0, dtype="bf16", kernel_expands_gqa=True, lm_head_wgrad=wgrad,
              loss_chunks=loss_chunks)   # the CPU kernel
    cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=sp)
    return evaluate(load_model_config(_config(vocab)), s, cluster)["activation_peak_bytes"]


def _rank_body(rank, world_size, case):
    sp, seq_len, u, offload, checkpoint, *loss = case
    with Fp32Gemms():       # the same bytes counted, the bf16 GEMMs 30-40x faster on an AVX2 CPU
        got = measured_peak(seq_len, u, offload, checkpoint, *loss)
    want = planned_peak(*case)
    assert abs(want - got) <= TOLERANCE * got, f"rank {rank}, {case}: planned {want:.0f} B, measured {got} B"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "sp{}-S{}-u{}-{}-ckpt_{}".format(
    c[0], c[1], c[2], "offload" if c[3] else "device", c[4]) + ("-V{}-{}".format(*c[5:7]) if c[5:] else "")
    + ("-N{}".format(c[7]) if c[7:] else ""))
def test_planned_activation_peak_matches_accountant(case):
    if case[0] == 1:
        _rank_body(0, 1, case)
    else:
        run_distributed(_rank_body, world_size=case[0], args=(case,))


@pytest.mark.slow
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("device_layers", [0, 1, 4, 6])
@pytest.mark.usefixtures("fp32_gemms")
def test_checkpoint_device_layers_move_checkpoints_between_tiers(offload, device_layers):
    """Offloaded checkpointing with the last k of 6 layers' inputs on the device: the planner's
    device activation peak (two inputs in flight, or k at the start of backward) within 10% of
    the accountant's; its host tier the other layers' inputs exactly (without attention
    offload) and, with the attention stash beside them, an upper bound (the planner's stash
    holds one layer input's worth more than this tiny model's, and with k = 0 one checkpoint
    more than is on the host at the stash's peak)."""
    cfg = {**CFG, "num_hidden_layers": 6}
    torch.manual_seed(0)
    model = fm.from_config(cfg, dtype=torch.bfloat16, num_chunks=2, offload=offload, checkpointing="offload",
                           checkpoint_device_layers=device_layers)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = model.prepare_inputs(torch.randint(0, 256, (1, 2048)))
    with MemoryAccountant("cpu") as acct:
        model(**inputs).backward()
    s = Setup.build(seq_len=2048, chunk_size=1024, checkpointing="offload", checkpoint_device_layers=device_layers,
              offload=offload, zero_stage=0, dtype="bf16", kernel_expands_gqa=True)
    r = evaluate(load_model_config(cfg), s, Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1))
    host = r["breakdown"]["checkpoints_host"] + r["breakdown"]["attention_stash_host"]
    assert abs(r["activation_peak_bytes"] - acct.device_peak) <= TOLERANCE * acct.device_peak
    nd = 2048 * 64 * 2
    assert r["breakdown"]["checkpoints_host"] == (6 - device_layers) * nd
    if offload:
        assert acct.host_peak <= host <= acct.host_peak + 2 * nd
    else:
        assert host == acct.host_peak == (6 - device_layers) * nd

"""Device memory of a Transformers model after ``fpdt.hf.apply_fpdt``, counted exactly on the CPU.

The same model and budget as :mod:`tests.memory.test_model_budget` (2 layers, hidden 256,
4 query heads / 1 KV head of 64, bf16, ``offload=True``, ``checkpointing="offload"``), built
as Transformers' ``LlamaForCausalLM`` and patched by ``apply_fpdt`` with its defaults (FPDT
attention with chunked q/k/v projections, lean RMSNorm, chunked MLP and loss). Budget on
the per-token slope at lengths where it is steady, in ``Nd`` (one bf16 hidden-state tensor of
the local sequence): fpdt's model's own budget (:mod:`tests.memory.test_model_budget` lists what
is live). Under fpdt's layer checkpoint the residual branches hand Transformers' layer norms, made
fpdt's lean RMSNorm, to the chunked attention and the chunked MLP, which normalise a chunk at a
time, as fpdt's model does (before, Transformers' decoder layer ran each norm over the whole
length: 1 Nd more in the attention phase, 2 in the MLP's). Plus the one thing Transformers keeps
that fpdt's model does not: RoPE's ``(cos, sin)`` tables for every local token, computed once
per forward and passed to every layer, ``2 * head_dim / hidden`` Nd (0.5 here; 1/16 for
Llama-3-8B).
"""

import contextlib

import pytest
import torch
import transformers

import fpdt.hf
from fpdt.memory.accountant import MemoryAccountant, sequence_unit
from tests.memory.test_model_budget import (ATTENTION_PHASE_ND, ATTENTION_WS_U, CONFIG, EPS, MLP_PHASE_ND, MLP_WS_U,
                                             STEADY, budget_nd)

ROPE_TABLES_ND = 2 * CONFIG["head_dim"] / CONFIG["hidden_size"]


def own_layer_forward_budget_nd(u: int) -> float:
    """Transformers' own decoder-layer forward (its checkpointing, not fpdt's): each norm runs as its
    own module over the whole length, so the attention returns the norm's output gradient full-length
    (1 Nd more) and the MLP saves the norm's output and returns its input gradient (2 Nd more)."""
    return max(ATTENTION_PHASE_ND + 1 + ATTENTION_WS_U / u, MLP_PHASE_ND + 2 + MLP_WS_U / u) + EPS


def _model(u: int, transformers_checkpointing: bool = False, lora_dropout: float | None = None, **options):
    cfg = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if lora_dropout is not None:     # PEFT LoRA on every decoder linear; PEFT makes the adapters fp32
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=lora_dropout,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    fpdt.hf.apply_fpdt(model, num_chunks=u, offload=True,
                       checkpointing="off" if transformers_checkpointing else "offload", **options)
    model.train()
    if transformers_checkpointing:
        model.gradient_checkpointing_enable()
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)                   # pre-allocated: part of the baseline
    return model


def _peak(model, seq: int) -> int:
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
    inputs = fpdt.hf.prepare_inputs(model, ids)
    with MemoryAccountant("cpu") as acct:
        loss = model(**inputs).loss
        loss.backward()
        del loss
    return acct.device_peak


def _slope(model, u: int) -> float:
    _peak(model, 256)                                      # kernel self-check outside the count
    lo, hi = STEADY[u]
    a, b = _peak(model, lo), _peak(model, hi)
    return (b - a) / (sequence_unit(hi, 256) - sequence_unit(lo, 256))


@pytest.mark.slow
@pytest.mark.parametrize("u", [4, 8])
@pytest.mark.usefixtures("outputs_only_attention")
def test_transformers_model_per_token_within_fpdt_model_budget(u):
    slope = _slope(_model(u), u)
    budget = budget_nd(u) + ROPE_TABLES_ND
    assert slope <= budget, f"u={u}: {slope:.3f} Nd per token > fpdt.model's budget + RoPE tables {budget:.3f}"
    assert slope >= budget - 0.1, f"u={u}: {slope:.3f} Nd, well under the derived budget {budget:.3f}: re-derive it"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.usefixtures("outputs_only_attention")
def test_transformers_own_checkpointing_within_its_norms_budget():
    """Transformers' checkpointing (``checkpointing="off"`` + ``gradient_checkpointing_enable()``)
    keeps every layer input on the device instead of fpdt's two (restored + prefetched): with
    these 2 layers no more than its layer forward's full-length norms cost (with 32 layers, 30 Nd
    more). Both hold one full-length gradient through a layer's backward: Transformers'
    non-reentrant recompute lets the engine accumulate the residual's gradient into the incoming
    one in place, fpdt's residual checkpoint does it itself."""
    u = 4
    slope = _slope(_model(u, transformers_checkpointing=True), u)
    budget = own_layer_forward_budget_nd(u) + ROPE_TABLES_ND
    assert budget - 0.1 <= slope <= budget, f"{slope:.3f} Nd per token, budget {budget:.3f}"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.usefixtures("outputs_only_attention")
def test_transformers_norms_and_projections_cost_what_the_docs_say():
    """With Transformers' own RMSNorm (fp32 copies saved) the slope is far over budget. With its
    own q/k/v projections, at the attention backward: the norm output they save for their weight
    gradients (1) and the attention core's full-length dq, dk, dv (``1 + 2 H_kv / H`` = 1.5), in
    place of the chunked projection's input gradient (1) and input chunk (``U``): 1.5 - 1/u Nd;
    the full-length attention output Transformers' ``o_proj`` saves, which fpdt's runs inside the
    pipeline only with the chunked projections (1); and the input norm, which then runs as its own
    module over the whole length where the chunked attention normalises a chunk at a time (1):
    3.5 - 1/u Nd more in all (measured 3.258 at u = 4)."""
    u = 4
    lean = _slope(_model(u), u)
    assert _slope(_model(u, lean_norms=False), u) > lean + 8
    assert _slope(_model(u, chunked_qkv=False), u) == pytest.approx(lean + 3.5 - 1 / u, abs=EPS)


def _trainer_route_against_own_loop(rank, world, u, seq):
    """Peak device bytes of one step, per rank: the user's own loop (inputs from prepare_inputs)
    against the Trainer's route (DeepSpeed's contiguous slices, moved into the FPDT layout)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from tests.hf.test_trainer import _adapter_slices

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(world)
    try:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
        peaks = {}
        for route, group in (("own loop", dist.group.WORLD), ("trainer", "trainer")):
            model = _model(u, group=group)
            if route == "own loop":
                inputs = fpdt.hf.prepare_inputs(model, ids)
            else:
                inputs = _adapter_slices(ids, ids, rank, world)
            model(**inputs).loss.backward()                 # kernel self-check outside the count
            with MemoryAccountant("cpu") as acct:
                loss = model(**inputs).loss
                loss.backward()
                del loss
            peaks[route] = acct.device_peak
        relaid = 3 * 8 * seq // world                      # input_ids, position_ids, shift_labels: int64
        extra = peaks["trainer"] - peaks["own loop"]
        assert 0 <= extra <= relaid, f"rank {rank}: the Trainer's route holds {extra} B more than the own loop " \
                                     f"(budget: the relaid integer inputs, {relaid} B)"
    finally:
        parallel_state_sp._release_sequence_parallel_groups()


@pytest.mark.slow
def test_trainer_route_holds_only_the_relaid_inputs_more():
    """Under the Trainer (``group="trainer"``, 2 ranks) a step holds what the user's own loop
    holds, plus at most this rank's copy of the integer inputs in the FPDT layout; the
    all-gather that builds it is freed before the first layer."""
    from tests.distributed import run_distributed

    run_distributed(_trainer_route_against_own_loop, 2, args=(4, 1024), timeout=240)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dropout", [pytest.param(0.0, marks=pytest.mark.long), 0.1])
@pytest.mark.usefixtures("outputs_only_attention")
def test_lora_holds_per_token_what_full_fine_tuning_holds(dropout):
    """PEFT LoRA on every decoder linear (fp32 adapters on the bf16 model): the chunked functions
    compute the q/k/v and MLP adapters, fpdt's chunked output projection the o_proj's, and the per-token
    slope is full fine-tuning's budget (PEFT's own o_proj forward keeps an fp32 copy of the
    attention output, and with dropout the dropped copy too: 1.9 / 5.9 Nd more here). The frozen
    base weights get no weight-sized gradient accumulators: the short-length peak is lower."""
    pytest.importorskip("peft")
    u = 4
    lora = _model(u, lora_dropout=dropout)
    slope = _slope(lora, u)
    budget = budget_nd(u) + ROPE_TABLES_ND
    assert budget - 0.1 <= slope <= budget, f"LoRA, dropout {dropout}: {slope:.3f} Nd per token, budget {budget:.3f}"
    assert _peak(lora, 1024) < _peak(_model(u), 1024)


def _held_after_forward(u: int, seq: int, keep_input: bool, lora_dropout: float | None = None) -> dict:
    """Device bytes live after the forward (the loss computed, before backward) and the step's peak,
    with ``offload=True`` and no layer checkpoint; ``keep_input``: ``o_proj`` run as its module on
    the full-length attention output (which it keeps for backward), as fpdt runs one it cannot read."""
    import fpdt.attention.module

    cfg = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if lora_dropout is not None:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=lora_dropout,
                                                           target_modules=["q_proj", "o_proj"]))
    fpdt.hf.apply_fpdt(model, num_chunks=u, offload=True, checkpointing="off")
    model.train()
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
    inputs = fpdt.hf.prepare_inputs(model, ids)
    model(**inputs).loss.backward()                        # kernel self-check outside the count
    with contextlib.ExitStack() as undo:
        if keep_input:
            undo.enter_context(_patched(fpdt.attention.module, "read_output_projection",
                                       lambda module, owner, training=True: None))
        with MemoryAccountant("cpu") as acct:
            loss = model(**inputs).loss
            after_forward = acct.device_live
            loss.backward()
            del loss
    return {"after_forward": after_forward, "peak": acct.device_peak}


@contextlib.contextmanager
def _patched(owner, name, value):
    """``owner.name = value`` for the block (added if absent, as on the code before the change)."""
    old = owner.__dict__.get(name, _patched)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if old is _patched:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


@pytest.mark.slow
@pytest.mark.parametrize("u,lora_dropout", [(4, None), (8, None), (4, 0.1)])
@pytest.mark.usefixtures("outputs_only_attention")
def test_no_layer_keeps_o_proj_input_without_a_checkpoint(u, lora_dropout):
    """``offload=True`` and ``checkpointing="off"`` (no Transformers checkpoint either): each layer's
    ``o_proj`` (plain, or PEFT LoRA with dropout) keeps no copy of its input, the attention output
    ``[1, S, H D]`` in bf16, from forward to backward; its backward reads it back from the
    attention's host stash. Counted exactly: the device bytes held after the forward are one such
    tensor per layer fewer than when a plain ``o_proj`` runs as its module and keeps it; a PEFT
    LoRA ``o_proj`` run as its module keeps more (its dropout's output and the adapters' fp32
    inputs), so at least that much fewer."""
    if lora_dropout is not None:
        pytest.importorskip("peft")
    seq = 1024
    new = _held_after_forward(u, seq, keep_input=False, lora_dropout=lora_dropout)
    old = _held_after_forward(u, seq, keep_input=True, lora_dropout=lora_dropout)
    layers, HD = CONFIG["num_hidden_layers"], CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    saved = layers * seq * HD * 2
    if lora_dropout is None:
        assert old["after_forward"] - new["after_forward"] == saved, (u, old, new, saved)
    else:
        assert old["after_forward"] - new["after_forward"] > saved, (u, lora_dropout, old, new, saved)
    assert new["peak"] < old["peak"], (u, lora_dropout, old, new)

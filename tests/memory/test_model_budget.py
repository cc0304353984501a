"""Whole-model device memory under ``checkpointing="offload"``, counted exactly on the CPU.

``Nd`` = one full-sequence bf16 hidden tensor (``S_local * hidden * 2`` bytes); ``U = Nd / u``
one attention chunk of it. The model is the issue's shape (2 layers, hidden 256, 4 query
heads / 1 KV head of 64, bf16), ``offload=True``, ``checkpointing="offload"``. Parameters and
gradients allocated before the step are the baseline (not counted). Parameter-sized step
temporaries (the fp32 weight-gradient accumulators of the chunked MLP, loss and projections)
do not grow with ``S``; the budget is therefore on the **per-token slope**: peak(2S) -
peak(S) over Nd(2S) - Nd(S), at fixed ``u``, so every term that grows with the sequence
counts. It is measured where it is steady (the same over ``(S, 2S)`` and ``(2S, 4S)``,
:data:`STEADY`): at shorter lengths those constant accumulators still decide *where* the
peak is (the MLP backward) and the slope under-reads (7.5 Nd at u = 4 over 1024 -> 2048
tokens, which this test used to assert while the true figure at long sequences was 10.15,
9.15 since the checkpoint accumulates the residual's gradient in place).

Three sub-phases of the recomputed last layer's backward can peak, per token:

**The attention-core backward** (the peak at u = 4 and 8):

* full-length, 3 Nd: the layer's gradient (the incoming one, into which the checkpoint adds
  each residual branch's input gradient in place,
  :func:`fpdt.model.checkpointing.checkpointed_residual`), the restored layer input and the
  prefetched input of the layer below (checkpoint offload's double buffer). The input norm runs
  inside the attention (:class:`fpdt.attention.projected_attention.InputNorm`): each chunk's
  projection gradient goes through the norm's backward and is added into the layer's gradient
  when the pipeline delivers that chunk, so neither the projection input's full-length gradient
  (1 Nd until 2026-12-03) nor the norm's own input gradient exists. ``o_proj`` runs inside the
  pipeline (:mod:`fpdt.attention.output_projection`): its input gradient is formed a chunk at a
  time when the pipeline needs it (the attention output's full-length gradient, 1 Nd more, went
  in 2026-12);
* the attention pipeline, 16.5 U (:func:`fpdt.attention.ring_costs.ulysses_working_set_U`
  counts the same buffers): q̂, ô, dô of the inner step and of the next one, prefetched (6);
  the prefetched fp32 dq (2); the next input chunk ``T`` (1); the kernel's dq (1); the CPU
  kernel's K/V repeated to the 4 query heads and its dK/dV at 4 heads (4) folded to fp32 (1;
  flash-attn and cuDNN take GQA natively); the fp32 dk/dv accumulators (1) and the k̂, v̂
  chunks (0.5) of the outer step;
* fp32 ``[S, 1]`` lse-sized vectors (``EPS``).

**The chunked MLP's backward**: the restored and prefetched inputs (2), the residual ``h1``
(1, saved by the chunked MLP, which runs the post-attention norm inside) and the layer's
gradient (1, into which the MLP adds its input gradient a chunk at a time) = 4 Nd, beside its
four live ``[n, I]`` intermediates, each half an attention chunk by the default byte budget of
:mod:`fpdt.model.chunks` (``2 U``).

**The recompute of the attention branch** (a forward, inside the layer's backward; the floor
from about u = 16): the layer's gradient, the restored and prefetched inputs and ``o_proj``'s
output = 4 Nd (the normed input, 1 Nd more until 2026-12-03, exists a chunk at a time), beside
the forward pipeline's chunks. The MLP branch's recompute adds nothing: its output is a backward
root only (:func:`fpdt.model.checkpointing.output_values_unused`).

Budget where the attention binds: ``3 + 16.5 / u`` Nd: 7.125 at u = 4, 5.06 at u = 8 (8.125 /
6.06 before the input norm moved inside, 9.125 / 7.06 before ``o_proj`` did). The issue's 7.5 Nd
holds at u = 4, 8, 16 and 32 (at u = 32 the MLP's and the recompute's 4 Nd bind: 4.09 Nd over
8K -> 16K tokens). Before the chunked MLP, the lean norms and the in-place residual gradient the
same run held 20 Nd. The forward's slope is 4 Nd (``FORWARD_ND``), in the last layer's MLP
branch: the embedding's output (layer 0's checkpointed input, held while its host copy is in
flight), the layer's input, ``h1`` and the MLP's output.
"""

import pytest
import torch

import fpdt.model as fm
from fpdt.offload import host_pool
from fpdt.memory.accountant import MemoryAccountant, sequence_unit

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 65536,
    "tie_word_embeddings": False, "rope_theta": 10000.0,
}
EPS = 0.05               # fp32 [S, 1] vectors: 4 / (hidden * 2) Nd each


def _model(u: int, lora: fm.LoraSpec | None = None, attention_checkpoint: str = "recompute"):
    torch.manual_seed(0)
    model = fm.from_config(CONFIG, dtype=torch.bfloat16, num_chunks=u, offload=True, checkpointing="offload",
                           attention_checkpoint=attention_checkpoint)
    if lora is not None:
        fm.add_lora(model, lora)                           # fp32 adapters on the bf16 model
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)                   # pre-allocated: part of the baseline
    return model


def _inputs(model, seq: int):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    return model.prepare_inputs(ids[:, :-1], labels=ids[:, 1:], shift=False)


def _peaks(model, seq: int) -> tuple[int, int]:
    """``(forward, step)`` device peaks of one step at ``seq`` tokens, bytes."""
    inputs = _inputs(model, seq)
    with MemoryAccountant("cpu") as acct:
        with acct.phase("fwd"):
            loss = model(**inputs)
        loss.backward()
        del loss
    return acct.phases["fwd"].peak, acct.device_peak


def _peak(model, seq: int) -> int:
    return _peaks(model, seq)[1]


STEADY = {4: (4096, 8192), 8: (8192, 16384), 16: (16384, 32768), 32: (8192, 16384)}
"""Lengths per ``u`` where the slope is steady (checked: the next doubling gives the same), but
u = 32's, where (16K, 32K) would take minutes under the accountant: there the slope bounds only."""
ATTENTION_PHASE_ND, ATTENTION_WS_U = 3.0, 16.5
MLP_PHASE_ND, MLP_WS_U = 4.0, 2.0
ISSUE_TARGET_ND = 7.5       # the 2-layer model's per-token budget, every u
FORWARD_ND = 4.0


def budget_nd(u: int) -> float:
    """The attention-bound budget (u = 4, 8); from u = 16 the MLP's and recompute's 4 Nd bind."""
    return max(ATTENTION_PHASE_ND + ATTENTION_WS_U / u, MLP_PHASE_ND + MLP_WS_U / u) + EPS


@pytest.mark.slow
@pytest.mark.timeout(1200)   # u = 16 and 32 run 32 chunks under the accountant: past the 300 s default on 2 loaded cores
@pytest.mark.parametrize("u,attention_checkpoint", [(4, "recompute"), (8, "recompute"),
                                                    pytest.param(16, "recompute", marks=pytest.mark.long),
                                                    pytest.param(32, "recompute", marks=pytest.mark.long),
                                                    (4, "save")])
@pytest.mark.usefixtures("outputs_only_attention")
def test_two_layer_model_per_token_within_budget(u, attention_checkpoint):
    """Also with ``attention_checkpoint="save"``: the saved outputs are on the host, the
    recompute fetches one output chunk at a time (and the next), and nothing else changes on
    the device: the same budget (measured at the attention-bound u = 4). The forward's and the
    step's slopes are both within the issue's 7.5 Nd at every u."""
    model = _model(u=u, attention_checkpoint=attention_checkpoint)
    model(**_inputs(model, 256)).backward()               # kernel self-check outside the count
    lo, hi = STEADY[u]
    (fa, a), (fb, b) = _peaks(model, lo), _peaks(model, hi)
    nd = sequence_unit(hi, 256) - sequence_unit(lo, 256)
    slope, forward = (b - a) / nd, (fb - fa) / nd
    assert slope <= ISSUE_TARGET_ND and forward <= FORWARD_ND + EPS, (u, slope, forward)
    if u <= 8:      # the attention binds: the derived budget, exactly enough
        assert slope <= budget_nd(u), f"u={u}: {slope:.3f} Nd per token > derived budget {budget_nd(u):.3f}"
        assert slope >= budget_nd(u) - 0.1, f"u={u}: {slope:.3f} Nd, well under the derived budget: re-derive it"


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, pytest.param(0.1, marks=pytest.mark.long)])
@pytest.mark.usefixtures("outputs_only_attention")
def test_lora_per_token_within_the_same_budget(dropout):
    """LoRA (:func:`fpdt.model.add_lora`, rank 8 on every decoder linear, fp32 adapters on the
    bf16 model, the base frozen) holds per token what full training holds: its terms run a chunk
    at a time inside the chunked functions and the o_proj's in its output-projection Function, and the
    dropout masks are regenerated, not kept. The frozen weights get no weight-sized gradient
    accumulators, so at a short length the peak is lower than full training's."""
    u = 4
    model = _model(u, fm.LoraSpec(8, dropout=dropout))
    model.train()
    model(**_inputs(model, 256)).backward()
    lo, hi = STEADY[u]
    slope = (_peak(model, hi) - _peak(model, lo)) / (sequence_unit(hi, 256) - sequence_unit(lo, 256))
    assert budget_nd(u) - 0.1 <= slope <= budget_nd(u), f"LoRA, dropout {dropout}: {slope:.3f} Nd per token"
    assert _peak(model, 1024) < _peak(_model(u), 1024)


@pytest.mark.parametrize("attention_checkpoint", ["recompute", "save"])
def test_host_pool_is_stable_over_steps(attention_checkpoint):
    """No pinned-buffer leak: after the first step the pool allocates nothing and every
    buffer is back in the pool at the end of each step."""
    model = _model(u=4, attention_checkpoint=attention_checkpoint)
    pool = host_pool("cpu")
    inputs = _inputs(model, 256)
    held = []
    for _ in range(3):
        model(**inputs).backward()
        assert pool.stats.in_use_bytes == 0
        held.append((pool.stats.allocations, pool.stats.allocated_bytes))
    assert held[1] == held[2] == held[0], held


@pytest.mark.parametrize("checkpointing,attention_checkpoint", [("offload", "recompute"), ("off", "recompute"),
                                                                ("offload", "save")])
def test_abandoned_forward_gives_its_host_buffers_back(checkpointing, attention_checkpoint):
    """A forward whose backward never runs (an exception before it, a skipped step): once
    its loss is dropped, every host buffer it took is back in the pool -- the model's
    long-lived layer-input stash keeps nothing, and the next steps allocate nothing new."""
    model = _model(u=4).configure(checkpointing=checkpointing, attention_checkpoint=attention_checkpoint)
    pool = host_pool("cpu")
    inputs = _inputs(model, 256)
    model(**inputs).backward()                             # warm the pool
    before = pool.stats.in_use_bytes, pool.stats.allocations
    for _ in range(2):
        loss = model(**inputs)
        assert pool.stats.in_use_bytes > before[0]
        del loss                                           # abandoned: no backward
        assert pool.stats.in_use_bytes == before[0]
        assert model._stash is None or not model._stash._host
    model(**inputs).backward()
    assert (pool.stats.in_use_bytes, pool.stats.allocations) == before

"""Whole-model device memory under ``checkpointing="offload"``, counted exactly on the CPU.

``Nd`` = one full-sequence bf16 hidden tensor (``S_local * hidden * 2`` bytes). The model
is the issue's shape (2 layers, hidden 256, 4 query heads / 1 KV head of 64, bf16),
``offload=True``, ``checkpointing="offload"``. Parameters and gradients allocated before
the step are the baseline (not counted). Parameter-sized step temporaries (the fp32
weight-gradient accumulators of the chunked MLP, loss and projections) do not grow with
``S``; the budget is therefore on the **per-token slope**: peak(2S) - peak(S) over
Nd(2S) - Nd(S), at fixed ``u``, so every term that grows with the sequence counts.

Live at the peak (inside the recomputed last layer's MLP backward), per token in Nd:
the restored layer input and the prefetched input of the layer below (2; checkpoint
offload double buffer), the attention output saved for ``o_proj`` (1), the residual
``h1`` (1, saved by the post-attention norm), the norm output saved by the MLP (1), the
incoming gradient (1) and the MLP's input gradient (1) = 7, plus the MLP backward's
four live ``[n, I]`` intermediates, each half a local attention chunk by the default byte
budget of :mod:`fpdt.model.chunks` (``2 U = 2 / u`` Nd), plus fp32 ``[S, 1]`` rstd /
lse-sized vectors (``EPS``). Budget: ``7 + 2 / u`` Nd (7.5 at u = 4), under the issue's 8.
The recomputed layer output is freed before its backward (``free_output``, counted by the
accountant through its storage-resize hook); before the fixes of issue 8 this was 20 Nd.
"""

import pytest
import torch

import fpdt.model as fm
from fpdt.offload import host_pool
from fpdt.profiling.memory import MemoryAccountant, sequence_unit

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 65536,
    "tie_word_embeddings": False, "rope_theta": 10000.0,
}
BUDGET_ND = 8.0          # the ceiling
EPS = 0.05               # fp32 [S, 1] vectors: 4 / (hidden * 2) Nd each


def _model(u: int):
    torch.manual_seed(0)
    model = fm.from_config(CONFIG, dtype=torch.bfloat16, num_chunks=u, offload=True, checkpointing="offload")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)                       # pre-allocated: part of the baseline
    return model


def _inputs(model, seq: int):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    return model.prepare_inputs(ids[:, :-1], labels=ids[:, 1:], shift=False)


def _peak(model, seq: int) -> int:
    inputs = _inputs(model, seq)
    with MemoryAccountant("cpu") as acct:
        loss = model(**inputs)
        loss.backward()
        del loss
    return acct.device_peak


@pytest.mark.parametrize("u", [4, 8])
def test_two_layer_model_per_token_within_budget(u):
    model = _model(u=u)
    model(**_inputs(model, 256)).backward()               # kernel self-check outside the count
    a, b = _peak(model, 1024), _peak(model, 2048)
    slope = (b - a) / (sequence_unit(2048, 256) - sequence_unit(1024, 256))
    budget = 7 + 2 / u + EPS
    assert budget <= BUDGET_ND
    assert slope <= budget, f"u={u}: {slope:.3f} Nd per token > derived budget {budget:.3f}"


def test_host_pool_is_stable_over_steps():
    """No pinned-buffer leak: after the first step the pool allocates nothing and every
    buffer is back in the pool at the end of each step."""
    model = _model(u=4)
    pool = host_pool("cpu")
    inputs = _inputs(model, 256)
    held = []
    for _ in range(3):
        model(**inputs).backward()
        assert pool.stats.in_use_bytes == 0
        held.append((pool.stats.allocations, pool.stats.allocated_bytes))
    assert held[1] == held[2] == held[0], held


@pytest.mark.parametrize("checkpointing", ["offload", "off"])
def test_abandoned_forward_gives_its_host_buffers_back(checkpointing):
    """A forward whose backward never runs (an exception before it, a skipped step): once
    its loss is dropped, every host buffer it took is back in the pool -- the model's
    long-lived layer-input stash keeps nothing, and the next steps allocate nothing new."""
    model = _model(u=4).configure(checkpointing=checkpointing)
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

"""Qwen3.5-MoE, Qwen3-Next and Mixtral through ``fpdt.model`` with ``stream_layers``, and on 4 ranks
(plain and streamed: :func:`four_rank_cases`), against the single-process Transformers model: the loss with the balancing
loss (coefficient 0.3) and every gradient, the loss scaled by a random factor so that the
backward's incoming gradient is not 1. The hybrids are judged against a float64 Transformers run
(``tests/model/qwen35.py``: 1e-5, or twice Transformers' own fp32 error), Mixtral against
Transformers' fp32 run within 1e-5. 1 and 2 ranks unstreamed: ``test_hybrid_moe_parity.py``,
``test_mixtral.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import fpdt.model as fm
from tests.model.helpers import compare, hf_loss_and_grads, tokens
from tests.model.hybrid_moe import hybrid_moe_model, mixtral_model
from tests.model.qwen35 import compare_hybrid, reference
from tests.model.test_streaming_hybrid_moe import STREAMED, _scale, _step


def run_case(name: str, rank: int, world: int, *, num_chunks: int, streamed: bool, **options):
    """One step of ``name`` (a :mod:`tests.model.hybrid_moe` model) on this rank of ``world``:
    parity of the loss and of the SP-summed gradients of ``loss * scale`` / ``scale``."""
    hybrid = not name.startswith("mixtral")
    ref = hybrid_moe_model(name) if hybrid else mixtral_model(name)
    ids, labels = tokens(ref.config.vocab_size, 2, 4 * world * num_chunks)
    scale = _scale(ids.shape[1])
    extra = dict(STREAMED, runtime="sim") if streamed else {}
    model = fm.from_config(ref.config, num_chunks=num_chunks, group=dist.group.WORLD if world > 1 else None,
                           **{**extra, **options})
    fm.load_hf_state_dict(model, ref.state_dict())
    loss, grads = _step(model, model.prepare_inputs(ids, labels=labels), scale)
    what = f"{name} rank {rank}/{world} u={num_chunks} streamed={streamed} {options}"
    if hybrid:
        compare_hybrid(loss, grads, reference(ref, ids, labels, None, scale), what)
    else:
        compare(loss, grads, *hf_loss_and_grads(ref, ids, labels), what)
    assert sorted(model.router_stats.expert_load()) == [i for i, layer in enumerate(model.model.layers)
                                                        if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("name,num_chunks,save", [("qwen35moe_odd", 3, "save"), ("qwen3next_odd", 2, "recompute"),
                                                  ("mixtral", 3, "save")])
def test_streamed_single_rank(name, num_chunks, save):
    """Streamed layers: the Gated DeltaNet and attention layers, the experts with the shared expert
    (Qwen3-Next's dense layer too), the router statistics recorded once per step."""
    run_case(name, 0, 1, num_chunks=num_chunks, streamed=True, attention_checkpoint=save)


def four_rank_cases(rank, world):
    """4 ranks: the Gated DeltaNet heads split four ways, the kv heads replicated, the router statistics
    all-reduced (the global balancing loss on every rank); unstreamed with offloaded layer checkpoints
    and saved attention outputs, and streamed. Run in the 4-rank spawn of
    ``tests/model/test_streaming_hybrid_moe.py::test_sequence_parallel`` (one spawn for both files)."""
    for name in ("qwen35moe_sp4", "qwen3next_sp4", "mixtral_sp2"):
        run_case(name, rank, world, num_chunks=2, streamed=False, offload=True, checkpointing="offload",
                 runtime="sim", attention_checkpoint="save")
        run_case(name, rank, world, num_chunks=1, streamed=True)

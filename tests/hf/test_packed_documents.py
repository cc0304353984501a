"""fpdt.hf on packed documents as Transformers' ``DataCollatorWithFlattening`` makes them (one row of
documents, positions restarting at 0, labels -100 at each document's first token; optionally its
FlashAttention ``cu_seq_lens_q/k``), against the same Transformers model on the same batch (its mask
path separates the documents by the positions) and against each document alone: 1 and 2 ranks,
and the Trainer's sequence-parallel route. fp32 within 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import DataCollatorWithFlattening

import fpdt.hf
from tests.distributed import run_distributed
from tests.model.helpers import compare, hf_loss_and_grads, hf_model
from tests.model.test_packed_documents import per_document_reference

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

LENGTHS = [5, 1, 13, 2, 20, 7]          # 48 tokens: across chunk and rank boundaries, a one-token document


def flattened(vocab: int, lengths=LENGTHS, seed: int = 4, flash_kwargs: bool = False) -> dict:
    """The collator's batch of documents of ``lengths`` random tokens."""
    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,u,options", [("llama_gqa", 2, {}), ("qwen2_tied", 3, {"checkpointing": "on"}),
                                            ("llama_bias", 4, {"chunked_qkv": False, "loss_chunks": 0})])
def test_one_process_matches_transformers_on_the_collators_batch(name, u, options):
    ref = hf_model(name)
    batch = flattened(ref.config.vocab_size)
    ref_loss, ref_grads = hf_loss_and_grads_packed(ref, batch)
    doc_loss, doc_grads = per_document_reference(copy.deepcopy(ref), batch["input_ids"], batch["labels"], [LENGTHS])
    compare(ref_loss, ref_grads, doc_loss, doc_grads, f"Transformers' own packed {name} vs each document alone")
    for inputs in ({k: batch[k] for k in ("input_ids", "labels", "position_ids")},      # the Trainer's call
                   flattened(ref.config.vocab_size, flash_kwargs=True),               # with cu_seq_lens_q/k
                   "prepare_inputs"):
        model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=u, **options).train()
        if inputs == "prepare_inputs":
            inputs = fpdt.hf.prepare_inputs(model, batch["input_ids"], labels=batch["labels"],
                                            position_ids=batch["position_ids"])
        loss = model(**inputs).loss
        loss.backward()
        compare(loss, _grads(model), ref_loss, ref_grads, f"{name} u={u} {options} {sorted(inputs)}")


def hf_loss_and_grads_packed(ref, batch):
    ref.zero_grad(set_to_none=True)
    loss = ref(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
               use_cache=False).loss
    loss.backward()
    return loss.detach(), _grads(ref)


def test_the_reference_masks_documents():
    """Transformers' packed loss is not the loss of one sequence: the comparison above can fail."""
    ref = hf_model("llama_gqa")
    batch = flattened(ref.config.vocab_size)
    packed, _ = hf_loss_and_grads_packed(ref, batch)
    whole, _ = hf_loss_and_grads(ref, batch["input_ids"], batch["labels"])
    assert abs(packed - whole) > 1e-3


def _two_ranks(rank, world, cases):
    for name, u, options in cases:
        ref = hf_model(name)
        batch = flattened(ref.config.vocab_size)
        ref_loss, ref_grads = hf_loss_and_grads_packed(ref, batch)
        model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=u, **options).train()
        inputs = fpdt.hf.prepare_inputs(model, batch["input_ids"], labels=batch["labels"],
                                        position_ids=batch["position_ids"])
        loss = model(**inputs).loss
        loss.backward()
        grads = _grads(model)
        for g in grads.values():
            dist.all_reduce(g)
        compare(loss, grads, ref_loss, ref_grads, f"{name} u={u} {options} rank {rank}/{world}")


def test_two_ranks_match_transformers():
    run_distributed(_two_ranks, 2, args=([("llama_gqa", 2, {}), ("mistral", 3, {"checkpointing": "offload",
                                                                                "offload": True}),
                                          ("llama_bias", 1, {"chunked_qkv": False})],), timeout=300)


def _trainer_route(rank, world, cases):
    """As tests/hf/test_trainer.py's route: DeepSpeed's SP groups, its data adapter's contiguous slices
    (of the collator's batch, positions restarting), Transformers' own SP loss aggregation."""
    import types

    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    from tests.hf.test_trainer import _as_under_zero3, _GroupAllGather

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(world)
    groups.mpu = parallel_state_sp
    _as_under_zero3()
    import torch.distributed.nn.functional as differentiable
    differentiable.all_gather = lambda tensor, group=None: _GroupAllGather.apply(tensor, group)
    try:
        for name, u, options in cases:
            ref = hf_model(name)
            batch = flattened(ref.config.vocab_size)
            ref_loss, ref_grads = hf_loss_and_grads_packed(ref, batch)
            model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), group="trainer", num_chunks=u, **options).train()
            S = batch["input_ids"].shape[1]
            cut = slice(rank * S // world, (rank + 1) * S // world)
            shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
            sliced = {"input_ids": batch["input_ids"][:, cut], "position_ids": batch["position_ids"][:, cut],
                      "shift_labels": shift[:, cut]}
            pc = types.SimpleNamespace(sp_backend="deepspeed", sp_size=world)
            loss = deepspeed_sp_compute_loss(None, model, sliced, False, pc)
            loss.backward()
            grads = _grads(model)
            for g in grads.values():      # DeepSpeed averages over the ranks, which trained on one window
                dist.all_reduce(g)
                g.div_(world)
            compare(loss, grads, ref_loss, ref_grads, f"{name} u={u} {options} trainer route rank {rank}/{world}")
    finally:
        groups.mpu = None
        parallel_state_sp._release_sequence_parallel_groups()


def test_trainer_route_matches_transformers():
    pytest.importorskip("deepspeed")
    run_distributed(_trainer_route, 2, args=([("llama_gqa", 2, {}),
                                              ("llama_bias", 3, {"checkpointing": "on"})],), timeout=300)


def test_refused_with_the_fix():
    model = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), num_chunks=2)
    batch = flattened(256, flash_kwargs=True)
    other, short = batch["cu_seq_lens_q"].clone(), batch["cu_seq_lens_q"].clone()
    other[1] += 1
    short[-1] -= 1
    with pytest.raises(fpdt.hf.FPDTHFError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        model(**{**batch, "cu_seq_lens_k": other})
    with pytest.raises(fpdt.hf.FPDTHFError, match="end at the window's B\\*S = 1\\*48"):
        model(**{**batch, "cu_seq_lens_q": short, "cu_seq_lens_k": short})
    with pytest.raises(fpdt.hf.FPDTHFError, match="non-decreasing"):
        fpdt.hf.prepare_inputs(model, batch["input_ids"], doc_ids=torch.arange(48).flip(0)[None])

"""Packed documents through fpdt.model: a window of documents, positions restarting at each, gives
the loss and every gradient of the documents each run alone through Transformers (float64
reference, fp32 within 1e-5), on 1, 2 and 4 ranks (FPDT layout and 2D mesh), offload on and off,
checkpointing on; one document gives exactly today's result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fpdt.attention import FPDTAttention
from fpdt.comm import SequenceMesh
from fpdt.layout import shard
from fpdt.layout.documents import DocumentError
from tests.distributed import run_distributed
from tests.model.helpers import compare, fpdt_from_hf, hf_model

# documents per row of a 48-token window: across chunk and rank boundaries, one-token documents,
# a document longer than a chunk (u = 3: 16 tokens), the window's last document cut short
ROWS = ([5, 1, 13, 1, 1, 20, 7], [16, 16, 16], [2, 30, 9, 7], [1] * 48)


def _window(vocab: int, rows, seed: int = 3):
    """ids ``[B, S]``, Transformers-style (unshifted) labels with a few -100, restarting positions."""
    g = torch.Generator().manual_seed(seed)
    S = sum(rows[0])
    ids = torch.randint(0, vocab, (len(rows), S), generator=g)
    labels = ids.clone()
    labels[0, 3:6] = -100
    labels[-1, S - 9:S - 6] = -100
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    return ids, labels, pos


def per_document_reference(ref, ids, labels, rows):
    """Every document run alone through Transformers in float64: the summed cross-entropy of its
    own next-token targets over all documents, divided by their count; and the gradients."""
    ref = ref.double()
    ref.zero_grad(set_to_none=True)
    losses, count = [], 0
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            doc, target = ids[b:b + 1, start:start + n], labels[b, start + 1:start + n]
            start += n
            if n == 1:
                continue                       # its one token predicts nothing
            logits = ref(input_ids=doc, use_cache=False).logits[0, :-1]
            losses.append(F.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
            count += int((target != -100).sum())
    loss = torch.stack(losses).sum() / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def run_packed(name, rank, world, *, rows, num_chunks, offload=False, checkpointing="off", mesh=None,
               how="positions"):
    """fpdt on the packed window (its documents named by ``how``) against the per-document reference."""
    ref = hf_model(name)
    ids, labels, pos = _window(ref.config.vocab_size, rows)
    model = fpdt_from_hf(ref, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing, mesh=mesh)
    ref_loss, ref_grads = per_document_reference(ref, ids, labels, rows)
    if how == "positions":
        inputs = model.prepare_inputs(ids, labels=labels, position_ids=pos)
    elif how == "doc_ids":         # the documents named by ids; positions restart by default
        docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)) * 7, torch.tensor(r)) for r in rows])
        inputs = model.prepare_inputs(ids, labels=labels, doc_ids=docs)
        assert torch.equal(inputs["position_ids"], model.prepare_inputs(ids, position_ids=pos)["position_ids"])
    else:                          # cu_seqlens over the flattened rows
        lengths = torch.tensor([n for r in rows for n in r])
        inputs = model.prepare_inputs(ids, labels=labels, cu_seqlens=F.pad(lengths.cumsum(0), (1, 0)))
    loss = model(**inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = f"{name} {rows} rank {rank}/{world} u={num_chunks} offload={offload} ckpt={checkpointing} mesh={mesh} {how}"
    return compare(loss, grads, ref_loss, ref_grads, what)


@pytest.mark.parametrize("num_chunks,checkpointing,offload", [(1, "off", False), (3, "on", True), (2, "off", True)])
def test_single_rank_equals_documents_alone(num_chunks, checkpointing, offload):
    run_packed("llama_gqa", 0, 1, rows=ROWS[:2], num_chunks=num_chunks, offload=offload, checkpointing=checkpointing)


@pytest.mark.parametrize("how", ["doc_ids", "cu_seqlens"])
def test_explicit_documents(how):
    run_packed("qwen2_tied", 0, 1, rows=ROWS[2:4], num_chunks=2, how=how)


def test_many_tiny_documents():
    rows = ([1, 2] * 33 + [3, 2],)            # 68 documents in 104 tokens
    run_packed("llama_bias", 0, 1, rows=rows, num_chunks=4, checkpointing="on")


def _multi_rank(rank, world, cases):
    for name, rows, u, offload, checkpointing, mesh_shape in cases:
        mesh = SequenceMesh(hp=mesh_shape[0], cp=mesh_shape[1]) if mesh_shape else None
        run_packed(name, rank, world, rows=rows, num_chunks=u, offload=offload, checkpointing=checkpointing,
                   mesh=mesh)


def test_two_ranks_equals_documents_alone():
    run_distributed(_multi_rank, 2, args=([("llama_gqa", ROWS[:2], 2, False, "on", None),
                                           ("mistral", ROWS[2:], 3, True, "on", None),
                                           ("llama_gqa", ROWS[:1], 1, True, "off", None)],), timeout=300)


@pytest.mark.slow
def test_four_ranks_and_a_2x2_mesh_equal_documents_alone():
    run_distributed(_multi_rank, 4, args=([("llama_sp4", ROWS[:2], 1, False, "on", None),
                                           ("llama_sp4", ROWS[1:3], 2, True, "on", (2, 2)),
                                           ("llama_sp4", ROWS[2:], 1, False, "off", (1, 4))],), timeout=300)


def _one_document_is_today(rank, world):
    """One document per row (positions arange, an offset arange, explicit ids all one document): the
    attention gets no doc_ids and loss and gradients are bit for bit those of the default inputs."""
    seen = []
    forward = FPDTAttention.forward

    def spy(self, *args, doc_ids=None, **kwargs):
        seen.append(doc_ids)
        return forward(self, *args, doc_ids=doc_ids, **kwargs)

    FPDTAttention.forward = spy
    try:
        ref = hf_model("llama_gqa")
        ids, labels, _ = _window(ref.config.vocab_size, ([24, 24],) * 2)
        S = ids.shape[1]
        results = []
        for extra in ({}, {"position_ids": torch.arange(S).expand(2, S)}, {"doc_ids": torch.full((2, S), 4)},
                      {"cu_seqlens": torch.tensor([0, S, 2 * S])}):
            model = fpdt_from_hf(ref, num_chunks=2, checkpointing="on")
            loss = model(**model.prepare_inputs(ids, labels=labels, **extra))
            loss.backward()
            results.append([loss.detach()] + [p.grad for p in model.parameters()])
        assert seen and all(d is None for d in seen)
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other))
        model = fpdt_from_hf(ref, num_chunks=2)         # a window inside one longer document: positions from 100
        inputs = model.prepare_inputs(ids, labels=labels, position_ids=torch.arange(100, 100 + S).expand(2, S))
        seen.clear()
        model(**inputs)
        assert len(seen) == ref.config.num_hidden_layers and all(d is None for d in seen)
    finally:
        FPDTAttention.forward = forward


def test_one_document_is_today_bit_for_bit():
    _one_document_is_today(0, 1)
    run_distributed(_one_document_is_today, 2, timeout=240)


def _bad_inputs(rank, world):
    model = fpdt_from_hf(hf_model("llama_gqa"), num_chunks=2)
    ids = torch.randint(0, 256, (1, 16))
    jumping = torch.cat([torch.arange(8), torch.arange(8) + 5])[None]
    with pytest.raises(DocumentError, match="step from 7 to 5 .*restart at 0"):
        model.prepare_inputs(ids, position_ids=jumping)
    inputs = model.prepare_inputs(ids)
    with pytest.raises(DocumentError, match="step from 7 to 5"):            # found by the model's forward too
        model(inputs["input_ids"], labels=inputs["labels"], position_ids=shard(jumping, world, 2, rank))
    with pytest.raises(DocumentError, match="non-decreasing"):
        model.prepare_inputs(ids, doc_ids=torch.tensor([[0] * 8 + [1] * 4 + [0] * 4]))
    with pytest.raises(DocumentError, match="non-decreasing"):
        model(**inputs, doc_ids=torch.tensor([[0] * 8 + [1] * 4 + [0] * 4]))
    with pytest.raises(DocumentError, match="whole global window"):
        model(**inputs, doc_ids=torch.zeros(1, 16 // world + 1, dtype=torch.long))
    with pytest.raises(DocumentError, match="end at the window's B\\*S = 1\\*16 = 16"):
        model.prepare_inputs(ids, cu_seqlens=torch.tensor([0, 5, 15]))


def test_bad_inputs_one_clear_error():
    _bad_inputs(0, 1)
    run_distributed(_bad_inputs, 2, timeout=240)

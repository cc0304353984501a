"""Packed documents (fpdt.layout.documents): one convention, Transformers' own, and one error per bad input."""

import pytest
import torch
import torch.distributed as dist
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from fpdt.comm import SequenceMesh
from fpdt.layout import local_position_ids, mesh_shard, shard
from fpdt.layout.documents import (DocumentError, canonical_doc_ids, doc_ids_from_cu_seqlens,
                                   doc_ids_from_position_ids, mask_cross_document_targets, restarting_position_ids,
                                   sequence_parallel_doc_ids)
from tests.distributed import run_distributed


def _packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


@pytest.mark.parametrize("lengths", [[5, 3, 1, 7], [1, 1, 1, 1], [16], [2, 14], [15, 1]])
def test_positions_match_transformers(lengths):
    pos = _packed_positions(lengths)
    ids = doc_ids_from_position_ids(pos)
    theirs = find_packed_sequence_indices(pos)             # the mask path's rule
    if len(lengths) == 1:
        assert ids is None and theirs is None
        return
    assert torch.equal(ids, theirs)
    (cu, _), _ = prepare_fa_kwargs_from_position_ids(pos)  # the FlashAttention varlen path's rule
    assert torch.equal(doc_ids_from_cu_seqlens(cu, pos.shape), ids)
    assert torch.equal(restarting_position_ids(ids, pos.shape), pos)


def test_rows_and_a_first_document_that_began_earlier():
    pos = torch.tensor([[7, 8, 9, 0, 1, 2], [3, 4, 5, 6, 7, 8]])   # row 1: one document, started before the window
    assert doc_ids_from_position_ids(pos).tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]]
    assert doc_ids_from_position_ids(pos[1:]) is None
    assert doc_ids_from_position_ids(torch.arange(9).expand(3, 9)) is None


def test_explicit_ids_and_cu_seqlens():
    assert canonical_doc_ids(torch.tensor([[4, 4, 9, 9, 9, 12]])).tolist() == [[0, 0, 1, 1, 1, 2]]
    assert canonical_doc_ids(torch.full((2, 5), 3)) is None
    assert doc_ids_from_cu_seqlens([0, 2, 5, 6, 10], (2, 5)).tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert doc_ids_from_cu_seqlens(torch.tensor([0, 5, 10], dtype=torch.int32), (2, 5)) is None


def test_cross_document_targets_are_ignored():
    docs = doc_ids_from_position_ids(_packed_positions([3, 2, 1]))
    labels = torch.arange(10, 16).unsqueeze(0)
    assert mask_cross_document_targets(labels, docs).tolist() == [[10, 11, -100, 13, -100, 15]]


@pytest.mark.parametrize("fn, match", [
    (lambda: doc_ids_from_position_ids(torch.tensor([[0, 1, 2, 5, 6]])), "step from 2 to 5 .*restart at 0"),
    (lambda: doc_ids_from_position_ids(torch.tensor([[0, 1, 1, 2]])), "step from 1 to 1"),
    (lambda: doc_ids_from_position_ids(torch.tensor([[-1, 0, 1]])), "negative"),
    (lambda: doc_ids_from_position_ids(torch.zeros(4)), r"\[B, S\]"),
    (lambda: doc_ids_from_position_ids(torch.zeros(1, 4)), "integers"),
    (lambda: canonical_doc_ids(torch.tensor([[0, 1, 1, 0]])), "decrease from 1 to 0 .*non-decreasing"),
    (lambda: canonical_doc_ids(torch.zeros(1, 4, dtype=torch.long), (1, 8)), "whole global window"),
    (lambda: doc_ids_from_cu_seqlens([0, 3, 7], (1, 8)), "end at the window's B\\*S"),
    (lambda: doc_ids_from_cu_seqlens([1, 3, 8], (1, 8)), "start at 0"),
    (lambda: doc_ids_from_cu_seqlens([0, 3, 3, 8], (1, 8)), "strictly increasing"),
    (lambda: doc_ids_from_cu_seqlens([0, 3, 8], (2, 4)), "crosses from row 0 into row 1"),
    (lambda: doc_ids_from_cu_seqlens(torch.zeros(2, 2, dtype=torch.long), (1, 4)), "1-D integer"),
])
def test_bad_inputs_one_clear_error(fn, match):
    with pytest.raises(DocumentError, match=match):
        fn()


def _gather_body(rank, world):
    S, u = 48, 3
    lengths = [5, 1, 13, 1, 1, 20, 7]                 # documents across chunk and rank boundaries
    pos = _packed_positions(lengths).expand(2, S).clone()
    pos[1] = torch.arange(S)                           # row 1: one document
    expect = doc_ids_from_position_ids(pos)
    got = sequence_parallel_doc_ids(shard(pos, world, u, rank), u)
    assert torch.equal(got, expect)
    assert sequence_parallel_doc_ids(local_position_ids(S, world, u, rank, 2), u) is None
    mesh = SequenceMesh(hp=2, cp=2)
    local = mesh_shard(pos, 2, 2, u, mesh.cp_rank, mesh.hp_rank)
    assert torch.equal(sequence_parallel_doc_ids(local, u, mesh=mesh), expect)
    sub = dist.new_group([0, 1])                       # a group that is not the world: ranks 0, 1
    if rank < 2:
        assert torch.equal(sequence_parallel_doc_ids(shard(pos, 2, u, rank), u, group=sub), expect)


@pytest.mark.slow
def test_gather_over_sequence_parallel_group_and_mesh():
    run_distributed(_gather_body, 4)

"""Sequence-parallel token layouts: which global tokens each rank holds, and in what order."""

from fpdt.layout.fpdt_layout import (
    check_layout,
    global_token_index,
    local_position_ids,
    shard,
    unshard,
)
from fpdt.layout.documents import (
    DocumentError,
    canonical_doc_ids,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    sequence_parallel_doc_ids,
)
from fpdt.layout.mesh_layout import check_mesh_layout, mesh_shard, mesh_token_index, mesh_unshard
from fpdt.layout.split import chunk_split, chunking_problems, hidden_bytes, sequence_multiple

__all__ = ["DocumentError", "canonical_doc_ids", "check_layout", "doc_ids_from_cu_seqlens", "doc_ids_from_position_ids",
           "sequence_parallel_doc_ids", "check_mesh_layout", "global_token_index", "local_position_ids", "mesh_shard",
           "mesh_token_index", "mesh_unshard", "shard", "unshard", "chunk_split", "chunking_problems", "hidden_bytes",
           "sequence_multiple"]

"""Sequence-parallel token layouts: which global tokens each rank holds, and in what order."""

from fpdt.layout.fpdt_layout import (
    check_layout,
    global_token_index,
    local_position_ids,
    shard,
    unshard,
)
from fpdt.layout.mesh_layout import check_mesh_layout, mesh_shard, mesh_token_index, mesh_unshard

__all__ = ["check_layout", "check_mesh_layout", "global_token_index", "local_position_ids", "mesh_shard",
           "mesh_token_index", "mesh_unshard", "shard", "unshard"]

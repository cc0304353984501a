"""Sequence-parallel token layouts: which global tokens each rank holds, and in what order."""

from fpdt.layout.fpdt_layout import (
    check_layout,
    global_token_index,
    local_position_ids,
    shard,
    unshard,
)

__all__ = ["check_layout", "global_token_index", "local_position_ids", "shard", "unshard"]

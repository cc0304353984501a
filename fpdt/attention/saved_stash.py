"""Tie a chunk stash's lifetime to autograd's saved tensors, so checkpointing can drop it.

The FPDT Functions keep what backward needs in a :class:`fpdt.offload.HostStash`. Held by
``ctx`` itself it would outlive a non-reentrant checkpoint's discarded first forward (a whole
layer's stash per layer until backward), so it hangs off a storage-less token tensor passed
through ``ctx.save_for_backward``: plain autograd keeps it until backward; a checkpoint drops the
first forward's token (freeing its stash) and hands backward the recompute's.
"""

from __future__ import annotations

import torch

from fpdt.offload import HostStash

_ATTR = "_fpdt_stash"
_USED = "_fpdt_stash_used"


def stash_token(stash: HostStash) -> torch.Tensor:
    """A 0-element CPU tensor carrying ``stash``; pass it to ``ctx.save_for_backward``."""
    token = torch.empty(0)
    setattr(token, _ATTR, stash)
    return token


def stash_of(token: torch.Tensor) -> HostStash:
    """The stash a saved token carries, for its one backward (after ``ctx.saved_tensors``); a second
    backward through the same graph (``retain_graph=True``) is refused here.
    """
    if getattr(token, _USED, False):
        raise RuntimeError("fpdt attention's saved chunks were consumed by an earlier backward through this "
                           "graph: backward twice (retain_graph=True) is not supported; run the forward again")
    stash = getattr(token, _ATTR, None)
    if stash is None:
        raise RuntimeError(
            "fpdt attention's saved state was replaced by a saved-tensor hook that copies tensors "
            "(e.g. torch.autograd.graph.save_on_cpu around the attention without a checkpoint): "
            "its chunks are already offloaded by fpdt's own offload=True, so leave the attention "
            "out of that hook (activation checkpointing around it is fine)")
    setattr(token, _USED, True)
    return stash

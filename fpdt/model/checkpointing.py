"""Per-decoder-layer activation checkpointing, optionally offloading the layer input.

Modes (``checkpointing=`` option of the model):

* ``"off"``: plain autograd; every layer keeps its activations until backward.
* ``"on"``: each layer keeps only its input ``x`` ``[B, S_local, hidden]``; backward re-runs
  the layer's forward (including its all-to-alls, brief §4 pitfall 11) to rebuild what its
  backward needs.
* ``"offload"``: as ``"on"``, but the kept input goes to host memory through a
  :class:`fpdt.offload.HostStash` (asynchronous device->host copy into a pooled, pinned
  buffer on CUDA, started before the layer's forward so that it overlaps it). The recompute
  of layer ``i`` pops its own input and immediately starts the host->device copy of layer
  ``i - 1``'s input, so that copy overlaps layer ``i``'s recompute and backward; device
  memory then holds O(1) layer inputs instead of ``num_layers`` of them. ``on_device`` keeps
  one layer's input on the device within such a stack (the model's
  ``checkpoint_device_layers``: the last layers, whose inputs backward needs first), trading
  device memory for host memory; its recompute still starts the fetch of the previous
  layer's offloaded input early.

The checkpoint is torch's non-reentrant one (``torch.utils.checkpoint``, saved-tensor hooks):
the forward keeps none of the layer's saved tensors, and backward recomputes them when the
layer's first backward node asks, then runs the layer's backward in the same engine pass as
the rest of the graph. That matters for memory: the engine owns the gradient arriving at the
layer and frees it once the residual has summed it in, where a reentrant checkpoint (a
``backward`` inside a custom Function's backward) holds it beside the residual's sum for the
whole layer, one ``[B, S_local, hidden]`` tensor more at the peak. The layer input reaches
the recompute through :class:`_LayerInput`, not as a checkpoint argument (which torch would
keep on the device). Autocast and the random state (CPU and device generators) are replayed
in the recompute by torch: fpdt's own models have no dropout, but LoRA adapters in a
Transformers model do (:mod:`fpdt.ops.lora` draws its masks' seed from the CPU generator).
Parameters are never inputs of the checkpoint, so ZeRO-3's partitioned parameters are fine;
a layer whose input needs no gradient (frozen embeddings) needs nothing special.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch.utils.checkpoint import checkpoint

from fpdt.offload import HostStash

CHECKPOINT_MODES = ("off", "on", "offload")


class _LayerInput:
    """A checkpointed layer's input: on the device, or in the host stash between the layer's
    forward and its recompute in backward (then popped, and the previous layer's input fetched
    early). Held by the checkpoint's recompute function, so freed with the graph: a forward
    whose backward never runs discards its stash entry then (:class:`_StashEntry`)."""

    def __init__(self, x: torch.Tensor, stash: HostStash | None, key: Hashable, prev_key: Hashable,
                 on_device: bool):
        self.stash, self.key, self.prev_key = stash, key, prev_key
        self.requires_grad = x.requires_grad
        self.keep = stash is None or on_device
        self.x = x                      # until the forward has run; then only if kept on the device
        self.forward_done = False
        self.entry = None
        if not self.keep:
            with torch.no_grad():       # a copy, not part of the graph
                stash.put(key, x)       # the device->host copy starts now and overlaps the layer's compute
            self.entry = _StashEntry(stash, key)

    def run(self, run_fn: Callable[[torch.Tensor], torch.Tensor], _device: torch.Tensor) -> torch.Tensor:
        if not self.forward_done:      # the forward: the caller's x
            self.forward_done = True
            x = self.x
            if not self.keep:
                self.x = None           # the stash has it; the graph keeps only the region's handles
            return run_fn(x)
        # the recompute, when the layer's backward starts
        x = self.x if self.keep else self.stash.pop(self.key)
        if self.stash is not None and self.prev_key is not None and self.prev_key in self.stash:
            self.stash.prefetch(self.prev_key)      # overlaps this layer's recompute + backward
        return run_fn(x.detach().requires_grad_(self.requires_grad))


class _StashEntry:
    """Discards a layer input's stash entry when the graph that owns it is freed.

    The model's stash lives across steps; if a forward's backward never runs (an exception,
    a skipped step, evaluation with grad enabled), its layer inputs would stay on the host
    for good. The recompute pops the entry first, and the token keeps a later ``put`` under
    the same key safe, so this only acts on abandoned entries.
    """

    def __init__(self, stash: HostStash, key: Hashable):
        self.stash, self.key, self.token = stash, key, stash.token(key)

    def __del__(self) -> None:
        try:
            self.stash.discard(self.key, token=self.token)
        except Exception:   # interpreter shutdown
            pass


def checkpointed(run_fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 params: list[torch.Tensor], stash: HostStash | None = None,
                 key: Hashable = None, prev_key: Hashable = None, on_device: bool = False) -> torch.Tensor:
    """Run ``run_fn(x)`` (``[B, S_local, hidden]`` -> same) under activation checkpointing.

    Args:
        run_fn: the layer's forward as a function of its input only.
        x: the layer input.
        params: the parameters ``run_fn`` uses (whether any needs a gradient).
        stash: when given, ``x`` is offloaded to host under ``key`` instead of kept on
            the device; ``prev_key`` names the previous layer's stashed input, whose
            fetch is started early in backward.
        on_device: keep ``x`` on the device although a ``stash`` is given (a layer whose
            input stays on the GPU in a partly offloaded stack); the stash still serves the
            early fetch of ``prev_key``.
    """
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return run_fn(x)  # no backward will come: nothing to keep
    holder = _LayerInput(x, stash, key, prev_key, on_device)
    device = torch.empty(0, device=x.device)   # tells torch which device's random state to replay
    del x
    return checkpoint(holder.run, run_fn, device, use_reentrant=False, preserve_rng_state=True)

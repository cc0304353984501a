"""Per-decoder-layer activation checkpointing, optionally offloading the layer input.

Modes (``checkpointing=`` option of the model):

* ``"off"``: plain autograd; every layer keeps its activations until backward.
* ``"on"``: each layer runs its forward without autograd and keeps only its input
  ``x`` ``[B, S_local, hidden]``; backward re-runs the layer's forward with autograd
  (including its all-to-alls, brief §4 pitfall 11) and back-propagates through it.
* ``"offload"``: as ``"on"``, but the kept input goes to host memory through a
  :class:`fpdt.offload.HostStash` (asynchronous device->host copy into a pooled, pinned
  buffer on CUDA, started before the layer's forward so that it overlaps it). The backward of layer ``i`` pops its own input and immediately starts
  the host->device copy of layer ``i - 1``'s input, so that copy overlaps layer ``i``'s
  recompute and backward; device memory then holds O(1) layer inputs instead of
  ``num_layers`` of them. ``on_device`` keeps one layer's input on the device within such
  a stack (the model's ``checkpoint_device_layers``: the last layers, whose inputs backward
  needs first), trading device memory for host memory; backward still starts the fetch of
  the previous layer's offloaded input early.

The function is "reentrant" (backward calls ``torch.autograd.backward`` on the
recomputed layer): parameter gradients accumulate into ``.grad`` exactly as without
checkpointing. When ``x`` does not require grad (e.g. frozen embeddings) an empty leaf that
does is passed along, so the output requires grad; the parameters themselves never are
(ZeRO-3 has them partitioned at that point). Autocast state is captured in forward
and restored for the recompute, and so is the random state (the default CPU generator, and
the device's on CUDA): fpdt's own models have no dropout, but LoRA adapters in a
Transformers model do (:mod:`fpdt.ops.lora` draws its masks' seed from the CPU generator),
and the recompute must draw the masks the forward drew.
"""

from __future__ import annotations

from typing import Callable, Hashable

import contextlib

import torch

from fpdt.offload import HostStash

CHECKPOINT_MODES = ("off", "on", "offload")


class _LayerCheckpoint(torch.autograd.Function):
    """``run_fn(x)`` with recompute in backward.

    Inputs: ``run_fn`` (x -> y, same shape), ``stash`` (HostStash or None), ``key`` and
    ``prev_key`` (stash keys of this layer's and the previous layer's input),
    ``free_output`` (see :func:`checkpointed`), ``on_device`` (keep ``x`` on the device even
    with a stash), ``x`` ``[B, S_local, hidden]``, then, when ``x`` does not require grad,
    an empty leaf that does (graph connectivity only; it gets no gradient).
    Saved: ``x`` -- in ``ctx`` when ``stash`` is None or ``on_device``, else offloaded to
    host under ``key``. With a stash, backward starts the fetch of ``prev_key`` either way.
    """

    @staticmethod
    def forward(ctx, run_fn, stash, key, prev_key, free_output, on_device, x, *anchor):
        ctx.run_fn, ctx.stash, ctx.key, ctx.prev_key = run_fn, stash, key, prev_key
        ctx.free_output, ctx.on_device = free_output, on_device
        ctx.x_requires_grad = x.requires_grad
        ctx.autocast = _autocast_state(x.device.type)
        ctx.rng = _rng_state(x.device)
        if stash is None or on_device:
            ctx.save_for_backward(x)
        else:
            stash.put(key, x)  # the device->host copy starts now and overlaps the layer's compute
            ctx.entry = _StashEntry(stash, key)   # freed with the graph: discards the entry if never popped
        with torch.no_grad():
            y = run_fn(x)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x = ctx.saved_tensors[0] if ctx.stash is None or ctx.on_device else ctx.stash.pop(ctx.key)
        if ctx.stash is not None and ctx.prev_key is not None and ctx.prev_key in ctx.stash:
            ctx.stash.prefetch(ctx.prev_key)  # overlaps this layer's recompute + backward
        x = x.detach().requires_grad_(ctx.x_requires_grad)
        device_type, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled), \
                _replayed_rng(ctx.rng, x.device):
            y = ctx.run_fn(x)
        if ctx.free_output:  # backward needs y's graph, not its values: give its memory back now
            y.untyped_storage().resize_(0)
        torch.autograd.backward(y, grad_y)
        return (None, None, None, None, None, None, x.grad if ctx.x_requires_grad else None) + \
            (None,) * (len(ctx.needs_input_grad) - 7)


class _StashEntry:
    """Discards a layer input's stash entry when the graph that owns it is freed.

    The model's stash lives across steps; if a forward's backward never runs (an exception,
    a skipped step, evaluation with grad enabled), its layer inputs would stay on the host
    for good. Backward pops the entry first, and the token keeps a later ``put`` under the
    same key safe, so this only acts on abandoned entries.
    """

    def __init__(self, stash: HostStash, key: Hashable):
        self.stash, self.key, self.token = stash, key, stash.token(key)

    def __del__(self) -> None:
        try:
            self.stash.discard(self.key, token=self.token)
        except Exception:   # interpreter shutdown
            pass


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default CPU generator's state, and the device's on CUDA (host-side: no sync)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _replayed_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
    """Run with the random state of :func:`_rng_state`, and put the current one back after."""
    cpu, dev = state
    with torch.random.fork_rng(devices=[device] if dev is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, device)
        yield


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def checkpointed(run_fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 params: list[torch.Tensor], stash: HostStash | None = None,
                 key: Hashable = None, prev_key: Hashable = None, free_output: bool = False,
                 on_device: bool = False) -> torch.Tensor:
    """Run ``run_fn(x)`` (``[B, S_local, hidden]`` -> same) under activation checkpointing.

    Args:
        run_fn: the layer's forward as a function of its input only.
        x: the layer input.
        params: the parameters ``run_fn`` uses.
        stash: when given, ``x`` is offloaded to host under ``key`` instead of kept on
            the device; ``prev_key`` names the previous layer's stashed input, whose
            fetch is started early in backward.
        free_output: the recomputed output's values are not saved by its own graph (e.g.
            ``run_fn`` ends with a residual add), so backward frees them before
            back-propagating (one ``[B, S_local, hidden]`` tensor less at the layer's peak).
            Wrong when the last op saves its result (``exp``, ``tanh``, ...): leave False.
        on_device: keep ``x`` on the device although a ``stash`` is given (a layer whose
            input stays on the GPU in a partly offloaded stack); the stash still serves the
            early fetch of ``prev_key``.
    """
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return run_fn(x)  # no backward will come: nothing to keep
    # When x does not require grad (frozen embeddings, as under LoRA), a throwaway leaf that
    # does connects the output to the graph. Not the parameters: under ZeRO-3 they are
    # partitioned (empty) here, and the gradient accumulator autograd would create for them now
    # would reject the full-shape gradients of the recomputed layer.
    anchors = [] if x.requires_grad else [torch.empty(0, device=x.device, requires_grad=True)]
    return _LayerCheckpoint.apply(run_fn, stash, key, prev_key, free_output, on_device, x, *anchors)

"""Per-decoder-layer activation checkpointing, optionally offloading the layer input.

``"on"`` keeps only each layer's input ``x`` ``[B, S_local, hidden]`` and recomputes the layer in
backward (reentrant); ``"offload"`` keeps it in a :class:`fpdt.offload.HostStash`. Modes and
mechanics: ``docs/model.md`` (Layer checkpointing)."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import contextlib

import torch

from fpdt.offload import HostStash



class _OpaqueBody:
    """``y = run_fn(x)``; backward recomputes ``y`` and back-propagates ``grad_y`` through it."""

    def __init__(self, run_fn: Callable[[torch.Tensor], torch.Tensor], free_output: bool):
        self.run_fn, self.free_output = run_fn, free_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_fn(x)

    def backward(self, x: torch.Tensor, x_requires_grad: bool, grad_y: torch.Tensor,
                 owned: bool) -> torch.Tensor | None:
        x = x.detach().requires_grad_(x_requires_grad)
        y = self.run_fn(x)
        if self.free_output:  # backward needs y's graph, not its values: give its memory back now
            _free_values(y)
        torch.autograd.backward(y, grad_y)
        return x.grad if x_requires_grad else None


class _ResidualBody:
    """``x_{k+1} = x_k + f_k(x_k)``; backward accumulates the input gradient into the incoming one in
    place. Branch outputs must not be saved by their own graphs: backward frees their values."""

    def __init__(self, branches: Sequence[Callable[[torch.Tensor], torch.Tensor]]):
        self.branches = tuple(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.branches:
            x = x + f(x)
        return x

    def backward(self, x: torch.Tensor, x_requires_grad: bool, grad_y: torch.Tensor,
                 owned: bool) -> torch.Tensor | None:
        """Back-propagate ``grad_y`` through the recomputed branches; ``owned``: ``grad_y`` may
        be accumulated into in place (:func:`_exclusively_owned`)."""
        # Recompute: one leaf per branch input, each branch's graph kept for its backward. The
        # next branch input is formed in the branch output's own storage (x + f(x), in that
        # order of operands as in forward: bitwise the same sum).
        leaves, outs = [], []
        h = x
        calls = []
        for k, f in enumerate(self.branches):
            leaf = h.detach().requires_grad_(k > 0 or x_requires_grad)
            call = BranchCall(values_unused=k + 1 == len(self.branches))   # the last output is a root only
            leaf._fpdt_branch = call        # carried on the branch input (see BranchCall)
            out = f(leaf)
            calls.append(call)
            skipped = call.placeholders
            if skipped and not any(p.data_ptr() == out.data_ptr() for p in skipped):
                raise RuntimeError("a Function skipped its forward in the recompute of a residual branch "
                                   "(output_values_unused) whose output is not that Function's: the branch "
                                   "must end with it, or later ops would save placeholder values")
            leaves.append(leaf)
            outs.append(out)
            if k + 1 < len(self.branches):
                with torch.no_grad():
                    h = out.add_(leaf) if out._base is None and _same_layout(out, leaf) else out + leaf
        del h, x, leaf, out, call
        _free_values(outs[-1])
        grad = grad_y
        del grad_y
        for k in reversed(range(len(self.branches))):
            calls[k].donation = grad if owned else None
            try:
                if outs[k].requires_grad:      # else a frozen branch on a frozen input: nothing to back-propagate
                    torch.autograd.backward(outs[k], grad)
            finally:
                calls[k].donation = None
            outs[k] = None                              # this branch's graph
            contribution, leaves[k] = leaves[k].grad, None
            if k > 0:
                _free_values(outs[k - 1])               # the input of branch k, built in that output
            if contribution is None:
                continue
            if owned and _same_layout(grad, contribution):
                grad.add_(contribution)
            else:
                grad, owned = grad + contribution, True
            del contribution
        return grad if x_requires_grad else None


class BranchCall:
    """What the checkpoint tells one residual branch in its recompute and backward (attribute
    ``_fpdt_branch`` of the branch's input leaf): ``values_unused``, ``placeholders``, ``donation``."""

    def __init__(self, values_unused: bool):
        self.values_unused = values_unused
        self.placeholders: list[torch.Tensor] = []
        self.donation: torch.Tensor | None = None


def _branch_call(branch_input: torch.Tensor) -> BranchCall | None:
    return getattr(branch_input, "_fpdt_branch", None)


def output_values_unused(branch_input: torch.Tensor, placeholder: torch.Tensor | None = None) -> bool:
    """True in the recompute of the layer's last residual branch, whose output is only a backward
    root: its Function may return a placeholder of the output's shape and dtype, passed here."""
    call = _branch_call(branch_input)
    if call is None or not call.values_unused:
        return False
    if placeholder is not None:
        call.placeholders.append(placeholder)
    return True


def in_recompute(branch_input: torch.Tensor) -> bool:
    """Whether ``branch_input`` is a residual branch's input in its checkpoint's recompute."""
    return _branch_call(branch_input) is not None


def donated_gradient(grad_out: torch.Tensor, branch_input: torch.Tensor) -> bool:
    """Whether a whole-branch Function's backward may add ``dL/dx`` into ``grad_out`` in place (and
    return ``None`` for ``x``): only when ``grad_out`` is the layer's gradient, held by this layer alone."""
    return _donated(_branch_call(branch_input), grad_out, branch_input.shape, branch_input.dtype)


def donation_check(branch_input: torch.Tensor) -> Callable[[torch.Tensor], bool] | None:
    """:func:`donated_gradient` bound to ``branch_input``, for a Function that does not keep that
    tensor (it holds only the checkpoint's call, shape and dtype); None outside a recompute."""
    call = _branch_call(branch_input)
    if call is None:
        return None
    shape, dtype = branch_input.shape, branch_input.dtype
    return lambda grad_out: _donated(call, grad_out, shape, dtype)


def _donated(call: BranchCall | None, grad_out: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> bool:
    grad = None if call is None else call.donation
    if grad is None:
        return False
    return (grad_out.data_ptr() == grad.data_ptr() and grad_out.shape == grad.shape
            and grad_out.dtype == grad.dtype and grad_out.is_contiguous()
            and shape == grad.shape and dtype == grad.dtype)


def _free_values(t: torch.Tensor) -> None:
    """Free ``t``'s memory, keeping its ``grad_fn`` usable as a root; the version bump makes a saver raise."""
    if t._base is None:
        torch.autograd.graph.increment_version(t)
    t.untyped_storage().resize_(0)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a.add_(b)`` computes ``a + b`` exactly in ``a``'s memory (no broadcast, no promotion)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()


def _exclusively_owned(grad: torch.Tensor) -> bool:
    """Whether a Function's incoming gradient is held by that backward call alone (False under
    double backward or where torch cannot tell)."""
    try:
        impl_refs = grad._use_count()
        storage_refs = torch._C._storage_Use_Count(grad.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return False
    # storage_refs counts this tensor and the temporary UntypedStorage made to ask
    return (impl_refs == 1 and storage_refs == 2 and not torch.is_grad_enabled()
            and not grad.requires_grad and grad.is_contiguous())


class _LayerCheckpoint(torch.autograd.Function):
    """``body.forward(x)`` with recompute in backward.

    Inputs: ``body``, ``stash``, ``key`` / ``prev_key``, ``on_device``, ``saved``, ``x``
    ``[B, S_local, hidden]``, then an empty leaf requiring grad when ``x`` does not. Saves ``x`` in
    ``ctx`` (no stash or ``on_device``) or offloaded under ``key``; backward starts fetching ``prev_key``."""

    @staticmethod
    def forward(ctx, body, stash, key, prev_key, on_device, saved, x, *anchor):
        ctx.body, ctx.stash, ctx.key, ctx.prev_key, ctx.on_device = body, stash, key, prev_key, on_device
        ctx.saved_attention = saved
        ctx.x_requires_grad = x.requires_grad
        ctx.autocast = _autocast_state(x.device.type)
        ctx.rng = rng_state(x.device)
        if stash is None or on_device:
            ctx.save_for_backward(x)
        else:
            stash.put(key, x)  # the device->host copy starts now and overlaps the layer's compute
            ctx.entry = _StashEntry(stash, key)   # freed with the graph: discards the entry if never popped
        with torch.no_grad():
            y = body.forward(x)       # a saving layer's attention records into ``saved`` (bound by the caller)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        owned = _exclusively_owned(grad_y)   # asked here: grad mode is the caller's (double backward)
        x = ctx.saved_tensors[0] if ctx.stash is None or ctx.on_device else ctx.stash.pop(ctx.key)
        if ctx.stash is not None and ctx.prev_key is not None and ctx.prev_key in ctx.stash:
            ctx.stash.prefetch(ctx.prev_key)  # overlaps this layer's recompute + backward
        device_type, enabled, dtype = ctx.autocast
        saved, ctx.saved_attention = ctx.saved_attention, None
        if saved is not None:
            saved.begin_backward()
        try:
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled), \
                    replayed_rng(ctx.rng, x.device):
                dx = ctx.body.backward(x, ctx.x_requires_grad, grad_y, owned)
        finally:
            if saved is not None:
                saved.end_backward()
        return (None, None, None, None, None, None, dx) + (None,) * (len(ctx.needs_input_grad) - 7)


class _StashEntry:
    """Discards a layer input's stash entry when its graph is freed unpopped; safe against a later ``put``."""

    def __init__(self, stash: HostStash, key: Hashable):
        self.stash, self.key, self.token = stash, key, stash.token(key)

    def __del__(self) -> None:
        try:
            self.stash.discard(self.key, token=self.token)
        except Exception:   # interpreter shutdown
            pass


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default CPU generator's state, and the device's on CUDA (host-side: no sync)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def replayed_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
    """Run with the random state of :func:`rng_state`, and put the current one back after."""
    cpu, dev = state
    with torch.random.fork_rng(devices=[device] if dev is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, device)
        yield


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _apply(body, x: torch.Tensor, params: list[torch.Tensor], stash: HostStash | None, key: Hashable,
           prev_key: Hashable, on_device: bool, saved=None) -> torch.Tensor:
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return body.forward(x)  # no backward will come: nothing to keep
    # When x does not require grad (frozen embeddings, as under LoRA), a throwaway leaf that
    # does connects the output to the graph. Not the parameters: under ZeRO-3 they are
    # partitioned (empty) here, and the gradient accumulator autograd would create for them now
    # would reject the full-shape gradients of the recomputed layer.
    anchors = [] if x.requires_grad else [torch.empty(0, device=x.device, requires_grad=True)]
    return _LayerCheckpoint.apply(body, stash, key, prev_key, on_device, saved, x, *anchors)


def checkpointed(run_fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 params: list[torch.Tensor], stash: HostStash | None = None,
                 key: Hashable = None, prev_key: Hashable = None, free_output: bool = False,
                 on_device: bool = False, saved=None) -> torch.Tensor:
    """Run ``run_fn(x)`` (``[B, S_local, hidden]`` -> same) under activation checkpointing.

    Args:
        run_fn: the layer's forward of its input only; ``params``: its parameters.
        stash: offload ``x`` under ``key``; backward fetches ``prev_key`` (the previous layer's) early.
        free_output: the output's values are not saved by its own graph, so backward frees them first.
        on_device: keep ``x`` on the device although a ``stash`` is given.
        saved: a ``SavedAttention`` for the layer's one attention call (recompute runs no kernel)."""
    return _apply(_OpaqueBody(run_fn, free_output), x, params, stash, key, prev_key, on_device, saved)


def checkpointed_residual(branches: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor,
                          params: list[torch.Tensor], stash: HostStash | None = None,
                          key: Hashable = None, prev_key: Hashable = None,
                          on_device: bool = False, saved=None) -> torch.Tensor:
    """Run ``x <- x + f(x)`` for ``f`` in ``branches`` under checkpointing, holding one full-length
    gradient through the layer's backward instead of :func:`checkpointed`'s two. Arguments as there;
    each branch's output must not be saved by its own graph."""
    return _apply(_ResidualBody(branches), x, params, stash, key, prev_key, on_device, saved)

"""Per-layer activation checkpointing with and without host offload of the layer input."""

import pytest
import torch
from torch import nn

from fpdt.model.checkpointing import _exclusively_owned, checkpointed, checkpointed_residual
from fpdt.offload import HostStash
from tests.model.helpers import rel_err


class _Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def _run(layers, x, mode):
    stash = HostStash("cpu", enabled=True) if mode == "offload" else None
    h = x
    for i, layer in enumerate(layers):
        if mode == "off":
            h = layer(h)
        else:
            h = checkpointed(layer, h, list(layer.parameters()), stash=stash, key=i,
                             prev_key=i - 1 if i else None)
    return h, stash


class _DropoutLayer(_Layer):
    """Draws from the default CPU generator in forward, as LoRA's dropout (and its mask seed) does."""

    def forward(self, x):
        return x + self.b(torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.5, training=True))


@pytest.mark.parametrize("mode", ["on", "offload"])
@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("layer", [_Layer, _DropoutLayer])
def test_same_gradients_as_plain(mode, input_requires_grad, layer):
    """With dropout, the recompute draws the masks the forward drew (the random state is replayed,
    and the generator left where the forward left it): fails without the replay."""
    torch.manual_seed(0)
    layers = nn.ModuleList(layer(8) for _ in range(3))
    x = torch.randn(2, 5, 8)
    grads = {}
    for m in ("off", mode):
        layers.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        xr = x.clone().requires_grad_(input_requires_grad)
        y, stash = _run(layers, xr, m)
        if stash is not None:
            assert len(stash._host) == 3  # every layer input went to the host
        after_forward = torch.get_rng_state()
        y.pow(2).sum().backward()
        assert torch.equal(torch.get_rng_state(), after_forward)      # backward draws nothing visible
        if stash is not None:
            assert len(stash._host) == 0 and not stash._inflight  # all popped in backward
        grads[m] = ({n: p.grad.clone() for n, p in layers.named_parameters()}, xr.grad, y.detach())
    (g0, dx0, y0), (g1, dx1, y1) = grads["off"], grads[mode]
    assert rel_err(y1, y0) == 0
    for n in g0:
        assert rel_err(g1[n], g0[n]) < 1e-6, n
    if input_requires_grad:
        assert rel_err(dx1, dx0) < 1e-6
    else:
        assert dx1 is None


def test_keeps_only_layer_inputs():
    torch.manual_seed(0)
    layers = nn.ModuleList(_Layer(8) for _ in range(3))
    x = torch.randn(2, 5, 8, requires_grad=True)
    for mode, expected in (("on", 3), ("offload", 0)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            _run(layers, x, mode)
        activations = [t for t in saved if t.shape == x.shape]
        assert len(activations) == expected, mode
        assert len(saved) == expected  # nothing else (weights are not saved either)


def test_no_grad_runs_plain():
    layer = _Layer(4)
    with torch.no_grad():
        y = checkpointed(layer, torch.randn(1, 3, 4), list(layer.parameters()))
    assert not y.requires_grad


def test_abandoned_forward_returns_its_host_buffers():
    """A forward whose backward never runs (exception, skipped step) must not keep its
    offloaded layer inputs: when its graph is freed they go back to the pool, and a later
    forward reusing the same keys is left alone."""
    from fpdt.offload import host_pool
    torch.manual_seed(0)
    layers = nn.ModuleList(_Layer(8) for _ in range(3))
    x = torch.randn(2, 5, 8, requires_grad=True)
    pool = host_pool("cpu")
    before = pool.stats.in_use_bytes
    y, stash = _run(layers, x, "offload")
    assert len(stash._host) == 3 and pool.stats.in_use_bytes == before + 3 * x.numel() * 4
    del y
    assert len(stash._host) == 0 and pool.stats.in_use_bytes == before
    # same keys, second forward: freeing the first graph late must not drop the second's entries
    y1 = _run_with(layers, x, stash)
    y2 = _run_with(layers, x, stash)   # put() replaced y1's entries; y1's graph still alive
    del y1
    assert len(stash._host) == 3
    y2.sum().backward()
    assert len(stash._host) == 0 and pool.stats.in_use_bytes == before


def _run_with(layers, x, stash):
    h = x
    for i, layer in enumerate(layers):
        h = checkpointed(layer, h, list(layer.parameters()), stash=stash, key=i, prev_key=i - 1 if i else None)
    return h


@pytest.mark.parametrize("on_device", [0, 1, 2, 3])
def test_last_layers_keep_their_input_on_the_device(on_device):
    """A partly offloaded stack: the last ``on_device`` layers keep their input on the device
    (saved in the graph), the others go to the host. Gradients are those of plain autograd,
    every host entry is popped, and the first offloaded layer's input is fetched early, in
    the backward of the last device-resident layer (the stash's prefetch), as between two
    offloaded layers."""
    torch.manual_seed(0)
    layers = nn.ModuleList(_Layer(8) for _ in range(3))
    x = torch.randn(2, 5, 8)
    layers.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    ref = _run(layers, xr, "off")[0]
    ref.pow(2).sum().backward()
    want = ({n: p.grad.clone() for n, p in layers.named_parameters()}, xr.grad.clone())
    layers.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    stash = HostStash("cpu", enabled=True)
    early = []                 # keys whose fetch had started before their layer's backward asked
    pop = stash.pop
    stash.pop = lambda key: early.append((key, key in stash._inflight)) or pop(key)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = xr
        for i, layer in enumerate(layers):
            h = checkpointed(layer, h, list(layer.parameters()), stash=stash, key=i, prev_key=i - 1 if i else None,
                             on_device=i >= 3 - on_device)
    assert sorted(stash._host) == list(range(3 - on_device))          # the first layers' inputs on the host
    assert len([t for t in saved if t.shape == x.shape]) == on_device  # the last ones' in the graph
    h.pow(2).sum().backward()
    assert len(stash._host) == 0 and not stash._inflight
    # every offloaded input was fetched ahead (in the next layer's backward), except the last
    # layer's when it is itself offloaded (no layer runs backward before it)
    host = 3 - on_device
    assert early == [(i, not (on_device == 0 and i == 2)) for i in range(host - 1, -1, -1)]
    assert all(rel_err(p.grad, want[0][n]) < 1e-6 for n, p in layers.named_parameters())
    assert rel_err(xr.grad, want[1]) < 1e-6



class _TwoBranchLayer(nn.Module):
    """``h = x + f0(x)``, ``y = h + f1(h)``; each branch ends with a linear (saves its input only).
    ``dropout`` draws from the CPU generator in both branches (the recompute must replay it)."""

    def __init__(self, d, dropout=0.0, widths=(2, 3)):
        super().__init__()
        self.a, self.b = nn.Linear(d, widths[0] * d), nn.Linear(widths[0] * d, d)
        self.c, self.e = nn.Linear(d, widths[1] * d), nn.Linear(widths[1] * d, d)
        self.p = dropout

    def f0(self, x):
        return self.b(nn.functional.dropout(torch.tanh(self.a(x)), self.p, training=self.p > 0))

    def f1(self, h):
        return self.e(nn.functional.dropout(torch.relu(self.c(h)), self.p, training=self.p > 0))

    def forward(self, x):
        h = x + self.f0(x)
        return h + self.f1(h)


def _run_residual(layers, x, mode, stash=None):
    h = x
    for i, layer in enumerate(layers):
        if mode == "off":
            h = layer(h)
        else:
            h = checkpointed_residual((layer.f0, layer.f1), h, list(layer.parameters()), stash=stash, key=i,
                                      prev_key=i - 1 if i else None)
    return h


@pytest.mark.parametrize("mode", ["on", "offload"])
@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_residual_checkpoint_same_gradients_as_plain(mode, input_requires_grad, dropout, dtype):
    """Residual branches under the checkpoint: output bitwise, input and parameter gradients as
    plain autograd (the in-place accumulation sums the same terms)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(_TwoBranchLayer(6, dropout) for _ in range(3)).to(dtype)
    x = torch.randn(2, 7, 6, dtype=dtype)
    g = torch.randn(2, 7, 6, dtype=dtype)
    got = {}
    for m in ("off", mode):
        layers.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        xr = x.clone().requires_grad_(input_requires_grad)
        stash = HostStash("cpu", enabled=True) if m == "offload" else None
        y = _run_residual(layers, xr, m, stash)
        (y * g).sum().backward()
        if stash is not None:
            assert len(stash._host) == 0 and not stash._inflight
        got[m] = ({n: p.grad.clone() for n, p in layers.named_parameters()}, xr.grad, y.detach())
    (g0, dx0, y0), (g1, dx1, y1) = got["off"], got[mode]
    assert torch.equal(y1, y0)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    for n in g0:
        assert rel_err(g1[n], g0[n]) < tol, n
    if input_requires_grad:
        assert rel_err(dx1, dx0) < tol
    else:
        assert dx1 is None


def test_residual_checkpoint_leaves_a_shared_gradient_alone():
    """The layer's output feeds two consumers whose gradients the engine hands on as one tensor
    (``y + w``: both inputs get the same gradient): the checkpoint must not accumulate into it,
    or ``w``'s gradient changes. Also a gradient the caller keeps (``y.backward(g)``)."""
    torch.manual_seed(0)
    layer = _TwoBranchLayer(5)
    x = torch.randn(3, 5, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    want_w = torch.ones(3, 5)
    y = checkpointed_residual((layer.f0, layer.f1), x, list(layer.parameters()))
    (y + w).sum().backward()
    assert torch.equal(w.grad, want_w)
    ref_x = x.grad.clone()
    x.grad = None
    layer.zero_grad()
    g = torch.ones(3, 5)
    y = checkpointed_residual((layer.f0, layer.f1), x, list(layer.parameters()))
    y.backward(g)
    assert torch.equal(g, torch.ones(3, 5))
    assert torch.equal(x.grad, ref_x)


def test_ownership_of_incoming_gradients():
    """:func:`_exclusively_owned` says yes only for a gradient no other tensor or node can see."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            seen.append(_exclusively_owned(g))
            return g

    x = torch.randn(4, requires_grad=True)
    (Probe.apply(x) * 2).sum().backward()                       # a fresh tensor: ours
    (Probe.apply(x) + torch.randn(4, requires_grad=True)).sum().backward()   # also handed to the other input
    g = torch.ones(4)
    Probe.apply(x).backward(g)                                 # the caller keeps it
    torch.cat([Probe.apply(x), x]).pow(2).sum().backward()     # a view of cat's gradient
    y = Probe.apply(x)
    torch.autograd.grad((y * y).sum(), x, create_graph=True)   # double backward: never in place
    assert seen == [True, False, False, False, False]


@pytest.mark.parametrize("saving_branch", [0, 1])
def test_residual_checkpoint_refuses_a_branch_that_saves_its_output(saving_branch):
    """A branch whose last op saves its result (``tanh``) would read freed or overwritten memory:
    its backward raises instead."""
    torch.manual_seed(0)
    layer = _TwoBranchLayer(4)
    branches = [layer.f0, layer.f1]
    plain = branches[saving_branch]
    branches[saving_branch] = lambda x: torch.tanh(plain(x))
    y = checkpointed_residual(branches, torch.randn(2, 4, requires_grad=True), list(layer.parameters()))
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_residual_checkpoint_holds_one_gradient_less():
    """Counted: through the layer's backward the residual form holds one ``[T, d]`` gradient
    less than the opaque form, which keeps the incoming gradient beside the engine's sum (the
    first branch is the wide one here, so that its backward is the peak, as attention's is)."""
    from fpdt.memory.accountant import MemoryAccountant
    torch.manual_seed(0)
    layer = _TwoBranchLayer(64, widths=(4, 1))
    x = torch.randn(4096, 64, requires_grad=True)
    peaks = {}
    for form in ("opaque", "residual"):
        h = x * 1                            # the incoming gradient comes from an op: owned
        if form == "opaque":
            y = checkpointed(layer, h, list(layer.parameters()), free_output=True)
        else:
            y = checkpointed_residual((layer.f0, layer.f1), h, list(layer.parameters()))
        loss = (y * 2).sum()
        layer.zero_grad(set_to_none=True)
        with MemoryAccountant("cpu") as acct:
            loss.backward()
        peaks[form] = acct.device_peak
        x.grad = None
    assert peaks["opaque"] - peaks["residual"] == x.numel() * 4, peaks

"""Per-layer activation checkpointing with and without host offload of the layer input."""

import pytest
import torch
from torch import nn

from fpdt.model.checkpointing import checkpointed
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


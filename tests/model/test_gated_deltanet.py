"""GatedDeltaNet (fpdt.model.gated_deltanet) against Transformers' Qwen3_5GatedDeltaNet on the same
weights: output and every parameter and input gradient, random output gradients, over chunk
counts, head shapes (HV > Hk and HV = Hk), world sizes and offload
(tests.model.gdn_helpers.check_against_references says how they are judged)."""

import copy

import pytest
import torch

from fpdt.model.gated_deltanet import GatedDeltaNet
from tests.model.gdn_helpers import HIDDEN, SHAPES, check_against_references, fpdt_layer, fpdt_run, hf_layer


def inputs(B, S, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, HIDDEN, generator=gen), torch.randn(B, S, HIDDEN, generator=gen)


def check_single(layer, ref, x, dout, doc_ids=None, where=""):
    l64 = copy.deepcopy(layer).double()
    check_against_references(lambda: fpdt_run(layer, x, dout, doc_ids),
                             lambda: fpdt_run(l64, x.double(), dout.double(), doc_ids), ref, x, dout, doc_ids, where)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_chunks,S", [(1, 70), (2, 70), (4, 76), (6, 6)])
def test_single_rank_matches_transformers(shape, num_chunks, S):
    """u = 6 over 6 tokens: one-token chunks, so the conv window spans three earlier chunks."""
    config, ref = hf_layer(SHAPES[shape], seed=num_chunks)
    layer = fpdt_layer(config, ref)
    layer.num_chunks = num_chunks
    x, dout = inputs(2, S, seed=S + num_chunks)
    check_single(layer, ref, x, dout, where=f"{shape} u={num_chunks}")


def test_offload_on_the_simulated_runtime():
    from fpdt.offload import fresh_runtime
    config, ref = hf_layer(SHAPES["gva"], seed=3)
    layer = fpdt_layer(config, ref)
    x, dout = inputs(1, 64, seed=5)
    with fresh_runtime("sim") as rt:
        layer.num_chunks, layer.offload, layer.runtime, layer.stash_label = 4, True, rt, "layer 0"
        check_single(layer, ref, x, dout, where="offload")


def test_frozen_weights_and_no_grad():
    """Frozen weights: the same input gradient, no weight gradients; no grad: the same output."""
    config, ref = hf_layer(SHAPES["equal"], seed=1)
    layer = fpdt_layer(config, ref)
    layer.num_chunks = 2
    x, dout = inputs(1, 10, seed=2)
    out, grads = fpdt_run(layer, x, dout)
    with torch.no_grad():
        assert torch.equal(layer(x), out)
    for p in layer.parameters():
        p.requires_grad_(False)
    layer.zero_grad()
    xg = x.clone().requires_grad_()
    layer(xg).backward(dout)
    assert (xg.grad - grads["x"]).norm() <= 1e-6 * grads["x"].norm(), (xg.grad - grads["x"]).norm() / grads["x"].norm()
    assert all(p.grad is None for p in layer.parameters())


def test_bad_input_is_refused_in_one_line():
    layer = GatedDeltaNet(HIDDEN, 2, 4, 8, 6)
    layer.num_chunks = 3
    with pytest.raises(ValueError, match="not divisible by sp\\*num_chunks"):
        layer(torch.randn(1, 10, HIDDEN))
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        GatedDeltaNet(HIDDEN, 3, 4, 8, 6)
    layer.num_chunks = 1
    with pytest.raises(ValueError, match="doc_ids must be"):
        layer(torch.randn(1, 10, HIDDEN), doc_ids=torch.zeros(1, 9, dtype=torch.long))


def test_kernel_is_named_and_state_dict_matches_transformers():
    config, ref = hf_layer(SHAPES["gva"])
    layer = fpdt_layer(config, ref)
    assert layer.kernel_name() == "torch"
    assert {k: v.shape for k, v in layer.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}

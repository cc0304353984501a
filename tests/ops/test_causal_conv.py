"""The GDN conv (fpdt.ops.causal_conv): the window-prepended conv equals Transformers' causal_conv1d_fn
over the whole sequence, the document mask equals each document alone, causal-conv1d by stub."""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from fpdt.ops.causal_conv import causal_conv, conv_kernel


def test_window_then_span_is_the_whole_sequence_conv():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 30, 7, generator=gen), torch.randn(7, 4, generator=gen)
    whole = causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    pieces, window = [], torch.zeros(2, 3, 7)
    for s in range(0, 30, 5):
        full = torch.cat([window, x[:, s:s + 5]], 1)
        pieces.append(causal_conv(full, w, kernel="torch"))
        window = full[:, -3:]
    assert torch.allclose(torch.cat(pieces, 1), whole, atol=1e-6)
    ones = torch.ones(2, 30, 4, dtype=torch.bool)      # a mask that drops nothing: the same sum
    assert torch.allclose(causal_conv(torch.cat([torch.zeros(2, 3, 7), x], 1), w, ones), whole, atol=1e-6)


def test_document_mask_is_each_document_alone():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 12, 3, generator=gen), torch.randn(3, 4, generator=gen)
    ids = torch.tensor([0] * 5 + [1] + [2] * 6)
    full_ids = torch.cat([torch.full((3,), -1), ids])
    mask = torch.stack([full_ids[j:j + 12] == ids for j in range(4)], -1)[None]
    got = causal_conv(torch.cat([torch.zeros(1, 3, 3), x], 1), w, mask)
    alone = torch.cat([causal_conv(torch.cat([torch.zeros(1, 3, 3), x[:, s:e]], 1), w, kernel="torch")
                       for s, e in ((0, 5), (5, 6), (6, 12))], 1)
    assert torch.allclose(got, alone, atol=1e-6)


def test_causal_conv1d_dispatch_by_stub(monkeypatch):
    calls = []

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        calls.append((tuple(x.shape), activation, bias))
        K = weight.shape[1]
        return F.silu(F.conv1d(F.pad(x, (K - 1, 0)), weight.unsqueeze(1), groups=x.shape[1]))
    mod = types.ModuleType("causal_conv1d")
    mod.causal_conv1d_fn = causal_conv1d_fn
    mod.__spec__ = importlib.machinery.ModuleSpec("causal_conv1d", loader=None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", mod)
    assert conv_kernel("cuda") == "causal-conv1d" and conv_kernel("cpu") == "torch"
    gen = torch.Generator().manual_seed(2)
    full, w = torch.randn(2, 13, 5, generator=gen), torch.randn(5, 4, generator=gen)
    got = causal_conv(full, w, kernel="causal-conv1d")
    assert calls == [((2, 5, 13), "silu", None)]
    assert torch.allclose(got, causal_conv(full, w, kernel="torch"), atol=1e-6)
    with pytest.raises(ValueError, match="unknown conv kernel"):
        causal_conv(full, w, kernel="triton")

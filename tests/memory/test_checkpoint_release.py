"""Under activation checkpointing, FPDT attention leaves nothing on the device but its output.

Non-reentrant ``torch.utils.checkpoint`` (Transformers' default for
``gradient_checkpointing_enable``) drops a region's saved tensors after the forward and
recomputes them in backward. The FPDT Functions keep their chunks in a stash carried by a
saved token (:mod:`fpdt.attention.saved_stash`), so the first forward's stash goes with
them: counted exactly, the live device bytes after the checkpointed forward are the
output's and nothing else, where the unchecked forward keeps every chunk's q̂, k̂, v̂, o and
lse. Gradients equal those without a checkpoint.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq, fpdt_attention
from fpdt.memory.accountant import MemoryAccountant
from tests.memory.helpers import warm_up

B, S, H, H_KV, D, U = 1, 256, 8, 2, 16, 4


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, S, h, D, generator=g, dtype=dtype).requires_grad_() for h in (H, H_KV, H_KV)]


def _forward_live(fn, args, use_checkpoint: bool):
    """Live device bytes created by the forward (beyond its inputs), and the gradients."""
    for a in args:
        a.grad = None
    with MemoryAccountant("cpu") as acc:
        out = checkpoint(fn, *args, use_reentrant=False) if use_checkpoint else fn(*args)
        live = acc.device_live
        out.float().square().sum().backward()
    return live, out.numel() * out.element_size(), [a.grad.clone() for a in args]


@pytest.mark.parametrize("offload", [False, True])
def test_fpdt_attention_releases_its_chunks_under_checkpoint(offload):
    warm_up((H, H_KV, D), dtype=torch.float32)
    args = _inputs(torch.float32)

    def fn(q, k, v):
        return fpdt_attention(q, k, v, num_chunks=U, offload=offload)

    plain, out_bytes, want = _forward_live(fn, args, use_checkpoint=False)
    ckpt, _, got = _forward_live(fn, args, use_checkpoint=True)
    assert ckpt == out_bytes, f"checkpointed forward keeps {ckpt - out_bytes} bytes beyond its output"
    if not offload:   # unchecked, the stash keeps every chunk's o and lse on the device (on one
        # rank q̂, k̂, v̂ are views of the inputs)
        assert plain >= out_bytes + B * S * H * D * 4 + B * H * S * 4
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_projected_attention_releases_its_chunks_under_checkpoint():
    torch.manual_seed(0)
    hidden = H * D
    layer = FPDTAttention(hidden, H, H_KV, D, num_chunks=U, offload=False)
    rope = RotaryEmbedding(default_inv_freq(D, 10000.0))
    x = torch.randn(B, S, hidden, requires_grad=True)
    pos = torch.arange(S).expand(B, S)

    def fn(h):
        return layer(h, pos, rope)

    plain, out_bytes, want = _forward_live(fn, [x], use_checkpoint=False)
    ckpt, _, got = _forward_live(fn, [x], use_checkpoint=True)
    assert plain > out_bytes
    # the output and the attention output before o_proj, which o_proj's own backward saves
    # (recomputed under the checkpoint, so it must not be live either)
    assert ckpt == out_bytes, f"checkpointed forward keeps {ckpt - out_bytes} bytes beyond its output"
    assert torch.equal(got[0], want[0])


def test_a_copying_saved_tensor_hook_gets_a_clear_error():
    """``save_on_cpu`` around the attention (no checkpoint) copies the stash token: refused in
    backward with the fix, never a silent wrong gradient."""
    q, k, v = _inputs(torch.float32)
    with torch.autograd.graph.save_on_cpu(pin_memory=True):   # copies every saved tensor
        out = fpdt_attention(q, k, v, num_chunks=U)
    with pytest.raises(RuntimeError, match="saved-tensor hook that copies tensors.*offload=True"):
        out.sum().backward()


@pytest.mark.parametrize("offload", [False, True])
def test_a_second_backward_through_the_same_graph_is_refused(offload):
    q, k, v = _inputs(torch.float32)
    out = fpdt_attention(q, k, v, num_chunks=U, offload=offload)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="consumed by an earlier backward.*retain_graph=True"):
        out.sum().backward()

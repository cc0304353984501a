"""Qwen3.5's gated full attention in :class:`fpdt.attention.FPDTAttention` (``output_gate``,
``rotary_dim``, ``qk_norm_zero_centred``) against Transformers' ``Qwen3_5Attention``.

A tiny ``Qwen3_5TextConfig`` (hidden 64, 4 query heads and 2 KV heads of 32, partial rotary 0.25:
8 rotated channels, q/k/v/o biases on, random zero-centred q/k norm weights), its weights copied
into fpdt's layer; fp32, random output gradients. Compared: the output, the input gradient and
every parameter gradient (q/k/v/o weights and biases, both norms; summed over the ranks) within
1e-5 relative, at num_chunks 1, 2 and 4, with and without offload, under the simulated runtime,
with ``attention_checkpoint="save"`` (a checkpointed layer replaying its saved outputs), on 1, 2
and 4 ranks and once on the 2 x 2 mesh; bf16 (offloaded, u = 4) no worse than Transformers' own bf16
against float64. Transformers' rotary is its interleaved MRoPE, which for
text positions is plain RoPE over the rotated channels (:mod:`fpdt.model.rope_scaling`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from fpdt.attention import FPDTAttention
from fpdt.attention.saved_attention import SavedAttention
from fpdt.comm import SequenceMesh
from fpdt.layout import local_position_ids, mesh_shard, shard
from fpdt.model.checkpointing import checkpointed
from fpdt.model.rope_scaling import build_rotary, rotary_dim
from fpdt.offload import fresh_runtime
from tests.attention.reference import assert_rel_close
from tests.distributed import run_distributed

HIDDEN, H, H_KV, D, FACTOR = 64, 4, 2, 32, 0.25
TOL = 1e-5


def qwen35_attention(seed: int):
    """Transformers' layer (fp32, sdpa: causal without a mask) with random norm weights and biases."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5TextRotaryEmbedding

    cfg = Qwen3_5TextConfig(hidden_size=HIDDEN, num_attention_heads=H, num_key_value_heads=H_KV, head_dim=D,
                            num_hidden_layers=4, intermediate_size=64, vocab_size=32, attention_bias=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": FACTOR, "mrope_section": [2, 1, 1]})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    ref = Qwen3_5Attention(cfg, layer_idx=3).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.15))
    return ref, Qwen3_5TextRotaryEmbedding(cfg)


def fpdt_layer(ref, u: int, offload: bool, runtime=None, mesh=None):
    """fpdt's layer holding copies of ``ref``'s weights (its norms as they are)."""
    layer = FPDTAttention(HIDDEN, H, H_KV, D, qkv_bias=True, o_bias=True, num_chunks=u, offload=offload,
                          runtime=runtime, mesh=mesh, output_gate=True, rotary_dim=rotary_dim(D, FACTOR),
                          qk_norm_zero_centred=True)
    layer.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith(("q_norm", "k_norm"))})
    layer.q_norm, layer.k_norm = copy.deepcopy(ref.q_norm), copy.deepcopy(ref.k_norm)
    layer.stash_label = "layer 3"
    return layer


def check(rank, world, *, u, offload, B=2, seed=0, mesh=None, save=False, sim=False):
    ref, ref_rope = qwen35_attention(seed)
    S = world * u * (4 if mesh is not None else 2)
    x = torch.randn(B, S, HIDDEN)
    dout = torch.randn(B, S, HIDDEN)
    xr = x.clone().requires_grad_()
    pos = torch.arange(S).expand(B, S)
    out_ref = ref(xr, ref_rope(xr, pos), None)[0]
    out_ref.backward(dout)

    if mesh is not None:
        def local(t):
            return mesh_shard(t, mesh.hp, mesh.cp, u, mesh.cp_rank, mesh.hp_rank)
        positions = local(pos)
    else:
        def local(t):
            return shard(t, world, u, rank)
        positions = local_position_ids(S, world, u, rank, B)
    rope = build_rotary(D, 10000.0, None, partial_rotary_factor=FACTOR)
    with (fresh_runtime("sim", mode="threaded", seed=1) if sim else _null()) as rt:
        layer = fpdt_layer(ref, u, offload, runtime=rt, mesh=mesh)
        xl = local(x).requires_grad_()
        if save:
            saved = SavedAttention(xl.device, on_host=True, label="layer 3", runtime=rt)
            out = checkpointed(lambda h: layer(h, positions, rope, saved=saved), xl, list(layer.parameters()),
                               saved=saved)
        else:
            out = layer(xl, positions, rope)
        out.backward(local(dout))
        assert save is False or saved.replayed
    what = f"rank {rank}/{world} u={u} offload={offload} mesh={mesh is not None} save={save} sim={sim}"
    assert_rel_close(out, local(out_ref.detach()), TOL, f"out [{what}]")
    assert_rel_close(xl.grad, local(xr.grad), TOL, f"d_hidden [{what}]")
    want = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad.detach().clone()
        if world > 1:
            dist.all_reduce(grad)
        assert grad.abs().max() > 0, f"{name}: zero gradient [{what}]"
        assert_rel_close(grad, want[name].grad, TOL, f"{name}.grad [{what}]")
    assert set(dict(layer.named_parameters())) == set(want)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("u", [1, 2, 4])
@pytest.mark.parametrize("offload", [False, True])
def test_one_rank_matches_transformers(u, offload):
    check(0, 1, u=u, offload=offload, seed=u)


def test_offload_on_the_simulated_runtime():
    check(0, 1, u=4, offload=True, sim=True)


def test_saved_attention_replay():
    check(0, 1, u=2, offload=True, save=True)


def _ranks(rank, world):
    for u in (1, 2):
        check(rank, world, u=u, offload=True, seed=u)
    check(rank, world, u=2, offload=False, B=1)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_transformers(world):
    run_distributed(_ranks, world, timeout=300)


def _mesh(rank, world):
    check(rank, world, u=2, offload=True, mesh=SequenceMesh(hp=2, cp=2))


@pytest.mark.slow
def test_the_2d_mesh_matches_transformers():
    run_distributed(_mesh, 4, timeout=300)


def test_bad_shapes_are_refused():
    layer = FPDTAttention(HIDDEN, H, H_KV, D, output_gate=True, rotary_dim=8)
    x = torch.randn(1, 8, HIDDEN)
    pos = torch.arange(8)[None]
    with pytest.raises(ValueError, match="RoPE table rotates 32 channels but rotary_dim is 8"):
        layer(x, pos, build_rotary(D, 10000.0, None))
    plain = FPDTAttention(HIDDEN, H, H_KV, D)
    plain.output_gate = True
    with pytest.raises(ValueError, match=r"output_gate=True needs q_proj to give \[query \| gate\]"):
        plain(x, pos, build_rotary(D, 10000.0, None))


def _run(layer, rope_fn, x, dout, hf: bool):
    x = x.detach().clone().requires_grad_()
    out = layer(x, rope_fn(x), None)[0] if hf else layer(x, *rope_fn(x))
    out.backward(dout.to(out.dtype))
    grads = {n: p.grad for n, p in layer.named_parameters()}
    grads["input"] = x.grad
    return out.detach(), grads


def test_bf16_no_worse_than_transformers_bf16():
    """bf16, offloaded, u = 4: the output and every gradient against float64 no worse than
    Transformers' own bf16 layer (:func:`tests.model.helpers.compare_bf16`)."""
    from tests.model.helpers import compare_bf16

    ref, ref_rope = qwen35_attention(7)
    B, S, u = 2, 32, 4
    x, dout = torch.randn(B, S, HIDDEN), torch.randn(B, S, HIDDEN)
    pos = torch.arange(S).expand(B, S)
    rope = build_rotary(D, 10000.0, None, partial_rotary_factor=FACTOR)
    exact = _run(copy.deepcopy(ref).double(), lambda h: ref_rope(h, pos), x.double(), dout, hf=True)
    plain = _run(copy.deepcopy(ref).bfloat16(), lambda h: ref_rope(h, pos), x.bfloat16(), dout, hf=True)
    ours = _run(fpdt_layer(ref, u, True).bfloat16(), lambda h: (local_position_ids(S, 1, u, 0, B), rope),
                x.bfloat16(), dout, hf=False)
    compare_bf16(*ours, *plain, *exact, "gated attention bf16")

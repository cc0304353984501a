"""Saved attention outputs (``attention_checkpoint="save"``) under the simulated runtime.

* host bytes per saving layer = ``fpdt.attention.offload_volume.saved_attention_bytes``
  (``B S (H D e + 4 H) / P``), counted on the host buffers the layer holds after its forward;
* copy volume per step of a checkpointed, offloaded layer = the formula, with and without
  saving, lazy and threaded, fp32 and bf16;
* the injected faults (``drop_wait``, ``drop_record_stream``) are caught on the saved tensors,
  the hazard naming them (``attn out chunk 2, layer 0`` / ``attn lse chunk ...``).
"""

from __future__ import annotations

import pytest
import torch

from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq
from fpdt.attention.offload_volume import checkpointed_attention_copy_bytes, saved_attention_bytes
from fpdt.attention.saved_attention import SavedAttention
from fpdt.layout import local_position_ids
from fpdt.model.checkpointing import checkpointed
from fpdt.offload import StreamHazardError, fresh_runtime
from tests.distributed import run_distributed

SHAPE = dict(hidden=32, H=4, H_kv=2, D=8)


def _step(rank, world, *, u, offload, saved_on_host, save, runtime, dtype=torch.float32, piece=2, B=1):
    """One checkpointed FPDTAttention layer (input kept on the device), forward + backward;
    returns the saved host bytes after forward and the local sequence length."""
    hidden, H, H_kv, D = SHAPE["hidden"], SHAPE["H"], SHAPE["H_kv"], SHAPE["D"]
    torch.manual_seed(0)
    S = world * u * piece
    layer = FPDTAttention(hidden, H, H_kv, D, num_chunks=u, offload=offload, runtime=runtime).to(dtype)
    layer.o_proj.requires_grad_(False)    # the attention's own copies (o_proj's read-back: tests/offload)
    layer.stash_label = "layer 0"
    x = torch.randn(B, S // world, hidden, dtype=dtype, requires_grad=True)
    pos = local_position_ids(S, world, u, rank, B)
    rope = RotaryEmbedding(default_inv_freq(D))
    saved = SavedAttention(x.device, on_host=saved_on_host, label="layer 0", runtime=runtime) if save else None
    out = checkpointed(lambda h: layer(h, pos, rope, saved=saved), x, list(layer.parameters()), saved=saved)
    held = 0 if saved is None else sum(h.numel() * h.element_size() for h, _ in saved.stash._host.values())
    out.backward(torch.randn_like(out))
    assert saved is None or not saved.stash._host and saved.replayed
    return held, S // world


def _volume(rank, world, u, dtype, mode):
    for save in (False, True):
        with fresh_runtime("sim", mode=mode) as rt:
            held, s_local = _step(rank, world, u=u, offload=True, saved_on_host=True, save=save, dtype=dtype,
                                  runtime=rt)
            got = (rt.counters.bytes_d2h, rt.counters.bytes_h2d)
        want = checkpointed_attention_copy_bytes(batch=1, seq_local=s_local, hidden=SHAPE["hidden"],
                                                 num_heads=SHAPE["H"], num_kv_heads=SHAPE["H_kv"],
                                                 head_dim=SHAPE["D"], sp=world, num_chunks=u, dtype=dtype, saved=save)
        assert got == (want.d2h, want.h2d), (save, got, want)
        formula = saved_attention_bytes(batch=1, seq_local=s_local, num_heads=SHAPE["H"], head_dim=SHAPE["D"],
                                        dtype=dtype)
        assert held == (formula if save else 0), (held, formula)
        # the figure for bf16: (2 S H D + 4 S H) / P per sequence
        if dtype == torch.bfloat16:
            S = s_local * world
            assert formula == (2 * S * SHAPE["H"] * SHAPE["D"] + 4 * S * SHAPE["H"]) // world


@pytest.mark.parametrize("mode", ["lazy", "threaded"])
@pytest.mark.parametrize("u,dtype", [(1, torch.float32), (3, torch.float32), (4, torch.bfloat16)])
def test_host_bytes_and_copy_volume_match_the_formulas(mode, u, dtype):
    _volume(0, 1, u, dtype, mode)


@pytest.mark.slow
def test_host_bytes_and_copy_volume_on_two_ranks():
    run_distributed(_volume, 2, args=(2, torch.bfloat16, "lazy"), timeout=240)


def test_device_saved_outputs_move_nothing_through_the_host():
    with fresh_runtime("sim") as rt:
        held, _ = _step(0, 1, u=3, offload=False, saved_on_host=False, save=True, runtime=rt)
    assert held == 0 and rt.counters.bytes_d2h == rt.counters.bytes_h2d == 0


@pytest.mark.parametrize("mode", ["lazy", "threaded"])
@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_injected_faults_are_caught_on_the_saved_outputs(mode, fault):
    """The saved outputs are the only host traffic here (attention chunks and layer input on
    the device), so the hazard names them."""
    with pytest.raises(StreamHazardError, match=r"attn (out|lse) chunk \d+, layer 0"):
        with fresh_runtime("sim", mode=mode, fault=fault, checks=True, seed=3) as rt:
            _step(0, 1, u=3, offload=False, saved_on_host=True, save=True, runtime=rt)
    # and without the fault, the same run is clean
    with fresh_runtime("sim", mode=mode, checks=True, seed=3) as rt:
        _step(0, 1, u=3, offload=False, saved_on_host=True, save=True, runtime=rt)


@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_injected_faults_are_caught_when_saved_buffers_move_into_the_attention_stash(fault):
    with pytest.raises(StreamHazardError, match=r"chunk \d+, layer 0"):
        with fresh_runtime("sim", fault=fault, checks=True) as rt:
            _step(0, 1, u=3, offload=True, saved_on_host=True, save=True, runtime=rt)

"""The FPDT offload schedule, asserted under the simulated runtime (FPDT, arXiv 2408.16978).

* fetch buffers: at most two per role (the one in use and the one being prefetched),
  allocated on the compute stream that reads them (record_stream only on D2H sources);
* bounded run-ahead: copies issued but not yet run stay under one stated bound at
  u = 4, 8 and 16 (under lazy copies the peak is equal at u = 8 and 16: it does not grow with u);
* no host-blocking synchronisation inside the chunk loops (zero per layer, at every u);
* streams: attention chunks on ``chunks``, hidden-state chunks and layer inputs on ``inputs``;
* layer inputs: offload issued before the layer's compute; in backward the previous
  layer's input is fetched before this layer's recompute starts;
* copy volume: the bytes each way equal fpdt.attention.offload_volume's formula.
"""

import pytest
import torch

from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq
from fpdt.attention.offload_volume import attention_layer_copy_bytes
from fpdt.layout import local_position_ids
from fpdt.offload import fresh_runtime
from fpdt.offload.streams import D2H_RUN_AHEAD
from tests.distributed import run_distributed
from tests.model.helpers import fpdt_from_hf, hf_model, tokens

import fpdt.model as fm

# Copies in flight: the D2H run-ahead window, plus the prefetches of one backward inner
# step (q̂, o, lse, dô, dq of the next query chunk), the next k̂/v̂ pair and T_{j+1}.
PENDING_BOUND = D2H_RUN_AHEAD + 8


def _layer_step(rank, world, *, u, runtime, B=1, hidden=32, H=4, H_kv=2, D=8, piece=2, dtype=torch.float32,
                from_stash=False):
    """Forward and backward of one offloaded FPDTAttention layer on this rank's shard
    (``from_stash``: o_proj's weight is trained, so its backward reads its input back from the
    attention's stash; else it is frozen)."""
    torch.manual_seed(0)
    S = world * u * piece
    layer = FPDTAttention(hidden, H, H_kv, D, num_chunks=u, offload=True, runtime=runtime).to(dtype)
    layer.o_proj.requires_grad_(from_stash)
    x = torch.randn(B, S // world, hidden, dtype=dtype, requires_grad=True)
    out = layer(x, local_position_ids(S, world, u, rank, B), RotaryEmbedding(default_inv_freq(D)))
    out.backward(torch.randn_like(out))
    return S // world


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lazy", "threaded"])
def test_buffers_run_ahead_and_syncs_are_bounded_independently_of_u(mode):
    seen = {}
    for u in (4, 8, 16):
        with fresh_runtime("sim", mode=mode, log=True) as rt:
            recorded = []
            record_stream = rt.record_stream
            rt.record_stream = lambda t, s: (recorded.append(s), record_stream(t, s))[1]
            _layer_step(0, 1, u=u, runtime=rt)
            c = rt.counters
            # record_stream only on device->host sources; fetch buffers belong to compute (no hand-over)
            assert len(recorded) == c.copies_d2h, (len(recorded), c.copies_d2h)
            assert max(c.peak_fetch_buffers.values()) <= 2, (u, c.peak_fetch_buffers)
            assert set(c.peak_fetch_buffers) == {"k", "v", "q", "o", "lse", "do", "dq", "T"}
            assert c.host_syncs == 0, (u, c.host_syncs)
            assert c.peak_copies_pending <= PENDING_BOUND, (u, c.peak_copies_pending)
            for stream, _, role in rt.log:
                assert stream == ("inputs" if role.startswith("T ") else "chunks"), (stream, role)
            seen[u] = c.peak_copies_pending
    if mode == "lazy":  # copies run as late as allowed: the peak stops growing once the pipeline is full
        assert seen[4] <= seen[8] == seen[16], seen


def _volume_body(rank, world, u, H, H_kv, dtype):
    for from_stash in (False, True):
        with fresh_runtime("sim") as rt:
            s_local = _layer_step(rank, world, u=u, H=H, H_kv=H_kv, dtype=dtype, runtime=rt, from_stash=from_stash)
            want = attention_layer_copy_bytes(batch=1, seq_local=s_local, hidden=32, num_heads=H, num_kv_heads=H_kv,
                                              head_dim=8, sp=world, num_chunks=u, dtype=dtype,
                                              o_proj_from_stash=from_stash)
            got = (rt.counters.bytes_d2h, rt.counters.bytes_h2d)
            assert got == (want.d2h, want.h2d), (from_stash, got, want)


def test_copy_volume_matches_the_formula_on_one_rank():
    """Also with o_proj reading its input back from the stash: ``u o`` more host -> device."""
    _volume_body(0, 1, 5, 4, 2, torch.float32)


@pytest.mark.slow
def test_copy_volume_matches_the_formula_on_two_ranks_with_kv_replication():
    run_distributed(_volume_body, 2, args=(4, 4, 1, torch.bfloat16))  # H_kv=1 < sp: replicated before the all-to-all


def test_layer_inputs_offload_before_compute_and_prefetch_in_backward():
    ref = hf_model("llama_gqa")
    layers = ref.config.num_hidden_layers
    assert layers >= 2
    ids, labels = tokens(ref.config.vocab_size, 1, 8, ignore=False)
    with fresh_runtime("sim", log=True) as rt:
        model = fpdt_from_hf(ref, num_chunks=2, offload=True, checkpointing="offload", runtime=rt)
        model(**fm.prepare_inputs(ids, labels=labels, sp_size=1, rank=0, num_chunks=2)).backward()
        c = rt.counters
    assert c.host_syncs == 0 and max(c.peak_fetch_buffers.values()) <= 2, c
    log = [(stream, direction, role) for stream, direction, role in rt.log]
    for stream, _, role in log:
        assert stream == ("inputs" if role.startswith(("T ", "layer input")) else "chunks"), (stream, role)

    def first(pred, start=0):
        return next(n for n in range(start, len(log)) if pred(*log[n]))

    for i in range(layers):
        offload = first(lambda s, d, r: d == "d2h" and r == f"layer input, layer {i}")
        compute = first(lambda s, d, r: r.endswith(f", layer {i}") and not r.startswith("layer input"))
        assert offload < compute, f"layer {i}'s input offload must be issued before its compute"
    for i in range(layers - 1, 0, -1):
        fetched = first(lambda s, d, r: d == "h2d" and r == f"layer input, layer {i}")
        prev = first(lambda s, d, r: d == "h2d" and r == f"layer input, layer {i - 1}", fetched)
        recompute = first(lambda s, d, r: r.endswith(f", layer {i}") and not r.startswith("layer input"), fetched)
        assert prev < recompute, f"layer {i - 1}'s input must be prefetched before layer {i}'s recompute"

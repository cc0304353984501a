"""2D attention (Ulysses over hp x zigzag ring over cp, FPDT chunks) vs a float64 reference.

Each case draws global q, k, v, dout, shards them with the mesh layout
(``mesh.shard``), runs ``fpdt_attention(mesh=...)`` forward and backward on every rank, and
compares the output and dq/dk/dv with the reference's shard: fp32 within 1e-5 (norm-wise
relative). Cases run inside one spawned world per size to keep the suite fast.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from fpdt.attention import fpdt_attention
from fpdt.attention.ring_costs import attention_costs
from fpdt.comm import SequenceMesh
from fpdt.layout import shard
from fpdt.offload import HostStash
from tests.attention.reference import assert_traffic_matches, assert_rel_close, reference_attention
from tests.distributed import run_distributed

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(S, H, H_kv, D, seed, B=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g) for h in (H, H_kv, H_kv, H)]


def check_mesh_case(mesh, *, u, H, H_kv, D=8, offload, causal=True, piece=2, seed=0, dtype=torch.float32,
                    runtime=None):
    S = 2 * mesh.hp * mesh.cp * u * piece
    q, k, v, dout = (t.to(dtype) for t in _inputs(S, H, H_kv, D, seed))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal)
    ref.backward(dout.double())
    ql, kl, vl = (mesh.shard(t, u).requires_grad_() for t in (q, k, v))
    out = fpdt_attention(ql, kl, vl, mesh=mesh, num_chunks=u, offload=offload, causal=causal, runtime=runtime)
    out.backward(mesh.shard(dout, u))
    assert out.dtype == dtype
    what = f"{mesh} u={u} H={H} H_kv={H_kv} offload={offload} causal={causal} {dtype}"
    for name, a, b in (("out", out, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
        assert_rel_close(a, mesh.shard(b, u), TOL[dtype], f"{name} [{what}]")


MESHES_4 = [dict(hp=1, cp=4), dict(hp=1, cp=4, inner_ring=2), dict(hp=2, cp=2),
            dict(hp=2, cp=2, placement="context_first"), dict(hp=4, cp=1), dict(hp=1, cp=2), dict(hp=2, cp=1),
            dict(hp=1, cp=4, inner_ring=1, placement="context_first")]


def _cases_4(n_mesh):
    """A spread over chunks, offload and heads per mesh (not the full product: suite time)."""
    heads = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA (hp=2/4 > H_kv=1 replicates)
    for m in range(n_mesh):
        for n, (u, offload) in enumerate(itertools.product((1, 2, 3), (False, True))):
            H, H_kv = heads[(m + n) % 3]
            yield m, dict(u=u, offload=offload, H=H, H_kv=H_kv, seed=10 * m + n)


def _world4_body(rank, world):
    meshes = [SequenceMesh(**kw) for kw in MESHES_4]
    for m, case in _cases_4(len(meshes)):
        check_mesh_case(meshes[m], **case)
    check_mesh_case(meshes[2], u=2, H=4, H_kv=2, offload=True, causal=False)  # non-causal: every pair is full
    check_mesh_case(meshes[1], u=2, H=2, H_kv=1, offload=False, causal=False)
    check_mesh_case(meshes[3], u=2, H=4, H_kv=2, offload=True, dtype=torch.bfloat16, piece=4)


@pytest.mark.slow
def test_mesh_parity_world4():
    run_distributed(_world4_body, 4, timeout=300)


def _world3_body(rank, world):
    mesh = SequenceMesh(hp=1, cp=3)
    for n, (u, offload) in enumerate(itertools.product((1, 2, 3), (False, True))):
        check_mesh_case(mesh, u=u, H=3, H_kv=(3, 1)[n % 2], offload=offload, seed=n)


@pytest.mark.slow
def test_mesh_parity_world3_odd_ring():
    run_distributed(_world3_body, 3, timeout=180)


def _cp1_is_ulysses_body(rank, world):
    """cp=1 reproduces plain Ulysses (group=) bit for bit, on the same tokens."""
    mesh = SequenceMesh(hp=world, cp=1)
    for u, H_kv, offload in ((1, 2, False), (2, 1, True), (3, 4, True)):
        S = 2 * world * u * 3
        q, k, v, dout = _inputs(S, 4, H_kv, 8, seed=u)
        grads = []
        for kw in (dict(mesh=mesh), dict(group=None)):
            ql, kl, vl = (mesh.shard(t, u).requires_grad_() for t in (q, k, v))
            assert torch.equal(ql, shard(q, world, u, rank))  # the mesh layout is the FPDT layout
            out = fpdt_attention(ql, kl, vl, num_chunks=u, offload=offload, **kw)
            out.backward(mesh.shard(dout, u))
            grads.append((out, ql.grad, kl.grad, vl.grad))
        for a, b in zip(*grads):
            assert torch.equal(a, b)
    # hp=1 x cp=2: a plain ring, every rank's own tokens, no all-to-all
    ring = SequenceMesh(hp=1, cp=world)
    check_mesh_case(ring, u=2, H=2, H_kv=2, offload=True)


@pytest.mark.slow
def test_cp1_is_ulysses_and_hp1_is_a_ring():
    run_distributed(_cp1_is_ulysses_body, 2)


# --------------------------------------------------------------------------- traffic
class _Traffic:
    """Counts what one rank sends: P2P ops/bytes, all-to-all calls/off-rank bytes, stash copies."""

    def __init__(self, monkey):
        self.p2p = [0, 0]
        self.a2a = [0, 0]
        self.d2h = self.h2d = 0
        real_batch, real_a2a = dist.batch_isend_irecv, dist.all_to_all_single
        real_put, real_prefetch = HostStash.put, HostStash.prefetch

        def batch(ops):
            for op in ops:
                if op.op is dist.isend:
                    self.p2p[0] += 1
                    self.p2p[1] += op.tensor.numel() * op.tensor.element_size()
            return real_batch(ops)

        def a2a(out, inp, *args, group=None, **kw):
            n = dist.get_world_size(group)
            self.a2a[0] += 1
            self.a2a[1] += inp.numel() * inp.element_size() * (n - 1) // n
            return real_a2a(out, inp, *args, group=group, **kw)

        def put(stash, key, t):
            if stash.enabled:
                self.d2h += t.numel() * t.element_size()
            return real_put(stash, key, t)

        def prefetch(stash, key):
            if stash.enabled and key not in stash._inflight:
                host = stash._host[key][0]
                self.h2d += host.numel() * host.element_size()
            return real_prefetch(stash, key)

        monkey.setattr(dist, "batch_isend_irecv", batch)
        monkey.setattr(dist, "all_to_all_single", a2a)
        monkey.setattr(HostStash, "put", put)
        monkey.setattr(HostStash, "prefetch", prefetch)

    def take(self):
        got = (tuple(self.p2p), tuple(self.a2a), self.h2d, self.d2h)
        self.p2p, self.a2a, self.h2d, self.d2h = [0, 0], [0, 0], 0, 0
        return got


TRAFFIC_CASES = [  # (mesh kwargs, u, H, H_kv, D, piece)
    (dict(hp=2, cp=2), 4, 4, 2, 8, 3),
    (dict(hp=1, cp=4, inner_ring=2), 2, 4, 1, 8, 2),
    (dict(hp=4, cp=1), 4, 4, 1, 8, 1),
]


def _traffic_body(rank, world):
    with pytest.MonkeyPatch.context() as monkey:
        traffic = _Traffic(monkey)
        for kw, u, H, H_kv, D, piece in TRAFFIC_CASES:
            mesh = SequenceMesh(**kw)
            S = 2 * mesh.hp * mesh.cp * u * piece
            q, k, v, dout = (mesh.shard(t, u) for t in _inputs(S, H, H_kv, D, seed=1))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            want = attention_costs(seq_len=S, num_heads=H, num_kv_heads=H_kv, head_dim=D, hp=mesh.hp, cp=mesh.cp,
                                   inner_ring=mesh.inner_ring, num_chunks=u, dtype_bytes=4, offload=True)
            traffic.take()
            out = fpdt_attention(q, k, v, mesh=mesh, num_chunks=u, offload=True)
            assert_traffic_matches(traffic.take(), want, "fwd", kw)
            out.backward(dout)
            assert_traffic_matches(traffic.take(), want, "bwd", kw)


@pytest.mark.slow
def test_traffic_per_layer_matches_the_cost_model():
    """P2P ops and bytes, all-to-all calls and bytes, host copies: a schedule change fails here."""
    run_distributed(_traffic_body, 4)


def test_ring_traffic_does_not_grow_with_chunks():
    per_u = [attention_costs(seq_len=1 << 16, num_heads=32, num_kv_heads=8, head_dim=128, hp=4, cp=2, num_chunks=u)
             for u in (1, 2, 4, 8)]
    assert len({(c.p2p_bytes_fwd, c.p2p_bytes_bwd) for c in per_u}) == 1


def test_costs_8b_1m():
    """Llama-3-8B shape at 1M tokens: the figures quoted in the docs."""
    kw = dict(seq_len=1 << 20, num_heads=32, num_kv_heads=8, head_dim=128, num_chunks=16)
    c42 = attention_costs(hp=4, cp=2, **kw)
    c81 = attention_costs(hp=8, cp=1, **kw)
    MiB = 1 << 20
    assert c42.p2p_bytes_fwd == 512 * MiB and c42.p2p_bytes_bwd == (512 + 2048) * MiB
    assert c81.p2p_bytes == 0
    assert c42.all_to_all_bytes_fwd == 1920 * MiB and c81.all_to_all_bytes_fwd == 2240 * MiB


def _errors_body(rank, world):
    mesh = SequenceMesh(hp=2, cp=2)
    q = torch.randn(1, 6, 4, 8)  # S = 24, not a multiple of 2*2*2*4 = 32
    with pytest.raises(ValueError, match=r"S=24 is not divisible by 2\*hp\*cp\*num_chunks=2\*2\*2\*4=32"):
        fpdt_attention(q, q, q, mesh=mesh, num_chunks=4)
    with pytest.raises(ValueError, match="either group= .* or mesh="):
        fpdt_attention(q, q, q, mesh=mesh, group=dist.group.WORLD)
    q3 = torch.randn(1, 8, 3, 8)
    with pytest.raises(ValueError, match="num_heads=3 is not divisible by the sequence-parallel size 2"):
        fpdt_attention(q3, q3, q3, mesh=mesh)


@pytest.mark.slow
def test_bad_inputs_name_the_fix():
    run_distributed(_errors_body, 4)


def _single_rank_mesh(q, k, v, u, offload, backend=None):
    from fpdt.attention.fpdt_attention import FPDTAttentionFunction
    from fpdt.attention.mesh_pipeline import single_rank_mesh_spec

    spec = single_rank_mesh_spec(num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3], dtype=q.dtype,
                                 device=q.device, num_chunks=u, backend=backend)
    return FPDTAttentionFunction.apply(q, k, v, spec, offload, True)


@pytest.mark.parametrize("u", [1, 3])
def test_single_rank_mesh_pipeline_is_exact_in_float64(u):
    """The mesh pipeline's loop order, stash staging and merges with a ring of one (no comm)."""
    torch.manual_seed(u)
    q, k, v = (torch.randn(1, 12 * u, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = _single_rank_mesh(q, k, v, u, offload=True, backend="math")
    ref = reference_attention(q, k, v)
    assert_rel_close(out, ref, 1e-12, "out")
    dout = torch.randn_like(out)     # random: out.sum()'s all-ones would hide a misplaced gradient chunk
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_rel_close(a, b, 1e-12, "grad")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mesh_path(dtype):
    """On one GPU: the (1, 1) mesh through fpdt_attention, and the ring pipeline's stash and
    stream code (pinned buffers, copy streams, events) with a ring of one."""
    torch.manual_seed(0)
    u = 4
    q, k, v = (torch.randn(2, 256 * u, h, 64, device="cuda", dtype=dtype, requires_grad=True) for h in (8, 2, 2))
    g = torch.randn_like(q)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr)
    ref.backward(g.double())
    for run in (lambda: fpdt_attention(q, k, v, mesh=SequenceMesh(1, 1), num_chunks=u, offload=True),
                lambda: _single_rank_mesh(q, k, v, u, offload=True)):
        q.grad = k.grad = v.grad = None
        out = run()
        out.backward(g)
        for name, a, b in (("out", out, ref), ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad),
                           ("dv", v.grad, vr.grad)):
            assert_rel_close(a, b, TOL[dtype], f"{name} {dtype}")

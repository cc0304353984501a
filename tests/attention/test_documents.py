"""Packed documents: document-masked FPDT attention against each document run alone.

The reference runs every document of every row alone through plain float64 attention
(``reference_document_attention``); fpdt's inputs are sharded with :mod:`fpdt.layout`.
Forward output and dq/dk/dv: fp32 within 1e-5 (norm-wise relative). Also checked: the
block classification, skipped blocks (no kernel call, no K/V fetch under offload), the
attention work actually run (query-key pairs counted in the kernels) against the sum over
documents of their causal pairs, and one document = the code path without documents.
"""

import dataclasses

import pytest
import torch

from fpdt.attention import fpdt_attention
from fpdt.attention.documents import DENSE, MASKED, SKIP, Documents, UlyssesDocuments, check_doc_ids
from fpdt.attention.kernels import BACKENDS, get_backend
from fpdt.attention.kernels import masked
from fpdt.attention.kernels.masked import masked_backward, masked_forward
from fpdt.layout import shard
from fpdt.offload import fresh_runtime
from tests.attention.reference import assert_traffic_matches, assert_rel_close, doc_ids_from_lengths, reference_document_attention
from tests.distributed import run_distributed

TOL = 1e-5

# Document lengths per row (each row sums to S = 48): chunk and rank boundaries fall inside
# documents, one-token documents, a document longer than a chunk, rows that differ.
LAYOUTS = {
    "mixed": [[5, 1, 1, 17, 7, 1, 16], [48]],
    "long_and_short": [[30, 1, 17], [1, 1, 1, 45]],
    "tiny": [[1] * 48, [2] * 24],
    "one_doc": [[48], [48]],
}


def _inputs(B, S, H, H_kv, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g).to(dtype) for h in (H, H_kv, H_kv, H)]


def _reference_case(lengths, H, H_kv, D, seed, causal):
    """Global inputs for these documents and the float64 per-document reference, back-propagated:
    ``(doc, (q, k, v, dout), (qr, kr, vr), ref)``."""
    doc = doc_ids_from_lengths(lengths)
    q, k, v, dout = _inputs(*doc.shape, H, H_kv, D, seed)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_document_attention(qr, kr, vr, doc, causal=causal)
    ref.backward(dout.double())
    return doc, (q, k, v, dout), (qr, kr, vr), ref


def check_case(rank, world, *, lengths, H, H_kv, u, offload, D=8, causal=True, seed=0, backend=None, runtime=None):
    doc, (q, k, v, dout), (qr, kr, vr), ref = _reference_case(lengths, H, H_kv, D, seed, causal)
    B, S = doc.shape
    ql, kl, vl = (shard(t, world, u, rank).requires_grad_() for t in (q, k, v))
    out = fpdt_attention(ql, kl, vl, num_chunks=u, offload=offload, causal=causal, doc_ids=doc, backend=backend,
                         runtime=runtime)
    out.backward(shard(dout, world, u, rank))
    what = f"rank {rank}/{world} docs={lengths} H={H} H_kv={H_kv} u={u} offload={offload} causal={causal}"
    for name, a, b in (("out", out, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
        assert_rel_close(a, shard(b, world, u, rank), TOL, f"{name} [{what}]")


# ----------------------------------------------------------------------------- classification
def test_classification_of_blocks():
    # S = 16, one rank, u = 4 (chunks of 4): documents [0..5], [6], [7..15]
    doc = doc_ids_from_lengths([[6, 1, 9]])
    docs = UlyssesDocuments(doc, seq_len=16, sp=1, num_chunks=4, causal=True)
    kinds = {(i, j): docs.block(i, j).kind for i in range(4) for j in range(i + 1)}
    assert kinds == {(0, 0): DENSE, (1, 0): MASKED, (1, 1): MASKED, (2, 0): SKIP, (2, 1): MASKED, (2, 2): DENSE,
                     (3, 0): SKIP, (3, 1): MASKED, (3, 2): DENSE, (3, 3): DENSE}
    # chunk 1 = tokens 4..7 = docs 0,0,1,2; chunk 0 = doc 0: queries 4,5 see keys 0..3
    assert docs.block(1, 0).segments == ((0, 0, 2, 0, 4),)
    assert docs.block(1, 1).segments == ((0, 0, 2, 0, 2), (0, 2, 3, 2, 3), (0, 3, 4, 3, 4))
    # pairs over all blocks = sum over documents of n (n + 1) / 2
    assert sum(docs.block(i, j).pairs for i in range(4) for j in range(i + 1)) == 21 + 1 + 45
    # sp = 2: head-layout chunk i is the global span [8 i, 8 i + 8)
    docs2 = UlyssesDocuments(doc_ids_from_lengths([[8, 8]]), seq_len=16, sp=2, num_chunks=2, causal=True)
    assert [docs2.block(1, 0).kind, docs2.block(1, 1).kind] == [SKIP, DENSE]


def test_bad_doc_ids_name_the_fix():
    with pytest.raises(ValueError, match="non-decreasing"):
        check_doc_ids(torch.tensor([[0, 1, 0]]), 1, 3)
    with pytest.raises(ValueError, match=r"\[B, S\]=\[1, 4\]"):
        check_doc_ids(torch.zeros(1, 3, dtype=torch.long), 1, 4)
    with pytest.raises(ValueError, match="integer tensor"):
        check_doc_ids(torch.zeros(1, 4), 1, 4)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"\[B, S\]=\[1, 8\]"):
        fpdt_attention(q, q, q, num_chunks=2, doc_ids=torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="B=1 .one row per batch row"):
        fpdt_attention(q, q, q, num_chunks=2, doc_ids=torch.zeros(2, 8, dtype=torch.long))


def test_documents_are_classified_once_per_doc_ids_tensor():
    from fpdt.attention.documents import cached_documents
    doc = doc_ids_from_lengths([[20, 28]])
    geometry = dict(seq_len=48, sp=1, num_chunks=4, causal=True)
    first = cached_documents(UlyssesDocuments, doc, **geometry)
    assert cached_documents(UlyssesDocuments, doc, **geometry) is first
    assert cached_documents(UlyssesDocuments, doc.clone(), **geometry) is not first   # another tensor
    doc[0, -1] += 1                                                                  # modified in place
    assert cached_documents(UlyssesDocuments, doc, **geometry) is not first


# ----------------------------------------------------------------------------- masked kernels
@pytest.mark.parametrize("backend,path", [("cpu", "segments"), ("cpu", "mask"), ("math", "segments")])
@pytest.mark.parametrize("diagonal", [True, False])
def test_masked_kernel_rows_without_keys(monkeypatch, backend, path, diagonal):
    """Exact against masked float64 math; rows that see no key: lse -inf, out 0, no NaN;
    backward with a merged (out, lse) from elsewhere gives those rows zero gradient.
    Both CPU paths: one dense call per segment, and one call with a mask."""
    monkeypatch.setattr(masked, "MASK_MIN_CALLS", 0 if path == "mask" else 1 << 30)
    S = 12
    qdoc = doc_ids_from_lengths([[2, 3, 7], [12]])
    kdoc = qdoc if diagonal else doc_ids_from_lengths([[9, 3], [12]]) - 1   # keys of docs -1, 0 (+ 1, 2 ...)
    docs = Documents(torch.cat([kdoc, qdoc], 1) if not diagonal else qdoc, causal=True)
    if diagonal:
        docs.add_side("q", torch.arange(S))
        blk = docs.block("q", "q")
    else:
        docs.add_side("k", torch.arange(S))
        docs.add_side("q", torch.arange(S, 2 * S))
        blk = docs.block("q", "k")
    assert blk.kind == MASKED
    assert masked.uses_mask(BACKENDS[backend], blk, 2) == (path == "mask")
    q, k, v, dout = _inputs(2, S, 4, 2, 8, seed=3)
    b = get_backend(backend, torch.device("cpu"), torch.float32, 8)
    out, lse = masked_forward(b, q, k, v, blk, 0.3)
    mask = torch.zeros(2, S, S, dtype=torch.bool)
    for row, q0, q1, k0, k1 in blk.segments:
        m = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        mask[row, q0:q1, k0:k1] = m.tril() if blk.causal else m
    kx = k.double().repeat_interleave(2, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kx) * 0.3
    s = s.masked_fill(~mask[:, None], float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    none = ~mask.any(-1)                                         # [B, Sq] rows that see nothing
    assert none.any() != diagonal
    assert torch.isneginf(lse.transpose(1, 2)[none]).all() and (out[none] == 0).all()
    assert not out.isnan().any() and not lse.isnan().any()
    see = ~none
    assert_rel_close(lse.transpose(1, 2)[see], ref_lse.transpose(1, 2)[see], 1e-6, "lse")
    p = torch.exp(s - ref_lse[..., None]).nan_to_num(0.0)
    ref_out = torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(2, 2))
    assert_rel_close(out, ref_out, 1e-6, "out")
    # backward from a merged lse that is finite everywhere (another block saw those rows)
    lse_final = torch.where(see[:, None, :], ref_lse, torch.full_like(ref_lse, 0.7)).float()
    dq, dk, dv = masked_backward(b, dout, q, k, v, out, lse_final, blk, 0.3)
    # the block's share of the gradient given the final (out, lse) (the math kernel's formula, masked)
    kk, vv, do = kx, v.double().repeat_interleave(2, 2), dout.double()
    pd = torch.exp(s - lse_final.double()[..., None])
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]
    ds = pd * (torch.einsum("bqhd,bkhd->bhqk", do, vv) - delta)
    gq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * 0.3
    gk = (torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * 0.3).view(2, S, 2, 2, 8).sum(3)
    gv = torch.einsum("bhqk,bqhd->bkhd", pd, do).view(2, S, 2, 2, 8).sum(3)
    for name, a, r in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
        assert not a.isnan().any()
        assert_rel_close(a, r, 1e-5, name)
    assert (dq[none] == 0).all()


# ----------------------------------------------------------------------------- pipeline, one rank
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("u", [1, 2, 3, 8])
def test_one_rank_parity(layout, u):
    """MHA, GQA and MQA with and without offload, two of them per (layout, u)."""
    configs = ((4, 4, False), (4, 2, True), (6, 2, False), (4, 1, True))
    for n in (u % 2, u % 2 + 2):
        H, H_kv, offload = configs[n]
        check_case(0, 1, lengths=LAYOUTS[layout], H=H, H_kv=H_kv, u=u, offload=offload, seed=10 * u + n)


def test_non_causal_and_hundred_tiny_documents():
    check_case(0, 1, lengths=LAYOUTS["mixed"], H=4, H_kv=2, u=4, offload=True, causal=False)
    lengths = [[2] * 100, [1] * 50 + [150]]       # 100 tiny documents; S = 200
    check_case(0, 1, lengths=lengths, H=4, H_kv=2, u=4, offload=True, seed=5)


def test_simulated_cuda_runtime():
    with fresh_runtime("sim") as rt:
        check_case(0, 1, lengths=LAYOUTS["mixed"], H=4, H_kv=2, u=4, offload=True, seed=7, runtime=rt)


def test_float64_math_backend_is_exact():
    doc = doc_ids_from_lengths(LAYOUTS["mixed"])
    q, k, v = (torch.randn(2, 48, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = fpdt_attention(q, k, v, num_chunks=6, offload=True, backend="math", doc_ids=doc)
    ref = reference_document_attention(q, k, v, doc)
    assert_rel_close(out, ref, 1e-12, "out")
    dout = torch.randn_like(out)     # random: out.sum()'s all-ones would hide a misplaced gradient chunk
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_rel_close(a, b, 1e-12, "grad")


def test_one_document_is_the_path_without_documents_bit_for_bit():
    q, k, v, dout = _inputs(2, 48, 4, 2, 8, seed=1)
    results = []
    for doc in (None, torch.zeros(2, 48, dtype=torch.long), torch.full((2, 48), 7)):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = fpdt_attention(qs, ks, vs, num_chunks=4, offload=True, doc_ids=doc)
        out.backward(dout)
        results.append((out, qs.grad, ks.grad, vs.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


# ----------------------------------------------------------------------------- skipped work, counted
def _counting_backend(monkeypatch):
    """The CPU backend under another name, counting kernel calls and (query, key) pairs."""
    counts = {"fwd": 0, "bwd": 0, "pairs": 0}
    base = BACKENDS["cpu"]

    def pairs(q, k, causal):
        n_q, n_k = q.shape[1], k.shape[1]
        return q.shape[0] * (n_q * (n_q + 1) // 2 if causal else n_q * n_k)

    def forward(q, k, v, causal, scale):
        counts["fwd"] += 1
        counts["pairs"] += pairs(q, k, causal)
        return base.forward(q, k, v, causal, scale)

    def backward(dout, q, k, v, out, lse, causal, scale):
        counts["bwd"] += 1
        return base.backward(dout, q, k, v, out, lse, causal, scale)

    monkeypatch.setitem(BACKENDS, "counting", dataclasses.replace(base, name="counting", forward=forward,
                                                                  backward=backward))
    get_backend("counting", torch.device("cpu"), torch.float32, 8)   # its self-check, before counting
    counts.update(fwd=0, bwd=0, pairs=0)
    return counts


def test_skipped_blocks_make_no_kernel_call_and_no_fetch(monkeypatch):
    counts = _counting_backend(monkeypatch)
    lengths = [[12, 12, 12, 12]]            # u = 4 chunks of 12: one document per chunk
    doc = doc_ids_from_lengths(lengths)
    q, k, v, dout = _inputs(1, 48, 4, 2, 8, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with fresh_runtime("sim", log=True) as rt:
        out = fpdt_attention(q, k, v, num_chunks=4, offload=True, doc_ids=doc, backend="counting", runtime=rt)
        fetched_fwd = [role for _, _, role in rt.log if role.startswith(("k ", "v "))]
        out.backward(dout)
    # only the 4 diagonal blocks are seen: 4 kernel calls each way, and no K/V fetch in forward
    assert counts == {"fwd": 4, "bwd": 4, "pairs": 4 * 12 * 13 // 2}
    assert fetched_fwd == [f"{x} chunk {i}" for i in range(4) for x in "kv"]   # the stash puts (d2h) only
    assert rt.counters.copies_h2d == 4 * 2 + 4 * 3        # backward: k, v per outer step; q, o, lse per step
    check = reference_document_attention(q.double(), k.double(), v.double(), doc)
    assert_rel_close(out, check, TOL, "out")


@pytest.mark.parametrize("layout,u", [("mixed", 4), ("long_and_short", 3), ("tiny", 8), ("one_doc", 2)])
def test_work_run_equals_the_documents_causal_pairs(monkeypatch, layout, u):
    counts = _counting_backend(monkeypatch)
    lengths = LAYOUTS[layout]
    doc = doc_ids_from_lengths(lengths)
    q, k, v, _ = _inputs(2, 48, 4, 2, 8, seed=4)
    docs = UlyssesDocuments(doc, seq_len=48, sp=1, num_chunks=u, causal=True)
    fpdt_attention(q, k, v, num_chunks=u, doc_ids=doc, backend="counting")
    expected = sum(n * (n + 1) // 2 for row in lengths for n in row)
    assert counts["pairs"] == expected == sum(docs.block(i, j).pairs for i in range(u) for j in range(i + 1))
    visible = sum(docs.visible(i, j) for i in range(u) for j in range(i + 1))
    assert visible <= u * (u + 1) // 2


# ----------------------------------------------------------------------------- several ranks
def _ranks_body(rank, world):
    for n, (layout, u, H_kv, offload) in enumerate((("mixed", 1, 2, False), ("mixed", 3, 4, True),
                                                    ("long_and_short", 2, 1, True), ("tiny", 2, 2, False),
                                                    ("mixed", 6 // world if world < 4 else 3, 2, True))):
        if 48 % (world * u):
            continue
        check_case(rank, world, lengths=LAYOUTS[layout], H=4, H_kv=H_kv, u=u, offload=offload, seed=n)
    with fresh_runtime("sim") as rt:
        check_case(rank, world, lengths=LAYOUTS["mixed"], H=4, H_kv=2, u=2, offload=True, seed=9, runtime=rt)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_parity(world):
    run_distributed(_ranks_body, world, timeout=300)


# ----------------------------------------------------------------------------- the 2D mesh
def check_mesh_case(mesh, *, lengths, u, H, H_kv, offload, D=8, causal=True, seed=0, runtime=None):
    from tests.attention.reference import assert_rel_close as close
    doc, (q, k, v, dout), (qr, kr, vr), ref = _reference_case(lengths, H, H_kv, D, seed, causal)
    B, S = doc.shape
    ql, kl, vl = (mesh.shard(t, u).requires_grad_() for t in (q, k, v))
    out = fpdt_attention(ql, kl, vl, mesh=mesh, num_chunks=u, offload=offload, causal=causal, doc_ids=doc,
                         runtime=runtime)
    out.backward(mesh.shard(dout, u))
    what = f"{mesh} docs={lengths} u={u} H={H} H_kv={H_kv} offload={offload} causal={causal}"
    for name, a, b in (("out", out, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
        close(a, mesh.shard(b, u), TOL, f"{name} [{what}]")


def _mesh_body(rank, world):
    from fpdt.comm import SequenceMesh
    meshes = [SequenceMesh(hp=2, cp=2), SequenceMesh(hp=1, cp=4, inner_ring=2)]
    for m, mesh in enumerate(meshes):
        for n, (layout, u, H_kv, offload) in enumerate((("mixed", 1, 2, True), ("mixed", 3, 4, False),
                                                        ("long_and_short", 2, 1, True), ("tiny", 3, 2, True))):
            if 48 % (2 * 4 * u):
                u = 1
            check_mesh_case(mesh, lengths=LAYOUTS[layout], u=u, H=4, H_kv=H_kv, offload=offload, seed=10 * m + n)
    check_mesh_case(meshes[0], lengths=LAYOUTS["mixed"], u=2, H=4, H_kv=2, offload=True, causal=False)
    with fresh_runtime("sim") as rt:
        check_mesh_case(meshes[1], lengths=LAYOUTS["mixed"], u=2, H=4, H_kv=2, offload=True, seed=99, runtime=rt)
    # one document: the mesh path without documents, bit for bit
    q, k, v, dout = _inputs(2, 48, 4, 2, 8, seed=5)
    results = []
    for doc in (None, torch.zeros(2, 48, dtype=torch.long)):
        ql, kl, vl = (meshes[0].shard(t, 3).requires_grad_() for t in (q, k, v))
        out = fpdt_attention(ql, kl, vl, mesh=meshes[0], num_chunks=3, offload=True, doc_ids=doc)
        out.backward(meshes[0].shard(dout, 3))
        results.append((out, ql.grad, kl.grad, vl.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.slow
def test_mesh_parity():
    run_distributed(_mesh_body, 4, timeout=400)


# ----------------------------------------------------------------------------- the projected layer
def test_layer_with_restarting_positions_equals_each_document_alone():
    """FPDTAttention (projections, RoPE at positions restarting per document, o_proj) vs each
    document through the float64 reference layer alone, forward and every gradient."""
    from fpdt.attention import FPDTAttention, RotaryEmbedding, default_inv_freq
    from tests.attention.reference import reference_layer
    torch.manual_seed(0)
    lengths = [5, 1, 1, 17, 7, 1, 16]
    hidden, H, H_kv, D, u = 24, 4, 2, 6, 3
    layer = FPDTAttention(hidden, H, H_kv, D, qkv_bias=True, num_chunks=u, offload=True)
    doc = doc_ids_from_lengths([lengths])
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    x, dout = torch.randn(1, 48, hidden), torch.randn(1, 48, hidden)
    names = {"wq": "q_proj.weight", "bq": "q_proj.bias", "wk": "k_proj.weight", "bk": "k_proj.bias",
             "wv": "v_proj.weight", "bv": "v_proj.bias", "wo": "o_proj.weight"}
    params = {k: layer.get_parameter(n).detach().double().requires_grad_() for k, n in names.items()}
    xr = x.double().requires_grad_()
    starts = [0] + torch.tensor(lengths).cumsum(0).tolist()
    ref = torch.cat([reference_layer(xr[:, a:b], pos[:, a:b], params, (H, H_kv, D))
                     for a, b in zip(starts[:-1], starts[1:])], dim=1)
    ref.backward(dout.double())
    xl = x.clone().requires_grad_()
    out = layer(xl, pos, RotaryEmbedding(default_inv_freq(D)), doc_ids=doc)
    out.backward(dout)
    assert_rel_close(out, ref, TOL, "out")
    assert_rel_close(xl.grad, xr.grad, TOL, "d_hidden")
    for key, name in names.items():
        assert_rel_close(layer.get_parameter(name).grad, params[key].grad, TOL, f"{name}.grad")


# ----------------------------------------------------------------------------- costs against what runs
def _layer_volume_body(rank, world, lengths, u):
    from fpdt.attention import FPDTAttention
    from fpdt.attention.offload_volume import attention_layer_copy_bytes
    doc = doc_ids_from_lengths(lengths)
    B, S = doc.shape
    torch.manual_seed(0)
    with fresh_runtime("sim") as rt:
        layer = FPDTAttention(32, 4, 2, 8, num_chunks=u, offload=True, runtime=rt)
        layer.o_proj.requires_grad_(False)    # the attention's own copies (o_proj's read-back: tests/offload)
        x = torch.randn(B, S // world, 32, requires_grad=True)
        pos = shard(torch.arange(S).expand(B, S), world, u, rank)
        out = layer(x, pos, None, doc_ids=doc)
        out.backward(torch.randn_like(out))
        got = (rt.counters.bytes_d2h, rt.counters.bytes_h2d)
    want = attention_layer_copy_bytes(batch=B, seq_local=S // world, hidden=32, num_heads=4, num_kv_heads=2,
                                      head_dim=8, sp=world, num_chunks=u, dtype=torch.float32, doc_ids=doc)
    dense = attention_layer_copy_bytes(batch=B, seq_local=S // world, hidden=32, num_heads=4, num_kv_heads=2,
                                       head_dim=8, sp=world, num_chunks=u, dtype=torch.float32)
    assert got == (want.d2h, want.h2d), (got, want)
    return want, dense


@pytest.mark.parametrize("lengths,u", [([[12, 12, 12, 12]], 4), ([[5, 1, 1, 17, 7, 1, 16]], 6),
                                       ([[48]], 3), ([[1] * 24 + [24]], 4)])
def test_copy_volume_with_documents_matches_the_formula(lengths, u):
    want, dense = _layer_volume_body(0, 1, lengths, u)
    if len(lengths[0]) > 1 and lengths[0][0] < 48 // u:
        assert want.h2d < dense.h2d                    # skipped blocks fetch nothing
    if lengths == [[48]]:
        assert want == dense


def _mesh_traffic_body(rank, world):
    from fpdt.attention.ring_costs import attention_costs
    from fpdt.comm import SequenceMesh
    from tests.attention.test_mesh_attention import _Traffic
    counts = {"pairs": 0}
    base = BACKENDS["cpu"]

    def forward(q, k, v, causal, scale):
        n_q, n_k = q.shape[1], k.shape[1]
        counts["pairs"] += q.shape[0] * (n_q * (n_q + 1) // 2 if causal else n_q * n_k)
        return base.forward(q, k, v, causal, scale)

    with pytest.MonkeyPatch.context() as monkey:
        monkey.setitem(BACKENDS, "counting", dataclasses.replace(base, name="counting", forward=forward))
        get_backend("counting", torch.device("cpu"), torch.float32, 8)
        traffic = _Traffic(monkey)
        for kw, lengths, u in ((dict(hp=2, cp=2), [[5, 1, 1, 17, 7, 1, 16]], 3),
                               (dict(hp=1, cp=4, inner_ring=2), [[6, 18, 24], [1] * 16 + [32]], 2),
                               (dict(hp=4, cp=1), [[20, 28]], 2)):
            mesh = SequenceMesh(**kw)
            doc = doc_ids_from_lengths(lengths)
            B, S = doc.shape
            q, k, v, dout = (mesh.shard(t, u) for t in _inputs(B, S, 4, 2, 8, seed=1))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            want = attention_costs(seq_len=S, num_heads=4, num_kv_heads=2, head_dim=8, hp=mesh.hp, cp=mesh.cp,
                                   inner_ring=mesh.inner_ring, num_chunks=u, dtype_bytes=4, offload=True,
                                   doc_ids=doc, cp_rank=mesh.cp_rank)
            traffic.take()
            counts["pairs"] = 0
            out = fpdt_attention(q, k, v, mesh=mesh, num_chunks=u, offload=True, doc_ids=doc, backend="counting")
            assert_traffic_matches(traffic.take(), want, "fwd", kw)
            # the work run: this rank's pairs as counted in the kernels = the cost model's, and over
            # the CP ranks the sum over documents of n (n + 1) / 2
            assert counts["pairs"] == want.attention_pairs, (kw, counts, want.attention_pairs)
            total = torch.tensor(counts["pairs"])
            torch.distributed.all_reduce(total)
            assert total.item() == mesh.hp * sum(n * (n + 1) // 2 for row in lengths for n in row)
            out.backward(dout)
            assert_traffic_matches(traffic.take(), want, "bwd", kw)


@pytest.mark.slow
def test_mesh_traffic_and_work_match_the_cost_model():
    """Per rank: P2P, all-to-all, host copies (skipped touches fetch nothing) and the
    (query, key) pairs the kernels compute, against ring_costs with the documents."""
    run_distributed(_mesh_traffic_body, 4, timeout=300)

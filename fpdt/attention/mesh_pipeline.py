"""2D attention pipeline: Ulysses over HP x load-balanced (double) ring over CP x FPDT chunks.

Same callbacks and stash as :mod:`fpdt.attention.pipeline`, tokens in the mesh layout
(:mod:`fpdt.layout.mesh_layout`): after the HP all-to-all, CP rank ``c`` holds zigzag pieces ``c``
and ``2cp-1-c`` of each span, head layout ``[B, C, H/hp, D]``. K/V travel packed as ``[2, B, C,
H_kv'/hp, D]`` (GQA replication before the all-to-all). Stashed: q̂, the K/V blocks, o, lse, dô
and the fp32 dq accumulators. With ``cp = 1`` :func:`build_mesh_spec` returns the FPDT pipeline's
spec. Loop order and block kinds: ``docs/attention.md`` (The mesh pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fpdt.attention.documents import DENSE, SKIP, Block, MeshDocuments, cached_documents
from fpdt.attention.kernels import AttentionBackend, default_scale, get_backend
from fpdt.attention.kernels.masked import masked_backward, masked_forward
from fpdt.attention.merge import merge
from fpdt.attention.pipeline import (Deliver, Emit, Keep, PipelineSpec, Produce, build_spec, pipeline_backward,
                                     pipeline_forward)
from fpdt.attention.saved_attention import replay_forward
from fpdt.comm import (PendingAllToAll, RingComm, RingSchedule, SequenceMesh, group_size, heads_to_seq,
                       heads_to_seq_packed, kv_replication_factor, replicate_kv, start_seq_to_heads_packed,
                       sum_kv_replicas)
from fpdt.comm.ring import TAG_GRAD, TAG_INNER, TAG_OUTER
from fpdt.layout import check_mesh_layout
from fpdt.offload import HostStash

FULL, CAUSAL, K_FIRST, Q_SECOND = "full", "causal", "k_first", "q_second"


def touch_kind(i: int, j: int, src: int, me: int, causal: bool) -> str | None:
    """How query chunk i of CP rank ``me`` meets KV chunk j of CP rank ``src`` (module
    docstring; None: skipped)."""
    if not causal or j < i:
        return FULL
    if j > i:
        return None
    return CAUSAL if src == me else (K_FIRST if src < me else Q_SECOND)


@dataclass
class MeshSpec:
    """Static description of one mesh attention call (cp > 1; :func:`single_rank_mesh_spec`
    builds a ring of one, which runs this pipeline's stash and stream code on one device)."""

    mesh: SequenceMesh
    comm: RingComm
    schedule: RingSchedule
    num_chunks: int
    causal: bool
    scale: float
    backend: AttentionBackend
    kv_factor: int
    acc_dtype: torch.dtype
    label: str | None = None    # names the caller in offload errors, e.g. "layer 2"
    docs: MeshDocuments | None = None   # packed documents (:mod:`fpdt.attention.documents`); None = one
    _last_touch: dict | None = None
    saved: object | None = None     # the call's SavedAttention (attention_checkpoint="save"), taken by the Function
    runtime: object | None = None   # the stash's device runtime (a Runtime, a name, or None: automatic)

    @property
    def hp_group(self):
        return self.mesh.hp_group

    @property
    def cp(self) -> int:
        return self.mesh.cp

    def q_blocks(self, j: int) -> list[int]:
        """Query chunks that attend to KV chunk j."""
        return list(range(j, self.num_chunks)) if self.causal else list(range(self.num_chunks))

    def kind(self, i: int, j: int, src: int) -> str | None:
        """How query chunk i of this rank meets KV chunk j of CP rank ``src`` (``docs/attention.md``)."""
        return touch_kind(i, j, src, self.mesh.cp_rank, self.causal)

    def last_pass(self, i: int) -> int:
        """The KV chunk after whose pass query chunk i is final."""
        return i if self.causal else self.num_chunks - 1

    def doc_block(self, i: int, j: int, src: int, kind: str) -> Block | None:
        """The documents' view of a touch (None without documents)."""
        if self.docs is None:
            return None
        return self.docs.mesh_block(i, j, src, 1 if kind == Q_SECOND else None, 0 if kind == K_FIRST else None)

    def is_last_touch(self, i: int, j: int, s: int) -> bool:
        """Whether ring step ``s`` of pass ``j`` is query chunk i's last touch (it is final after it)."""
        if self.docs is None:
            return j == self.last_pass(i) and s == self.cp - 1
        if self._last_touch is None:
            self._last_touch = {}
            for jj in range(self.num_chunks):
                for ss in range(self.cp):
                    for ii, _ in _touches(self, jj, self.schedule.owner(ss)):
                        self._last_touch[ii] = (jj, ss)
        return self._last_touch[i] == (j, s)


def build_mesh_spec(*, seq_local: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device, mesh: SequenceMesh, num_chunks: int, causal: bool,
                    softmax_scale: float | None, backend: str | None, doc_ids: torch.Tensor | None = None
                    ) -> MeshSpec | PipelineSpec:
    """Validate one call on ``mesh`` (errors name the fix); ``cp = 1`` gives the Ulysses spec.
    ``doc_ids``: packed documents ``[B, S]`` (global order), None = one document."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1")
    check_mesh_layout(seq_local * mesh.sp, mesh.hp, mesh.cp, num_chunks)
    if mesh.cp == 1:
        return build_spec(seq_local=seq_local, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          dtype=dtype, device=device, group=mesh.hp_group, num_chunks=num_chunks, causal=causal,
                          softmax_scale=softmax_scale, backend=backend, doc_ids=doc_ids)
    docs = None if doc_ids is None else cached_documents(
        MeshDocuments, doc_ids, seq_len=seq_local * mesh.sp, hp=mesh.hp, cp=mesh.cp, num_chunks=num_chunks,
        causal=causal, cp_rank=mesh.cp_rank)
    return MeshSpec(docs=docs,
        mesh=mesh, comm=RingComm(mesh.cp_ranks, mesh.cp_group, mesh.cp_outer_group),
        schedule=RingSchedule(mesh.cp, mesh.inner_ring, mesh.cp_rank), num_chunks=num_chunks, causal=causal,
        scale=default_scale(head_dim) if softmax_scale is None else float(softmax_scale),
        backend=get_backend(backend, device, dtype, head_dim),
        kv_factor=kv_replication_factor(num_heads, num_kv_heads, mesh.hp),
        acc_dtype=torch.float64 if dtype == torch.float64 else torch.float32)


def single_rank_mesh_spec(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device, num_chunks: int, causal: bool = True,
                          backend: str | None = None) -> MeshSpec:
    """A :class:`MeshSpec` for one rank (hp = cp = 1, no process group): the mesh pipeline's loops,
    stash traffic and merges without communication, for single-device checks.
    """
    if group_size(None) > 1:
        raise ValueError("single_rank_mesh_spec is for a world of one process; build a SequenceMesh for more")
    mesh = SequenceMesh(hp=1, cp=1)
    return MeshSpec(mesh=mesh, comm=RingComm([0], None), schedule=RingSchedule(1, 1, 0), num_chunks=num_chunks,
                    causal=causal, scale=default_scale(head_dim), backend=get_backend(backend, device, dtype, head_dim),
                    kv_factor=kv_replication_factor(num_heads, num_kv_heads, 1),
                    acc_dtype=torch.float64 if dtype == torch.float64 else torch.float32)


# ----------------------------------------------------------------------------- the ring
def ring_pass(spec: MeshSpec, block: torch.Tensor, visit: Callable[[int, int, torch.Tensor], None]) -> None:
    """Circulate this rank's ``block`` over the CP group (double ring when ``w < cp``);
    ``visit(step, src, blk)`` runs once per step with CP rank ``src``'s block while the next is in
    flight (the outer transfer on ``mesh.cp_outer_group``).
    """
    sched, comm = spec.schedule, spec.comm
    cur, outer = block, None
    for s in range(spec.cp):
        if sched.sends_outer(s):  # in flight for the whole inner ring
            to, frm = sched.outer_peers()
            outer_recv = torch.empty_like(cur)
            pending = comm.exchange([(cur, to, TAG_OUTER)], [(outer_recv, frm, TAG_OUTER)], outer=True)
            outer = (pending, outer_recv)
        inner = None
        if sched.sends_inner(s):
            to, frm = sched.inner_peers()
            inner_recv = torch.empty_like(cur)
            inner = (comm.exchange([(cur, to, TAG_INNER)], [(inner_recv, frm, TAG_INNER)]), inner_recv)
        visit(s, sched.owner(s), cur)
        if inner is not None:
            inner[0].wait()
            cur = inner[1]
        elif s + 1 < spec.cp:  # the inner ring is done: the next outer step starts from the outer block
            outer[0].wait()
            cur, outer = outer[1], None


def _touches(spec: MeshSpec, j: int, src: int) -> list[tuple[int, str]]:
    """(query chunk, kind) of every block pass j's ring step with ``src``'s block computes
    (no block whose queries see none of its keys)."""
    return [(i, k) for i in spec.q_blocks(j) if (k := spec.kind(i, j, src)) is not None
            and (spec.docs is None or spec.doc_block(i, j, src, k).kind != SKIP)]


def _next_first_touch(spec: MeshSpec, j: int, s: int) -> int | None:
    """Query chunk of the first touch after ring step ``s`` of KV pass ``j`` (None at the end)."""
    if s + 1 < spec.cp:
        touches = _touches(spec, j, spec.schedule.owner(s + 1))
    elif j + 1 < spec.num_chunks:
        touches = _touches(spec, j + 1, spec.mesh.cp_rank)
    else:
        return None
    return touches[0][0] if touches else None


def _prefetch(stash: HostStash, names: tuple[str, ...], i: int | None) -> None:
    if i is None:
        return
    for name in names:
        if (name, i) in stash:
            stash.prefetch((name, i))


# ----------------------------------------------------------------------------- forward
def _start_to_heads(spec: MeshSpec, produce: Produce, i: int) -> PendingAllToAll:
    q, k, v = produce(i)
    return start_seq_to_heads_packed((q, replicate_kv(k, spec.kv_factor), replicate_kv(v, spec.kv_factor)),
                                     spec.hp_group)


def _block_forward(spec: MeshSpec, kind: str, q: torch.Tensor, kv: torch.Tensor, blk: Block | None = None):
    """(rows, o_blk, lse_blk): this block's partial attention for query rows ``rows``
    (``blk``: its documents, None or dense for the dense kernel)."""
    half = q.shape[1] // 2
    k, v = kv[0], kv[1]
    if kind == K_FIRST:
        k, v = k[:, :half], v[:, :half]
    rows = slice(half, None) if kind == Q_SECOND else slice(None)
    if blk is not None and blk.kind != DENSE:
        return (rows, *masked_forward(spec.backend, q[:, rows], k, v, blk, spec.scale))
    o, lse = spec.backend.forward(q[:, rows], k, v, kind == CAUSAL, spec.scale)
    return rows, o, lse


def mesh_forward(spec: MeshSpec, produce: Produce, emit: Emit, stash: HostStash, for_backward: bool = True,
                 keep: Keep | None = None) -> None:
    """Forward; leaves ``("kv"|"q"|"o"|"lse", i)`` in ``stash`` for backward (nothing without
    ``for_backward``). ``emit(i, out_i)`` gets each output chunk in sequence layout; ``keep(i,
    o_i, lse_i)``, when given, its final output (head layout) and lse."""
    u = spec.num_chunks
    pending = _start_to_heads(spec, produce, 0)
    for i in range(u):
        q_h, k_h, v_h = pending.wait()
        pending = _start_to_heads(spec, produce, i + 1) if i + 1 < u else None
        stash.put(("q", i), q_h)
        stash.put(("kv", i), torch.stack((k_h, v_h)))
        del q_h, k_h, v_h
    for j in range(u):
        block = stash.get(("kv", j)) if for_backward else stash.pop(("kv", j))

        def visit(s, src, kv, j=j):
            touches = _touches(spec, j, src)
            for n, (i, kind) in enumerate(touches):
                if n + 1 < len(touches):  # double buffer: the next touch's query side copies in now
                    _prefetch(stash, ("q", "oacc", "lseacc"), touches[n + 1][0])
                final = spec.is_last_touch(i, j, s)
                q = stash.get(("q", i)) if for_backward or not final else stash.pop(("q", i))
                rows, o_blk, lse_blk = _block_forward(spec, kind, q, kv, spec.doc_block(i, j, src, kind))
                if ("oacc", i) not in stash and rows != slice(None):  # documents: a first touch of half the rows
                    acc_o = torch.zeros(q.shape, dtype=spec.acc_dtype, device=q.device)
                    acc_lse = torch.full(lse_blk.shape[:2] + q.shape[1:2], float("-inf"), dtype=spec.acc_dtype,
                                         device=q.device)
                    acc_o[:, rows], acc_lse[:, :, rows] = o_blk, lse_blk
                elif ("oacc", i) not in stash:  # first touch: own block, every row
                    acc_o, acc_lse = o_blk.to(spec.acc_dtype), lse_blk.to(spec.acc_dtype)
                else:
                    acc_o, acc_lse = stash.pop(("oacc", i)), stash.pop(("lseacc", i))
                    acc_o[:, rows], acc_lse[:, :, rows] = merge(acc_o[:, rows], acc_lse[:, :, rows],
                                                                o_blk.to(spec.acc_dtype), lse_blk.to(spec.acc_dtype))
                if final:
                    o_i = acc_o.to(q.dtype)
                    if keep is not None:
                        keep(i, o_i, acc_lse)
                    if for_backward:
                        stash.put(("o", i), o_i)
                        stash.put(("lse", i), acc_lse)
                    emit(i, heads_to_seq(o_i, spec.hp_group))
                else:
                    stash.put(("oacc", i), acc_o)
                    stash.put(("lseacc", i), acc_lse)
                del q, o_blk, lse_blk, acc_o, acc_lse
            # the next step's first touch copies in while this step's transfer finishes
            _prefetch(stash, ("q", "oacc", "lseacc"), _next_first_touch(spec, j, s))

        ring_pass(spec, block, visit)
        del block
    if not for_backward:
        stash.clear()


# ----------------------------------------------------------------------------- backward
def _block_backward(spec: MeshSpec, kind: str, do, q, kv, o, lse, blk: Block | None = None):
    """(rows, keys, dq, dk, dv): this block's gradient contributions and where they go."""
    half = q.shape[1] // 2
    k, v = kv[0], kv[1]
    keys = slice(None, half) if kind == K_FIRST else slice(None)
    rows = slice(half, None) if kind == Q_SECOND else slice(None)
    if kind == Q_SECOND:
        do, q, o, lse = do[:, rows], q[:, rows], o[:, rows], lse[:, :, rows].contiguous()
    if blk is not None and blk.kind != DENSE:
        dq, dk, dv = masked_backward(spec.backend, do, q, k[:, keys], v[:, keys], o, lse, blk, spec.scale)
    else:
        dq, dk, dv = spec.backend.backward(do, q, k[:, keys], v[:, keys], o, lse, kind == CAUSAL, spec.scale)
    return rows, keys, dq, dk, dv


def mesh_backward(spec: MeshSpec, grad_out_chunk: Callable[[int], torch.Tensor], deliver: Deliver,
                  stash: HostStash) -> None:
    """Backward over what :func:`mesh_forward` left in ``stash`` (emptied); ``deliver(j, dq_j, dk_j,
    dv_j)`` gets chunk j's final fp32 gradients in sequence layout (dk/dv summed over GQA replicas).
    """
    u = spec.num_chunks
    pending = start_seq_to_heads_packed((grad_out_chunk(0),), spec.hp_group)
    for i in range(u):  # dô_i: every pass touches chunk i from the first one on
        do_i = pending.wait()[0]
        if i + 1 < u:
            pending = start_seq_to_heads_packed((grad_out_chunk(i + 1),), spec.hp_group)
        stash.put(("do", i), do_i)
        del do_i
    final_dq: dict[int, torch.Tensor] = {}
    final_kv: dict[int, torch.Tensor] = {}
    for j in range(u):
        block = stash.pop(("kv", j))
        grads = {}  # the fp32 dK/dV in flight behind the blocks

        def visit(s, src, kv, j=j):
            local = torch.zeros(kv.shape, dtype=spec.acc_dtype, device=kv.device)
            touches = _touches(spec, j, src)
            for n, (i, kind) in enumerate(touches):
                if n + 1 < len(touches):
                    _prefetch(stash, ("q", "o", "lse", "do", "dq"), touches[n + 1][0])
                final = spec.is_last_touch(i, j, s)
                take = stash.pop if final else stash.get
                q, o, lse, do = take(("q", i)), take(("o", i)), take(("lse", i)), take(("do", i))
                rows, keys, dq_b, dk_b, dv_b = _block_backward(spec, kind, do, q, kv, o, lse,
                                                               spec.doc_block(i, j, src, kind))
                dq = stash.pop(("dq", i)) if ("dq", i) in stash else torch.zeros(q.shape, dtype=spec.acc_dtype,
                                                                               device=q.device)
                dq[:, rows] += dq_b
                local[0][:, keys] += dk_b
                local[1][:, keys] += dv_b
                if final:  # dq_i is complete: back through the all-to-all at once
                    final_dq[i] = heads_to_seq(dq, spec.hp_group)
                else:
                    stash.put(("dq", i), dq)
                del q, o, lse, do, dq_b, dk_b, dv_b, dq
            _prefetch(stash, ("q", "o", "lse", "do", "dq"), _next_first_touch(spec, j, s))
            if s > 0:  # the block's gradients so far arrive from its previous holder
                grads["pending"].wait()
                local += grads["incoming"]
            if spec.cp == 1:  # a ring of one (single-device runs of this pipeline): nothing to pass
                grads["pending"], grads["incoming"] = None, local
                return
            to, frm = spec.schedule.grad_peers(s)
            incoming = torch.empty_like(local)
            grads["pending"] = spec.comm.exchange([(local, to, TAG_GRAD)], [(incoming, frm, TAG_GRAD)])
            grads["incoming"] = incoming

        ring_pass(spec, block, visit)
        del block
        if grads["pending"] is not None:
            grads["pending"].wait()  # after the last step our own block's gradients come home
        final_kv[j] = grads.pop("incoming")
        for c in ([j] if spec.causal else (list(range(u)) if j == u - 1 else [])):
            dk, dv = heads_to_seq_packed((final_kv[c][0], final_kv[c][1]), spec.hp_group)
            del final_kv[c]
            deliver(c, final_dq.pop(c), sum_kv_replicas(dk, spec.kv_factor), sum_kv_replicas(dv, spec.kv_factor))
    stash.clear()


# ----------------------------------------------------------------------------- dispatch
def run_forward(spec: MeshSpec | PipelineSpec, produce: Produce, emit: Emit, stash: HostStash,
                for_backward: bool = True, saved: tuple | None = None) -> None:
    """:func:`mesh_forward` for a mesh spec, the Ulysses pipeline's forward otherwise.

    ``saved``: what :func:`fpdt.attention.saved_attention.active` returned for this call:
    ``("record", s)`` hands each chunk's output and lse to ``s``; ``("replay", s)`` runs
    :func:`fpdt.attention.saved_attention.replay_forward` (no attention kernel) instead."""
    if saved is not None and saved[0] == "replay":
        replay_forward(spec, produce, emit, stash, saved[1])
        return
    keep = saved[1].keep if saved is not None else None
    fn = mesh_forward if isinstance(spec, MeshSpec) else pipeline_forward
    fn(spec, produce, emit, stash, for_backward, keep)


def run_backward(spec: MeshSpec | PipelineSpec, grad_out_chunk: Callable[[int], torch.Tensor], deliver: Deliver,
                 stash: HostStash) -> None:
    """:func:`mesh_backward` for a mesh spec, the Ulysses pipeline's backward otherwise."""
    fn = mesh_backward if isinstance(spec, MeshSpec) else pipeline_backward
    fn(spec, grad_out_chunk, deliver, stash)

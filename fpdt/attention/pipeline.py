"""The FPDT chunk pipeline: chunked Ulysses attention with host-resident chunks, shared by
:func:`fpdt.attention.fpdt_attention` and :class:`fpdt.attention.FPDTAttention`. Callers supply:

* ``produce(i) -> (q_i, k_i, v_i)``: local chunk ``i`` in sequence layout, q ``[B, L, H, D]``,
  k/v ``[B, L, H_kv, D]`` (RoPE applied);
* ``emit(i, out_i)``: output chunk ``i`` in sequence layout ``[B, L, H, D]``;
* ``deliver(j, dq_j, dk_j, dv_j)``: chunk ``j``'s final gradients in sequence layout, fp32, k/v
  summed over GQA replicas (the callee may overwrite them).

Saved per chunk in the stash (host with offload), head layout ``[B, C, H/P, D]``: q̂, k̂, v̂, o and
the fp32 lse. Loop order and overlap: ``docs/attention.md`` (The chunk pipeline); working set:
``docs/memory.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from fpdt.attention.documents import DENSE, UlyssesDocuments, cached_documents
from fpdt.attention.kernels import AttentionBackend, default_scale, get_backend
from fpdt.attention.kernels.masked import masked_backward, masked_forward
from fpdt.attention.merge import OnlineSoftmax
from fpdt.comm import (PendingAllToAll, group_size, heads_to_seq, heads_to_seq_packed, kv_replication_factor,
                       replicate_kv, start_seq_to_heads_packed, sum_kv_replicas)
from fpdt.offload import HostStash

Produce = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Emit = Callable[[int, torch.Tensor], None]
Deliver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
Keep = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class PipelineSpec:
    """Static description of one FPDT attention call."""

    group: dist.ProcessGroup | None
    num_chunks: int
    causal: bool
    scale: float
    backend: AttentionBackend
    kv_factor: int              # GQA replication factor before the all-to-all (1 = none)
    acc_dtype: torch.dtype      # fp32 (float64 for float64 inputs)
    label: str | None = None    # names the caller in offload errors, e.g. "layer 2"
    saved: object | None = None     # the call's SavedAttention (attention_checkpoint="save"), taken by the Function
    runtime: object | None = None   # the stash's device runtime (a Runtime, a name, or None: automatic)
    sp_size: int = 1            # ranks in ``group``
    docs: UlyssesDocuments | None = None   # packed documents (:mod:`fpdt.attention.documents`); None = one

    @property
    def overlap_all_to_all(self) -> bool:
        """Start chunk i+1's all-to-all during chunk i's attention; only with P > 1 (with one rank,
        producing chunk i+1 early would only hold its q/k/v through chunk i's attention).
        """
        return self.sp_size > 1

    def kv_blocks(self, i: int) -> list[int]:
        """KV chunks that query chunk i attends to, diagonal first (its KV is on the device)."""
        blocks = [i] + (list(range(i)) if self.causal else [j for j in range(self.num_chunks) if j != i])
        return blocks if self.docs is None else [j for j in blocks if self.docs.visible(i, j)]

    def q_blocks(self, j: int) -> list[int]:
        """Query chunks that attend to KV chunk j, in the backward's inner-loop order; causal: the
        diagonal chunk j *last*, so its final dq goes straight to delivery with dk_j/dv_j.
        """
        blocks = list(range(j + 1, self.num_chunks)) + [j] if self.causal else list(range(self.num_chunks))
        return blocks if self.docs is None else [i for i in blocks if self.docs.visible(i, j)]

    def block_forward(self, i: int, j: int, q, k, v):
        """The kernel of block (query chunk i, KV chunk j): dense, or document-masked."""
        blk = None if self.docs is None else self.docs.block(i, j)
        if blk is None or blk.kind == DENSE:
            return self.backend.forward(q, k, v, self.causal and i == j, self.scale)
        return masked_forward(self.backend, q, k, v, blk, self.scale)

    def block_backward(self, i: int, j: int, do, q, k, v, o, lse):
        blk = None if self.docs is None else self.docs.block(i, j)
        if blk is None or blk.kind == DENSE:
            return self.backend.backward(do, q, k, v, o, lse, self.causal and i == j, self.scale)
        return masked_backward(self.backend, do, q, k, v, o, lse, blk, self.scale)


def build_spec(*, seq_local: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, group: dist.ProcessGroup | None, num_chunks: int, causal: bool,
               softmax_scale: float | None, backend: str | None, doc_ids: torch.Tensor | None = None
               ) -> PipelineSpec:
    """Validate one call's shapes and options (errors name the fix) and build its spec.
    ``doc_ids``: packed documents, ``[B, S]`` over the global sequence (None: one document)."""
    P = group_size(group)
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1")
    if seq_local % num_chunks or seq_local < num_chunks:
        raise ValueError(
            f"sequence length S={seq_local * P} (S_local={seq_local} on each of {P} ranks) is not divisible by "
            f"sp*num_chunks={P}*{num_chunks}={P * num_chunks}; pad S to a multiple of {P * num_chunks} or use "
            f"fewer/larger chunks (a chunk cannot be larger than the sequence)")
    return PipelineSpec(
        group=group,
        num_chunks=num_chunks,
        causal=causal,
        scale=default_scale(head_dim) if softmax_scale is None else float(softmax_scale),
        backend=get_backend(backend, device, dtype, head_dim),
        kv_factor=kv_replication_factor(num_heads, num_kv_heads, P),
        acc_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
        sp_size=P,
        docs=None if doc_ids is None else cached_documents(UlyssesDocuments, doc_ids, seq_len=seq_local * P, sp=P,
                                                           num_chunks=num_chunks, causal=causal),
    )


def _start_to_heads(spec: PipelineSpec, produce: Produce, i: int) -> PendingAllToAll:
    """Produce chunk i and start its sequence -> head all-to-all (q, k, v in one message)."""
    q, k, v = produce(i)
    return start_seq_to_heads_packed((q, replicate_kv(k, spec.kv_factor), replicate_kv(v, spec.kv_factor)),
                                     spec.group)


def pipeline_forward(spec: PipelineSpec, produce: Produce, emit: Emit, stash: HostStash,
                     for_backward: bool = True, keep: Keep | None = None) -> None:
    """Run the forward; ``emit(i, out_i)`` receives each output chunk in sequence layout
    ``[B, L, H, D]`` (callers write it into a preallocated output).

    With ``for_backward`` it leaves ``("k"|"v"|"q"|"o"|"lse", i)`` for every chunk in ``stash``;
    without (a no-grad pass) only the KV chunks go through the stash, emptied at the end.
    ``keep(i, o_i, lse_i)``, when given, gets each chunk's final output (head layout) and lse.
    """
    u = spec.num_chunks
    pending = None
    if not spec.causal:  # every query chunk needs every KV chunk: produce them all first
        for i in range(u):
            q_h, k_h, v_h = _start_to_heads(spec, produce, i).wait()
            stash.put(("k", i), k_h)
            stash.put(("v", i), v_h)
            stash.put(("q", i), q_h)
            del q_h, k_h, v_h
    for i in range(u):
        if spec.causal:
            if pending is None:
                pending = _start_to_heads(spec, produce, i)
            q_h, k_h, v_h = pending.wait()
            # chunk i+1's projection and all-to-all start now and overlap chunk i's attention
            pending = _start_to_heads(spec, produce, i + 1) if i + 1 < u and spec.overlap_all_to_all else None
            stash.put(("k", i), k_h)   # async copy out; k_h stays usable for the diagonal block
            stash.put(("v", i), v_h)
            current = {i: (k_h, v_h)}
            del k_h, v_h
        else:
            q_h = stash.get(("q", i))
            current = {}
        o_h, lse = _attend(spec, i, q_h, current, stash)
        del current
        if keep is not None:
            keep(i, o_h, lse)
        if for_backward:
            if spec.causal:
                stash.put(("q", i), q_h)
            stash.put(("o", i), o_h)
            stash.put(("lse", i), lse)
        del q_h, lse
        emit(i, heads_to_seq(o_h, spec.group))
        del o_h
    if not for_backward:
        stash.clear()


def _attend(spec: PipelineSpec, i: int, q_h: torch.Tensor, current: dict, stash: HostStash):
    """Attention of q̂_i over its KV blocks, merged online; returns (o_i in q's dtype, lse_i)."""
    acc = OnlineSoftmax(spec.acc_dtype)
    blocks = spec.kv_blocks(i)
    fetched = [j for j in blocks if j not in current]
    if fetched:
        stash.prefetch(("k", fetched[0]))
        stash.prefetch(("v", fetched[0]))
    for n, j in enumerate(blocks):
        if j in current:
            k_j, v_j = current[j]
        else:
            k_j, v_j = stash.get(("k", j)), stash.get(("v", j))
        nxt = blocks[n + 1] if n + 1 < len(blocks) else None
        if nxt is not None and nxt not in current:  # double buffer: next block copies during this one
            stash.prefetch(("k", nxt))
            stash.prefetch(("v", nxt))
        o_blk, lse_blk = spec.block_forward(i, j, q_h, k_j, v_j)
        del k_j, v_j
        acc.update(o_blk, lse_blk)
        del o_blk, lse_blk
    out, lse = acc.out, acc.lse
    del acc
    return out.to(q_h.dtype), lse


def pipeline_backward(spec: PipelineSpec, grad_out_chunk: Callable[[int], torch.Tensor],
                      deliver: Deliver, stash: HostStash) -> None:
    """Run the backward over the chunks :func:`pipeline_forward` left in ``stash`` (emptied);
    ``grad_out_chunk(i)`` returns local chunk ``i``'s output gradient ``[B, L, H, D]``.
    """
    u = spec.num_chunks
    final_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    final_dq: dict[int, torch.Tensor] = {}
    _prefetch_outer(spec, 0, stash)
    do_order = _first_touch_order(spec)   # dô_i is all-to-all'd on chunk i's first touch
    # with P > 1 the next one's all-to-all starts a step early; with one rank it would only hold
    # the next dô (which the caller may compute, e.g. o_proj's g_i W) through this step
    ahead = spec.overlap_all_to_all
    pending_do = _start_dout(spec, grad_out_chunk, do_order.pop(0)) if ahead else None
    for j in range(u):
        k_j, v_j = stash.pop(("k", j)), stash.pop(("v", j))
        dk = torch.zeros(k_j.shape, dtype=spec.acc_dtype, device=k_j.device)
        dv = torch.zeros(v_j.shape, dtype=spec.acc_dtype, device=v_j.device)
        inner = spec.q_blocks(j)
        for n, i in enumerate(inner):
            if n + 1 < len(inner):  # double buffer the q side of the next inner step
                _prefetch_q_side(stash, inner[n + 1])
            if ("dq", i) in stash:  # needed only after this block's kernel: its copy overlaps the kernel
                stash.prefetch(("dq", i))
            last_use = _last_outer(spec, i) == j
            first_use = ("dq", i) not in stash and i not in final_dq
            take = stash.pop if last_use else stash.get
            q_i, o_i, lse_i = take(("q", i)), take(("o", i)), take(("lse", i))
            if first_use:  # dô_i: all-to-all of grad-out chunk i, done on first use...
                do_i = (pending_do or _start_dout(spec, grad_out_chunk, do_order.pop(0))).wait()[0]
                pending_do = None
                if do_order and ahead:  # ...and the next one's starts now, overlapping this step
                    pending_do = _start_dout(spec, grad_out_chunk, do_order.pop(0))
                if not last_use:
                    stash.put(("do", i), do_i)
            else:
                do_i = take(("do", i))
            dq_blk, dk_blk, dv_blk = spec.block_backward(i, j, do_i, q_i, k_j, v_j, o_i, lse_i)
            del q_i, o_i, lse_i, do_i
            dk += dk_blk
            dv += dv_blk
            del dk_blk, dv_blk
            if first_use:
                dq_i = dq_blk.to(spec.acc_dtype, memory_format=torch.contiguous_format)
            else:
                dq_i = stash.pop(("dq", i))
                dq_i += dq_blk  # fp32 accumulator, updated in place
            del dq_blk
            if last_use:  # dq_i is final: send it back through the all-to-all right away
                final_dq[i] = heads_to_seq(dq_i, spec.group)
            else:
                stash.put(("dq", i), dq_i)  # host-resident between outer steps when offloading
            del dq_i
        del k_j, v_j
        if j + 1 < u:  # the next outer step's chunks copy in while we all-to-all and deliver
            _prefetch_outer(spec, j + 1, stash)
        final_kv[j] = (dk, dv)
        del dk, dv
        for c in _ready_chunks(spec, j):
            dk_s, dv_s = heads_to_seq_packed(final_kv.pop(c), spec.group)  # one all-to-all for both
            deliver(c, final_dq.pop(c), sum_kv_replicas(dk_s, spec.kv_factor), sum_kv_replicas(dv_s, spec.kv_factor))
            del dk_s, dv_s
    stash.clear()


def _start_dout(spec: PipelineSpec, grad_out_chunk: Callable[[int], torch.Tensor], i: int) -> PendingAllToAll:
    return start_seq_to_heads_packed((grad_out_chunk(i),), spec.group)


def _last_outer(spec: PipelineSpec, i: int) -> int:
    """The last outer step that touches query chunk i (after it, dq_i is final)."""
    if spec.causal or spec.docs is None:
        return i if spec.causal else spec.num_chunks - 1
    return max(j for j in range(spec.num_chunks) if spec.docs.visible(i, j))


def _first_touch_order(spec: PipelineSpec) -> list[int]:
    """Query chunks in the order the backward first touches them (j = 0's inner loop
    without documents; with them a chunk whose block with KV chunk 0 is skipped comes later)."""
    order: list[int] = []
    for j in range(spec.num_chunks):
        order += [i for i in spec.q_blocks(j) if i not in order]
    return order


def _ready_chunks(spec: PipelineSpec, j: int) -> list[int]:
    """Chunks whose dq, dk and dv are all final after outer step j."""
    if spec.causal:
        return [j]
    return list(range(spec.num_chunks)) if j == spec.num_chunks - 1 else []


def _prefetch_q_side(stash: HostStash, i: int) -> None:
    """Start fetching what the backward kernel of query chunk i reads (dô_i once it exists); its
    fp32 dq_i comes later, when step i starts, so one dq is on the device at a time.
    """
    for name in ("q", "o", "lse", "do"):
        if (name, i) in stash:
            stash.prefetch((name, i))


def _prefetch_outer(spec: PipelineSpec, j: int, stash: HostStash) -> None:
    """Start fetching KV chunk j and the q side of outer step j's first inner step."""
    stash.prefetch(("k", j))
    stash.prefetch(("v", j))
    _prefetch_q_side(stash, spec.q_blocks(j)[0])

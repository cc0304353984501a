"""``fpdt_attention``: FPDT attention over q, k, v that are already projected.

One autograd.Function, :class:`FPDTAttentionFunction`. Saved for backward, per chunk, in a
:class:`HostStash` carried by one storage-less saved token (:mod:`fpdt.attention.saved_stash`):
``k̂_i, v̂_i, q̂_i, o_i`` (head layout, input dtype) and ``lse_i`` (fp32), in pinned host memory
with ``offload=True``, on the device otherwise. With ``attention_checkpoint="save"`` the recompute
runs no attention kernel (:mod:`fpdt.attention.saved_attention`).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import torch.distributed as dist

from fpdt.attention.documents import check_batch
from fpdt.attention.mesh_pipeline import build_mesh_spec, run_backward, run_forward
from fpdt.attention.pipeline import build_spec
from fpdt.attention.saved_attention import SavedAttention
from fpdt.attention.saved_stash import stash_of, stash_token
from fpdt.comm import SequenceMesh
from fpdt.offload import HostStash, Runtime


class FPDTAttentionFunction(torch.autograd.Function):
    """Chunked, optionally offloaded Ulysses attention; see :mod:`fpdt.attention.pipeline`."""

    @staticmethod
    def forward(ctx, q, k, v, spec, offload: bool, for_backward: bool):
        u = spec.num_chunks
        L = q.shape[1] // u
        stash = HostStash(q.device, enabled=offload, runtime=spec.runtime)

        def produce(i):
            sl = slice(i * L, (i + 1) * L)
            return q[:, sl], k[:, sl], v[:, sl]

        out = torch.empty_like(q)

        def emit(i, out_i):
            out[:, i * L:(i + 1) * L] = out_i

        saved, spec.saved = spec.saved, None    # the call's SavedAttention (no cycle spec -> saved)
        if saved is not None:
            saved = saved.claim(for_backward, (type(spec).__name__, u, tuple(q.shape), tuple(k.shape), q.dtype))
        run_forward(spec, produce, emit, stash, for_backward, saved)
        ctx.save_for_backward(stash_token(stash))
        ctx.spec, ctx.L = spec, L
        ctx.shapes = (q.shape, k.shape, v.shape, q.dtype)
        return out

    @staticmethod
    @once_differentiable   # the chunked backward is not itself differentiable
    def backward(ctx, grad_out):
        q_shape, k_shape, v_shape, dtype = ctx.shapes
        L = ctx.L
        device = grad_out.device
        dq = torch.empty(q_shape, dtype=dtype, device=device)
        dk = torch.empty(k_shape, dtype=dtype, device=device)
        dv = torch.empty(v_shape, dtype=dtype, device=device)
        grad_out = grad_out.to(dtype)

        def grad_out_chunk(i):
            return grad_out[:, i * L:(i + 1) * L]

        def deliver(j, dq_j, dk_j, dv_j):
            sl = slice(j * L, (j + 1) * L)
            dq[:, sl] = dq_j
            dk[:, sl] = dk_j
            dv[:, sl] = dv_j

        run_backward(ctx.spec, grad_out_chunk, deliver, stash_of(ctx.saved_tensors[0]))
        return dq, dk, dv, None, None, None


def fpdt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   group: dist.ProcessGroup | None = None, mesh: SequenceMesh | None = None,
                   num_chunks: int = 1, offload: bool = False, causal: bool = True, softmax_scale: float | None = None,
                   backend: str | None = None, doc_ids: torch.Tensor | None = None,
                   saved: SavedAttention | None = None, runtime: Runtime | str | None = None) -> torch.Tensor:
    """FPDT attention of sequence-parallel q, k, v.

    Args:
        q: ``[B, S_local, H, D]`` in the FPDT layout (:mod:`fpdt.layout`), ``S`` divisible by ``P * u``.
        k, v: ``[B, S_local, H_kv, D]``; ``H_kv`` divides ``H`` (replicated when P exceeds it).
        group / mesh: the SP group (None: default) or a 2D :class:`fpdt.comm.SequenceMesh` (mesh layout).
        num_chunks, offload, backend, runtime: as the :class:`fpdt.options.FPDTOptions` fields.
        causal: causal over the *global* sequence; ``softmax_scale`` defaults to ``1/sqrt(D)``.
        doc_ids: ``[B, S]`` global document ids (non-decreasing, equal on every rank); None: one.
        saved: a checkpointed layer's :class:`~fpdt.attention.saved_attention.SavedAttention`.

    Returns:
        ``[B, S_local, H, D]`` in the layout and dtype of ``q``; differentiable in q, k, v.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S_local, heads, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_batch(doc_ids, q.shape[0])
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    shape = dict(seq_local=q.shape[1], num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3],
                 dtype=q.dtype, device=q.device, num_chunks=num_chunks, causal=causal, softmax_scale=softmax_scale,
                 backend=backend, doc_ids=doc_ids)
    if mesh is not None:
        if group is not None:
            raise ValueError("pass either group= (plain Ulysses) or mesh= (hp x cp), not both")
        spec = build_mesh_spec(mesh=mesh, **shape)
    else:
        spec = build_spec(group=group, **shape)
    spec.saved = saved
    spec.runtime = runtime
    for_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return FPDTAttentionFunction.apply(q, k, v, spec, offload, for_backward)

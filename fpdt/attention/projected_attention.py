"""QKV projection + RoPE + FPDT attention as one autograd.Function, chunk by chunk.

The full-sequence q, k, v never exist on the device: chunk ``i`` of the hidden states is
projected, rotated, all-to-all'd and attended, then dropped. Saved for backward:

* through ``ctx.save_for_backward``: the projection weights and biases, the position
  ids or the rotation table (small: ``D`` per token against ``hidden``) and a token
  carrying the stash (:mod:`fpdt.attention.saved_stash`);
* in the :class:`HostStash` (pinned host memory when ``offload=True``): the input chunks
  ``T_i`` ``[B, L, hidden]`` and the attention chunks of :mod:`fpdt.attention.pipeline`
  (``q̂_i, k̂_i, v̂_i, o_i, lse_i``).

Backward (FPDT): after outer step ``j`` of the attention backward, dq̂_j/dk̂_j/dv̂_j come
back through the all-to-all, RoPE is undone, and the projection backward runs with
``T_j`` (prefetched during the outer step) to give ``dT_j`` and accumulate fp32 weight
gradients.

Optionally (Qwen3), q and k are RMS-normalised per head over ``D`` before RoPE, with
weights ``[D]`` (fp32 normalisation, cast, then the weight multiply); backward recomputes the
chunk's pre-norm q/k from ``T_j`` (one more projection GEMM each) and accumulates the norm
weights' gradients in fp32.

RoPE comes either from a :class:`RotaryEmbedding` evaluated at the chunk's position ids,
or from a precomputed rotation table ``(cos, sin)`` ``[B or 1, S_local, D]`` sliced per
chunk (what a Transformers model computes once per forward and passes to every layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fpdt.attention.mesh_pipeline import build_mesh_spec, run_backward, run_forward
from fpdt.attention.pipeline import PipelineSpec, build_spec
from fpdt.attention.rope import RotaryEmbedding, apply_rotary, apply_rotary_backward_
from fpdt.attention.saved_stash import stash_of, stash_token
from fpdt.comm import SequenceMesh
from fpdt.offload import HostStash
from fpdt.ops.rmsnorm import input_grad_, normalised, rms_norm_reference, weight_grad


def projected_fpdt_attention(hidden: torch.Tensor, q_proj: torch.nn.Linear, k_proj: torch.nn.Linear,
                             v_proj: torch.nn.Linear, *, heads: tuple[int, int, int],
                             position_ids: torch.Tensor | None = None, rope: RotaryEmbedding | None = None,
                             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                             group: dist.ProcessGroup | None = None, mesh: SequenceMesh | None = None,
                             num_chunks: int = 1, offload: bool = False, backend: str | None = None,
                             softmax_scale: float | None = None, label: str | None = None,
                             qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """Causal self-attention of ``hidden`` ``[B, S_local, hidden]`` (this rank's tokens in the
    FPDT or mesh layout) through the projections ``q_proj``/``k_proj``/``v_proj`` (whose
    ``weight``/``bias`` are read directly), chunk by chunk; returns ``[B, S_local, H, D]``
    before the output projection. ``heads`` = ``(H, H_kv, D)``; RoPE from ``rope`` at
    ``position_ids``, or from the table ``cos``/``sin`` ``[B or 1, S_local, D]``, or none.
    ``label`` names the chunks in offload errors (e.g. "layer 2"). ``qk_norm`` =
    ``(q_weight, k_weight, eps)``: RMSNorm of q and k per head before RoPE (Qwen3)."""
    if mesh is not None and group is not None:
        raise ValueError("projected FPDT attention got both group= (plain Ulysses) and mesh= (hp x cp); set one")
    H, H_kv, D = heads
    shape = dict(seq_local=hidden.shape[1], num_heads=H, num_kv_heads=H_kv, head_dim=D, dtype=hidden.dtype,
                 device=hidden.device, num_chunks=num_chunks, causal=True, softmax_scale=softmax_scale,
                 backend=backend)
    spec = build_mesh_spec(mesh=mesh, **shape) if mesh is not None else build_spec(group=group, **shape)
    spec.label = label
    inputs = (hidden, q_proj.weight, q_proj.bias, k_proj.weight, k_proj.bias, v_proj.weight, v_proj.bias)
    wqn, wkn, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    # a no-grad pass (e.g. the first pass of a checkpointed layer) saves nothing for backward
    for_backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*inputs, wqn, wkn))
    return ProjectedFPDTAttentionFunction.apply(*inputs, position_ids, rope, spec, offload, heads, for_backward,
                                                cos, sin, wqn, wkn, eps)


class ProjectedFPDTAttentionFunction(torch.autograd.Function):
    """hidden ``[B, S_local, hidden]`` -> attention output ``[B, S_local, H, D]`` (before o_proj).

    RoPE: ``rope`` at ``position_ids`` ``[B, S_local]``, or the table ``cos``/``sin``
    ``[B or 1, S_local, D]`` (then ``rope`` and ``position_ids`` are None), or neither.
    ``q_norm``/``k_norm`` ``[D]`` (or None) with ``norm_eps``: per-head RMSNorm before RoPE.
    """

    @staticmethod
    def forward(ctx, hidden, wq, bq, wk, bk, wv, bv, position_ids, rope: RotaryEmbedding | None,
                spec: PipelineSpec, offload: bool, heads: tuple[int, int, int], for_backward: bool,
                cos=None, sin=None, q_norm=None, k_norm=None, norm_eps: float = 0.0):
        H, H_kv, D = heads
        B, S_local, _ = hidden.shape
        L = S_local // spec.num_chunks
        stash = HostStash(hidden.device, enabled=offload, label=spec.label)
        rotation = _rotation(rope, position_ids, cos, sin)

        def produce(i):
            sl = slice(i * L, (i + 1) * L)
            T = hidden[:, sl]
            if for_backward:
                stash.put(("T", i), T)
            q = F.linear(T, wq, bq).view(B, L, H, D)
            k = F.linear(T, wk, bk).view(B, L, H_kv, D)
            v = F.linear(T, wv, bv).view(B, L, H_kv, D)
            if q_norm is not None:
                q, k = rms_norm_reference(q, q_norm, norm_eps), rms_norm_reference(k, k_norm, norm_eps)
            if rotation is not None:
                c, s = rotation(sl, q.dtype)
                q, k = apply_rotary(q, c, s), apply_rotary(k, c, s)
            return q, k, v

        out = torch.empty(B, S_local, H, D, dtype=hidden.dtype, device=hidden.device)

        def emit(i, out_i):
            out[:, i * L:(i + 1) * L] = out_i

        run_forward(spec, produce, emit, stash, for_backward)
        ctx.save_for_backward(wq, bq, wk, bk, wv, bv, position_ids, cos, sin, q_norm, k_norm, stash_token(stash))
        ctx.rope, ctx.spec, ctx.L, ctx.heads, ctx.norm_eps = rope, spec, L, heads, norm_eps
        ctx.hidden_meta = (hidden.shape, hidden.dtype)
        return out

    @staticmethod
    @once_differentiable   # the chunked backward is not itself differentiable
    def backward(ctx, grad_out):
        wq, bq, wk, bk, wv, bv, position_ids, cos, sin, q_norm, k_norm, token = ctx.saved_tensors
        H, H_kv, D = ctx.heads
        L, spec = ctx.L, ctx.spec
        rotation = _rotation(ctx.rope, position_ids, cos, sin)
        stash = stash_of(token)
        shape, dtype = ctx.hidden_meta
        B = shape[0]
        acc = spec.acc_dtype
        grad_out = grad_out.to(dtype)
        d_hidden = torch.empty(shape, dtype=dtype, device=grad_out.device)
        weights = (wq, wk, wv)
        biases = (bq, bk, bv)
        # fp32 accumulators for the weight and bias gradients, summed over chunks
        d_w = [torch.zeros(w.shape, dtype=acc, device=w.device) for w in weights]
        d_b = [None if b is None else torch.zeros(b.shape, dtype=acc, device=b.device) for b in biases]
        norms = (q_norm, k_norm)
        d_n = [None if w is None else torch.zeros(w.shape, dtype=acc, device=w.device) for w in norms]
        stash.prefetch(("T", 0))

        def grad_out_chunk(i):
            return grad_out[:, i * L:(i + 1) * L]

        def deliver(j, dq, dk, dv):
            sl = slice(j * L, (j + 1) * L)
            T = stash.pop(("T", j))
            if j + 1 < spec.num_chunks:
                stash.prefetch(("T", j + 1))  # copies in during the next outer step
            if rotation is not None:
                c, s = rotation(sl, acc)
                dq, dk = apply_rotary_backward_(dq, c, s), apply_rotary_backward_(dk, c, s)  # ours to overwrite
            if q_norm is not None:   # through the per-head RMSNorm, from the recomputed pre-norm q/k
                pre = (F.linear(T, wq, bq).view(B, L, H, D), F.linear(T, wk, bk).view(B, L, H_kv, D))
                dq = _head_rms_norm_backward(dq, pre[0], q_norm, ctx.norm_eps, d_n[0])
                dk = _head_rms_norm_backward(dk, pre[1], k_norm, ctx.norm_eps, d_n[1])
            T2 = T.reshape(B * L, -1)
            d_T = None
            for n, g in enumerate((dq, dk, dv)):
                g2 = g.reshape(B * L, -1)
                g_c = g2.to(dtype)
                d_w[n] += (g_c.t() @ T2).to(acc)
                if d_b[n] is not None:
                    d_b[n] += g2.sum(0)
                part = g_c @ weights[n]
                d_T = part if d_T is None else d_T + part
            d_hidden[:, sl] = d_T.view(B, L, -1)

        run_backward(spec, grad_out_chunk, deliver, stash)
        out_w = [dw.to(w.dtype) for dw, w in zip(d_w, weights)]
        out_b = [None if db is None else db.to(b.dtype) for db, b in zip(d_b, biases)]
        out_n = [None if dn is None else dn.to(w.dtype) for dn, w in zip(d_n, norms)]
        return (d_hidden, out_w[0], out_b[0], out_w[1], out_b[1], out_w[2], out_b[2],
                None, None, None, None, None, None, None, None, out_n[0], out_n[1], None)


def _head_rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            d_weight: torch.Tensor) -> torch.Tensor:
    """Gradient of the per-head RMSNorm ``rms_norm_reference(x, weight, eps)`` (over each head's
    ``D``) w.r.t. ``x``, in fp32; adds the weight's gradient to the fp32 accumulator ``d_weight``."""
    x_hat, rstd = normalised(x, eps)
    dy = dy.float()
    d_weight += weight_grad(dy, x_hat, x.dtype)
    return input_grad_(dy * weight.float(), x_hat, rstd)


def _rotation(rope: RotaryEmbedding | None, position_ids, cos, sin):
    """``(slice, dtype) -> (cos, sin)`` of a chunk, or None without RoPE."""
    if cos is not None:
        if rope is not None:
            raise ValueError("pass a RotaryEmbedding or a (cos, sin) table, not both")
        return lambda sl, dtype: (cos[:, sl].to(dtype), sin[:, sl].to(dtype))
    if rope is not None:
        return lambda sl, dtype: rope.cos_sin(position_ids[:, sl], dtype)
    return None

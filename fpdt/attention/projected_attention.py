"""QKV projection + RoPE + FPDT attention as one autograd.Function, chunk by chunk.

The full-sequence q, k, v never exist on the device: chunk ``i`` of the hidden states is
projected, rotated, all-to-all'd and attended, then dropped. Saved for backward:

* through ``ctx.save_for_backward``: the projection weights and biases, the position
  ids (small) and a token carrying the stash (:mod:`fpdt.attention.saved_stash`);
* in the :class:`HostStash` (pinned host memory when ``offload=True``): the input chunks
  ``T_i`` ``[B, L, hidden]`` and the attention chunks of :mod:`fpdt.attention.pipeline`
  (``q̂_i, k̂_i, v̂_i, o_i, lse_i``).

Backward (FPDT): after outer step ``j`` of the attention backward, dq̂_j/dk̂_j/dv̂_j come
back through the all-to-all, RoPE is undone, and the projection backward runs with
``T_j`` (prefetched during the outer step) to give ``dT_j`` and accumulate fp32 weight
gradients.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import torch.nn.functional as F

from fpdt.attention.mesh_pipeline import run_backward, run_forward
from fpdt.attention.pipeline import PipelineSpec
from fpdt.attention.rope import RotaryEmbedding, apply_rotary, apply_rotary_backward_
from fpdt.attention.saved_stash import stash_of, stash_token
from fpdt.offload import HostStash


class ProjectedFPDTAttentionFunction(torch.autograd.Function):
    """hidden ``[B, S_local, hidden]`` -> attention output ``[B, S_local, H, D]`` (before o_proj)."""

    @staticmethod
    def forward(ctx, hidden, wq, bq, wk, bk, wv, bv, position_ids, rope: RotaryEmbedding | None,
                spec: PipelineSpec, offload: bool, heads: tuple[int, int, int], for_backward: bool):
        H, H_kv, D = heads
        B, S_local, _ = hidden.shape
        L = S_local // spec.num_chunks
        stash = HostStash(hidden.device, enabled=offload, label=spec.label)

        def produce(i):
            sl = slice(i * L, (i + 1) * L)
            T = hidden[:, sl]
            if for_backward:
                stash.put(("T", i), T)
            q = F.linear(T, wq, bq).view(B, L, H, D)
            k = F.linear(T, wk, bk).view(B, L, H_kv, D)
            v = F.linear(T, wv, bv).view(B, L, H_kv, D)
            if rope is not None:
                cos, sin = rope.cos_sin(position_ids[:, sl], q.dtype)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            return q, k, v

        out = torch.empty(B, S_local, H, D, dtype=hidden.dtype, device=hidden.device)

        def emit(i, out_i):
            out[:, i * L:(i + 1) * L] = out_i

        run_forward(spec, produce, emit, stash, for_backward)
        ctx.save_for_backward(wq, bq, wk, bk, wv, bv, position_ids, stash_token(stash))
        ctx.rope, ctx.spec, ctx.L, ctx.heads = rope, spec, L, heads
        ctx.hidden_meta = (hidden.shape, hidden.dtype)
        return out

    @staticmethod
    @once_differentiable   # the chunked backward is not itself differentiable
    def backward(ctx, grad_out):
        wq, bq, wk, bk, wv, bv, position_ids, token = ctx.saved_tensors
        H, H_kv, D = ctx.heads
        L, spec, rope = ctx.L, ctx.spec, ctx.rope
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
        stash.prefetch(("T", 0))

        def grad_out_chunk(i):
            return grad_out[:, i * L:(i + 1) * L]

        def deliver(j, dq, dk, dv):
            sl = slice(j * L, (j + 1) * L)
            T = stash.pop(("T", j))
            if j + 1 < spec.num_chunks:
                stash.prefetch(("T", j + 1))  # copies in during the next outer step
            if rope is not None:
                cos, sin = rope.cos_sin(position_ids[:, sl], acc)
                dq, dk = apply_rotary_backward_(dq, cos, sin), apply_rotary_backward_(dk, cos, sin)  # ours to overwrite
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
        return (d_hidden, out_w[0], out_b[0], out_w[1], out_b[1], out_w[2], out_b[2],
                None, None, None, None, None, None)

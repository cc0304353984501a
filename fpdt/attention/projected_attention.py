"""QKV projection + RoPE + FPDT attention as one autograd.Function, chunk by chunk.

The full-sequence q, k, v and attention output never exist on the device (``o_proj`` runs on
each output chunk). Saved for backward: the projection weights and biases, the position ids or
rotation table and a stash token (``ctx``); the input chunks ``T_i`` ``[B, L, hidden]`` and the
pipeline's ``q̂_i, k̂_i, v̂_i, o_i, lse_i`` (the :class:`HostStash`, pinned host memory with
``offload=True``). LoRA and Qwen3's per-head q/k norm save nothing more. Backward and options:
``docs/attention.md``, "Layout, forward, backward"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fpdt.attention.documents import check_batch
from fpdt.attention.mesh_pipeline import build_mesh_spec, run_backward, run_forward
from fpdt.attention.pipeline import PipelineSpec, build_spec
from fpdt.attention.rope import RotaryEmbedding, apply_rotary, apply_rotary_backward_
from fpdt.attention.saved_attention import SavedAttention
from fpdt.attention.saved_stash import stash_of, stash_token
from fpdt.comm import SequenceMesh
from fpdt.offload import HostStash, Runtime
from fpdt.attention.output_projection import OutputChunks, check_adapters, read_back
from fpdt.ops.lora import LoraAdapters, LoraLayout, accumulators, finish, lora_backward, with_lora
from fpdt.ops.rmsnorm import effective_weight, norm_backward, normalised, rms_norm_reference


def projected_fpdt_attention(hidden: torch.Tensor, q_proj: torch.nn.Linear, k_proj: torch.nn.Linear,
                             v_proj: torch.nn.Linear, *, heads: tuple[int, int, int],
                             position_ids: torch.Tensor | None = None, rope: RotaryEmbedding | None = None,
                             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                             group: dist.ProcessGroup | None = None, mesh: SequenceMesh | None = None,
                             num_chunks: int = 1, offload: bool = False, backend: str | None = None,
                             softmax_scale: float | None = None, label: str | None = None,
                             qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                             adapters: LoraAdapters | None = None,
                             doc_ids: torch.Tensor | None = None, saved: SavedAttention | None = None,
                             runtime: Runtime | str | None = None, o_proj: torch.nn.Linear | None = None,
                             o_adapters: LoraAdapters | None = None, output_gate: bool = False,
                             rotary_dim: int | None = None, qk_norm_zero_centred: bool = False,
                             input_norm: tuple[torch.Tensor, float, bool] | None = None,
                             donate: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """Causal self-attention of ``hidden`` ``[B, S_local, hidden]`` (FPDT or mesh layout) through
    ``q_proj``/``k_proj``/``v_proj`` (``weight``/``bias`` read directly), chunk by chunk; returns
    ``[B, S_local, H, D]``, or with ``o_proj`` (and its LoRA ``o_adapters``) that projection of
    it ``[B, S_local, hidden]``, applied a chunk at a time. ``heads`` = ``(H, H_kv, D)``; RoPE from
    ``rope`` at ``position_ids``, or the table ``cos``/``sin`` ``[B or 1, S_local, D]``, or none.
    ``label``: for errors. ``qk_norm`` = ``(q_weight, k_weight, eps)`` (Qwen3). ``adapters``: LoRA
    of q, k, v. ``doc_ids``: ``[B, S]`` packed documents (None: one). ``saved``: a
    ``SavedAttention``. ``runtime``: the stash's device runtime (None: automatic). Qwen3.5:
    ``output_gate`` (``q_proj`` gives ``[query | gate]`` per head, ``[H, 2 D]``; the attention
    output is multiplied by ``sigmoid(gate)`` before ``o_proj``), ``rotary_dim`` (RoPE on the
    first ``rotary_dim`` channels of each head, the table's width; None: ``D``),
    ``qk_norm_zero_centred`` (the q/k norms multiply by ``1 + weight``). ``input_norm`` = ``(weight,
    eps, zero_centred)``: the layer's input RMSNorm, applied to each chunk first (:class:`InputNorm`);
    ``donate(grad_out)``: whether backward may add ``hidden``'s gradient into ``grad_out`` in place
    and return None (a checkpoint's residual branch, :func:`fpdt.model.checkpointing.donation_check`)."""
    spec = attention_spec(hidden.shape, hidden.dtype, hidden.device, heads, group=group, mesh=mesh,
                          num_chunks=num_chunks, backend=backend, softmax_scale=softmax_scale, doc_ids=doc_ids,
                          label=label, runtime=runtime)
    spec.saved = saved
    wo, bo = (None, None) if o_proj is None else (o_proj.weight, o_proj.bias)
    inputs = (hidden, q_proj.weight, q_proj.bias, k_proj.weight, k_proj.bias, v_proj.weight, v_proj.bias, wo, bo)
    wqn, wkn, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    if adapters is not None and len(adapters.layout.terms) != 3:
        raise ValueError(f"the q/k/v LoRA layout must have 3 projections, got {len(adapters.layout.terms)}")
    if o_adapters is not None and o_proj is None:
        raise ValueError("o_adapters without o_proj: pass the output projection they belong to")
    check_adapters(o_adapters)
    tensors = (*(adapters.tensors if adapters is not None else ()),
               *(o_adapters.tensors if o_adapters is not None else ()))
    # a no-grad pass (e.g. the first pass of a checkpointed layer) saves nothing for backward
    norm_w, norm_opts = (None, None) if input_norm is None else (input_norm[0], tuple(input_norm[1:]))
    for_backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                   for t in (*inputs, wqn, wkn, norm_w, *tensors))
    _check_rotary(heads[2], rotary_dim, rope, cos)
    if output_gate and q_proj.weight.shape[0] != 2 * heads[0] * heads[2]:
        raise ValueError(f"output_gate=True needs q_proj to give [query | gate] per head, {2 * heads[0] * heads[2]} "
                         f"outputs for {heads[0]} heads of {heads[2]}; it gives {q_proj.weight.shape[0]}")
    opts = CallOptions(heads, offload, for_backward, eps, None if adapters is None else adapters.layout,
                       None if o_adapters is None else o_adapters.layout, output_gate, qk_norm_zero_centred,
                       norm_opts, donate)
    return ProjectedFPDTAttentionFunction.apply(*inputs, position_ids, rope, spec, cos, sin, wqn, wkn, norm_w, opts,
                                                *tensors)


def _check_rotary(head_dim: int, rotary_dim: int | None, rope: RotaryEmbedding | None, cos) -> None:
    """The RoPE table's width must be the ``rotary_dim`` asked for (``head_dim`` when None)."""
    want = head_dim if rotary_dim is None else rotary_dim
    if not 0 < want <= head_dim or want % 2:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
    width = rope.head_dim if rope is not None else (cos.shape[-1] if cos is not None else None)
    if width is not None and width != want:
        raise ValueError(f"the RoPE table rotates {width} channels but rotary_dim is {want}: build the rotary "
                         f"embedding with {want // 2} frequencies (partial_rotary_factor = rotary_dim / head_dim)")


def attention_spec(shape: torch.Size, dtype: torch.dtype, device: torch.device, heads: tuple[int, int, int], *,
                   group: dist.ProcessGroup | None, mesh: SequenceMesh | None, num_chunks: int, backend: str | None,
                   softmax_scale: float | None, doc_ids: torch.Tensor | None, label: str | None = None,
                   runtime: Runtime | str | None = None):
    """The causal pipeline spec (Ulysses over ``group``, or the 2D ``mesh``) of hidden states of
    ``shape`` ``[B, S_local, hidden]``; ``heads`` = ``(H, H_kv, D)``."""
    if mesh is not None and group is not None:
        raise ValueError("projected FPDT attention got both group= (plain Ulysses) and mesh= (hp x cp); set one")
    H, H_kv, D = heads
    check_batch(doc_ids, shape[0])
    kw = dict(seq_local=shape[1], num_heads=H, num_kv_heads=H_kv, head_dim=D, dtype=dtype, device=device,
              num_chunks=num_chunks, causal=True, softmax_scale=softmax_scale, backend=backend, doc_ids=doc_ids)
    spec = build_mesh_spec(mesh=mesh, **kw) if mesh is not None else build_spec(group=group, **kw)
    spec.label, spec.runtime = label, runtime
    return spec


class QKVChunks:
    """The q/k/v projections of hidden chunks ``T`` ``[B, L, hidden]`` and their backward, a chunk
    at a time. ``weights``/``biases``: ``(q, k, v)``; ``rotation``: :func:`rotation_of` or None;
    ``qk_norm``: ``(q_weight, k_weight, eps)`` or None; ``lora``/``lora_tensors``/``seed``: LoRA terms.
    ``gate``: q's projection gives ``[query | gate]`` per head (``[B, L, H, 2 D]``, Qwen3.5's
    output gate); ``zero_centred``: the q/k norms multiply by ``1 + weight`` (Qwen3.5).
    Backward: :meth:`start_backward`, then :meth:`backward` per chunk, then :meth:`finish`."""

    def __init__(self, weights, biases, heads: tuple[int, int, int], L: int, rotation=None, qk_norm=None,
                 lora=None, lora_tensors=(), seed=None, gate: bool = False, zero_centred: bool = False):
        self.weights, self.biases, self.heads, self.L = tuple(weights), tuple(biases), heads, L
        self.rotation, self.gate, self.zero_centred = rotation, gate, zero_centred
        self.norms = (qk_norm[0], qk_norm[1]) if qk_norm is not None else (None, None)
        self.norm_eps = qk_norm[2] if qk_norm is not None else 0.0
        self.lora, self.lora_tensors, self.seed = lora, tuple(lora_tensors), seed
        self.terms = lora.split(self.lora_tensors) if lora is not None else [[], [], []]

    def _pre(self, n: int, T: torch.Tensor, i: int, heads: int, width: int | None = None) -> torch.Tensor:
        B = T.shape[0]
        return with_lora(F.linear(T, self.weights[n], self.biases[n]), T, self.terms[n], self.seed, i) \
            .view(B, self.L, heads, width or self.heads[2])

    def query_and_gate(self, i: int, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chunk ``i``'s ``(query before norm and RoPE, gate)``, each ``[B, L, H, D]`` (gate None without one)."""
        H, _, D = self.heads
        if not self.gate:
            return self._pre(0, T, i, H), None
        qg = self._pre(0, T, i, H, 2 * D)
        return qg[..., :D], qg[..., D:]

    def forward(self, i: int, T: torch.Tensor):
        """Chunk ``i``'s ``(q [B, L, H, D], k, v [B, L, H_kv, D])``, RoPE applied."""
        H, H_kv, _ = self.heads
        q, k, v = self.query_and_gate(i, T)[0], self._pre(1, T, i, H_kv), self._pre(2, T, i, H_kv)
        if self.norms[0] is not None:
            q = rms_norm_reference(q, self.norms[0], self.norm_eps, self.zero_centred)
            k = rms_norm_reference(k, self.norms[1], self.norm_eps, self.zero_centred)
        elif self.gate:
            q = q.contiguous()          # a strided half of the projection
        if self.rotation is not None:
            c, s = self.rotation(slice(i * self.L, (i + 1) * self.L), q.dtype)
            q, k = apply_rotary(q, c, s), apply_rotary(k, c, s)
        return q, k, v

    def start_backward(self, acc: torch.dtype, need_w, need_b, need_norms, need_lora, need_hidden: bool) -> None:
        """fp32 (``acc``) accumulators for the weights, biases, q/k norms and LoRA tensors whose
        ``need_*`` flag is set (each a sequence of three, two, or one per LoRA tensor)."""
        def zeros(t, need):
            return None if t is None or not need else torch.zeros(t.shape, dtype=acc, device=t.device)
        self.acc, self.need_hidden = acc, need_hidden
        self.d_w = [zeros(w, n) for w, n in zip(self.weights, need_w)]
        self.d_b = [zeros(b, n) for b, n in zip(self.biases, need_b)]
        self.d_n = [zeros(w, n) for w, n in zip(self.norms, need_norms)]
        self.d_lora = accumulators(self.lora, self.lora_tensors, need_lora) if self.lora is not None else []
        self.d_terms = self.lora.split(self.d_lora) if self.lora is not None else [[], [], []]

    def backward(self, j: int, T: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                 d_gate: torch.Tensor | None = None):
        """Chunk ``j``'s projection backward (``dq``/``dk``/``dv`` are overwritten; ``d_gate`` the
        gate's gradient with ``gate``): accumulates the parameter gradients, returns ``dT``
        ``[B, L, hidden]`` in ``T.dtype`` (None if not needed)."""
        H, H_kv, _ = self.heads
        B, L, dtype = T.shape[0], self.L, T.dtype
        if self.rotation is not None:
            c, s = self.rotation(slice(j * L, (j + 1) * L), self.acc)
            dq, dk = apply_rotary_backward_(dq, c, s), apply_rotary_backward_(dk, c, s)  # ours to overwrite
        if self.norms[0] is not None:   # through the per-head RMSNorm, from the recomputed pre-norm q/k
            dq = _head_rms_norm_backward(dq, self.query_and_gate(j, T)[0], self.norms[0], self.norm_eps, self.d_n[0],
                                         self.zero_centred)
            dk = _head_rms_norm_backward(dk, self._pre(1, T, j, H_kv), self.norms[1], self.norm_eps, self.d_n[1],
                                         self.zero_centred)
        if self.gate:       # q's projection gradient, [query | gate] per head, in the input dtype
            full = torch.empty(B, L, H, 2 * self.heads[2], dtype=dtype, device=dq.device)
            full[..., :self.heads[2]], full[..., self.heads[2]:] = dq, d_gate
            dq = full
            del full
        T2 = T.reshape(B * L, -1)
        d_T = None
        for n, g in enumerate((dq, dk, dv)):
            g2 = g.reshape(B * L, -1)
            g_c = g2.to(dtype)
            if self.d_w[n] is not None:
                self.d_w[n] += (g_c.t() @ T2).to(self.acc)
            if self.d_b[n] is not None:
                self.d_b[n] += g2.sum(0, dtype=self.acc)
            if self.need_hidden:
                part = g_c @ self.weights[n]
                d_T = part if d_T is None else d_T + part
            if self.terms[n]:
                d_lo = lora_backward(T2, g2, self.terms[n], self.d_terms[n], self.seed, j, self.need_hidden)
                if d_lo is not None:
                    d_T.add_(d_lo)          # d_T: this step's own sum
        return None if d_T is None else d_T.view(B, L, -1)

    def finish(self):
        """``(d_weights (q, k, v), d_biases, d_norms (q, k), d_lora)`` in their tensors' dtypes."""
        return (finish(self.d_w, self.weights), finish(self.d_b, self.biases), finish(self.d_n, self.norms),
                finish(self.d_lora, self.lora_tensors))


@dataclass(frozen=True)
class CallOptions:
    """What one call of :class:`ProjectedFPDTAttentionFunction` computes besides its tensors:
    ``heads`` ``(H, H_kv, D)``, ``offload``, ``for_backward`` (False: a no-grad pass, nothing
    saved), the q/k norm's ``norm_eps``, and the LoRA layouts of q/k/v (``lora``) and of
    ``o_proj`` (``o_lora``), whose tensors follow the Function's other inputs in that order;
    ``output_gate`` and ``zero_centred`` as :class:`QKVChunks` takes them; ``input_norm`` ``(eps,
    zero_centred)`` of the fused input norm, ``donate`` as :func:`projected_fpdt_attention` takes them."""

    heads: tuple[int, int, int]
    offload: bool
    for_backward: bool
    norm_eps: float = 0.0
    lora: LoraLayout | None = None
    o_lora: LoraLayout | None = None
    output_gate: bool = False
    zero_centred: bool = False
    input_norm: tuple[float, bool] | None = None
    donate: Callable[[torch.Tensor], bool] | None = field(default=None, compare=False)

    def split_lora(self, tensors) -> tuple[tuple, tuple]:
        n = self.lora.num_tensors if self.lora is not None else 0
        return tuple(tensors[:n]), tuple(tensors[n:])


class ProjectedFPDTAttentionFunction(torch.autograd.Function):
    """hidden ``[B, S_local, hidden]`` -> ``o_proj`` of the attention ``[B, S_local, hidden']``
    (``wo`` given), or the attention output ``[B, S_local, H, D]`` (``wo`` None).

    RoPE: ``rope`` at ``position_ids``, or the table ``cos``/``sin``, or neither. ``q_norm``/``k_norm``
    ``[D]`` (or None); ``opts``: a :class:`CallOptions`; the LoRA tensors last. ``o_proj`` runs on
    each output chunk as the pipeline emits it and, in backward, reads the chunks back from the
    stash for its weight gradient (:class:`fpdt.attention.output_projection.OutputChunks`)."""

    @staticmethod
    def forward(ctx, hidden, wq, bq, wk, bk, wv, bv, wo, bo, position_ids, rope: RotaryEmbedding | None,
                spec: PipelineSpec, cos, sin, q_norm, k_norm, norm_w, opts: CallOptions, *lora_tensors):
        H, H_kv, D = opts.heads
        B, S_local, _ = hidden.shape
        L = S_local // spec.num_chunks
        for_backward = opts.for_backward
        stash = HostStash(hidden.device, enabled=opts.offload, label=spec.label, runtime=spec.runtime)
        qkv_lora, o_lora = opts.split_lora(lora_tensors)
        seed = opts.lora.draw_seed() if opts.lora is not None else None
        qk_norm = (q_norm, k_norm, opts.norm_eps) if q_norm is not None else None
        chunks = QKVChunks((wq, wk, wv), (bq, bk, bv), opts.heads, L, rotation_of(rope, position_ids, cos, sin),
                           qk_norm, opts.lora, qkv_lora, seed, opts.output_gate, opts.zero_centred)
        o_chunks = None if wo is None else OutputChunks(wo, bo, opts.o_lora, o_lora, S_local, spec.num_chunks)
        gate = opts.output_gate
        normed = InputNorm.of(norm_w, opts.input_norm).forward

        def produce(i):
            T = hidden[:, i * L:(i + 1) * L]
            if for_backward:
                stash.put(("T", i), T)      # before the norm: backward recomputes it
            return chunks.forward(i, normed(T))

        if o_chunks is None:
            out = torch.empty(B, S_local, H, D, dtype=hidden.dtype, device=hidden.device)
        else:
            out = torch.empty(B, S_local, wo.shape[0], dtype=hidden.dtype, device=hidden.device)

        def emit(i, out_i):
            if gate:    # recomputed from the input chunk: nothing held between produce and emit
                out_i = out_i * torch.sigmoid(chunks.query_and_gate(i, normed(hidden[:, i * L:(i + 1) * L]))[1])
            if o_chunks is not None:
                out_i = o_chunks.forward(i, out_i.reshape(B, L, H * D))
            out[:, i * L:(i + 1) * L] = out_i

        saved, spec.saved = spec.saved, None    # the call's SavedAttention (no cycle spec -> saved)
        if saved is not None:
            saved = saved.claim(for_backward, (type(spec).__name__, spec.num_chunks, tuple(hidden.shape), hidden.dtype))
        run_forward(spec, produce, emit, stash, for_backward, saved)
        ctx.save_for_backward(wq, bq, wk, bk, wv, bv, wo, bo, position_ids, cos, sin, q_norm, k_norm, norm_w,
                              stash_token(stash), *lora_tensors)
        ctx.rope, ctx.spec, ctx.L, ctx.opts = rope, spec, L, opts
        ctx.seeds = (seed, None if o_chunks is None else o_chunks.seed)
        ctx.hidden_meta = (hidden.shape, hidden.dtype)
        return out

    @staticmethod
    @once_differentiable   # the chunked backward is not itself differentiable
    def backward(ctx, grad_out):
        wq, bq, wk, bk, wv, bv, wo, bo, position_ids, cos, sin, q_norm, k_norm, norm_w, token, *lora_tensors = \
            ctx.saved_tensors
        need = ctx.needs_input_grad
        L, spec, opts = ctx.L, ctx.spec, ctx.opts
        H, _, D = opts.heads
        stash = stash_of(token)
        shape, dtype = ctx.hidden_meta
        B = shape[0]
        # the hidden gradient added into grad_out itself, chunk j at its delivery: the pipeline
        # has read chunk j's output gradient (o_proj's weights, its first touch) by then
        into = need[0] and opts.donate is not None and opts.donate(grad_out)
        grad_out = grad_out.to(dtype)
        norm = InputNorm.of(norm_w, opts.input_norm)
        d_norm = torch.zeros(norm_w.shape, dtype=spec.acc_dtype, device=norm_w.device) if need[16] else None
        qkv_lora, o_lora = opts.split_lora(lora_tensors)
        n_qkv = len(qkv_lora)
        qk_norm = (q_norm, k_norm, opts.norm_eps) if q_norm is not None else None
        chunks = QKVChunks((wq, wk, wv), (bq, bk, bv), opts.heads, L, rotation_of(ctx.rope, position_ids, cos, sin),
                           qk_norm, opts.lora, qkv_lora, ctx.seeds[0], opts.output_gate, opts.zero_centred)
        chunks.start_backward(spec.acc_dtype, (need[1], need[3], need[5]), (need[2], need[4], need[6]),
                              (need[14], need[15]), need[18:18 + n_qkv], need[0] or need[16])
        d_o = ()
        if wo is None:
            def grad_out_chunk(i):
                return grad_out[:, i * L:(i + 1) * L]
        else:   # o_proj: its weight gradients from the o chunks read back, then g_i W per chunk on demand
            o_chunks = OutputChunks(wo, bo, opts.o_lora, o_lora, shape[1], spec.num_chunks, ctx.seeds[1])
            o_chunks.start_backward(spec.acc_dtype, need[7], need[8], need[18 + n_qkv:])
            if opts.output_gate:
                _gated_output_backward(chunks, o_chunks, stash, spec, grad_out, B, L, norm.forward)
            elif o_chunks.needs_input:
                for i, x_i in enumerate(read_back(stash, spec, B, L)):
                    o_chunks.weight_grads(i, x_i, grad_out[:, i * L:(i + 1) * L])
                    del x_i
            d_o = o_chunks.finish(grad_out)     # cast now: no fp32 accumulator beside the pipeline

            def grad_out_chunk(i):
                if opts.output_gate:
                    return stash.pop(("dattn", i))
                return o_chunks.input_grad(i, grad_out[:, i * L:(i + 1) * L]).view(B, L, H, D)
        d_hidden = torch.empty(shape, dtype=dtype, device=grad_out.device) if need[0] and not into else None
        stash.prefetch(("T", 0))

        def deliver(j, dq, dk, dv):
            T = stash.pop(("T", j))
            d_T = chunks.backward(j, norm.forward(T), dq, dk, dv, stash.pop(("dgate", j)) if opts.output_gate else None)
            del dq, dk, dv
            if d_T is not None and norm.weight is not None:
                d_T = norm.backward(T, d_T, d_norm, need[0])      # fp32, or None
            if into:
                grad_out[:, j * L:(j + 1) * L] += d_T.to(dtype)   # the residual's sum, in place
            elif d_hidden is not None:
                d_hidden[:, j * L:(j + 1) * L] = d_T
            del T, d_T
            if j + 1 < spec.num_chunks:
                stash.prefetch(("T", j + 1))  # copies in during the next outer step, after this chunk's buffers

        run_backward(spec, grad_out_chunk, deliver, stash)
        out_w, out_b, out_n, out_lora = chunks.finish()
        d_wo, d_bo, d_o_lora = d_o if d_o else (None, None, ())
        d_norm = None if d_norm is None else d_norm.to(norm_w.dtype)
        return (d_hidden, out_w[0], out_b[0], out_w[1], out_b[1], out_w[2], out_b[2], d_wo, d_bo,
                None, None, None, None, None, out_n[0], out_n[1], d_norm, None, *out_lora, *d_o_lora)


class InputNorm:
    """The layer's input RMSNorm on one chunk ``T`` ``[B, L, hidden]`` (:mod:`fpdt.ops.rmsnorm`):
    ``weight`` ``[hidden]`` (the input's dtype unless zero-centred), or None: the identity."""

    def __init__(self, weight: torch.Tensor | None, eps: float = 0.0, zero_centred: bool = False):
        self.weight, self.eps, self.zero_centred = weight, eps, zero_centred
        self.w32 = None if weight is None else effective_weight(weight, zero_centred)

    @classmethod
    def of(cls, weight: torch.Tensor | None, opts: tuple[float, bool] | None) -> "InputNorm":
        return cls(None) if weight is None else cls(weight, *opts)

    def forward(self, T: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return T
        x_hat, _ = normalised(T, self.eps)
        if self.zero_centred:
            return x_hat.mul_(self.w32).to(T.dtype)
        return torch.mul(self.weight, x_hat.to(T.dtype))

    def backward(self, T: torch.Tensor, grad: torch.Tensor, d_weight: torch.Tensor | None,
                 need_dx: bool) -> torch.Tensor | None:
        """fp32 ``dL/dT`` from the output gradient (None unless ``need_dx``); adds the weight's into ``d_weight``."""
        x_hat, rstd = normalised(T, self.eps)
        return norm_backward(grad, x_hat, rstd, self.w32, torch.float32 if self.zero_centred else T.dtype, d_weight,
                             need_dx)


def _gated_output_backward(chunks: QKVChunks, o_chunks: OutputChunks, stash: HostStash, spec, grad_out, B: int,
                           L: int, normed: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``o_proj``'s weight gradients through the output gate, chunk by chunk: with ``o_i`` read
    back and the gate recomputed from the input chunk ``T_i``, ``z_i = o_i sigmoid(gate_i)``
    feeds the weight gradients, and the attention output's gradient ``dz_i sigmoid(gate_i)`` and
    the gate's ``dz_i o_i sigmoid'(gate_i)`` (``dz_i = g_i W``) go to ``stash`` as ``("dattn",
    i)`` / ``("dgate", i)`` for the attention backward's first touch of chunk i and for the
    projections' backward (``deliver``)."""
    H, _, D = chunks.heads
    for i, x_i in enumerate(read_back(stash, spec, B, L)):
        g_i = grad_out[:, i * L:(i + 1) * L]
        gate = chunks.query_and_gate(i, normed(stash.get(("T", i))))[1].reshape(B, L, H * D)
        o_chunks.weight_grads(i, x_i * torch.sigmoid(gate), g_i)
        s = torch.sigmoid(gate.float())
        dz = o_chunks.input_grad(i, g_i).float()
        stash.put(("dattn", i), (dz * s).to(x_i.dtype).view(B, L, H, D))
        stash.put(("dgate", i), dz.mul_(x_i.float()).mul_(s).mul_(1.0 - s).to(x_i.dtype).view(B, L, H, D))
        del x_i, gate, s, dz


def _head_rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            d_weight: torch.Tensor | None, zero_centred: bool = False) -> torch.Tensor:
    """fp32 gradient of the per-head RMSNorm w.r.t. ``x``; adds the weight's into ``d_weight`` (None: frozen)."""
    x_hat, rstd = normalised(x, eps)
    return norm_backward(dy, x_hat, rstd, effective_weight(weight, zero_centred),
                         torch.float32 if zero_centred else x.dtype, d_weight)


def rotation_of(rope: RotaryEmbedding | None, position_ids, cos, sin):
    """``(slice, dtype) -> (cos, sin)`` of a chunk, or None without RoPE."""
    if cos is not None:
        if rope is not None:
            raise ValueError("pass a RotaryEmbedding or a (cos, sin) table, not both")
        return lambda sl, dtype: (cos[:, sl].to(dtype), sin[:, sl].to(dtype))
    if rope is not None:
        return lambda sl, dtype: rope.cos_sin(position_ids[:, sl], dtype)
    return None

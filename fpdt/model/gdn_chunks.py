"""Gated DeltaNet over FPDT chunks and Ulysses ranks as one autograd.Function.

Per local chunk ``i`` (``L`` tokens, FPDT layout): the input projections; an all-to-all of the
pre-conv channels and the ``b``/``a`` gates from sequence to heads (each rank gets the global span
``[i P L, (i + 1) P L)`` of its ``Hk/P`` key and ``HV/P`` value heads); the causal conv, gates and
delta rule of :func:`head_stage` from the boundary carried over from chunk ``i - 1`` (fp32 state
``[B, HV/P, dk, dv]`` and the ``K - 1`` pre-conv tokens before the span); the output back to the
sequence layout, the gated RMSNorm and ``out_proj``. Saved per chunk in a :class:`HostStash` (host
memory with offload): the input ``x_i``, the head-layout pre-conv channels and gates, the boundary
state and window, and the core output before the norm. Backward runs the chunks in reverse, each
rebuilt from those; the state's and the window's gradients flow to the previous chunk. LoRA terms
on the five projections (:mod:`fpdt.ops.lora`, layout order ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``, ``out_proj``) are added chunk by chunk; ``out_proj``'s input is rebuilt
in backward. Derivation and memory: ``docs/gated_deltanet.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fpdt.attention.saved_stash import stash_of, stash_token
from fpdt.comm import (PendingAllToAll, group_rank, group_size, heads_to_seq, heads_to_seq_packed,
                       start_seq_to_heads_packed)
from fpdt.offload import HostStash, Runtime
from fpdt.ops.causal_conv import causal_conv, conv_kernel
from fpdt.ops.delta_rule import delta_rule_kernel, gated_delta_rule, l2norm
from fpdt.ops.lora import LoraLayout, accumulators, finish, lora_backward, with_lora

CHUNK_KEYS = ("x", "pre", "ba", "state", "window", "o")
"""What the stash holds per chunk (see the module docstring)."""


@dataclass(frozen=True)
class GDNShape:
    """Head counts and sizes of one Gated DeltaNet layer (Transformers' ``linear_*`` config fields)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class DocumentPlan:
    """Packed documents ``doc_ids`` ``[B, S]`` (global order) cut into head-layout spans of ``span``
    tokens: read from the device once, the masks copied to ``device`` once, so the chunk loops
    never wait for a copy. :meth:`span` gives one span's resets (None: nothing resets in it)."""

    def __init__(self, doc_ids: torch.Tensor, window: int, span: int, device: torch.device):
        ids = doc_ids.detach().cpu()
        B, S = ids.shape
        padded = torch.cat([torch.full((B, window), -1, dtype=ids.dtype), ids], 1)
        taps = torch.stack([padded[:, j:j + S] == ids for j in range(window + 1)], -1)     # [B, S, K]
        starts = ids != torch.cat([ids[:, :1], ids[:, :-1]], 1)      # token 0's state is zero anyway
        self.span_len, self.spans, keeps = span, [], []
        for start in range(0, S, span):
            st = starts[:, start:start + span]
            if bool(taps[:, start:start + span].all()) and not bool(st.any()):
                self.spans.append(None)
                continue
            cuts = sorted(set(torch.nonzero(st.any(0)).flatten().tolist()) | {0})
            segments = []
            for c, e in zip(cuts, cuts[1:] + [st.shape[1]]):
                if bool(st[:, c].any()):
                    keeps.append(~st[:, c])
                segments.append((c, e, len(keeps) - 1 if bool(st[:, c].any()) else None))
            self.spans.append(segments)
        self.taps = taps.to(device) if keeps or any(sp is not None for sp in self.spans) else None
        self.keep = torch.stack(keeps).to(device=device, dtype=torch.float32) if keeps else None

    def span(self, n: int):
        """``(conv_mask [B, N, K], segments)`` for span ``n``, or None. ``conv_mask[b, t, j]``: tap ``j``
        of token ``t`` reads its own document; ``segments``: ``(s, e, keep)`` runs of the span,
        ``keep`` ``[B]`` (0: the row's state resets at ``s``) or None."""
        segments = self.spans[n]
        if segments is None:
            return None
        start = n * self.span_len
        return (self.taps[:, start:start + self.span_len],
                [(c, e, None if k is None else self.keep[k]) for c, e, k in segments])


@dataclass
class GDNSpec:
    """One call's static description: shapes, the Ulysses group, chunking and offload."""

    shape: GDNShape
    group: dist.ProcessGroup | None
    sp: int
    rank: int
    num_chunks: int
    L: int
    offload: bool
    kernel: str
    conv_kernel: str = "torch"
    label: str | None = None
    runtime: Runtime | str | None = None
    docs: DocumentPlan | None = None

    def span(self, i: int):
        """Chunk ``i``'s document resets in the head layout (see :meth:`DocumentPlan.span`)."""
        return None if self.docs is None else self.docs.span(i)

    def local_sizes(self) -> tuple[int, int, int]:
        """This rank's q, k, v pre-conv channels."""
        s, P = self.shape, self.sp
        return s.key_dim // P, s.key_dim // P, s.value_dim // P

    def local_params(self, conv_w: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
        """This rank's heads of the full parameters: ``(conv [C/P, K], A_log [HV/P], dt_bias [HV/P])``;
        slices of the full tensors, so their gradients reach the full parameters."""
        s, r = self.shape, self.rank
        nq, _, nv = self.local_sizes()
        conv = conv_w.reshape(s.conv_dim, -1)
        starts = (r * nq, s.key_dim + r * nq, 2 * s.key_dim + r * nv)
        local = torch.cat([conv[a:a + n] for a, n in zip(starts, (nq, nq, nv))])
        hv = s.num_v_heads // self.sp
        heads = slice(r * hv, (r + 1) * hv)
        return local, A_log[heads], dt_bias[heads]

    def zero_boundary(self, B: int, dtype: torch.dtype, device: torch.device):
        """The state and conv window before the first chunk."""
        s, P = self.shape, self.sp
        state = torch.zeros(B, s.num_v_heads // P, s.head_k_dim, s.head_v_dim, dtype=acc_dtype(dtype), device=device)
        return state, torch.zeros(B, s.conv_kernel - 1, sum(self.local_sizes()), dtype=dtype, device=device)


def build_gdn_spec(x_shape, device: torch.device, shape: GDNShape, *, group, mesh, num_chunks: int, offload: bool,
                   doc_ids: torch.Tensor | None, label: str | None, runtime) -> GDNSpec:
    """Validate one call (errors name the fix) and build its spec."""
    if mesh is not None:
        if mesh.cp > 1:
            raise ValueError(f"Gated DeltaNet layers do not run on a 2D mesh with cp={mesh.cp} > 1 (no state passing "
                             f"across context-parallel ranks yet): use plain Ulysses (cp=1)")
        if group is not None:
            raise ValueError("the Gated DeltaNet layer got both group= and mesh=; set one")
        group = mesh.hp_group
    P = group_size(group)
    for name, n in (("linear_num_key_heads", shape.num_k_heads), ("linear_num_value_heads", shape.num_v_heads)):
        if n % P:
            raise ValueError(f"sp={P} does not divide {name}={n} of a Gated DeltaNet layer: choose an sp size "
                             f"dividing both {shape.num_k_heads} and {shape.num_v_heads}")
    B, S_local = x_shape[0], x_shape[1]
    if num_chunks < 1 or S_local % num_chunks:
        raise ValueError(f"sequence length S={S_local * P} is not divisible by sp*num_chunks={P}*{num_chunks}: pad S "
                         f"to a multiple of {P * max(num_chunks, 1)} or use fewer chunks")
    docs = None
    if doc_ids is not None:
        if doc_ids.dim() != 2 or tuple(doc_ids.shape) != (B, S_local * P):
            raise ValueError(f"doc_ids must be [B, S]=[{B}, {S_local * P}] (the global window), got "
                             f"{tuple(doc_ids.shape)}")
        docs = DocumentPlan(doc_ids, shape.conv_kernel - 1, P * (S_local // num_chunks), device)
    return GDNSpec(shape=shape, group=group, sp=P, rank=group_rank(group), num_chunks=num_chunks,
                   L=S_local // num_chunks, offload=offload, kernel=delta_rule_kernel(device),
                   conv_kernel=conv_kernel(device), label=label,
                   runtime=runtime, docs=docs)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or float64 for float64 inputs: the gates', norms' and state's precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_stage(pre, ba, state, window, conv_w, A_log, dt_bias, spec: GDNSpec, resets):
    """One chunk's mixer in the head layout, differentiable: ``pre`` ``[B, N, C/P]`` pre-conv channels
    (this rank's q | k | v), ``ba`` ``[B, N, 2 HV/P]``, ``state`` ``[B, HV/P, dk, dv]`` fp32,
    ``window`` ``[B, K - 1, C/P]``, the local parameters of :meth:`GDNSpec.local_params` and
    ``resets`` (:meth:`GDNSpec.span`) -> ``(o [B, N, HV/P, dv] in pre's dtype, state, window)``."""
    s = spec.shape
    B, N, _ = pre.shape
    hk, hv = s.num_k_heads // spec.sp, s.num_v_heads // spec.sp
    full = torch.cat([window, pre], 1)
    conv = causal_conv(full, conv_w, None if resets is None else resets[0], spec.conv_kernel)
    new_window = full[:, full.shape[1] - (s.conv_kernel - 1):].clone()     # not a view keeping `full`
    q, k, v = conv.split(spec.local_sizes(), -1)
    q, k = q.reshape(B, N, hk, s.head_k_dim), k.reshape(B, N, hk, s.head_k_dim)
    in_kernel = spec.kernel == "fla"          # fla normalises q, k inside; else in fp32 before the repeat
    if not in_kernel:
        q, k = l2norm(q), l2norm(k)
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2)
    v = v.reshape(B, N, hv, s.head_v_dim)
    b, a = ba.split(hv, -1)
    beta = b.sigmoid()
    acc = acc_dtype(pre.dtype)
    gate = torch.float64 if pre.dtype == torch.float32 else acc     # fp32 runs: A_log, dt_bias grads summed in fp64
    g = (-A_log.to(gate).exp() * F.softplus(a.to(gate) + dt_bias.to(gate))).to(acc)
    segments = [(0, N, None)] if resets is None else resets[1]
    outs = []
    for start, end, keep in segments:
        if keep is not None:
            state = state * keep[:, None, None, None]
        o, state = gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                    beta[:, start:end], initial_state=state, scale=s.head_k_dim ** -0.5,
                                    kernel=spec.kernel, qk_l2norm=in_kernel)
        outs.append(o)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    return o.to(pre.dtype), state, new_window


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm(o) * weight * silu(z)`` per value head (Transformers' ``Qwen3_5RMSNormGated``); ``[..., dv]``."""
    acc = acc_dtype(o.dtype)
    h = o.to(acc)
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return (h * F.silu(z.to(acc))).to(o.dtype)


def _start_to_heads(proj, i: int, x_i, spec: GDNSpec) -> PendingAllToAll:
    """Start chunk ``i``'s (``x_i`` ``[B, L, hidden]``) projections (``proj``: :meth:`GDNChunks.project`)
    and all-to-all; ``.wait()`` gives this rank's ``(pre [B, P L, C/P], ba [B, P L, 2 HV/P])`` through
    :func:`_joined`."""
    s = spec.shape
    q, k, v = proj(0, i, x_i).split([s.key_dim, s.key_dim, s.value_dim], -1)
    return start_seq_to_heads_packed([t.unsqueeze(-1) for t in (q, k, v, proj(2, i, x_i), proj(3, i, x_i))],
                                     spec.group)


def _joined(parts):
    return torch.cat(parts[:3], 2).squeeze(-1), torch.cat(parts[3:], 2).squeeze(-1)


def _to_sequence(d_pre, d_ba, spec: GDNSpec):
    """The gradients of :func:`_start_to_heads`'s outputs back in the sequence layout: ``(d_qkv [B, L, C],
    d_b, d_a [B, L, HV])``."""
    hv = spec.shape.num_v_heads // spec.sp
    parts = [t.unsqueeze(-1) for t in (*d_pre.split(spec.local_sizes(), -1), *d_ba.split(hv, -1))]
    back = [t.squeeze(-1) for t in heads_to_seq_packed(parts, spec.group)]
    return torch.cat(back[:3], -1), back[3], back[4]


class GDNChunks:
    """The layer's chunk steps over ``weights`` (the nine tensors of :class:`GatedDeltaNetFunction`,
    full) and ``stash``: :meth:`forward` for chunks ``0 .. u-1`` in order, then :meth:`start_backward`,
    :meth:`backward` for ``u-1 .. 0`` and :meth:`finish`. The Function runs them over a whole layer
    input; a caller holding the chunks elsewhere (streamed layers) can run them itself. ``lora``: the
    five projections' :class:`LoraLayout`, ``lora_tensors`` its tensors and ``seed`` the call's dropout
    seed (the same in forward and backward)."""

    def __init__(self, spec: GDNSpec, weights, stash: HostStash, for_backward: bool = True,
                 lora: LoraLayout | None = None, lora_tensors=(), seed: int | None = None):
        self.spec, self.weights, self.stash, self.for_backward = spec, tuple(weights), stash, for_backward
        self.pending: PendingAllToAll | None = None
        self.boundary = None
        self.lora, self.lora_tensors, self.seed = lora, tuple(lora_tensors), seed
        self.terms = lora.split(self.lora_tensors) if lora is not None else [[] for _ in range(5)]

    def project(self, n: int, i: int, x: torch.Tensor) -> torch.Tensor:
        """Projection ``n`` (0 ``in_proj_qkv``, 1 ``in_proj_z``, 2 ``in_proj_b``, 3 ``in_proj_a``,
        4 ``out_proj``) of chunk ``i``'s ``x`` ``[B, L, in]``, with its LoRA terms -> ``[B, L, out]``."""
        w = self.weights[(0, 1, 2, 3, 8)[n]]
        if not self.terms[n]:
            return F.linear(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        return with_lora(F.linear(x2, w), x2, self.terms[n], self.seed, i).view(*x.shape[:-1], w.shape[0])

    def forward(self, i: int, x_i: torch.Tensor, x_next: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk ``i``'s output ``[B, L, hidden]`` from ``x_i`` ``[B, L, hidden]`` (don't modify ``x_i``
        in place afterwards); ``x_next``: chunk ``i + 1``, whose all-to-all then overlaps this chunk (P > 1)."""
        spec, s, stash = self.spec, self.spec.shape, self.stash
        conv_w, A_log, dt_bias, norm_w = self.weights[4:8]
        B, L = x_i.shape[:2]
        if self.boundary is None:
            self.boundary = spec.zero_boundary(B, x_i.dtype, x_i.device)
        state, window = self.boundary
        pending = self.pending or _start_to_heads(self.project, i, x_i, spec)
        pre, ba = _joined(pending.wait())
        del pending                                # with P = 1 it holds the projections' output
        self.pending = _start_to_heads(self.project, i + 1, x_next, spec) if x_next is not None and spec.sp > 1 \
            else None
        if self.for_backward:
            for key, t in (("x", x_i), ("pre", pre), ("ba", ba), ("state", state), ("window", window)):
                stash.put((key, i), t)
        o_h, state, window = head_stage(pre, ba, state, window, *spec.local_params(conv_w, A_log, dt_bias), spec,
                                        spec.span(i))
        self.boundary = (state, window)
        del pre, ba
        o = heads_to_seq(o_h, spec.group)                                # [B, L, HV, dv]
        del o_h
        if self.for_backward:
            stash.put(("o", i), o)
        z = self.project(1, i, x_i).view(B, L, s.num_v_heads, s.head_v_dim)
        return self.project(4, i, gated_rms_norm(o, z, norm_w, s.eps).flatten(2))

    def start_backward(self, need, lora_need=()) -> None:
        """``need``: whether the input and each of the nine weights needs its gradient (ten flags);
        ``lora_need``: the LoRA tensors' flags. fp32 accumulators (float64 for float64 weights)."""
        self.need_x = need[0]
        self.leaves = [w.detach().requires_grad_(n) for w, n in zip(self.weights[4:], need[5:10])]
        self.acc = [torch.zeros(w.shape, dtype=acc_dtype(w.dtype), device=w.device) if n else None
                    for w, n in zip(self.weights, need[1:10])]
        self.lora_acc = accumulators(self.lora, self.lora_tensors, lora_need) if self.lora is not None else []
        self.lora_acc_terms = self.lora.split(self.lora_acc) if self.lora is not None else [[] for _ in range(5)]
        self.d_state = self.d_window = None          # the last chunk's boundary gradients are zero
        _prefetch(self.stash, self.spec.num_chunks - 1)

    def backward(self, j: int, grad_j: torch.Tensor) -> torch.Tensor | None:
        """Chunk ``j``'s input gradient ``[B, L, hidden]`` (None if not needed) from its output gradient."""
        spec, stash, acc = self.spec, self.stash, self.acc
        w_qkv, w_z, w_b, w_a = self.weights[:4]
        x_j, pre, ba, state, window, o = (stash.pop((key, j)) for key in CHUNK_KEYS)
        if j > 0:
            _prefetch(stash, j - 1)
        B, L, hidden = x_j.shape
        d_o, d_z = self._output_backward(j, o, x_j, grad_j.to(x_j.dtype))
        del o
        d_o = start_seq_to_heads_packed((d_o.contiguous(),), spec.group)   # overlaps the mixer's recompute
        d_pre, d_ba, self.d_state, self.d_window = _mixer_backward(j, pre, ba, state, window, self.leaves[:3], d_o,
                                                                   self.d_state, self.d_window, acc, spec)
        del pre, ba, state, window, d_o
        grads = (*_to_sequence(d_pre, d_ba, spec), d_z.reshape(B, L, -1))
        del d_pre, d_ba
        x2 = x_j.reshape(B * L, -1)
        part = None
        for n, w, g in zip((0, 2, 3, 1), (w_qkv, w_b, w_a, w_z), grads):
            g2 = g.reshape(B * L, -1).to(x_j.dtype)
            if acc[n] is not None:
                acc[n] += g2.t() @ x2
            if self.need_x:
                part = g2 @ w if part is None else part.add_(g2 @ w)
            if self.terms[n]:
                d_lo = lora_backward(x2, g2, self.terms[n], self.lora_acc_terms[n], self.seed, j, self.need_x)
                if d_lo is not None:
                    part.add_(d_lo.to(part.dtype))
        return None if part is None else part.view(B, L, hidden)

    def finish(self) -> tuple:
        """The nine weights' gradients in their dtypes (None where not needed), then the LoRA
        tensors'; empties the stash."""
        self.stash.clear()
        return (*(None if a is None else a.to(w.dtype) for a, w in zip(self.acc, self.weights)),
                *finish(self.lora_acc, self.lora_tensors))

    def _output_backward(self, j: int, o, x_j, grad_out_j):
        """The gated norm and ``out_proj`` of chunk ``j``, rebuilt and differentiated: ``(d_o [B, L, HV, dv],
        d_z)``; adds the norm's, ``out_proj``'s and its adapters' gradients into the accumulators."""
        s, acc = self.spec.shape, self.acc
        norm_w, w_out = self.leaves[3], self.leaves[4]
        B, L = o.shape[:2]
        out_terms = [(t, *(None if x is None else x.detach().requires_grad_(d is not None)
                           for x, d in zip(term[1:], accs[1:])))
                     for term, accs in zip(self.terms[4], self.lora_acc_terms[4]) for t in term[:1]]
        with torch.enable_grad():
            o_l = o.detach().requires_grad_()
            z_l = self.project(1, j, x_j).view(B, L, s.num_v_heads, s.head_v_dim).detach().requires_grad_()
            h = gated_rms_norm(o_l, z_l, norm_w, s.eps).flatten(2).reshape(B * L, -1)
            y = with_lora(F.linear(h, w_out), h, out_terms, self.seed, j)
            lora_wanted = [(d, x) for term, accs in zip(out_terms, self.lora_acc_terms[4])
                           for x, d in zip(term[1:], accs[1:]) if d is not None]
            wanted = [o_l, z_l] + [w for w in (norm_w, w_out) if w.requires_grad] + [x for _, x in lora_wanted]
            got = list(torch.autograd.grad(y, wanted, grad_out_j.reshape(B * L, -1)))
        for n, w in ((7, norm_w), (8, w_out)):
            if w.requires_grad:
                acc[n] += got.pop(2)
        for (d, _), g in zip(lora_wanted, got[2:]):
            d += g
        return got[0], got[1]


class GatedDeltaNetFunction(torch.autograd.Function):
    """x ``[B, S_local, hidden]`` (FPDT layout) -> the layer's output ``[B, S_local, hidden]``.
    Parameters: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` weights, the conv weight
    ``[C, 1, K]``, ``A_log``, ``dt_bias``, the gated norm's weight and ``out_proj``'s, all full."""

    @staticmethod
    def forward(ctx, x, w_qkv, w_z, w_b, w_a, conv_w, A_log, dt_bias, norm_w, w_out, spec: GDNSpec,
                for_backward: bool, lora: LoraLayout | None = None, *lora_tensors):
        weights = (w_qkv, w_z, w_b, w_a, conv_w, A_log, dt_bias, norm_w, w_out)
        L, u = spec.L, spec.num_chunks
        stash = HostStash(x.device, enabled=spec.offload, label=spec.label, runtime=spec.runtime)
        seed = lora.draw_seed() if lora is not None else None
        chunks = GDNChunks(spec, weights, stash, for_backward, lora, lora_tensors, seed)
        out = torch.empty(*x.shape[:2], w_out.shape[0], dtype=x.dtype, device=x.device)
        for i in range(u):
            x_next = x[:, (i + 1) * L:(i + 2) * L] if i + 1 < u else None
            out[:, i * L:(i + 1) * L] = chunks.forward(i, x[:, i * L:(i + 1) * L], x_next)
        del chunks
        ctx.save_for_backward(*weights, stash_token(stash), *lora_tensors)
        ctx.spec, ctx.x_meta, ctx.lora, ctx.seed = spec, (x.shape, x.dtype), lora, seed
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        weights, token, lora_tensors = saved[:9], saved[9], saved[10:]
        spec, (shape, dtype) = ctx.spec, ctx.x_meta
        chunks = GDNChunks(spec, weights, stash_of(token), lora=ctx.lora, lora_tensors=lora_tensors, seed=ctx.seed)
        chunks.start_backward(ctx.needs_input_grad, ctx.needs_input_grad[13:])
        L = spec.L
        d_x = torch.empty(shape, dtype=dtype, device=grad_out.device) if ctx.needs_input_grad[0] else None
        for j in reversed(range(spec.num_chunks)):
            d_j = chunks.backward(j, grad_out[:, j * L:(j + 1) * L])
            if d_x is not None:
                d_x[:, j * L:(j + 1) * L] = d_j
            del d_j
        grads = chunks.finish()
        return (d_x, *grads[:9], None, None, None, *grads[9:])


def _prefetch(stash: HostStash, j: int) -> None:
    for key in CHUNK_KEYS:
        stash.prefetch((key, j))


def _mixer_backward(j: int, pre, ba, state, window, params, d_o, d_state, d_window, acc, spec: GDNSpec):
    """One chunk's :func:`head_stage`, rebuilt and differentiated for the output gradient (``d_o``: its
    all-to-all in flight, waited for after the rebuild) and the next chunk's boundary gradients:
    ``(d_pre, d_ba, d_state, d_window)`` (the last two None for the first chunk); adds the conv,
    ``A_log`` and ``dt_bias`` gradients into ``acc``."""
    has_boundary = j > 0
    with torch.enable_grad():
        pre_l, ba_l = pre.detach().requires_grad_(), ba.detach().requires_grad_()
        state_l, window_l = (t.detach().requires_grad_(has_boundary) for t in (state, window))
        o, state_out, window_out = head_stage(pre_l, ba_l, state_l, window_l, *spec.local_params(*params), spec,
                                              spec.span(j))
        outs, grads = [o], [d_o.wait()[0]]
        if d_state is not None:
            outs += [state_out, window_out]
            grads += [d_state, d_window]
        wanted = [pre_l, ba_l] + ([state_l, window_l] if has_boundary else []) + [p for p in params if p.requires_grad]
        got = list(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
    got = [torch.zeros_like(w) if g is None else g for w, g in zip(wanted, got)]
    d_pre, d_ba = got[0], got[1]
    d_state, d_window = (got[2], got[3]) if has_boundary else (None, None)
    rest = got[4 if has_boundary else 2:]
    for n, p in zip((4, 5, 6), params):
        if p.requires_grad:
            acc[n] += rest.pop(0)
    return d_pre, d_ba, d_state, d_window

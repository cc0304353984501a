"""Streamed decoder layers (``stream_layers=True``): the residual stream lives in host memory.

The embedding, every layer and the loss run as passes over the ``u`` chunks ``[B, L, hidden]``
(``L = S_local / u``), whose values and gradients wait in pinned host memory between passes (one
:class:`fpdt.offload.HostStash` per layer boundary; ``stash k`` holds layer ``k``'s input, the last
one the final hidden states). No ``[B, S_local, hidden]`` tensor exists on the device. An attention
layer, forward: ``produce(i)`` (norm, q/k/v, RoPE) and ``emit(i, o_i)`` (output gate, ``o_proj``,
MLP, to the host); backward: the recompute and the branch backward in ``emit``, then the attention
backward, whose ``deliver(j)`` writes ``dx_j``. A Gated DeltaNet layer runs its chunk steps
(:class:`fpdt.model.gdn_chunks.GDNChunks`) in order, then in reverse for the backward. An MoE MLP
records its router statistics in the forward pass only. Parameter gradients accumulate in fp32 and
reach autograd once per layer. Schedule, memory and the NVMe tier: ``docs/memory.md``, "Streamed layers"."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from fpdt.attention.module import norm_eps
from fpdt.attention.mesh_pipeline import run_backward, run_forward
from fpdt.attention.output_projection import output_projection
from fpdt.attention.projected_attention import QKVChunks, attention_spec
from fpdt.attention.saved_attention import SavedAttention
from fpdt.model.apply import has_attention
from fpdt.model.checkpointing import replayed_rng, rng_state
from fpdt.model.layer_checkpoints import LayerCheckpoints, nvme_layer_count
from fpdt.model.gdn_chunks import GDNChunks
from fpdt.model.mlp import ChunkedSwiGLU
from fpdt.model.loss import chunked_lm_loss, floored_loss_chunks, sum_over_group, valid_token_scale
from fpdt.model.moe import ChunkedMoE, RouterStatistics, balancing_loss
from fpdt.offload import HostStash
from fpdt.offload.nvme_stash import NVMeStash
from fpdt.options import FPDTOptions
from fpdt.ops.projections import read_output_projection, read_projections

RESIDUAL, RESIDUAL_GRAD = "residual", "residual grad"     # a layer's input chunk, and its gradient
O_GRAD, BRANCH_GRAD = "o grad", "branch grad"           # d(attention output), d(x + o_proj(o)) chunks
GATE_GRAD = "gate grad"                                 # d(output gate) chunks (gated attention)


@dataclass(frozen=True)
class StreamedModel:
    """What a streamed run reads of a causal LM besides its modules (``model.model.embed_tokens``,
    ``.layers``, ``.norm``, ``model.lm_head``): the options, the loss's token chunks,
    ``rope(position_ids, dtype) -> (cos, sin)`` of a chunk's positions, and the model's layer
    checkpoints (which layers save their attention output; the NVMe tier); for MoE layers the
    call's ``router_stats`` and ``aux_coef``, the balancing loss's coefficient (None: not added)."""

    options: FPDTOptions
    loss_chunks: int
    rope: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
    checkpoints: LayerCheckpoints
    router_stats: RouterStatistics | None = None
    aux_coef: float | None = None


class StreamedRun:
    """One forward call of a streamed model: the host stashes of its residual stream and what
    every pass reads. ``model``: a causal LM as :class:`StreamedModel` says, ``spec`` what else;
    ``input_ids`` and ``position_ids`` ``[B, S_local]``; ``doc_ids`` ``[B, S]`` or None."""

    def __init__(self, model, spec: StreamedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids):
        opts, saving = spec.options, spec.checkpoints.saving
        self.spec = spec
        self.model, self.layers = model, list(model.model.layers)
        self.opts, self.device = opts, input_ids.device
        self.ids, self.position_ids, self.doc_ids = input_ids, position_ids, doc_ids
        self.B, S_local = input_ids.shape
        self.u = opts.num_chunks
        self.L = S_local // self.u
        self.for_backward = torch.is_grad_enabled()
        n = len(self.layers)
        self.on_nvme = min(nvme_layer_count(opts, n), n - 1) if self.for_backward else 0   # the last: read first
        store = spec.checkpoints.nvme_store() if self.on_nvme else None
        self.stashes = [NVMeStash(self.device, store, runtime=opts.runtime, label=f"layer {k}", staging=None,
                                  to_disk=lambda key: key[0] == RESIDUAL) if k < self.on_nvme else
                        HostStash(self.device, enabled=True, label=f"layer {k}" if k < n else "final norm",
                                  runtime=opts.runtime) for k in range(n + 1)]
        self.saved = [SavedAttention(self.device, on_host=True, label=f"layer {k}", runtime=opts.runtime,
                                     stash=NVMeStash(self.device, store, runtime=opts.runtime, label=f"layer {k}",
                                                     staging=None) if k < self.on_nvme else None)
                      if k < saving and self.for_backward else None for k in range(n)]
        self.rng: list = [None] * n
        self.grad_scale: torch.Tensor | None = None    # the loss's incoming gradient (head backward)

    # ------------------------------------------------------------------ chunks
    def rows(self, i: int) -> slice:
        return slice(i * self.L, (i + 1) * self.L)

    def fetch(self, stash: HostStash, kind: str, i: int, keep: bool, step: int = 1) -> torch.Tensor:
        """Chunk ``i`` of ``kind`` on the device, the next one's (``i + step``) copy started."""
        value = stash.get((kind, i)) if keep else stash.pop((kind, i))
        if 0 <= i + step < self.u and (kind, i + step) in stash:
            stash.prefetch((kind, i + step))
        return value

    # ------------------------------------------------------------------ embedding
    def embed_forward(self) -> None:
        embed = self.model.model.embed_tokens
        for i in range(self.u):
            self.stashes[0].put((RESIDUAL, i), embed(self.ids[:, self.rows(i)]))

    def embed_backward(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The embedding's weight gradient (``shape``, ``dtype``), summed over the chunks in fp32."""
        embed = self.model.model.embed_tokens
        acc = torch.zeros(shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)
        for i in range(self.u):
            g = self.fetch(self.stashes[0], RESIDUAL_GRAD, i, keep=False)
            acc.index_add_(0, self.ids[:, self.rows(i)].reshape(-1), g.reshape(-1, g.shape[-1]).to(acc.dtype))
        if embed.padding_idx is not None:
            acc[embed.padding_idx] = 0
        return acc.to(dtype)

    # ------------------------------------------------------------------ a layer
    def _attention(self, k: int):
        """Layer ``k``'s pipeline spec, a fresh attention stash and its :class:`QKVChunks`."""
        attn = self.layers[k].self_attn
        heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        shape = (self.B, self.L * self.u, attn.q_proj.in_features)
        spec = attention_spec(shape, attn.q_proj.weight.dtype, self.device, heads, group=attn.group, mesh=attn.mesh,
                              num_chunks=self.u, backend=attn.backend, softmax_scale=attn.softmax_scale,
                              doc_ids=self.doc_ids, label=f"layer {k}", runtime=attn.runtime)
        proj = read_projections({"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj},
                                type(attn).__name__, attn.projection_fix, attn.training)
        adapters, (q, k_, v) = proj.adapters, proj.bases
        lora, tensors = (None, ()) if adapters is None else (adapters.layout, adapters.tensors)
        rope, positions = self.spec.rope, self.position_ids
        qk_norm = None if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight, norm_eps(attn.q_norm))
        qkv = QKVChunks((q.weight, k_.weight, v.weight), (q.bias, k_.bias, v.bias), heads, self.L,
                        lambda sl, dtype: rope(positions[:, sl], dtype), qk_norm, lora, tensors,
                        lora.draw_seed() if lora is not None else None, getattr(attn, "output_gate", False),
                        getattr(attn, "qk_norm_zero_centred", False))
        stash = HostStash(self.device, enabled=True, label=f"layer {k}", runtime=self.opts.runtime)
        return spec, stash, qkv

    def _claim(self, k: int, for_backward: bool):
        saved = self.saved[k]
        return None if saved is None else saved.claim(for_backward, ("streamed", self.u, self.B, self.L))

    def _branch(self, k: int, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``y = h + mlp(norm(h))`` with ``h = x + o_proj(o * sigmoid(gate))`` (attention; ``gate``
        None: no output gate) or ``h = x + o`` (Gated DeltaNet, ``o`` its output), one chunk."""
        layer = self.layers[k]
        if not has_attention(layer):
            return self._mlp(layer, x + o)
        attn = layer.self_attn
        if gate is not None:
            o = o * torch.sigmoid(gate)
        o = o.reshape(self.B, self.L, -1)
        read = read_output_projection(attn.o_proj, type(attn).__name__, attn.training)
        if read is None or read.adapters is None:
            a = attn.o_proj(o)
        else:
            a = output_projection(o, read.bases[0].weight, read.bases[0].bias, read.adapters, 1)
        return self._mlp(layer, x + a)

    def _mlp(self, layer, h: torch.Tensor) -> torch.Tensor:
        """``h + mlp(norm(h))``: fpdt.model's layer as its unstreamed pass runs it (an MoE MLP records
        its statistics outside a backward only); a Transformers layer with the norm inside the chunked
        MLP when it is fpdt's plain RMSNorm (an MoE MLP then reads the statistics set on it per call)."""
        if hasattr(layer, "mlp_branch"):
            return h + layer.mlp_branch(h, self.spec.router_stats, checkpointed=True)
        mlp, norm = layer.mlp, layer.post_attention_layernorm
        inside = isinstance(mlp, (ChunkedSwiGLU, ChunkedMoE)) and getattr(norm, "zero_centred", None) is False
        return h + (mlp(h, norm=norm) if inside else mlp(norm(h)))

    def _gate(self, qkv: QKVChunks, i: int, x: torch.Tensor, norm) -> torch.Tensor | None:
        """Chunk ``i``'s output gate ``[B, L, H, D]`` from its layer input ``x`` (None without one)."""
        return qkv.query_and_gate(i, norm(x))[1] if qkv.gate else None

    def layer_forward(self, k: int) -> None:
        """Layer ``k``: stash ``k``'s input chunks -> stash ``k + 1``'s (module docstring)."""
        self.rng[k] = rng_state(self.device)
        if not has_attention(self.layers[k]):
            self._gdn_forward(k)
            return
        src, dst = self.stashes[k], self.stashes[k + 1]
        spec, stash, qkv = self._attention(k)
        norm = self.layers[k].input_layernorm

        def produce(i):
            return qkv.forward(i, norm(self.fetch(src, RESIDUAL, i, keep=True)))

        def emit(i, o_i):
            x = src.get((RESIDUAL, i)) if self.for_backward else src.pop((RESIDUAL, i))
            dst.put((RESIDUAL, i), self._branch(k, x, o_i, self._gate(qkv, i, x, norm)))

        run_forward(spec, produce, emit, stash, False, self._claim(k, False))
        self._to_disk(k)

    # ------------------------------------------------------------------ a Gated DeltaNet layer
    def _gdn_chunks(self, k: int, for_backward: bool) -> GDNChunks:
        """Layer ``k``'s chunk steps; ``for_backward``: with the graph from fused projections (Qwen3-Next's
        ``in_proj_qkvz``, ``in_proj_ba``) to the weights the steps read, which :meth:`_gdn_backward` follows."""
        gdn = self.layers[k].linear_attn
        with torch.enable_grad() if for_backward else contextlib.nullcontext():
            spec, weights, adapters = gdn.spec_and_weights((self.B, self.L * self.u, gdn.hidden_size), self.device,
                                                           self.doc_ids)
        lora, tensors = (None, ()) if adapters is None else (adapters.layout, adapters.tensors)
        stash = HostStash(self.device, enabled=True, label=f"layer {k}", runtime=self.opts.runtime)
        return GDNChunks(spec, weights, stash, for_backward, lora, tensors,
                         lora.draw_seed() if lora is not None else None)   # the same seed: replayed RNG

    def _gdn_pass(self, k: int, chunks: GDNChunks, keep: bool, step) -> None:
        """Layer ``k``'s Gated DeltaNet forward over the chunks in order; ``step(i, x_i, a_i)`` takes
        each chunk's input and mixer output (the next chunk's all-to-all started first, ``P > 1``)."""
        src, norm = self.stashes[k], self.layers[k].input_layernorm
        ahead = chunks.spec.sp > 1
        x = self.fetch(src, RESIDUAL, 0, keep=keep)
        t = norm(x)
        for i in range(self.u):
            x_next = self.fetch(src, RESIDUAL, i + 1, keep=keep) if i + 1 < self.u else None
            t_next = None if x_next is None else norm(x_next)
            step(i, x, chunks.forward(i, t, t_next if ahead else None))
            x, t = x_next, t_next

    def _gdn_forward(self, k: int) -> None:
        dst = self.stashes[k + 1]
        chunks = self._gdn_chunks(k, for_backward=False)
        self._gdn_pass(k, chunks, self.for_backward, lambda i, x, a: dst.put((RESIDUAL, i), self._branch(k, x, a)))
        chunks.stash.clear()
        self._to_disk(k)

    def _gdn_backward(self, k: int, wanted: set, acc: dict, scale) -> None:
        """Layer ``k``'s backward (Gated DeltaNet): the forward again with its chunk states saved and
        the branch backward per chunk, then the mixer's backward in reverse chunk order."""
        layer, src, dst = self.layers[k], self.stashes[k], self.stashes[k + 1]
        chunks = self._gdn_chunks(k, for_backward=True)
        branch_params = _params_in(wanted, layer.post_attention_layernorm, layer.mlp)
        norm_params = _params_in(wanted, layer.input_layernorm)
        dst.prefetch((RESIDUAL_GRAD, 0))

        def branch_backward(i, x, a):
            x, a = x.detach().requires_grad_(), a.detach().requires_grad_()
            g = self.fetch(dst, RESIDUAL_GRAD, i, keep=False)
            with torch.enable_grad():
                y = self._branch(k, x, a)
            grads = torch.autograd.grad(y, [x, a, *branch_params], g if scale is None else g * scale)
            _accumulate(acc, branch_params, grads[2:])
            src.put((BRANCH_GRAD, i), grads[0])
            src.put((O_GRAD, i), grads[1])

        self._gdn_pass(k, chunks, True, branch_backward)
        chunks.start_backward([True] + [id(w) in wanted or w.grad_fn is not None for w in chunks.weights],
                              [t is not None and id(t) in wanted for t in chunks.lora_tensors])
        last = self.u - 1
        for key in (O_GRAD, RESIDUAL, BRANCH_GRAD):
            src.prefetch((key, last))
        for j in reversed(range(self.u)):
            d_t = chunks.backward(j, self.fetch(src, O_GRAD, j, keep=False, step=-1))
            x = self.fetch(src, RESIDUAL, j, keep=False, step=-1).detach().requires_grad_()
            with torch.enable_grad():
                t = layer.input_layernorm(x)
            grads = torch.autograd.grad(t, [x, *norm_params], d_t)
            _accumulate(acc, norm_params, grads[1:])
            src.put((RESIDUAL_GRAD, j), grads[0] + self.fetch(src, BRANCH_GRAD, j, keep=False, step=-1))
        regrouped = []                               # weights regrouped from fused projections
        for w, d in zip((*chunks.weights, *chunks.lora_tensors), chunks.finish()):
            if w is not None and d is not None:
                if id(w) in wanted:
                    acc[id(w)] = d
                elif w.grad_fn is not None:
                    regrouped.append((w, d))
        if regrouped:
            params = _params_in(wanted, layer.linear_attn)
            grads = torch.autograd.grad([w for w, _ in regrouped], params, [d for _, d in regrouped], allow_unused=True)
            _accumulate(acc, params, grads)

    def _to_disk(self, k: int) -> None:
        """After layer ``k``'s forward: its input and saved outputs start their writes, layer ``k - 1``'s finish."""
        for j, wait in ((k, False), (k - 1, True)):
            if 0 <= j < self.on_nvme:
                for stash in (self.stashes[j], self.saved[j].stash if self.saved[j] is not None else None):
                    if stash is not None:
                        stash.flush() if wait else stash.start_flush()

    def _read_back(self, k: int) -> None:
        """Before layer ``k``'s backward: its and layer ``k - 1``'s inputs and saved outputs read back."""
        for j in (k, k - 1):
            if 0 <= j < self.on_nvme:
                self.stashes[j].read_all()
                if self.saved[j] is not None:
                    self.saved[j].stash.read_all()

    def layer_backward(self, k: int, params: list[torch.Tensor], needs) -> list[torch.Tensor | None]:
        """Layer ``k``'s backward (module docstring): stash ``k + 1``'s gradient chunks -> stash
        ``k``'s; returns the gradients of ``params`` (None where not ``needs``)."""
        layer = self.layers[k]
        wanted = {id(p) for p, need in zip(params, needs) if need}
        acc: dict[int, torch.Tensor] = {}
        scale = self.grad_scale if k + 1 == len(self.layers) else None
        self._read_back(k)
        if not has_attention(layer):
            with replayed_rng(self.rng[k], self.device):
                self._gdn_backward(k, wanted, acc, scale)
        else:
            self._attention_backward(k, wanted, acc, scale)
        missing = [i for i, p in enumerate(params) if id(p) in wanted and id(p) not in acc]
        if missing:
            raise RuntimeError(f"stream_layers: layer {k} has parameters its streamed pass does not use "
                               f"(indices {missing} of layer.parameters()); it streams Llama-family, Qwen3.5 "
                               f"and Qwen3-MoE layers only")
        return [acc[id(p)].to(p.dtype) if id(p) in wanted else None for p in params]

    def _attention_backward(self, k: int, wanted: set, acc: dict, scale) -> None:
        layer, src, dst = self.layers[k], self.stashes[k], self.stashes[k + 1]
        if self.saved[k] is not None:
            self.saved[k].begin_backward()
        with replayed_rng(self.rng[k], self.device):
            spec, stash, qkv = self._attention(k)
            attn, norm = layer.self_attn, layer.input_layernorm
            qkv.start_backward(spec.acc_dtype, [id(w) in wanted for w in qkv.weights],
                               [b is not None and id(b) in wanted for b in qkv.biases],
                               [w is not None and id(w) in wanted for w in qkv.norms],
                               [t is not None and id(t) in wanted for t in qkv.lora_tensors], True)
            branch_params = _params_in(wanted, attn.o_proj, layer.post_attention_layernorm, layer.mlp)
            norm_params = _params_in(wanted, norm)
            dst.prefetch((RESIDUAL_GRAD, 0))

            def produce(i):
                return qkv.forward(i, norm(self.fetch(src, RESIDUAL, i, keep=True)))

            def emit(i, o_i):
                x = src.get((RESIDUAL, i))
                gate = self._gate(qkv, i, x, norm)
                x = x.detach().requires_grad_()
                o = o_i.detach().requires_grad_()
                leaves = [x, o] + ([] if gate is None else [gate.detach().requires_grad_()])
                g = self.fetch(dst, RESIDUAL_GRAD, i, keep=False)
                with torch.enable_grad():
                    y = self._branch(k, *leaves)
                grads = torch.autograd.grad(y, leaves + branch_params, g if scale is None else g * scale)
                _accumulate(acc, branch_params, grads[len(leaves):])
                src.put((BRANCH_GRAD, i), grads[0])
                src.put((O_GRAD, i), grads[1])
                if gate is not None:
                    src.put((GATE_GRAD, i), grads[2])

            run_forward(spec, produce, emit, stash, True, self._claim(k, True))

            def grad_out_chunk(i):
                return self.fetch(src, O_GRAD, i, keep=False).view(self.B, self.L, attn.num_heads, attn.head_dim)

            def deliver(j, dq, dk, dv):
                x = self.fetch(src, RESIDUAL, j, keep=False).detach().requires_grad_()   # its last use
                with torch.enable_grad():
                    t = norm(x)
                d_gate = self.fetch(src, GATE_GRAD, j, keep=False) if qkv.gate else None
                d_t = qkv.backward(j, t.detach(), dq, dk, dv, d_gate)
                grads = torch.autograd.grad(t, [x, *norm_params], d_t)
                _accumulate(acc, norm_params, grads[1:])
                src.put((RESIDUAL_GRAD, j), grads[0] + self.fetch(src, BRANCH_GRAD, j, keep=False))

            run_backward(spec, grad_out_chunk, deliver, stash)
        if self.saved[k] is not None:
            self.saved[k].end_backward()
        d_w, d_b, d_n, d_lora = qkv.finish()
        for t, d in zip((*qkv.weights, *qkv.biases, *qkv.norms, *qkv.lora_tensors), (*d_w, *d_b, *d_n, *d_lora)):
            if t is not None and d is not None:
                acc[id(t)] = d

    # ------------------------------------------------------------------ head
    def head_forward(self, labels: torch.Tensor, num_valid_tokens, sp: int, group) -> tuple[torch.Tensor, list]:
        """This rank's term of the loss (fp32 scalar), and when training the fp32 gradients of the
        final norm's and LM head's weights (their input's gradient chunks go to the last stash)."""
        model, last = self.model, self.stashes[-1]
        norm, weight = model.model.norm, model.lm_head.weight
        scale = valid_token_scale(labels, group=group, sp=sp, num_valid_tokens=num_valid_tokens).to(self.device)
        params = [p for p in (norm.weight, weight) if self.for_backward and p.requires_grad]
        acc: dict[int, torch.Tensor] = {}
        chunks = -(-self.spec.loss_chunks // self.u) if self.spec.loss_chunks else 0
        if chunks and self.opts.loss_chunks is None:      # the default count, floored for one chunk's tokens
            chunks = floored_loss_chunks(chunks, labels.shape[0] * self.L)
        total = None
        for i in range(self.u):
            h = self.fetch(last, RESIDUAL, i, keep=False).detach().requires_grad_(self.for_backward)
            with torch.enable_grad() if self.for_backward else torch.no_grad():
                loss = chunked_lm_loss(norm(h), weight, labels[:, self.rows(i)], scale, chunks,
                                       wgrad=self.opts.lm_head_wgrad)
            if self.for_backward:
                grads = torch.autograd.grad(loss, [h, *params])
                last.put((RESIDUAL_GRAD, i), grads[0])
                _accumulate(acc, params, grads[1:])
            total = loss.detach() if total is None else total + loss.detach()
        return total, [acc.get(id(p)) for p in (norm.weight, weight)]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _params_in(wanted: set, *modules) -> list[torch.Tensor]:
    """The parameters of ``modules`` whose gradient is wanted, in module order."""
    return [p for m in modules for p in m.parameters() if id(p) in wanted]


def _accumulate(acc: dict, params, grads) -> None:
    for p, g in zip(params, grads):
        if g is None:
            continue
        if id(p) in acc:
            acc[id(p)] += g.to(acc[id(p)].dtype)
        else:
            acc[id(p)] = g.to(_acc_dtype(p), copy=True)


class StreamedEmbeddingFunction(torch.autograd.Function):
    """``anchor`` (an empty leaf that requires grad), the embedding ``weight`` -> an empty token
    that carries the chain; the embedded chunks go to ``run``'s first stash."""

    @staticmethod
    def forward(ctx, anchor, weight, run: StreamedRun):
        run.embed_forward()
        ctx.run, ctx.meta = run, (weight.shape, weight.dtype, weight.device)   # ZeRO-3 may release it
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        d_w = ctx.run.embed_backward(*ctx.meta) if ctx.needs_input_grad[1] else None
        return torch.empty(0, device=ctx.run.device), d_w, None


class StreamedLayerFunction(torch.autograd.Function):
    """Token in -> token out for decoder layer ``k`` of ``run``; ``params``: the layer's
    parameters, whose gradients its backward returns (nothing else is saved)."""

    @staticmethod
    def forward(ctx, token, run: StreamedRun, k: int, *params):
        run.layer_forward(k)
        ctx.run, ctx.k, ctx.params = run, k, params
        return token.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grads = ctx.run.layer_backward(ctx.k, list(ctx.params), ctx.needs_input_grad[3:])
        return (torch.empty(0, device=ctx.run.device), None, None, *grads)


class StreamedHeadFunction(torch.autograd.Function):
    """Token, labels ``[B, S_local]``, the final norm's and LM head's weights -> this rank's
    loss term; backward scales the gradients its forward computed by the incoming one."""

    @staticmethod
    def forward(ctx, token, run: StreamedRun, labels, num_valid_tokens, sp: int, group, norm_w, lm_w):
        loss, grads = run.head_forward(labels, num_valid_tokens, sp, group)
        ctx.run, ctx.grads = run, grads
        ctx.dtypes = (norm_w.dtype, lm_w.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        ctx.run.grad_scale = grad
        d = [None if g is None else (g * grad).to(dt) for g, dt in zip(ctx.grads, ctx.dtypes)]
        return (torch.empty(0, device=grad.device), None, None, None, None, None, *d)


def streamed_layer(layer, token: torch.Tensor, stream: tuple[StreamedRun, int]) -> torch.Tensor:
    """A decoder layer's forward under ``stream = (run, k)``: layer ``k`` of ``run`` (the layer
    module's forward calls this, so ZeRO-3's hooks on the layer gather its parameters)."""
    run, k = stream
    return StreamedLayerFunction.apply(token, run, k, *layer.parameters())


def streamed_loss(model, spec: StreamedModel, input_ids: torch.Tensor, labels: torch.Tensor | None,
                  position_ids: torch.Tensor, doc_ids: torch.Tensor | None, num_valid_tokens, sp: int,
                  group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The forward of a causal LM with ``stream_layers``; each layer is called as
    ``layer(token, fpdt_stream=(run, k))``. Returns the global token-mean loss (plus ``spec.aux_coef``
    times the balancing loss of ``spec.router_stats`` when given), None without labels."""
    run = StreamedRun(model, spec, input_ids, position_ids, doc_ids)
    anchor = torch.empty(0, device=input_ids.device, requires_grad=run.for_backward)
    token = StreamedEmbeddingFunction.apply(anchor, model.model.embed_tokens.weight, run)
    for k, layer in enumerate(run.layers):
        token = layer(token, fpdt_stream=(run, k))
    if labels is None:
        for stash in run.stashes:
            stash.clear()
        return None
    aux = None
    if spec.router_stats is not None and spec.aux_coef is not None:
        token, aux = balancing_loss(token, spec.router_stats)      # its backward runs before the layers'
    local = StreamedHeadFunction.apply(token, run, labels, num_valid_tokens, sp, group, model.model.norm.weight,
                                       model.lm_head.weight)
    loss = sum_over_group(local, group=group, sp=sp)
    return loss if aux is None else loss + spec.aux_coef * aux


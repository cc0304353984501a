"""Chunked mixture-of-experts MLP (Qwen3-MoE, Qwen3-Next / Qwen3.5-MoE with a shared expert) over
token chunks (:class:`ChunkedMoEFunction`), and the per-step router statistics of the balancing loss
(:class:`RouterStatistics`). Derivation, memory and kernels: ``docs/moe.md``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fpdt.model.checkpointing import donated_gradient, in_recompute, output_values_unused
from fpdt.model.chunks import budget_chunks, chunk_bounds
from fpdt.ops.lora import LoraLayout, accumulators, finish, lora_backward, with_lora
from fpdt.ops.parameter_lora import base_module, read_parameters
from fpdt.ops.projections import read_projections
from fpdt.ops.rmsnorm import norm_backward, normalised


def default_moe_chunks(hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                       num_chunks: int = 1, shared_intermediate_size: int = 0) -> int:
    """Token chunks so that one chunk's backward set, :func:`moe_elements_per_token` elements per
    token, fits two local attention chunks of bf16 hidden states, the dense MLP's rule (:mod:`fpdt.model.chunks`)."""
    per_token = moe_elements_per_token(hidden_size, moe_intermediate_size, num_experts, top_k, shared_intermediate_size)
    return budget_chunks(num_chunks, hidden_size, per_token)


def moe_elements_per_token(hidden: int, ffn: int, num_experts: int, top_k: int, shared_ffn: int = 0) -> int:
    """The backward's peak per token of a chunk, in elements of the model's dtype (fp32 counts 2 and
    an int64 index 4, for bf16): the norm's fp32 ``x_hat``, its output, the fp32 input gradient
    ``5 hidden``; fp32 probabilities ``2 E``; top-k indices, values, weights, the row order, the
    rows' weights and their gradients ``24 k``; per routed row the gathered input and output
    gradient, ``gate_up``, ``silu(gate)``, the product, the expert output and its fp32 copy
    ``5 hidden + 4 ffn`` (the grouped kernel's padded copies for a weight gradient: ``3 hidden + 5
    ffn``). The grouped kernel adds one ``gate_up``-sized weight gradient per chunk (``docs/moe.md``)."""
    row = max(5 * hidden + 4 * ffn, 3 * hidden + 5 * ffn)
    routed = 5 * hidden + 2 * num_experts + 24 * top_k + top_k * row
    return max(routed, 9 * hidden + 4 * shared_ffn)


def moe_kernel(device: torch.device, dtype: torch.dtype, hidden: int, ffn: int) -> str:
    """``"grouped_mm"`` (``torch._grouped_mm``: CUDA, bf16, compute capability 9.0 or newer, widths
    multiples of 8) or ``"loop"`` (one matmul per expert with tokens; a host read of the counts per chunk)."""
    if (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0) and hidden % 8 == 0 and ffn % 8 == 0):
        return "grouped_mm"
    return "loop"


class RouterStatistics:
    """One forward call's router statistics: per MoE layer, tokens routed per expert (top-k counts)
    and the sum of router probabilities per expert, summed over chunks, calls and the micro-batch;
    over the sequence-parallel ``group`` by one all-reduce (:meth:`reduce`).

    The balancing loss (Transformers' ``load_balancing_loss_func`` without a mask) is
    ``E * sum_e C_e P_e / R**2``, with ``C``, ``P`` the counts and probability sums over all layers
    and tokens and ``R`` the rows over all layers. Its gradient w.r.t. each layer's ``P`` is
    ``E C / R**2``: the routers' backward reads it from here (:meth:`prob_grad`), scaled by the
    gradient :func:`balancing_loss` received, so layer checkpoints and recompute need no graph of it."""

    def __init__(self, num_experts: int, top_k: int, group: dist.ProcessGroup | None = None):
        self.num_experts, self.top_k, self.group = num_experts, top_k, group
        self.layers: dict[int, list] = {}          # layer -> [counts fp32 [E], prob sums fp32 [E], rows]
        self._reduced: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self.loss_grad: torch.Tensor | None = None  # d(returned loss)/d(balancing loss), set in backward

    def record(self, layer: int, counts: torch.Tensor, prob_sum: torch.Tensor, rows: int) -> None:
        if self._reduced is not None:
            raise RuntimeError("router statistics were already reduced: use a fresh RouterStatistics per forward")
        entry = self.layers.setdefault(layer, [torch.zeros_like(counts), torch.zeros_like(prob_sum), 0])
        entry[0] += counts
        entry[1] += prob_sum
        entry[2] += rows

    def reduce(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(counts [L, E], prob sums [L, E], rows over all layers)`` summed over the group (once)."""
        if self._reduced is None:
            if not self.layers:
                raise RuntimeError("no MoE layer recorded router statistics in this forward call")
            order = sorted(self.layers)
            counts = torch.stack([self.layers[i][0] for i in order])
            probs = torch.stack([self.layers[i][1] for i in order])
            rows = torch.tensor([float(sum(self.layers[i][2] for i in order))], device=counts.device)
            flat = torch.cat([counts.reshape(-1), probs.reshape(-1), rows])
            if self.group is not None or (dist.is_available() and dist.is_initialized()):
                if dist.get_world_size(self.group) > 1:
                    dist.all_reduce(flat, group=self.group)
            n = counts.numel()
            self._reduced = (flat[:n].view_as(counts), flat[n:2 * n].view_as(probs), float(flat[-1].item()))
        return self._reduced

    def balancing_loss(self) -> torch.Tensor:
        """The loss's value, an fp32 scalar (no graph; :func:`balancing_loss` attaches its gradient)."""
        counts, probs, rows = self.reduce()
        return self.num_experts * (counts.sum(0) * probs.sum(0)).sum() / rows ** 2

    def prob_grad(self) -> torch.Tensor | None:
        """``d loss / d P_layer`` ``[E]`` fp32 (the same for every layer), or None when the loss had no gradient."""
        if self.loss_grad is None:
            return None
        counts, _, rows = self.reduce()
        return self.loss_grad * (self.num_experts / rows ** 2) * counts.sum(0)

    def layer_counts(self) -> dict[int, torch.Tensor]:
        """Per MoE layer, tokens routed to each expert ``[E]`` over the group (no graph)."""
        counts, _, _ = self.reduce()
        return dict(zip(sorted(self.layers), counts.detach()))

    def expert_load(self) -> dict[int, dict[str, float]]:
        """:func:`expert_load` of :meth:`layer_counts`."""
        return expert_load(self.layer_counts())


def expert_load(counts: dict[int, torch.Tensor]) -> dict[int, dict[str, float]]:
    """Per layer: ``max`` and ``mean`` tokens per expert and their ratio ``imbalance`` (1: balanced)."""
    out = {}
    for layer, c in counts.items():
        mx, mean = float(c.max()), float(c.mean())
        out[layer] = dict(max=mx, mean=mean, imbalance=mx / mean if mean else 0.0)
    return out


class _BalancingLoss(torch.autograd.Function):
    """``(h, stats) -> (h, loss)``; backward hands the loss's gradient to ``stats`` before the layers'."""

    @staticmethod
    def forward(ctx, h, stats):
        ctx.stats = stats
        return h.view_as(h), stats.balancing_loss()

    @staticmethod
    def backward(ctx, grad_h, grad_loss):
        ctx.stats.loss_grad = grad_loss.float() if grad_loss is not None else None
        return grad_h, None


def balancing_loss(h: torch.Tensor, stats: RouterStatistics) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, loss)``: the final hidden states ``h`` (unchanged; every layer's backward follows this
    one's) and the balancing loss of ``stats``; its gradient reaches the routers through ``stats``."""
    return _BalancingLoss.apply(h, stats)


class ExpertGroups:
    """Rows sorted by expert: ``counts`` ``[E]`` and either ``offs`` (int32 cumulative ends, the
    grouped kernel) or host ``bounds`` ``[(expert, start, end)]`` of non-empty experts (the loop)."""

    def __init__(self, counts: torch.Tensor, kernel: str):
        self.kernel, self.counts = kernel, counts
        if kernel == "grouped_mm":
            self.offs = torch.cumsum(counts, 0, dtype=torch.int32)
        else:
            ends = torch.cumsum(counts, 0).tolist()
            self.bounds = [(e, end - c, end) for e, (c, end) in enumerate(zip(counts.tolist(), ends)) if c]

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Rows of expert ``e``: ``x_e @ w[e].T``; ``x`` ``[m, in]``, ``w`` ``[E, out, in]`` -> ``[m, out]``."""
        if self.kernel == "grouped_mm":
            return torch._grouped_mm(x, w.transpose(1, 2), offs=self.offs)
        out = x.new_empty(x.shape[0], w.shape[1])
        for e, s, t in self.bounds:
            out[s:t] = x[s:t] @ w[e].t()
        return out

    def input_grad(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``dy_e @ w[e]``: ``dy`` ``[m, out]`` -> ``[m, in]``."""
        if self.kernel == "grouped_mm":
            return torch._grouped_mm(dy, w, offs=self.offs)
        out = dy.new_empty(dy.shape[0], w.shape[2])
        for e, s, t in self.bounds:
            out[s:t] = dy[s:t] @ w[e]
        return out

    def add_weight_grad(self, acc: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
        """``acc[e] += dy_e.T @ x_e`` (``acc`` ``[E, out, in]`` fp32 or the weights' dtype)."""
        if self.kernel == "grouped_mm":
            dy_t, x = _padded_rows(dy.t(), 1), _padded_rows(x, 0)     # 16-byte aligned row strides
            dw = torch._grouped_mm(dy_t, x, offs=self.offs)
            del dy_t, x
            dw.masked_fill_((self.counts == 0)[:, None, None], 0)     # empty groups are not written
            acc += dw
            return
        for e, s, t in self.bounds:
            acc[e] += (dy[s:t].t() @ x[s:t]).to(acc.dtype)


def _padded_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` contiguous with its size along ``dim`` (the rows) zero-padded to 16 bytes; rows past
    the last group's end are outside every group."""
    align = 16 // t.element_size()
    pad = -t.shape[dim] % align
    if pad == 0:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] += pad
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _route(xc: torch.Tensor, w_router: torch.Tensor, top_k: int, norm_topk: bool):
    """-> (probs fp32 ``[n, E]``, top-k indices ``[n, k]``, top-k values ``[n, k]``, weights fp32 ``[n, k]``)."""
    probs = torch.softmax(F.linear(xc.float(), w_router.float()), dim=-1)
    top_v, top_i = torch.topk(probs, top_k, dim=-1)
    weights = top_v / top_v.sum(-1, keepdim=True) if norm_topk else top_v
    return probs, top_i, top_v, weights


def _sorted_rows(top_i: torch.Tensor, num_experts: int, kernel: str):
    """-> (``order`` of the ``n k`` (token, slot) rows by expert, their tokens, :class:`ExpertGroups`)."""
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // top_i.shape[1], ExpertGroups(counts, kernel)


def _swiglu_rows(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[m, 2 I]`` gate | up -> (gate, up) views."""
    ffn = gu.shape[1] // 2
    return gu[:, :ffn], gu[:, ffn:]


class ChunkedMoEFunction(torch.autograd.Function):
    """The MoE MLP over ``num_chunks`` token chunks with recompute in backward.

    Inputs: ``x`` ``[B, S, hidden]``; ``w_router`` ``[E, hidden]``; ``gate_up`` ``[E, 2 I, hidden]``;
    ``down`` ``[E, hidden, I]``; ``num_chunks``; ``spec`` (top_k, norm_topk, kernel, layer, stats);
    ``norm_eps`` or None; then the norm weight (with ``norm_eps``) and, for a shared expert,
    ``shared_gate_proj``, ``shared_up_proj`` ``[Is, hidden]``, ``shared_down_proj`` ``[hidden, Is]``,
    ``shared_expert_gate`` ``[1, hidden]``, then the LoRA tensors of ``spec["lora"]`` (a
    :class:`LoraLayout` of those four projections, or None). Output ``[B, S, hidden]`` in ``x.dtype``.
    Saved: ``x``, the weights and (with the norm) an fp32 ``rstd`` per token; everything per token
    chunk is recomputed (LoRA dropout masks from the call's seed)."""

    @staticmethod
    def forward(ctx, x, w_router, gate_up, down, num_chunks: int, spec: dict, norm_eps=None, *tensors):
        norm_w, shared, lora_tensors = _split_tensors(tensors, norm_eps, spec.get("lora"))
        lora = spec.get("lora")
        terms = lora.split(lora_tensors) if lora is not None else [[]] * 4
        flat = x.reshape(-1, x.shape[-1])
        dtype = x.dtype if norm_w is None else torch.promote_types(norm_w.dtype, x.dtype)
        ctx.seed = seed = lora.draw_seed() if lora is not None else None
        ctx.num_chunks, ctx.spec, ctx.norm_eps, ctx.num_tensors = num_chunks, spec, norm_eps, len(tensors)
        # a checkpoint's recompute records nothing again (its backward reads the statistics)
        stats = spec["stats"] if spec["record"] and not in_recompute(x) else None
        if norm_w is not None and output_values_unused(x):
            ctx.save_for_backward(x, w_router, gate_up, down, None, *tensors)
            placeholder = torch.empty(1, dtype=dtype, device=x.device).expand(*x.shape[:-1], x.shape[-1])
            output_values_unused(x, placeholder)
            return placeholder
        E, k = w_router.shape[0], spec["top_k"]
        out = torch.empty(flat.shape, dtype=dtype, device=x.device)
        rstd = None if norm_w is None else torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)
        counts = torch.zeros(E, dtype=torch.float32, device=x.device) if stats is not None else None
        prob_sum = torch.zeros(E, dtype=torch.float32, device=x.device) if stats is not None else None
        for c, (s, e) in enumerate(chunk_bounds(flat.shape[0], num_chunks)):
            if norm_w is None:
                xc = flat[s:e]
            else:
                x_hat, rstd[s:e] = normalised(flat[s:e], norm_eps)
                xc = torch.mul(norm_w, x_hat.to(x.dtype))
                del x_hat
            probs, top_i, _, weights = _route(xc, w_router, k, spec["norm_topk"])
            if stats is not None:
                counts += torch.bincount(top_i.reshape(-1), minlength=E).float()
                prob_sum += probs.sum(0)
            del probs
            order, tokens, groups = _sorted_rows(top_i, E, spec["kernel"])
            xs = xc[tokens]                                                 # [n k, hidden], sorted by expert
            g, u = _swiglu_rows(groups.linear(xs, gate_up))
            ys = groups.linear(F.silu(g) * u, down)                         # [n k, hidden]
            del g, u, xs
            ys = ys.float().mul_(weights.reshape(-1)[order, None])
            acc = torch.zeros(xc.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, ys)
            del ys
            if shared:
                acc += _shared_forward(xc, shared, terms, seed, c)
            out[s:e] = acc
        if stats is not None:
            stats.record(spec["layer"], counts, prob_sum, flat.shape[0])
        ctx.save_for_backward(x, w_router, gate_up, down, rstd, *tensors)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, w_router, gate_up, down, rstd, *tensors = ctx.saved_tensors
        eps, spec, lora, seed = ctx.norm_eps, ctx.spec, ctx.spec.get("lora"), ctx.seed
        norm_w, shared, lora_tensors = _split_tensors(tensors, eps, lora)
        names = ("x", "w_router", "gate_up", "down", "num_chunks", "spec", "norm_eps") + \
            (("norm_w",) if eps is not None else ()) + tuple(f"shared{i}" for i in range(len(shared))) + \
            tuple(f"lora{i}" for i in range(len(lora_tensors)))
        need = dict(zip(names, ctx.needs_input_grad))
        terms = lora.split(lora_tensors) if lora is not None else [[]] * 4
        d_lora = accumulators(lora, lora_tensors, [need[f"lora{i}"] for i in range(len(lora_tensors))]) \
            if lora is not None else []
        lora_accs = lora.split(d_lora) if lora is not None else [[]] * 4
        d_router, d_gu, d_down, d_norm = (_grad_buffer(w, need.get(n)) for w, n in (
            (w_router, "w_router"), (gate_up, "gate_up"), (down, "down"), (norm_w, "norm_w")))
        d_shared = [_grad_buffer(w, need[f"shared{i}"]) for i, w in enumerate(shared)]
        stats = spec["stats"]
        g_prob = stats.prob_grad() if stats is not None else None          # [E] fp32 or None
        flat = x.reshape(-1, x.shape[-1])
        gflat = grad_out.reshape(-1, grad_out.shape[-1])
        need_dx = need["x"]
        into = eps is not None and need_dx and donated_gradient(grad_out, x)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx and not into else None
        dx_flat = gflat if into else None if dx is None else dx.view(flat.shape)
        mlp_dx = need_dx or d_norm is not None
        w32 = None if norm_w is None else norm_w.float()
        E, k = w_router.shape[0], spec["top_k"]
        for c, (s, e) in enumerate(chunk_bounds(flat.shape[0], ctx.num_chunks)):
            if norm_w is None:
                xc = flat[s:e]
            else:
                x_hat, r = normalised(flat[s:e], eps, None if rstd is None else rstd[s:e])
                xc = torch.mul(norm_w, x_hat.to(x.dtype))
            dy = gflat[s:e]
            dxc = torch.zeros(xc.shape, dtype=torch.float32, device=x.device) if mlp_dx else None
            probs, top_i, top_v, weights = _route(xc, w_router, k, spec["norm_topk"])
            order, tokens, groups = _sorted_rows(top_i, E, spec["kernel"])
            d_weights = _experts_backward(xc, dy, tokens, order, weights, groups, gate_up, down, d_gu, d_down, dxc)
            _router_backward(xc, probs, top_i, top_v, weights, d_weights, g_prob, spec["norm_topk"], w_router,
                             d_router, dxc)
            del probs, top_i, top_v, weights, order, tokens, groups, d_weights
            if shared:
                _shared_backward(xc, dy, shared, d_shared, dxc, terms, lora_accs, seed, c)
            if norm_w is None:
                if dx_flat is not None:
                    dx_flat[s:e] = dxc
            elif dxc is not None:
                dh = norm_backward(dxc, x_hat, r, w32, x.dtype, d_norm, need_dx)
                if into:
                    dx_flat[s:e] += dh.to(x.dtype)
                elif dh is not None:
                    dx_flat[s:e] = dh
                del dh, x_hat
            del dxc
        cast = lambda g, w: None if g is None else g.to(w.dtype)  # noqa: E731
        grads = dict(x=dx, w_router=cast(d_router, w_router), gate_up=cast(d_gu, gate_up), down=cast(d_down, down),
                     norm_w=cast(d_norm, norm_w))
        grads.update((f"shared{i}", cast(g, w)) for i, (g, w) in enumerate(zip(d_shared, shared)))
        grads.update((f"lora{i}", g) for i, g in enumerate(finish(d_lora, lora_tensors)))
        return tuple(grads.get(n) for n in names)


def _split_tensors(tensors, norm_eps, lora: LoraLayout | None):
    """:class:`ChunkedMoEFunction`'s trailing inputs as ``(norm weight or None, shared weights, LoRA tensors)``."""
    n_norm, n_lora = int(norm_eps is not None), lora.num_tensors if lora is not None else 0
    return (tensors[0] if n_norm else None, tuple(tensors[n_norm:len(tensors) - n_lora]),
            tuple(tensors[len(tensors) - n_lora:]))


def _experts_backward(xc, dy, tokens, order, weights, groups, gate_up, down, d_gu, d_down, dxc):
    """One chunk of the routed experts' backward: accumulates ``d_gu``, ``d_down`` and ``dxc`` (fp32);
    returns the routing weights' gradient ``[n, k]`` fp32."""
    xs = xc[tokens]
    g, u = _swiglu_rows(groups.linear(xs, gate_up))
    a = F.silu(g)
    h = a * u
    w_rows = weights.reshape(-1)[order]                                     # [n k] fp32
    dys = dy[tokens]                                                        # [n k, hidden]
    d_w_rows = groups.linear(h, down).float().mul_(dys).sum(-1)            # d loss / d weight, per row
    dys = dys.float().mul_(w_rows[:, None]).to(xs.dtype)
    if d_down is not None:
        groups.add_weight_grad(d_down, dys, h)
    del h
    dh = groups.input_grad(dys, down)                                       # [n k, I]
    del dys
    du = dh * a
    dg = torch.ops.aten.silu_backward(dh.mul_(u), g)
    del a, g, u, dh
    dgu = torch.cat([dg, du], dim=1)                                        # [n k, 2 I]
    del dg, du
    if d_gu is not None:
        groups.add_weight_grad(d_gu, dgu, xs)
    if dxc is not None:
        dxc.index_add_(0, tokens, groups.input_grad(dgu, gate_up).float())
    d_weights = torch.empty_like(d_w_rows)
    d_weights[order] = d_w_rows
    return d_weights.view(weights.shape)


def _router_backward(xc, probs, top_i, top_v, weights, d_weights, g_prob, norm_topk, w_router, d_router, dxc):
    """The router's backward for one chunk (fp32): top-k renormalisation, the balancing loss's
    gradient ``g_prob`` on every probability, softmax; accumulates ``d_router`` and ``dxc``."""
    if norm_topk:
        d_top = (d_weights - (d_weights * weights).sum(-1, keepdim=True)) / top_v.sum(-1, keepdim=True)
    else:
        d_top = d_weights
    d_probs = torch.zeros_like(probs).scatter_(1, top_i, d_top)
    if g_prob is not None:
        d_probs += g_prob
    d_logits = probs.mul_(d_probs - (d_probs * probs).sum(-1, keepdim=True))   # [n, E]
    if d_router is not None:
        d_router += d_logits.t() @ xc.float()
    if dxc is not None:
        dxc += d_logits @ w_router.float()


def _shared_forward(xc, shared, terms, seed, chunk):
    """``sigmoid(gate_logit(xc)) * down(silu(gate(xc)) * up(xc))`` in fp32 ``[n, hidden]``; ``terms``:
    the LoRA terms of gate, up, down and the sigmoid gate (:meth:`LoraLayout.split`)."""
    (w_gate, w_up, w_down, w_sg), (tg, tu, td, ts) = shared, terms
    h = F.silu(with_lora(F.linear(xc, w_gate), xc, tg, seed, chunk)) * with_lora(F.linear(xc, w_up), xc, tu, seed, chunk)
    y = with_lora(F.linear(h, w_down), h, td, seed, chunk)
    return torch.sigmoid(with_lora(F.linear(xc, w_sg), xc, ts, seed, chunk).float()) * y.float()


def _shared_backward(xc, dy, shared, d_shared, dxc, terms, lora_accs, seed, chunk):
    """The shared expert's backward for one chunk; accumulates its four gradients, its LoRA
    gradients (``lora_accs``, split as ``terms``) and ``dxc``."""
    w_gate, w_up, w_down, w_sg = shared
    dwg, dwu, dwd, dsg = d_shared
    (tg, tu, td, ts), (ag, au, ad, a_s) = terms, lora_accs
    g, u = with_lora(F.linear(xc, w_gate), xc, tg, seed, chunk), with_lora(F.linear(xc, w_up), xc, tu, seed, chunk)
    a = F.silu(g)
    h = a * u
    sig = torch.sigmoid(with_lora(F.linear(xc, w_sg), xc, ts, seed, chunk).float())     # [n, 1]
    y = with_lora(F.linear(h, w_down), h, td, seed, chunk)
    d_gate_logit = (dy.float() * y.float()).sum(-1, keepdim=True) * sig * (1 - sig)
    del y
    if dsg is not None:
        dsg += d_gate_logit.t() @ xc.float()
    if dxc is not None:
        dxc += d_gate_logit @ w_sg.float()
    _lora_input_grad(xc, d_gate_logit, ts, a_s, seed, chunk, dxc)
    dys = (dy.float() * sig).to(xc.dtype)
    if dwd is not None:
        dwd += (dys.t() @ h).to(dwd.dtype)
    dh = dys @ w_down
    if td:
        dh += lora_backward(h, dys, td, ad, seed, chunk, True).to(dh.dtype)
    du, dg = dh * a, torch.ops.aten.silu_backward(dh * u, g)
    for acc, d, w, t, accs in ((dwu, du, w_up, tu, au), (dwg, dg, w_gate, tg, ag)):
        if acc is not None:
            acc += (d.t() @ xc).to(acc.dtype)
        if dxc is not None:
            dxc += (d @ w).float()
        _lora_input_grad(xc, d, t, accs, seed, chunk, dxc)


def _lora_input_grad(x, dy, terms, accs, seed, chunk, dx) -> None:
    """One projection's LoRA backward (:func:`lora_backward`); its share of the input gradient added to ``dx`` (fp32)."""
    if terms:
        d = lora_backward(x, dy, terms, accs, seed, chunk, dx is not None)
        if d is not None:
            dx += d.float()


def _grad_buffer(w: torch.Tensor | None, needed: bool | None) -> torch.Tensor | None:
    if w is None or not needed:
        return None
    dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
    return torch.zeros(w.shape, dtype=dtype, device=w.device)


class MoERouter(nn.Module):
    """Transformers' ``Qwen3MoeTopKRouter`` parameters: ``weight`` ``[E, hidden]``."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))


class MoEExperts(nn.Module):
    """Fused expert weights: ``gate_up_proj`` ``[E, 2 I, hidden]`` (gate rows first), ``down_proj`` ``[E, hidden, I]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SharedExpert(nn.Module):
    """A SwiGLU MLP with Transformers' names (``gate_proj``, ``up_proj``, ``down_proj``), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class ChunkedMoE(nn.Module):
    """The sparse MoE block with Transformers' names (``gate.weight``, ``experts.gate_up_proj``,
    ``experts.down_proj``; with ``shared_intermediate_size``: ``shared_expert.{gate,up,down}_proj``
    and ``shared_expert_gate``), run by :class:`ChunkedMoEFunction`.

    ``forward(x [B, S_local, hidden], norm=None, stats=None, record=True) -> [B, S_local, hidden]``:
    ``norm`` an RMSNorm applied first inside; ``stats`` a :class:`RouterStatistics`, recorded under
    ``layer_index`` unless ``record`` is False (a layer checkpoint's recompute), read in backward.
    ``num_chunks`` (token chunks) and ``kernel`` (None: :func:`moe_kernel`) are reassignable."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, shared_intermediate_size: int = 0, num_chunks: int = 1):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.gate = MoERouter(num_experts, hidden_size)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size)
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.num_chunks, self.kernel, self.layer_index = num_chunks, None, 0

    @classmethod
    def from_block(cls, block: nn.Module, num_chunks: int = 1, norm_topk_prob: bool | None = None) -> "ChunkedMoE":
        """A chunked MoE over a Transformers sparse MoE block's modules (``gate`` with ``top_k`` and
        ``norm_topk_prob`` unless given; ``experts``; optional ``shared_expert`` / ``shared_expert_gate``),
        which become its children."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.gate, self.experts = block.gate, block.experts     # LoRA on either: PEFT's ParamWrapper around it
        if getattr(block, "shared_expert", None) is not None:
            self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        router = base_module(block.gate)
        self.num_experts, self.top_k = router.weight.shape[0], router.top_k
        norm_topk_prob = router.norm_topk_prob if norm_topk_prob is None else norm_topk_prob
        self.norm_topk_prob, self.num_chunks, self.kernel, self.layer_index = norm_topk_prob, num_chunks, None, 0
        return self

    def shared_weights(self) -> tuple[tuple[torch.Tensor, ...], LoraLayout | None, tuple]:
        """The shared expert's gate, up, down and sigmoid-gate weights, and their LoRA (fpdt's or
        PEFT's; layout and tensors, or ``(None, ())``); ``((), None, ())`` without a shared expert."""
        if not hasattr(self, "shared_expert"):
            return (), None, ()
        m = self.shared_expert
        proj = read_projections({"gate_proj": m.gate_proj, "up_proj": m.up_proj, "down_proj": m.down_proj,
                                 "shared_expert_gate": self.shared_expert_gate}, "the MoE shared expert",
                                "use plain nn.Linear or plain LoRA (fpdt's or PEFT's) on the shared expert",
                                self.training)
        if any(base.bias is not None for base in proj.bases):
            raise ValueError("the MoE shared expert's projections have biases, which the chunked experts do not add: "
                             "use bias-free projections, as Qwen3-Next and Qwen3.5-MoE do")
        adapters = proj.adapters
        return (tuple(base.weight for base in proj.bases), *((None, ()) if adapters is None else
                                                            (adapters.layout, adapters.tensors)))

    def kernel_name(self, x: torch.Tensor) -> str:
        down = base_module(self.experts).down_proj
        return self.kernel or moe_kernel(x.device, down.dtype, x.shape[-1], down.shape[2])

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, stats: RouterStatistics | None = None,
                record: bool = True) -> torch.Tensor:
        if self.num_chunks < 1:
            raise ValueError(f"the MoE MLP runs over token chunks only: num_chunks={self.num_chunks} must be >= 1")
        if stats is None and getattr(self, "call_stats", None) is not None:     # set per call by fpdt.hf
            stats = self.call_stats
            record = not (getattr(self, "checkpointed", False) and torch.is_grad_enabled())
        shared, lora, lora_tensors = self.shared_weights()
        spec = dict(top_k=self.top_k, norm_topk=self.norm_topk_prob, kernel=self.kernel_name(x),
                    layer=self.layer_index, stats=stats, record=record, lora=lora)
        norm_args = (None,) if norm is None else (norm.eps, norm.weight)
        gate_up, down = read_parameters(self.experts, ("gate_up_proj", "down_proj"), "the MoE experts")
        router, = read_parameters(self.gate, ("weight",), "the MoE router")
        return ChunkedMoEFunction.apply(x, router, gate_up, down, self.num_chunks, spec, *norm_args, *shared,
                                        *lora_tensors)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, num_chunks={self.num_chunks}"

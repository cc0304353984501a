"""Chunked SwiGLU MLP, ``down(silu(gate(x)) * up(x))``, over token chunks (:class:`ChunkedSwiGLUFunction`).

Saved: ``x`` ``[B, S_local, hidden]`` (with the fused pre-MLP RMSNorm, an fp32 ``rstd`` per token)
and weight references; intermediates are recomputed per chunk. Weight gradients accumulate in fp32.
Flow and memory: ``docs/memory.md`` ("The chunked MLP")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fpdt.model.checkpointing import donated_gradient, output_values_unused
from fpdt.model.chunks import budget_chunks, chunk_bounds
from fpdt.ops.rmsnorm import norm_backward, normalised
from fpdt.ops.lora import LoraAdapters, accumulators, finish, lora_backward, with_lora
from fpdt.ops.projections import read_projections


def default_mlp_chunks(hidden_size: int, intermediate_size: int, num_chunks: int = 1) -> int:
    """``ceil(2 * u * I / hidden)``: the backward's four ``[n, I]`` intermediates stay within two chunks."""
    return budget_chunks(num_chunks, hidden_size, 4 * intermediate_size)


def swiglu_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
                     b_down: torch.Tensor | None = None) -> torch.Tensor:
    """The plain (unchunked, autograd-tracked) SwiGLU; ``x`` ``[..., hidden]`` -> ``[..., hidden]``."""
    return F.linear(F.silu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)


class ChunkedSwiGLUFunction(torch.autograd.Function):
    """SwiGLU over ``num_chunks`` token chunks with recompute in backward.

    Inputs: ``x`` ``[B, S, hidden]``; ``w_gate``, ``w_up`` ``[I, hidden]``; ``w_down`` ``[hidden, I]``;
    biases ``[I]``, ``[I]``, ``[hidden]`` or None; ``num_chunks``; ``lora`` (a ``LoraLayout`` or None);
    ``norm_eps`` (normalise ``x`` first) or None; then the norm's weight ``[hidden]`` (with
    ``norm_eps``) and the LoRA tensors. Output ``[B, S, hidden]`` in ``x.dtype`` (promoted with the
    norm weight). Saved: ``x``, weights, biases, with a norm fp32 ``rstd`` ``[T, 1]``. In the
    recompute of a layer's last branch (:func:`fpdt.model.checkpointing.output_values_unused`)
    forward returns a placeholder."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, num_chunks: int, lora=None, norm_eps=None,
                *tensors):
        norm_w, lora_tensors = (tensors[0], tensors[1:]) if norm_eps is not None else (None, tensors)
        flat = x.reshape(-1, x.shape[-1])                                   # [T, hidden]
        dtype = x.dtype if norm_w is None else torch.promote_types(norm_w.dtype, x.dtype)   # the MLP's input's
        tg, tu, td = lora.split(lora_tensors) if lora is not None else ([], [], [])
        seed = lora.draw_seed() if lora is not None else None
        ctx.num_chunks, ctx.lora, ctx.seed, ctx.norm_eps = num_chunks, lora, seed, norm_eps
        ctx.input_names = _input_names(norm_eps is not None, len(lora_tensors))
        if norm_w is not None and output_values_unused(x):
            # a checkpoint's recompute of this branch: only the graph is needed; backward
            # recomputes every chunk (and the norm's rstd, the same per-token numbers). Only
            # with the norm inside: with a separate norm module (fpdt.hf) the branch's graph
            # around the placeholder held one full-length tensor more (counted), not less
            ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up, b_down, None, *tensors)
            placeholder = torch.empty(1, dtype=dtype, device=x.device).expand(*x.shape[:-1], w_down.shape[0])
            output_values_unused(x, placeholder)
            return placeholder
        out = torch.empty(flat.shape[0], w_down.shape[0], dtype=dtype, device=x.device)
        rstd = None if norm_w is None else torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)
        for k, (s, e) in enumerate(chunk_bounds(flat.shape[0], num_chunks)):
            if norm_w is None:
                xc = flat[s:e]
            else:
                x_hat, rstd[s:e] = normalised(flat[s:e], norm_eps)
                xc = torch.mul(norm_w, x_hat.to(x.dtype))                  # [n, hidden], the norm's output
                del x_hat
            g = with_lora(F.linear(xc, w_gate, b_gate), xc, tg, seed, k)
            h = F.silu(g) * with_lora(F.linear(xc, w_up, b_up), xc, tu, seed, k)   # [n, I]
            out[s:e] = with_lora(F.linear(h, w_down, b_down), h, td, seed, k)
        ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up, b_down, rstd, *tensors)
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down, b_gate, b_up, b_down, rstd, *tensors = ctx.saved_tensors
        eps = ctx.norm_eps
        norm_w, lora_tensors = (tensors[0], tensors[1:]) if eps is not None else (None, tensors)
        need = dict(zip(ctx.input_names, ctx.needs_input_grad))             # by input name
        lora, seed = ctx.lora, ctx.seed
        tg, tu, td = lora.split(lora_tensors) if lora is not None else ([], [], [])
        d_lora = accumulators(lora, lora_tensors, [need[f"lora{i}"] for i in range(len(lora_tensors))]) \
            if lora is not None else []
        acc_gate, acc_up, acc_down = lora.split(d_lora) if lora is not None else ([], [], [])
        flat = x.reshape(-1, x.shape[-1])                                   # [T, hidden]
        gflat = grad_out.reshape(-1, grad_out.shape[-1])                    # [T, hidden]
        dwg, dwu, dwd = (_grad_buffer(w, need.get(n)) for w, n in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down")))
        dbg, dbu, dbd = (_grad_buffer(b, need.get(n)) for b, n in ((b_gate, "b_gate"), (b_up, "b_up"), (b_down, "b_down")))
        dnorm = _grad_buffer(norm_w, need.get("norm_w"))
        need_dx = need["x"]
        # With the norm inside, the input gradient may go straight into the layer's gradient,
        # which is then grad_out itself: each chunk is read before its own slice is written.
        into = eps is not None and need_dx and donated_gradient(grad_out, x)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx and not into else None
        dx_flat = gflat if into else None if dx is None else dx.view(flat.shape)
        mlp_dx = need_dx or (dnorm is not None)                             # the MLP input's gradient is needed
        w32 = None if norm_w is None else norm_w.float()
        # At most four [n, I] tensors live at a time (g, u or u*dh, a or du, and one of
        # a*u / dh / dg): products are formed in place wherever the input is dead after.
        for k, (s, e) in enumerate(chunk_bounds(flat.shape[0], ctx.num_chunks)):
            dy = gflat[s:e]                                                 # [n, hidden]
            if norm_w is None:
                xc = flat[s:e]
                dxc = dx_flat[s:e] if dx_flat is not None else None        # the MLP input's gradient, in place
            else:
                x_hat, r = normalised(flat[s:e], eps, None if rstd is None else rstd[s:e])
                xc = torch.mul(norm_w, x_hat.to(x.dtype))                  # the norm's output, recomputed
                dxc = torch.empty(xc.shape, dtype=xc.dtype, device=xc.device) if mlp_dx else None   # chunk-sized
            g = with_lora(F.linear(xc, w_gate, b_gate), xc, tg, seed, k)   # [n, I]
            u = with_lora(F.linear(xc, w_up, b_up), xc, tu, seed, k)
            a = F.silu(g)
            dh = _down_backward(dy, a, u, w_down, dwd, dbd, td, acc_down, seed, k)   # [n, I]
            u.mul_(dh)                                                      # dL/da = dh * u
            du = a.mul_(dh)                                                 # dL/du = dh * silu(g)
            del a, dh
            _accumulate(dwu, dbu, du, xc)
            if dxc is not None:
                dxc[...] = du @ w_up                                        # cast to the input's dtype (autocast)
            if tu:
                d_lo = lora_backward(xc, du, tu, acc_up, seed, k, dxc is not None)
                if d_lo is not None:
                    dxc.add_(d_lo)
            del du
            dg = torch.ops.aten.silu_backward(u, g)                         # dL/dg, fused
            del u, g
            _accumulate(dwg, dbg, dg, xc)
            if dxc is not None:
                dxc += dg @ w_gate
            if tg:
                d_lo = lora_backward(xc, dg, tg, acc_gate, seed, k, dxc is not None)
                if d_lo is not None:
                    dxc.add_(d_lo)
            del dg
            if norm_w is not None and dxc is not None:                     # the norm's backward, as RMSNormFunction's
                dh = norm_backward(dxc, x_hat, r, w32, x.dtype, dnorm, need_dx)   # fp32 [n, hidden]
                if into:
                    dx_flat[s:e] += dh.to(x.dtype)                          # the residual's sum, in place
                elif dh is not None:
                    dx_flat[s:e] = dh
                del dh, x_hat, dxc
        cast = lambda g, w: None if g is None else g.to(w.dtype)  # noqa: E731
        grads = dict(x=dx, w_gate=cast(dwg, w_gate), w_up=cast(dwu, w_up), w_down=cast(dwd, w_down),
                     b_gate=cast(dbg, b_gate), b_up=cast(dbu, b_up), b_down=cast(dbd, b_down),
                     norm_w=cast(dnorm, norm_w))
        grads.update((f"lora{i}", g) for i, g in enumerate(finish(d_lora, lora_tensors)))
        return tuple(grads.get(name) for name in ctx.input_names)


def _grad_buffer(w: torch.Tensor | None, needed: bool | None) -> torch.Tensor | None:
    """A zeroed gradient accumulator for ``w`` (fp32 for 16-bit weights), or None when not needed."""
    if w is None or not needed:
        return None
    dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
    return torch.zeros(w.shape, dtype=dtype, device=w.device)


def _accumulate(dw: torch.Tensor | None, db: torch.Tensor | None, d: torch.Tensor, xc: torch.Tensor) -> None:
    """Add one chunk's weight and bias gradients of a projection ``d = xc @ w.T + b`` (``d``
    the output gradient ``[n, out]``, ``xc`` the input ``[n, in]``) into the accumulators."""
    if dw is not None:
        dw += (d.t() @ xc).to(dw.dtype)
    if db is not None:
        db += d.sum(0, dtype=db.dtype)


def _down_backward(dy, a, u, w_down, dwd, dbd, td, acc_down, seed, k) -> torch.Tensor:
    """``down_proj``'s backward for one chunk: accumulates its gradients and returns ``dh`` ``[n, I]``."""
    if dwd is not None or td:
        au = a * u                                                          # h
        if dwd is not None:
            dwd += (dy.t() @ au).to(dwd.dtype)                              # [hidden, I]
        d_lo = lora_backward(au, dy, td, acc_down, seed, k, True) if td else None
        del au
    if dbd is not None:
        dbd += dy.sum(0, dtype=dbd.dtype)
    dh = dy @ w_down                                                        # [n, I]
    if td:
        dh.add_(d_lo)
    return dh


def _input_names(with_norm: bool, num_lora: int) -> tuple[str, ...]:
    """The names of :meth:`ChunkedSwiGLUFunction.forward`'s inputs, in order (its backward
    returns gradients by name, in this order)."""
    return (("x", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down", "num_chunks", "lora", "norm_eps")
            + (("norm_w",) if with_norm else ()) + tuple(f"lora{i}" for i in range(num_lora)))


class ChunkedSwiGLU(nn.Module):
    """The Llama MLP with HF parameter names (``gate_proj``, ``up_proj``, ``down_proj``).

    Args:
        hidden_size, intermediate_size: widths; bias: projection biases (``mlp_bias``).
        num_chunks: token chunks (reassignable); ``0`` runs the plain autograd MLP.

    Projections may carry fpdt's or PEFT's LoRA; :meth:`from_projections` wraps existing modules.
    ``forward(x [B, S_local, hidden]) -> [B, S_local, hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, num_chunks: int = 1):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.num_chunks = num_chunks

    projection_fix = "use plain nn.Linear or PEFT LoRA projections"
    """The fix a refused projection's error names (:mod:`fpdt.ops.projections`)."""

    @classmethod
    def from_projections(cls, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
                         num_chunks: int = 1) -> "ChunkedSwiGLU":
        """A chunked MLP over existing projection modules, which become its children."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.gate_proj, self.up_proj, self.down_proj, self.num_chunks = gate_proj, up_proj, down_proj, num_chunks
        return self

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """``norm``: an RMSNorm (``weight``, ``eps``) applied to ``x`` first, inside the chunked function."""
        if self.num_chunks == 0 and not any(hasattr(m, "lora_A") for m in (self.gate_proj, self.up_proj,
                                                                              self.down_proj)):
            return swiglu_of_linears(x, self.gate_proj, self.up_proj, self.down_proj, 0, None, norm)
        proj = read_projections({"gate_proj": self.gate_proj, "up_proj": self.up_proj, "down_proj": self.down_proj},
                                type(self).__name__, self.projection_fix, self.training)
        return swiglu_of_linears(x, *proj.bases, self.num_chunks, proj.adapters, norm)

    def extra_repr(self) -> str:
        return f"num_chunks={self.num_chunks}"


def swiglu_of_linears(x: torch.Tensor, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                      num_chunks: int, adapters: LoraAdapters | None = None,
                      norm: nn.Module | None = None) -> torch.Tensor:
    """SwiGLU of three ``nn.Linear`` modules' weights over ``num_chunks`` token chunks, or plain when 0;
    ``adapters``: LoRA of gate, up, down (chunked only); ``norm``: an RMSNorm applied to ``x`` first."""
    if num_chunks == 0 and norm is not None:
        x = norm(x)
    args = (x, gate_proj.weight, up_proj.weight, down_proj.weight, gate_proj.bias, up_proj.bias, down_proj.bias)
    if num_chunks == 0:
        if adapters is not None:
            raise ValueError("LoRA adapters run inside the chunked MLP only: num_chunks must be >= 1")
        return swiglu_reference(*args)
    if adapters is not None and len(adapters.layout.terms) != 3:
        raise ValueError(f"the MLP's LoRA layout must have 3 projections, got {len(adapters.layout.terms)}")
    layout, lora_tensors = (None, ()) if adapters is None else (adapters.layout, adapters.tensors)
    norm_args = (None,) if norm is None else (norm.eps, norm.weight)
    return ChunkedSwiGLUFunction.apply(*args, num_chunks, layout, *norm_args, *lora_tensors)

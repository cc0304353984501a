"""The gated delta rule (Gated DeltaNet's token mixer, arXiv 2412.06464) with an explicit recurrent
state in and out, chunked (64 tokens) in PyTorch, or fla-core's Triton kernel on CUDA.

Per value head, state ``S`` ``[dk, dv]``: ``S <- e^g S; S += beta k (v - S^T k)^T``; ``o = scale S^T q``.
Shapes: ``q``, ``k`` ``[B, T, H, dk]`` (already repeated to the value heads, L2-normalised by the
caller), ``v`` ``[B, T, H, dv]``, ``g`` (log decay, <= 0) and ``beta`` ``[B, T, H]``, states
``[B, H, dk, dv]`` fp32. The chunk form's derivation: ``docs/gated_deltanet.md``.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch.autograd.function import once_differentiable

CHUNK = 64


def fla_available() -> bool:
    """Whether fla-core's ``fla.ops.gated_delta_rule`` can be imported (an optional extra)."""
    try:
        return importlib.util.find_spec("fla") is not None and \
            importlib.util.find_spec("fla.ops.gated_delta_rule") is not None
    except (ImportError, ValueError):
        return False


def delta_rule_kernel(device: torch.device | str) -> str:
    """The kernel :func:`gated_delta_rule` runs on ``device``: ``"fla"`` (CUDA with fla-core) or ``"torch"``."""
    return "fla" if torch.device(device).type == "cuda" and fla_available() else "torch"


def gated_delta_rule(q, k, v, g, beta, initial_state=None, scale: float | None = None, kernel: str | None = None,
                     qk_l2norm: bool = False):
    """Differentiable ``(o [B, T, H, dv] in v's dtype, final_state [B, H, dk, dv] fp32)``;
    gradients reach ``initial_state``. ``kernel``: ``"fla"``, ``"torch"`` or None (:func:`delta_rule_kernel`).
    ``qk_l2norm``: L2-normalise q and k first (fla inside its kernel; here in fp32, :func:`l2norm`)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kernel = delta_rule_kernel(q.device) if kernel is None else kernel
    if kernel == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        o, final = chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                                          beta.contiguous(), scale=scale, initial_state=initial_state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm)
        return o.to(v.dtype), final.float()
    if kernel != "torch":
        raise ValueError(f"unknown delta-rule kernel {kernel!r}: use 'fla', 'torch' or None (automatic)")
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return chunked_delta_rule(q, k, v, g, beta, initial_state, scale)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dim in fp32 (float64 for float64), fla's and
    Transformers' convention."""
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(q, k, v, g, beta, initial_state=None, scale: float = 1.0, chunk: int = CHUNK):
    """The PyTorch kernel behind :func:`gated_delta_rule`: ``chunk`` tokens at a time in the WY form,
    in fp32 (float64 for float64 inputs). Differentiable through :class:`BlockedDeltaRule`."""
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    B, T, H, dk = q.shape
    out_dtype = v.dtype
    q, k, v = (x.transpose(1, 2).to(acc) for x in (q, k, v))          # [B, H, T, d]
    g, beta = (x.transpose(1, 2).to(acc) for x in (g, beta))          # [B, H, T]
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=acc, device=v.device) if initial_state is None \
        else initial_state.to(acc)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, S)):
        o, S = BlockedDeltaRule.apply(q, k, v, g, beta, S, scale, chunk)
    else:
        o, S, _ = _blocks(q, k, v, g, beta, S, scale, chunk, keep_starts=False)
    return o.transpose(1, 2).to(out_dtype), S.float() if acc == torch.float32 else S


class BlockedDeltaRule(torch.autograd.Function):
    """``(q, k, v [B, H, T, d], g, beta [B, H, T], S0 [B, H, dk, dv])`` in the accumulation dtype ->
    ``(o [B, H, T, dv], S_T)``. Saves its inputs and the state at each block start (``T / chunk``
    states); backward recomputes one block at a time in reverse, so one block's intermediates live."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, scale: float, chunk: int):
        o, S, starts = _blocks(q, k, v, g, beta, S0, scale, chunk, keep_starts=True)
        ctx.save_for_backward(q, k, v, g, beta, *starts)
        ctx.scale, ctx.chunk = scale, chunk
        return o, S

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dS):
        q, k, v, g, beta, *starts = ctx.saved_tensors
        T, chunk = q.shape[2], ctx.chunk
        grads = [torch.empty_like(t) for t in (q, k, v, g, beta)]
        dS = torch.zeros_like(starts[0]) if dS is None else dS
        for n in reversed(range(len(starts))):
            s, e = n * chunk, min((n + 1) * chunk, T)
            with torch.enable_grad():
                leaves = [t[:, :, s:e].detach().requires_grad_() for t in (q, k, v, g, beta)]
                S_in = starts[n].detach().requires_grad_()
                o, S_out = _chunk_step(leaves[0] * ctx.scale, *leaves[1:], S_in)
                got = torch.autograd.grad([o, S_out], leaves + [S_in], [do[:, :, s:e], dS])
            for grad, d in zip(grads, got[:5]):
                grad[:, :, s:e] = d
            dS = got[5]
        return (*grads, dS if ctx.needs_input_grad[5] else None, None, None)


def _blocks(q, k, v, g, beta, S, scale: float, chunk: int, keep_starts: bool):
    """The block loop: ``(o, S_T, the state at each block start (empty unless keep_starts))``."""
    starts, outs = [], []
    for s in range(0, q.shape[2], chunk):
        e = min(s + chunk, q.shape[2])
        if keep_starts:
            starts.append(S)
        o, S = _chunk_step(q[:, :, s:e] * scale, k[:, :, s:e], v[:, :, s:e], g[:, :, s:e], beta[:, :, s:e], S)
        outs.append(o)
    return (torch.cat(outs, 2) if outs else v.new_zeros(v.shape)), S, starts


def _chunk_step(q, k, v, g, beta, S):
    """One block of ``n`` tokens from state ``S``: ``(o [B, H, n, dv], S_next)``."""
    n = q.shape[2]
    c = g.cumsum(-1)                                               # log of the decay since the block start
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    D = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{c_t - c_j}, j <= t
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * D.tril(-1)                    # strictly lower: the in-block corrections
    system = A + torch.eye(n, dtype=A.dtype, device=A.device)
    gamma = c.exp()[..., None]
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * gamma, upper=False, unitriangular=True)
    delta = u - w @ S                                              # the rank-one updates' values
    o = (q * gamma) @ S + ((q @ k.transpose(-1, -2)) * D) @ delta
    last = c[..., -1:]
    S = S * last.exp()[..., None] + (k * (last - c).exp()[..., None]).transpose(-1, -2) @ delta
    return o, S


def gated_delta_rule_backward(q, k, v, g, beta, initial_state, do, dht=None, scale: float | None = None,
                              kernel: str | None = None):
    """Recompute :func:`gated_delta_rule` and differentiate it: ``(dq, dk, dv, dg, dbeta, dh0)`` for
    output gradient ``do`` and final-state gradient ``dht`` (None: zero). ``dh0`` is None without
    ``initial_state``."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.detach().requires_grad_()
    with torch.enable_grad():
        o, final = gated_delta_rule(*leaves, initial_state=h0, scale=scale, kernel=kernel)
        outs, grads = [o], [do]
        if dht is not None:
            outs.append(final)
            grads.append(dht)
        got = torch.autograd.grad(outs, leaves + ([h0] if h0 is not None else []), grads, allow_unused=True)
    got = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves + [h0], got)]
    return (*got[:5], got[5] if h0 is not None else None)

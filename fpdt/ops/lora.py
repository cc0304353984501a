"""LoRA adapters on a linear projection, computed a chunk of tokens at a time inside fpdt's
chunked functions (q/k/v of :mod:`fpdt.attention.projected_attention`, the MLP of
:mod:`fpdt.model.mlp`), which read their weights directly.

One term adds ``delta(x) = (dropout(x) A^T B^T + b) * scaling`` (``A [r, in]``, ``B [out, r]``,
``b [out]`` or None) in the adapters' dtype; the sum is cast back to the base output's dtype.
Dropout saves nothing: masks are regenerated per ``(seed, stream, chunk)`` in backward. A chunked
function takes a :class:`LoraLayout` and the terms' tensors as trailing inputs, ``(A, B, b)`` per
term in layout order. Backward formulas and the dropout seeding: ``docs/model.md`` (LoRA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

TENSORS_PER_TERM = 3     # A, B, B's bias (or None)


@dataclass(frozen=True)
class LoraTerm:
    """One adapter on one projection: ``scaling``, the dropout probability in effect (0 in eval mode),
    and ``stream``, which tells its masks apart from the other terms' of the same call."""
    scaling: float
    dropout: float
    stream: int

    def __post_init__(self):
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout probability {self.dropout} must be in [0, 1)")


@dataclass(frozen=True)
class LoraLayout:
    """The LoRA terms of each projection of one chunked function (``terms[n]``: projection
    ``n``'s, maybe none). Their tensors follow the function's other inputs, in this order."""
    terms: tuple[tuple[LoraTerm, ...], ...]

    @property
    def num_tensors(self) -> int:
        return TENSORS_PER_TERM * sum(len(t) for t in self.terms)

    def split(self, tensors: Sequence) -> list[list[tuple]]:
        """``tensors`` (``num_tensors`` of anything: tensors, gradients, accumulators) grouped
        per projection and term: ``[[(term, A, B, b), ...], ...]``."""
        if len(tensors) != self.num_tensors:
            raise ValueError(f"LoRA layout has {self.num_tensors} tensors, got {len(tensors)}")
        it = iter(tensors)
        return [[(term, next(it), next(it), next(it)) for term in terms] for terms in self.terms]

    def draw_seed(self) -> int | None:
        """The dropout seed of one call (default CPU generator, :func:`rank_seed`), or None without dropout."""
        if not any(t.dropout for terms in self.terms for t in terms):
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return rank_seed(int(torch.randint(0, 2 ** 62, (), dtype=torch.int64, device="cpu")), rank)


def rank_seed(seed: int, rank: int) -> int:
    """``seed`` made this rank's, so that ranks seeded alike draw different masks."""
    return (seed + rank * 0x9E3779B97F4A7C15) % (2 ** 62)


@dataclass
class LoraAdapters:
    """A layout and its tensors: what a caller hands to a chunked function."""
    layout: LoraLayout
    tensors: tuple[torch.Tensor | None, ...]

    def __post_init__(self):
        self.layout.split(self.tensors)        # checks the count

    def requires_grad(self) -> bool:
        return any(t is not None and t.requires_grad for t in self.tensors)


def drop_mask(shape: torch.Size, device: torch.device, p: float, seed: int, stream: int, chunk: int) -> torch.Tensor:
    """Dropout's bool mask for one chunk (True = dropped, probability ``p``), fixed by ``(seed, stream, chunk)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + stream * 10_007 + chunk) % (2 ** 63))
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(p, generator=gen)


def keep_scale(shape: torch.Size, dtype: torch.dtype, device: torch.device, p: float, seed: int, stream: int,
               chunk: int) -> torch.Tensor:
    """0 where :func:`drop_mask` drops, else ``1 / (1 - p)`` (for references)."""
    return drop_mask(shape, device, p, seed, stream, chunk).logical_not_().to(dtype).div_(1.0 - p)


def _dropped(x: torch.Tensor, dtype: torch.dtype, term: LoraTerm, seed: int | None, chunk: int):
    """``(dropout(x) in dtype, the drop mask or None)``: one copy of ``x`` and a bool mask."""
    if not term.dropout:
        return x.to(dtype), None
    drop = drop_mask(x.shape, x.device, term.dropout, seed, term.stream, chunk)
    return x.to(dtype, copy=True).masked_fill_(drop, 0.0).mul_(1.0 / (1.0 - term.dropout)), drop


def with_lora(base: torch.Tensor, x: torch.Tensor, terms: list[tuple], seed: int | None, chunk: int) -> torch.Tensor:
    """``base`` (the base projection of ``x`` ``[..., in]``) plus each term's delta, in
    the base output's dtype. ``terms``: ``[(term, A, B, b), ...]`` of one projection."""
    if not terms:
        return base
    out = base
    for term, a, b, bias in terms:
        xd, _ = _dropped(x, a.dtype, term, seed, chunk)
        out = out + F.linear(F.linear(xd, a), b, bias) * term.scaling
        del xd
    return out.to(base.dtype)


def accumulators(layout: LoraLayout, tensors: Sequence, needs: Sequence[bool]) -> list[torch.Tensor | None]:
    """Zeroed gradient accumulators for the trailing tensors (fp32 for 16-bit; None where not needed)."""
    def acc(t, need):
        if t is None or not need:
            return None
        dtype = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
        return torch.zeros(t.shape, dtype=dtype, device=t.device)
    layout.split(tensors)
    return [acc(t, n) for t, n in zip(tensors, needs)]


def finish(accs: Sequence, tensors: Sequence) -> tuple:
    """The accumulators cast back to their tensors' dtypes (the gradients to return)."""
    return tuple(None if a is None else a.to(t.dtype) for a, t in zip(accs, tensors))


def lora_backward(x: torch.Tensor, dy: torch.Tensor, terms: list[tuple], accs: list[tuple], seed: int | None,
                  chunk: int, need_dx: bool) -> torch.Tensor | None:
    """One projection's terms, one chunk: ``x`` ``[..., in]``, ``dy`` ``[..., out]`` (only read); adds to
    ``accs`` (``[(term, dA, dB, db), ...]``, None where not needed) and returns the terms' share of
    ``dx`` in the adapters' dtype, or None."""
    dx = None
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    for (term, a, b, _), (_, da, db, dbias) in zip(terms, accs):
        xd, drop = _dropped(x2, a.dtype, term, seed, chunk)
        g = dy2.to(a.dtype)                                      # [n, out]; the scaling goes on [., r] terms
        if db is not None:
            db += (g.t() @ F.linear(xd, a)).mul_(term.scaling).to(db.dtype)   # [out, r]
        if dbias is not None:
            dbias += g.sum(0, dtype=dbias.dtype).mul_(term.scaling)
        dz = (g @ b).mul_(term.scaling)                          # [n, r]
        del g
        if da is not None:
            da += (dz.t() @ xd).to(da.dtype)                     # [r, in]
        del xd
        if need_dx:
            part = dz @ a                                        # [n, in]
            if drop is not None:
                part.masked_fill_(drop, 0.0).mul_(1.0 / (1.0 - term.dropout))
            if dx is None:
                dx = part
            else:
                dx.add_(part)
    return None if dx is None else dx.view(*x.shape[:-1], x.shape[-1])


def lora_input_grad(dy: torch.Tensor, terms: list[tuple], seed: int | None, chunk: int) -> torch.Tensor:
    """The terms' share of ``dx`` (as :func:`lora_backward` computes it) from ``dy`` ``[n, out]``
    alone, in the adapters' dtype ``[n, in]``: the dropout masks are regenerated, not read from ``x``."""
    dx = None
    dy2 = dy.reshape(-1, dy.shape[-1])
    for term, a, b, _ in terms:
        part = ((dy2.to(a.dtype) @ b).mul_(term.scaling)) @ a
        if term.dropout:
            drop = drop_mask(part.shape, part.device, term.dropout, seed, term.stream, chunk)
            part.masked_fill_(drop, 0.0).mul_(1.0 / (1.0 - term.dropout))
        dx = part if dx is None else dx.add_(part)
    return dx


def flat_terms(per_projection: list[list[tuple]]) -> Iterator[torch.Tensor | None]:
    """The tensors of ``[[(term, A, B, b), ...], ...]`` in layout order (inverse of ``split``)."""
    for terms in per_projection:
        for _, a, b, bias in terms:
            yield from (a, b, bias)


class LoraLinearFunction(torch.autograd.Function):
    """A LoRA layer (``F.linear(x, weight, bias)`` plus one projection's terms) over ``num_chunks``
    token chunks. Inputs: ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` or None,
    ``num_chunks``, a one-projection :class:`LoraLayout` and its tensors. Output ``[..., out]`` in the
    base output's dtype. Saved: ``x`` and references to the weights; fp32 temporaries are one chunk's."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_chunks: int, layout: LoraLayout, *tensors):
        (terms,) = layout.split(tensors)
        seed = layout.draw_seed()
        out = F.linear(x, weight, bias)
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for k, (s, e) in enumerate(_bounds(flat_x.shape[0], num_chunks)):
            flat_out[s:e] = with_lora(flat_out[s:e], flat_x[s:e], terms, seed, k)
        ctx.save_for_backward(x, weight, bias, *tensors)
        ctx.num_chunks, ctx.layout, ctx.seed = num_chunks, layout, seed
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, *tensors = ctx.saved_tensors
        need = ctx.needs_input_grad
        flat_x, g = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        dx = (g @ weight) if need[0] else None                               # [T, in]
        dw = (g.t() @ flat_x) if need[1] else None
        db = g.sum(0) if need[2] and bias is not None else None
        accs = accumulators(ctx.layout, tensors, need[5:])
        (terms,), (d_terms,) = ctx.layout.split(tensors), ctx.layout.split(accs)
        for k, (s, e) in enumerate(_bounds(flat_x.shape[0], ctx.num_chunks)):
            part = lora_backward(flat_x[s:e], g[s:e], terms, d_terms, ctx.seed, k, dx is not None)
            if part is not None:
                dx[s:e].add_(part)
        return (None if dx is None else dx.view_as(x), dw, db, None, None, *finish(accs, tensors))


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    chunks = max(1, min(chunks, n))
    return [(k * n // chunks, (k + 1) * n // chunks) for k in range(chunks)]


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, adapters: LoraAdapters,
                num_chunks: int) -> torch.Tensor:
    """:class:`LoraLinearFunction` of one projection's adapters."""
    if len(adapters.layout.terms) != 1:
        raise ValueError(f"lora_linear takes one projection's adapters, got {len(adapters.layout.terms)}")
    return LoraLinearFunction.apply(x, weight, bias, num_chunks, adapters.layout, *adapters.tensors)

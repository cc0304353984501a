"""``o_proj`` of :class:`fpdt.attention.FPDTAttention` as one autograd.Function whose backward
reads its input a chunk at a time.

Its input ``x`` ``[B, S_local, H D]`` is the attention output, which the attention's stash holds
as ``o_i`` ``[B, C, H/P, D]`` (keys ``("o", i)``). With that stash the Function saves no copy of
``x`` (weight, bias, LoRA tensors and a storage-less token, :mod:`fpdt.attention.saved_stash`):
backward fetches each ``o_i``, all-to-alls it back and accumulates ``dW`` in fp32, never holding a
full-length ``x`` (``docs/memory.md``). Without it ``x`` is saved. LoRA terms run over ``2 u``
token pieces (:func:`lora_pieces`), each with its own dropout mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fpdt.attention.saved_stash import stash_of, stash_token
from fpdt.comm import heads_to_seq
from fpdt.offload import HostStash
from fpdt.ops.lora import LoraAdapters, LoraLayout, accumulators, finish, lora_backward, with_lora


@dataclass(frozen=True)
class StashedInput:
    """Where the output projection's input lives between forward and backward: the attention
    call's ``stash`` (``("o", i)`` chunks, head layout), its ``spec`` (the group the chunks go
    back through, ``num_chunks``) and the local chunk length ``L``."""

    stash: HostStash
    spec: object
    L: int


def _all_to_all_group(spec):
    """The group ``o`` chunks go back through: the mesh's head-parallel group, or Ulysses'."""
    return spec.hp_group if hasattr(spec, "hp_group") else spec.group


def lora_pieces(seq_local: int, num_chunks: int) -> list[list[tuple[int, int, int]]]:
    """The LoRA terms' token pieces ``(k, start, end)`` along the local sequence, per attention
    chunk: ``2 u`` pieces (``seq_local`` of them when shorter), ``k`` numbering them over the
    sequence; each lies inside one chunk."""
    n = max(1, min(2 * num_chunks, seq_local))
    L = seq_local // num_chunks
    per_chunk: list[list[tuple[int, int, int]]] = [[] for _ in range(num_chunks)]
    for k in range(n):
        s, e = k * seq_local // n, (k + 1) * seq_local // n
        per_chunk[s // L].append((k, s, e))
    return per_chunk


class OutputProjectionFunction(torch.autograd.Function):
    """``x`` ``[B, S_local, H D]`` (sequence layout) -> ``F.linear(x, weight, bias)`` plus the LoRA
    terms of ``layout`` (None: none) ``[B, S_local, hidden]``, in the base output's dtype.
    ``source``: a :class:`StashedInput` (``x`` is then not saved) or None (``x`` is saved)."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_chunks: int, source: StashedInput | None, layout: LoraLayout | None,
                *tensors):
        B, S_local, _ = x.shape
        out = F.linear(x, weight, bias)
        seed = None
        if layout is not None:
            (terms,) = layout.split(tensors)
            seed = layout.draw_seed()
            for k, s, e in (p for chunk in lora_pieces(S_local, num_chunks) for p in chunk):
                rows = _rows(x, s, e)
                out[:, s:e] = with_lora(_rows(out, s, e), rows, terms, seed, k).view(B, e - s, -1)
                del rows
        kept = x if source is None else stash_token(source.stash)
        ctx.save_for_backward(kept, weight, bias, *tensors)
        ctx.num_chunks, ctx.layout, ctx.seed = num_chunks, layout, seed
        ctx.source = None if source is None else (source.spec, source.L)    # no stash on ctx (see saved_stash)
        ctx.x_meta = x.shape
        return out

    @staticmethod
    @once_differentiable   # the chunked backward is not itself differentiable
    def backward(ctx, grad_out):
        kept, weight, bias, *tensors = ctx.saved_tensors
        need = ctx.needs_input_grad
        layout, u = ctx.layout, ctx.num_chunks
        B, S_local, _ = ctx.x_meta
        L = S_local // u
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        g = grad_out
        dx = (g @ weight) if need[0] else None                                 # [B, S_local, H D]
        db = g.reshape(-1, g.shape[-1]).sum(0) if need[2] and bias is not None else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need[1] else None
        accs = accumulators(layout, tensors, need[6:]) if layout is not None else []
        lora_live = layout is not None and (dx is not None or any(a is not None for a in accs))
        if dw is not None or lora_live:
            (terms,), (d_terms,) = (layout.split(tensors), layout.split(accs)) if layout is not None else ([[]], [[]])
            pieces = lora_pieces(S_local, u)
            read = _chunk_reader(kept, ctx.source, B, u)
            for i in range(u):
                x_i = read(i)                                                   # [B, L, H D]
                if dw is not None:
                    dw += (_rows(g, i * L, (i + 1) * L).t() @ x_i.reshape(-1, x_i.shape[-1])).to(acc)
                if lora_live:
                    for k, s, e in pieces[i]:
                        part = lora_backward(_rows(x_i, s - i * L, e - i * L), _rows(g, s, e), terms, d_terms,
                                             ctx.seed, k, dx is not None)
                        if part is not None:
                            dx[:, s:e] += part.view(B, e - s, -1)
                        del part
                del x_i
        return (dx, None if dw is None else dw.to(weight.dtype), db, None, None, None,
                *(finish(accs, tensors) if layout is not None else ()))


def _rows(t: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Tokens ``[s, e)`` of ``t`` ``[B, S, n]`` as ``[B (e - s), n]`` rows (a view for B = 1)."""
    return t[:, s:e].reshape(-1, t.shape[-1])


def _chunk_reader(kept: torch.Tensor, source: tuple | None, B: int, u: int):
    """``read(i)`` -> local chunk ``i`` of the input ``[B, L, H D]``, in order i = 0, 1, ...:
    a slice of the saved input, or fetched from the attention's stash (the next one
    prefetched) and all-to-all'd back to sequence layout."""
    if source is None:
        L = kept.shape[1] // u
        return lambda i: kept[:, i * L:(i + 1) * L]
    spec, L = source
    stash = stash_of(kept)
    group = _all_to_all_group(spec)
    if ("o", u - 1) not in stash:
        raise RuntimeError("fpdt attention's saved chunks were consumed by an earlier backward through this "
                           "graph: backward twice (retain_graph=True) is not supported; run the forward again")
    stash.prefetch(("o", 0))

    def read(i: int) -> torch.Tensor:
        o = stash.get(("o", i))             # get, not pop: the attention backward reads it next
        if i + 1 < u:
            stash.prefetch(("o", i + 1))    # copies in during this chunk's GEMMs
        return heads_to_seq(o, group).reshape(B, L, -1)

    return read


def output_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      adapters: LoraAdapters | None, num_chunks: int,
                      source: StashedInput | None = None) -> torch.Tensor:
    """``o_proj`` of the attention output ``x`` ``[B, S_local, H D]`` with ``weight`` ``[hidden, H D]``,
    ``bias`` and the one projection's LoRA ``adapters`` (or None); ``source``: the attention
    call's stash, to read ``x`` back from a chunk at a time in backward instead of saving it
    (``x`` must then be that call's output, reshaped). Returns ``[B, S_local, hidden]``."""
    if adapters is not None and len(adapters.layout.terms) != 1:
        raise ValueError(f"the output projection takes one projection's adapters, got {len(adapters.layout.terms)}")
    if x.shape[1] % num_chunks:
        raise ValueError(f"S_local={x.shape[1]} is not divisible by num_chunks={num_chunks}")
    layout, tensors = (None, ()) if adapters is None else (adapters.layout, adapters.tensors)
    return OutputProjectionFunction.apply(x, weight, bias, num_chunks, source, layout, *tensors)

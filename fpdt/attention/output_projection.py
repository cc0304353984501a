"""``o_proj`` a chunk at a time.

:class:`OutputChunks` runs inside the projected attention's Function
(:mod:`fpdt.attention.projected_attention`): the forward applies it to each output chunk as the
pipeline emits it, so no full-length attention output exists; the backward first reads the
chunks ``o_i`` back from the attention's stash (:func:`read_back`) for the weight and LoRA
gradients, then gives the pipeline each chunk's input gradient ``g_i W`` on demand.
:class:`OutputProjectionFunction` is the same projection as an autograd Function over a
full-length input, which it saves (streamed layers call it one chunk at a time). LoRA terms run
over ``2 u`` token pieces (:func:`lora_pieces`), each with its own dropout mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fpdt.comm import heads_to_seq
from fpdt.offload import HostStash
from fpdt.ops.lora import (LoraAdapters, LoraLayout, accumulators, finish, lora_backward, lora_input_grad,
                          with_lora)


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
    """``x`` ``[B, S_local, H D]`` (sequence layout, saved) -> ``F.linear(x, weight, bias)`` plus
    the LoRA terms of ``layout`` (None: none) ``[B, S_local, hidden]``, in the base output's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_chunks: int, layout: LoraLayout | None, *tensors):
        chunks = OutputChunks(weight, bias, layout, tensors, x.shape[1], num_chunks)
        out = _joined([chunks.forward(i, x[:, i * chunks.L:(i + 1) * chunks.L]) for i in range(num_chunks)])
        ctx.save_for_backward(x, weight, bias, *tensors)
        ctx.num_chunks, ctx.layout, ctx.seed = num_chunks, layout, chunks.seed
        return out

    @staticmethod
    @once_differentiable   # the chunked backward is not itself differentiable
    def backward(ctx, grad_out):
        x, weight, bias, *tensors = ctx.saved_tensors
        need = ctx.needs_input_grad
        u = ctx.num_chunks
        chunks = OutputChunks(weight, bias, ctx.layout, tensors, x.shape[1], u, ctx.seed)
        chunks.start_backward(torch.float64 if weight.dtype == torch.float64 else torch.float32,
                              need[1], need[2], need[5:])
        L = chunks.L
        for i in range(u):
            chunks.weight_grads(i, x[:, i * L:(i + 1) * L], grad_out[:, i * L:(i + 1) * L])
        dx = _joined([chunks.input_grad(i, grad_out[:, i * L:(i + 1) * L]) for i in range(u)]) if need[0] else None
        dw, db, d_lora = chunks.finish(grad_out)
        return (dx, dw, db, None, None, *d_lora)


class OutputChunks:
    """``o_proj`` (``weight`` ``[hidden, H D]``, ``bias``, one projection's LoRA ``layout`` and
    ``tensors``) over the ``num_chunks`` local chunks ``[B, L, H D]`` of a ``seq_local``-token
    input. ``seed``: the LoRA dropout seed (None: drawn). Backward: :meth:`start_backward`, then
    :meth:`weight_grads` per chunk (needs the input) and :meth:`input_grad` per chunk (does not),
    then :meth:`finish`."""

    def __init__(self, weight, bias, layout: LoraLayout | None, tensors, seq_local: int, num_chunks: int,
                 seed: int | None = None):
        self.weight, self.bias, self.layout, self.tensors = weight, bias, layout, tuple(tensors)
        self.terms = layout.split(self.tensors)[0] if layout is not None else []
        self.seed = seed if seed is not None or layout is None else layout.draw_seed()
        self.L = seq_local // num_chunks
        self.pieces = lora_pieces(seq_local, num_chunks)

    def _local(self, i: int):
        """Chunk ``i``'s LoRA pieces as ``(k, start, end)`` within the chunk."""
        return [(k, s - i * self.L, e - i * self.L) for k, s, e in self.pieces[i]]

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Chunk ``i``: ``x`` ``[B, L, H D]`` -> ``[B, L, hidden]``."""
        out = F.linear(x, self.weight, self.bias)
        for k, s, e in self._local(i) if self.terms else ():
            out[:, s:e] = with_lora(_rows(out, s, e), _rows(x, s, e), self.terms, self.seed, k).view(
                x.shape[0], e - s, -1)
        return out

    def start_backward(self, acc: torch.dtype, need_w: bool, need_b: bool, need_lora) -> None:
        """fp32 (``acc``) accumulators of the weight, bias and LoRA tensors that need a gradient."""
        self.acc = acc
        self.dw = torch.zeros(self.weight.shape, dtype=acc, device=self.weight.device) if need_w else None
        self.need_b = need_b and self.bias is not None
        self.d_lora = accumulators(self.layout, self.tensors, need_lora) if self.layout is not None else []
        self.d_terms = self.layout.split(self.d_lora)[0] if self.layout is not None else []

    @property
    def needs_input(self) -> bool:
        """Whether the backward needs the input (the weight's or an adapter's gradient)."""
        return self.dw is not None or any(a is not None for a in self.d_lora)

    def weight_grads(self, i: int, x: torch.Tensor, g: torch.Tensor) -> None:
        """Chunk ``i``'s share of the weight and adapter gradients: ``x`` its input, ``g`` its
        output gradient ``[B, L, hidden]``."""
        if self.dw is not None:
            self.dw += (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(self.acc)
        for k, s, e in self._local(i) if self.d_terms else ():
            lora_backward(_rows(x, s, e), _rows(g, s, e), self.terms, self.d_terms, self.seed, k, False)

    def input_grad(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Chunk ``i``'s input gradient ``[B, L, H D]`` from its output gradient ``g``."""
        dx = g @ self.weight
        for k, s, e in self._local(i) if self.terms else ():
            dx[:, s:e] += lora_input_grad(_rows(g, s, e), self.terms, self.seed, k).view(g.shape[0], e - s, -1)
        return dx

    def finish(self, grad_out: torch.Tensor) -> tuple:
        """``(d_weight, d_bias, d_lora)`` in their tensors' dtypes (None where not needed); the
        bias's from the whole output gradient ``grad_out`` ``[B, S_local, hidden]``."""
        dw = None if self.dw is None else self.dw.to(self.weight.dtype)
        db = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=self.acc).to(self.bias.dtype) if self.need_b \
            else None
        self.dw = None
        return dw, db, finish(self.d_lora, self.tensors) if self.layout is not None else ()


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, 1)


def _rows(t: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Tokens ``[s, e)`` of ``t`` ``[B, S, n]`` as ``[B (e - s), n]`` rows (a view for B = 1)."""
    return t[:, s:e].reshape(-1, t.shape[-1])


def all_to_all_group(spec):
    """The group ``o`` chunks go back through: the mesh's head-parallel group, or Ulysses'."""
    return spec.hp_group if hasattr(spec, "hp_group") else spec.group


def read_back(stash: HostStash, spec, B: int, L: int):
    """The attention output chunks ``o_i`` the pipeline left in ``stash`` (head layout), each
    all-to-all'd back to sequence layout ``[B, L, H D]``, in order i = 0, 1, ... (``get``, the
    next one prefetched: the attention backward reads them next)."""
    u, group = spec.num_chunks, all_to_all_group(spec)
    stash.prefetch(("o", 0))
    for i in range(u):
        o = stash.get(("o", i))
        if i + 1 < u:
            stash.prefetch(("o", i + 1))    # copies in during this chunk's GEMMs
        yield heads_to_seq(o, group).reshape(B, L, -1)
        del o


def output_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      adapters: LoraAdapters | None, num_chunks: int) -> torch.Tensor:
    """``o_proj`` of ``x`` ``[B, S_local, H D]`` with ``weight`` ``[hidden, H D]``, ``bias`` and the
    one projection's LoRA ``adapters`` (or None), saving ``x``. Returns ``[B, S_local, hidden]``."""
    check_adapters(adapters)
    if x.shape[1] % num_chunks:
        raise ValueError(f"S_local={x.shape[1]} is not divisible by num_chunks={num_chunks}")
    layout, tensors = (None, ()) if adapters is None else (adapters.layout, adapters.tensors)
    return OutputProjectionFunction.apply(x, weight, bias, num_chunks, layout, *tensors)


def check_adapters(adapters: LoraAdapters | None) -> None:
    if adapters is not None and len(adapters.layout.terms) != 1:
        raise ValueError(f"the output projection takes one projection's adapters, got {len(adapters.layout.terms)}")

"""Shared measurement for the memory budget tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fpdt.attention import fpdt_attention
from fpdt.memory.accountant import MemoryAccountant, chunk_unit

GQA = (4, 1, 64)   # the shape: hidden 256 = 4 q heads x 64, one KV head (4:1)
MHA = (4, 4, 64)


def warm_up(heads, dtype=torch.bfloat16, group=None) -> None:
    """Run the kernel's first-use self-check outside any measurement."""
    H, H_kv, D = heads
    P = 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)
    q = torch.randn(1, 4 * P, H, D, dtype=dtype, requires_grad=True)
    kv = torch.randn(1, 4 * P, H_kv, D, dtype=dtype, requires_grad=True)
    fpdt_attention(q, kv, kv, num_chunks=2, group=group).sum().backward()


def attention_working_set(chunk: int, u: int, heads, offload: bool, group=None, dtype=torch.bfloat16,
                          seed: int = 0) -> dict[str, float]:
    """One rank's ``fpdt_attention`` forward + backward at global chunk ``chunk`` tokens and ``u``
    chunks per rank. Returns, in ``U = chunk * H * D * 2`` bytes: ``fwd`` = forward peak beyond
    the output it returns, ``bwd`` = backward peak beyond its start and the input gradients."""
    H, H_kv, D = heads
    P = dist.get_world_size(group) if dist.is_initialized() else 1
    S_local = chunk * u // P
    g = torch.Generator().manual_seed(seed + (dist.get_rank(group) if dist.is_initialized() else 0))
    q = torch.randn(1, S_local, H, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, S_local, H_kv, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(1, S_local, H_kv, D, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(1, S_local, H, D, generator=g).to(dtype)
    with MemoryAccountant("cpu") as acct:
        with acct.phase("fwd"):
            out = fpdt_attention(q, k, v, num_chunks=u, offload=offload, group=group)
        with acct.phase("bwd"):
            out.backward(dout)
    U = chunk_unit(chunk, H * D)
    out_bytes = out.numel() * out.element_size()
    grads = sum(t.numel() * t.element_size() for t in (q, k, v))
    return {"fwd": (acct.phases["fwd"].peak - out_bytes) / U,
            "bwd": (acct.phases["bwd"].peak_above_start - grads) / U}


def measure_matrix(chunk: int, cases, group=None) -> dict:
    """``{(name, offload, u): {"fwd", "bwd"}}`` for ``cases`` = [(name, heads, offloads, us)]."""
    import gc
    results = {}
    for name, heads, offloads, us in cases:
        warm_up(heads, group=group)
        for offload in offloads:
            for u in us:
                gc.collect()
                results[(name, offload, u)] = attention_working_set(chunk, u, heads, offload, group=group)
    return results

"""Masked blocks on CUDA: torch's variable-length FlashAttention-2 (``aten._flash_attention_forward``
/ ``_flash_attention_backward`` with cumulative sequence lengths).

Each segment of a masked block is one sequence of the call, gathered into packed ``[total, H, D]``
tensors (a view when the segments cover every token in order) with int32 ``cum_seq_q`` /
``cum_seq_k``. Returns out ``[Nq, H, D]`` and lse ``[H, Nq]`` fp32 (rows in no segment: out 0,
lse -inf); KV heads native; head_dim zero-padded to a multiple of 8. Used when
:func:`varlen_for` says so (CUDA, fp16/bf16, head_dim <= 256, :func:`varlen_self_check` passed).
"""

from __future__ import annotations

import functools
import warnings

import torch

from fpdt.attention.kernels.common import HALF, check_relative_errors, pad_head_dim

aten = torch.ops.aten
DEVICE_TYPES = ("cuda",)


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=None)
def _rng_specs() -> tuple:
    """(shape, dtype) of the forward's rng_state and unused outputs, from the meta kernel."""
    q = torch.empty(4, 1, 8, device="meta", dtype=torch.float16)
    cu = torch.zeros(2, device="meta", dtype=torch.int32)
    res = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.0, False, False, scale=1.0)
    return tuple((tuple(t.shape), t.dtype) for t in res[2:4])


def _flat_index(starts: list[int], lengths: list[int], total: int, device):
    """Flat indices of the runs ``[start, start + length)`` in order; None when they are
    ``0 .. total - 1`` in order (the packed tensor is then a view)."""
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    if sum(lengths) == total and offsets.tolist() == starts:
        return None
    shift = torch.repeat_interleave(torch.tensor(starts) - offsets, torch.tensor(lengths))
    return (torch.arange(sum(lengths)) + shift).to(device)


def _packing(block, batch: int, device):
    """(q_index, k_index, cu_q, cu_k, max_q, max_k): flat token indices of the segments'
    queries and keys (None: every token, in order) and the cumulative lengths."""
    segs = block.segments
    len_q = [q1 - q0 for _, q0, q1, _, _ in segs]
    len_k = [k1 - k0 for _, _, _, k0, k1 in segs]
    q_index = _flat_index([r * block.q_len + q0 for r, q0, _, _, _ in segs], len_q, batch * block.q_len, device)
    k_index = _flat_index([r * block.k_len + k0 for r, _, _, k0, _ in segs], len_k, batch * block.k_len, device)
    cu_q = torch.tensor([0] + len_q).cumsum(0).to(device, torch.int32)
    cu_k = torch.tensor([0] + len_k).cumsum(0).to(device, torch.int32)
    return q_index, k_index, cu_q, cu_k, max(len_q), max(len_k)


def _pack(x: torch.Tensor, index):
    flat = x.reshape(-1, *x.shape[2:])
    return flat if index is None else flat.index_select(0, index)


def varlen_forward(q, k, v, block, scale):
    """A masked block's ``(out [B, Sq, H, D], lse [B, H, Sq])``; see the module docstring."""
    B, Sq, H, D = q.shape
    q_index, k_index, cu_q, cu_k, max_q, max_k = _packing(block, B, q.device)
    qp, kp, vp = (pad_head_dim(t, 8) for t in (_pack(q, q_index), _pack(k, k_index), _pack(v, k_index)))
    res = aten._flash_attention_forward(qp, kp, vp, cu_q, cu_k, max_q, max_k, 0.0, block.causal, False, scale=scale)
    out_p, lse_p = res[0][..., :D], res[1]
    if q_index is None:
        out = out_p.reshape(B, Sq, H, D)
        lse = lse_p.view(H, B, Sq).permute(1, 0, 2)
    else:
        out = torch.zeros(B * Sq, H, D, dtype=q.dtype, device=q.device).index_copy_(0, q_index, out_p)
        lse = torch.full((H, B * Sq), float("-inf"), dtype=torch.float32, device=q.device)
        lse = lse.index_copy_(1, q_index, lse_p.float()).view(H, B, Sq).permute(1, 0, 2)
        out = out.view(B, Sq, H, D)
    return out, lse.float()


def varlen_backward(dout, q, k, v, out, lse, block, scale):
    """The block's (dq, dk, dv) from the merged (out, lse), fp32, zero outside its segments."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    q_index, k_index, cu_q, cu_k, max_q, max_k = _packing(block, B, q.device)
    dop, qp, op = (pad_head_dim(_pack(t, q_index), 8) for t in (dout, q, out))
    kp, vp = (pad_head_dim(_pack(t, k_index), 8) for t in (k, v))
    lse_p = lse.permute(1, 0, 2).reshape(H, B * Sq)
    lse_p = (lse_p if q_index is None else lse_p.index_select(1, q_index)).float().contiguous()
    rng, unused = (torch.zeros(shape, dtype=dtype, device=q.device) for shape, dtype in _rng_specs())
    dq_p, dk_p, dv_p = aten._flash_attention_backward(dop, qp, kp, vp, op, lse_p, cu_q, cu_k, max_q, max_k, 0.0,
                                                      block.causal, rng, unused, scale=scale)
    acc = _acc(q.dtype)

    def scatter(g, index, n, heads):
        g = g[..., :D].to(acc)
        if index is None:
            return g.reshape(B, n, heads, D)
        return torch.zeros(B * n, heads, D, dtype=acc, device=q.device).index_copy_(0, index, g).view(B, n, heads, D)

    return (scatter(dq_p, q_index, Sq, H), scatter(dk_p, k_index, Sk, k.shape[2]),
            scatter(dv_p, k_index, Sk, k.shape[2]))


_CHECKS: dict[tuple, str | None] = {}


def varlen_self_check(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The varlen kernel against the segment path on the float64 math kernel, forward and the
    backward from a merged (out, lse), on a GQA block of mixed documents (diagonal and
    keys-before-queries, with rows that see no key). None when it passes, else what failed."""
    key = (str(device), dtype, head_dim)
    if key in _CHECKS:
        return _CHECKS[key]
    from fpdt.attention.documents import Documents
    from fpdt.attention.kernels import BACKENDS
    from fpdt.attention.kernels.segments import segments_backward, segments_forward
    g = torch.Generator().manual_seed(4321)
    C, scale = 40, head_dim ** -0.5
    lengths = ([7, 1, 20, 24, 8, 20], [3, 37, 10, 10, 19, 1])         # two rows, 2C tokens each
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])
    docs = Documents(ids, causal=True)
    docs.add_side("k", torch.arange(C))
    docs.add_side("q", torch.arange(C, 2 * C))
    math = BACKENDS["math"]
    try:
        for blk in (docs.block("q", "q"), docs.block("q", "k")):
            q, dout = (torch.randn(2, C, 4, head_dim, generator=g).to(device, dtype) for _ in range(2))
            k, v = (torch.randn(2, C, 2, head_dim, generator=g).to(device, dtype) for _ in range(2))
            ro, rl = segments_forward(math, q, k, v, blk, scale)
            go, gl = varlen_forward(q, k, v, blk, scale)
            seen = torch.isfinite(rl)
            if not torch.equal(seen, torch.isfinite(gl)):
                raise AssertionError("rows without keys do not get lse -inf")
            lse = torch.where(seen, rl, torch.full_like(rl, 0.5))          # a merged lse, finite everywhere
            pairs = [(go, ro), (gl[seen], rl[seen])]
            pairs += zip(varlen_backward(dout, q, k, v, ro, lse, blk, scale),
                         segments_backward(math, dout, q, k, v, ro, lse, blk, scale))
            check_relative_errors(pairs, 5e-2)
        result = None
    except Exception as e:  # noqa: BLE001 -- any failure disqualifies the kernel
        result = f"{type(e).__name__}: {e}"
    _CHECKS[key] = result
    return result


def varlen_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether masked blocks on ``(device, dtype, head_dim)`` take the varlen kernel (warns
    once when it fails its self-check)."""
    if device.type not in DEVICE_TYPES or dtype not in HALF or head_dim > 256:
        return False
    failure = varlen_self_check(device, dtype, head_dim)
    if failure is not None:
        key = ("warned", str(device), dtype, head_dim)
        if key not in _CHECKS:
            _CHECKS[key] = failure
            warnings.warn(f"the varlen attention kernel failed its self-check on {device}, {dtype}, head_dim="
                          f"{head_dim} ({failure}); masked document blocks use one dense call per document",
                          RuntimeWarning, stacklevel=3)
        return False
    return True

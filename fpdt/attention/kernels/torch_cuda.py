"""torch's own CUDA attention kernels: ``cuda_flash``, ``cuda_cudnn``, ``cuda_efficient``.

Each backward gets the lse and RNG outputs in the layout its forward produced, read from torch's
meta kernel of the forward op (:func:`forward_output_specs`): ``cuda_flash`` lse ``[B, H, Sq]``
(rng_state unused), native GQA; ``cuda_cudnn`` lse ``[B, H, Sq, 1]`` (squeezed for the merge,
unsqueezed back), philox seed and offset, native GQA from torch 2.8; ``cuda_efficient`` lse
``[B, H, align(Sq, 32)]`` (sliced to Sq for the merge, padded back with +inf), philox seed and
offset, KV expanded here and the replica gradients summed in fp32. :func:`sdpa_choice` says which
kernel torch's own SDPA would run, so automatic selection can follow it.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend

from fpdt.attention.kernels.common import bhsd, expand_kv, fold_kv_grad

aten = torch.ops.aten

_FORWARD_OPS = {
    "flash": lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=1.0),
    "cudnn": lambda q, k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                                      scale=1.0),
    "efficient": lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                              scale=1.0),
}


@functools.lru_cache(maxsize=None)
def forward_output_specs(kernel: str, seq_q: int, dtype: torch.dtype) -> tuple:
    """``(shape, dtype)`` (or None) of each output of ``kernel``'s forward op for ``seq_q`` queries
    (batch 1, one head, head_dim 8), from torch's meta kernel: no device work, no sync."""
    q = torch.empty(1, 1, seq_q, 8, device="meta", dtype=dtype)
    k = torch.empty(1, 1, 8, 8, device="meta", dtype=dtype)
    outs = _FORWARD_OPS[kernel](q, k, k)
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in outs)


def _like(spec, device) -> torch.Tensor:
    shape, dtype = spec
    return torch.zeros(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- flash

def flash_forward(q, k, v, causal, scale):
    res = aten._scaled_dot_product_flash_attention(bhsd(q), bhsd(k), bhsd(v), 0.0, causal, False, scale=scale)
    return bhsd(res[0]), res[1]


def flash_backward(dout, q, k, v, out, lse, causal, scale):
    Sq, Sk = q.shape[1], k.shape[1]
    specs = forward_output_specs("flash", Sq, q.dtype)
    # Dense batch: the forward's cumulative-length outputs are undefined tensors (None from
    # Python), and a defined one would select the varlen path.
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.contiguous(), None, None,
        Sq, Sk, 0.0, causal, _like(specs[6], q.device), _like(specs[7], q.device), scale=scale)
    return bhsd(dq), bhsd(dk), bhsd(dv)


_SDPA_KERNELS = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.CUDNN_ATTENTION: "cudnn",
                 SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}


_SDPA_CHOICES: dict[tuple, str] = {}


def sdpa_choice(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                causal: bool = True) -> str | None:
    """The kernel torch's ``scaled_dot_product_attention`` dispatches a maskless, grad-requiring
    self-attention call to on ``device`` (``"flash"``, ``"cudnn"``, ``"efficient"``, ``"math"``; None if
    torch cannot say), ``enable_gqa`` when ``num_kv_heads`` differs from ``num_heads``. Asks
    ``torch._fused_sdp_choice`` on a small probe, so it follows the installed torch, cuDNN, GPU and
    ``TORCH_CUDNN_SDPA_*``; answers (not failures) are cached per argument tuple for the process.
    """
    key = (str(device), dtype, num_heads, num_kv_heads, head_dim, causal)
    if key in _SDPA_CHOICES:
        return _SDPA_CHOICES[key]
    try:
        with torch.enable_grad():
            q = torch.zeros(1, num_heads, 128, head_dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.zeros(1, num_kv_heads, 128, head_dim, device=device, dtype=dtype, requires_grad=True)
            choice = _SDPA_KERNELS.get(SDPBackend(torch._fused_sdp_choice(q, k, k, is_causal=causal,
                                                                          enable_gqa=num_heads != num_kv_heads)))
    except Exception:  # noqa: BLE001 -- an old torch or a device it cannot probe: no answer
        return None
    if choice is not None:
        _SDPA_CHOICES[key] = choice
    return choice


CUDNN_NATIVE_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
"""Whether torch's cuDNN attention op takes fewer KV heads than query heads (torch >= 2.8)."""


# ----------------------------------------------------------------------------- cuDNN

def cudnn_forward(q, k, v, causal, scale):
    if not CUDNN_NATIVE_GQA:
        k, v, _ = expand_kv(k, v, q.shape[2])
    res = aten._scaled_dot_product_cudnn_attention(bhsd(q), bhsd(k), bhsd(v), None, True, 0.0, causal,
                                                   False, scale=scale)
    lse = res[1]
    if lse.dim() == 4:  # [B, H, Sq, 1]
        lse = lse.squeeze(-1)
    return bhsd(res[0]), lse.float()


def cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    k, v, group = expand_kv(k, v, q.shape[2]) if not CUDNN_NATIVE_GQA else (k, v, 1)
    Sq, Sk = q.shape[1], k.shape[1]
    specs = forward_output_specs("cudnn", Sq, q.dtype)
    if len(specs[1][0]) == 4:  # back to the forward's [B, H, Sq, 1]
        lse = lse.unsqueeze(-1)
    # cuDNN reads all of q, k, v, out, dout with one layout: make them the same (BSHD) one.
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.contiguous(),
        _like(specs[6], q.device), _like(specs[7], q.device), None, None, None, Sq, Sk, 0.0, causal, scale=scale)
    return bhsd(dq), fold_kv_grad(bhsd(dk), group), fold_kv_grad(bhsd(dv), group)


# ----------------------------------------------------------------------------- memory-efficient

def efficient_forward(q, k, v, causal, scale):
    k, v, _ = expand_kv(k, v, q.shape[2])
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(bhsd(q), bhsd(k), bhsd(v), None, True, 0.0,
                                                                  causal, scale=scale)
    return bhsd(out), lse[..., : q.shape[1]]  # the kernel pads lse along the query dim


def efficient_backward(dout, q, k, v, out, lse, causal, scale):
    k, v, group = expand_kv(k, v, q.shape[2])
    Sq = q.shape[1]
    specs = forward_output_specs("efficient", Sq, q.dtype)
    padded = specs[1][0][-1]
    if padded != Sq:  # the kernel reads lse with its padded row stride; padding rows get +inf (p = 0)
        lse = torch.nn.functional.pad(lse, (0, padded - Sq), value=float("inf"))
    # In half precision the kernel reads out and dout with q's strides: given another layout,
    # dq and dk came out wrong (measured on an H100, torch 2.11; fp32 was right). All BSHD, as for cuDNN.
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        bhsd(dout), bhsd(q), bhsd(k), bhsd(v), None, bhsd(out), lse.contiguous(),
        _like(specs[2], q.device), _like(specs[3], q.device), 0.0, [True, True, True, False], causal, scale=scale)
    return bhsd(dq), fold_kv_grad(bhsd(dk), group), fold_kv_grad(bhsd(dv), group)

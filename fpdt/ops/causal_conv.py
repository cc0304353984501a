"""The depthwise causal conv (+ SiLU) of a Gated DeltaNet layer over a span with its window of earlier
tokens: PyTorch's ``conv1d``, Dao-AILab's causal-conv1d on CUDA where installed (an optional extra),
or a masked sum of the taps where packed documents start inside the span."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F


def causal_conv1d_available() -> bool:
    """Whether the ``causal_conv1d`` package imports."""
    try:
        return importlib.util.find_spec("causal_conv1d") is not None
    except (ImportError, ValueError):
        return False


def conv_kernel(device: torch.device | str) -> str:
    """The conv kernel :func:`causal_conv` runs on ``device`` without documents: ``"causal-conv1d"`` or ``"torch"``."""
    return "causal-conv1d" if torch.device(device).type == "cuda" and causal_conv1d_available() else "torch"


def causal_conv(full: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None = None,
                kernel: str | None = None) -> torch.Tensor:
    """``silu(conv)``: ``full`` ``[B, K - 1 + N, C]`` (the window, then the span), ``weight`` ``[C, K]``
    -> ``[B, N, C]`` in ``full``'s dtype; ``mask`` ``[B, N, K]`` (bool) drops the taps reading another
    document (always the PyTorch sum). ``kernel``: ``"causal-conv1d"``, ``"torch"`` or None (:func:`conv_kernel`)."""
    K = weight.shape[1]
    N = full.shape[1] - (K - 1)
    w = weight.to(full.dtype)
    if mask is not None:
        return F.silu(sum(full[:, j:j + N] * w[:, j] * mask[:, :, j:j + 1].to(full.dtype) for j in range(K)))
    kernel = conv_kernel(full.device) if kernel is None else kernel
    if kernel == "causal-conv1d":
        from causal_conv1d import causal_conv1d_fn
        out = causal_conv1d_fn(full.transpose(1, 2).contiguous(), w.contiguous(), None, activation="silu")
        return out[..., K - 1:].transpose(1, 2)
    if kernel != "torch":
        raise ValueError(f"unknown conv kernel {kernel!r}: use 'causal-conv1d', 'torch' or None (automatic)")
    return F.silu(F.conv1d(full.transpose(1, 2), w.unsqueeze(1), groups=w.shape[0]).transpose(1, 2))

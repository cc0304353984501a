"""What every block-attention backend shares: the backend record and the layout helpers.

Layouts: the pipeline works in ``[B, S, H, D]`` (flash-attn's layout); torch's SDPA ops
take ``[B, H, S, D]``, which :func:`bhsd` gives as a view (no copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

HALF = (torch.float16, torch.bfloat16)


def _needs_gpu() -> str:
    return "a CUDA build of torch and a GPU"


@dataclass(frozen=True)
class AttentionBackend:
    """One kernel family: how to run a block forward and backward, and where it applies.

    ``native_gqa``: k/v go to the kernel with their ``H_kv`` heads (the kernel sums the
    replicas' gradients itself); otherwise the adapter expands them to ``H`` heads first
    and sums the replica gradients in fp32 (see :func:`expand_kv`, :func:`fold_kv_grad`).
    ``hint()`` says what to install when ``available()`` is False.
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    supports: Callable[[torch.device, torch.dtype, int], bool]  # (device, dtype, head_dim)
    available: Callable[[], bool]
    native_gqa: bool = False
    hint: Callable[[], str] = _needs_gpu


def on(device_type: str, dtypes: tuple[torch.dtype, ...], max_head_dim: int = 1 << 30, multiple_of: int = 1):
    """A ``supports`` predicate: this device type, these dtypes, head_dim in range."""
    return lambda device, dtype, head_dim: (device.type == device_type and dtype in dtypes
                                            and head_dim <= max_head_dim and head_dim % multiple_of == 0)


def bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` <-> ``[B, H, S, D]`` as a view."""
    return x.transpose(1, 2)


def expand_kv(k: torch.Tensor, v: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Repeat KV heads to ``num_heads`` (``repeat_interleave``: query head ``h`` reads KV head
    ``h // group``) for kernels without native GQA; also returns the group size.
    """
    group = num_heads // k.shape[2]
    if group == 1:
        return k, v, 1
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), group


def fold_kv_grad(g: torch.Tensor, group: int) -> torch.Tensor:
    """Backward of :func:`expand_kv` for one of dk/dv: ``[B, S, H, D]`` -> ``[B, S, H_kv, D]``, the
    replica gradients summed and returned in fp32 (float64 for float64 input).
    """
    if group == 1:
        return g
    B, S, H, D = g.shape
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    return g.view(B, S, H // group, group, D).sum(dim=3, dtype=acc)


def pad_head_dim(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim to a multiple of ``multiple`` (no copy when it already is one); zero
    columns change no dot product, so slicing the result back is exact.
    """
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def check_relative_errors(pairs, tol: float) -> None:
    """Raise ``AssertionError`` unless every ``(got, want)`` pair agrees within ``tol``, relative
    to ``want``'s largest magnitude (a NaN fails too): the kernels' self-checks."""
    for got, want in pairs:
        got, want = got.double(), want.double()
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        if not err <= tol:
            raise AssertionError(f"relative error {err:.2e} > {tol:.0e}")

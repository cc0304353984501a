"""Block attention kernels that return ``(out, lse)`` and a backward that takes the
*final merged* ``(out, lse)``. Contract of every backend, layout ``[B, S, H, D]``:

* ``forward(q, k, v, causal, scale) -> (out, lse)``: q ``[B, Sq, H, D]``, k/v ``[B, Sk, H_kv, D]``
  (``H % H_kv == 0``); out ``[B, Sq, H, D]`` in q's dtype, lse ``[B, H, Sq]`` fp32 (float64 for
  float64 inputs). ``causal`` only on diagonal blocks (``Sq == Sk``, plain lower triangle).
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` with the final merged
  ``out``/``lse``: exactly this block's contribution; dk/dv ``[B, Sk, H_kv, D]``, any float dtype.

Backends, automatic selection (:func:`auto_order`, :func:`self_check`) and GQA:
``docs/attention.md`` (Kernels).
"""

from __future__ import annotations

import math
import warnings

import torch

from fpdt.attention.kernels import flash, torch_cpu, torch_cuda
from fpdt.attention.kernels.common import HALF, AttentionBackend, check_relative_errors, on
from fpdt.attention.kernels.reference import math_backward as _math_backward
from fpdt.attention.kernels.reference import math_forward as _math_forward

__all__ = ["AttentionBackend", "BACKENDS", "auto_order", "default_scale", "expands_gqa_on_gpu", "get_backend",
           "self_check"]

_ALWAYS = lambda: True  # noqa: E731
_CUDA = torch.cuda.is_available

BACKENDS: dict[str, AttentionBackend] = {
    "flash_attn3": AttentionBackend("flash_attn3", flash.fa3_forward, flash.fa3_backward, on("cuda", HALF, 256),
                                    flash.fa3_available, native_gqa=True, hint=flash.fa3_hint),
    "flash_attn": AttentionBackend("flash_attn", flash.fa2_forward, flash.fa2_backward, on("cuda", HALF, 256),
                                   flash.fa2_available, native_gqa=True, hint=flash.fa2_hint),
    "cuda_flash": AttentionBackend("cuda_flash", torch_cuda.flash_forward, torch_cuda.flash_backward,
                                   on("cuda", HALF, 256), _CUDA, native_gqa=True),
    "cuda_cudnn": AttentionBackend("cuda_cudnn", torch_cuda.cudnn_forward, torch_cuda.cudnn_backward,
                                   on("cuda", HALF, 128, multiple_of=8), _CUDA,
                                   native_gqa=torch_cuda.CUDNN_NATIVE_GQA),
    "cuda_efficient": AttentionBackend("cuda_efficient", torch_cuda.efficient_forward, torch_cuda.efficient_backward,
                                       on("cuda", (torch.float32,) + HALF), _CUDA),
    "cpu": AttentionBackend("cpu", torch_cpu.cpu_forward, torch_cpu.cpu_backward,
                            on("cpu", (torch.float32, torch.float64) + HALF), _ALWAYS),
    "math": AttentionBackend("math", _math_forward, _math_backward, lambda *_: True, _ALWAYS),
}

# Preference order for automatic selection (each candidate must also pass self_check);
# auto_order() moves cuda_cudnn forward where torch's SDPA prefers it.
_AUTO_ORDER = ("flash_attn3", "flash_attn", "cuda_flash", "cuda_cudnn", "cuda_efficient", "cpu", "math")


def auto_order(device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int = 8,
               num_kv_heads: int = 2) -> tuple[str, ...]:
    """The candidates automatic selection tries, best first (``docs/attention.md``, Kernels).

    :data:`_AUTO_ORDER`, except that on a CUDA device where torch's SDPA would dispatch a
    ``num_heads``/``num_kv_heads`` self-attention call to cuDNN, ``cuda_cudnn`` comes right
    after ``flash_attn3``.
    """
    device = torch.device(device)
    if device.type != "cuda" or torch_cuda.sdpa_choice(device, dtype, num_heads, num_kv_heads, head_dim) != "cudnn":
        return _AUTO_ORDER
    rest = tuple(n for n in _AUTO_ORDER if n not in ("flash_attn3", "cuda_cudnn"))
    return ("flash_attn3", "cuda_cudnn") + rest


def expands_gqa_on_gpu(name: str | None, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention on a CUDA GPU repeats the KV heads per block (for the memory model, on any
    machine): the named backend's ``not native_gqa``, or for automatic selection that of the first of
    torch's CUDA kernels taking ``dtype`` and ``head_dim`` (bf16/fp16: native; fp32: expands).
    """
    if name is not None:
        return not BACKENDS[name].native_gqa
    cuda = torch.device("cuda")
    for candidate in (n for n in _AUTO_ORDER if n.startswith("cuda_")):   # torch's own CUDA kernels
        if BACKENDS[candidate].supports(cuda, dtype, head_dim):
            return not BACKENDS[candidate].native_gqa
    return True     # the math kernel


_SELF_CHECKS: dict[tuple[str, str, torch.dtype, int], str | None] = {}
_CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-10}  # half precisions: 5e-2


def self_check(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Check ``backend`` once per (device, dtype, head_dim) against the float64 math kernel: a GQA
    query block against a diagonal and an earlier KV block, forward and the backward from the
    *merged* (out, lse). Returns None when it passes, else what went wrong (a kernel that fails, a
    fake lse, a backward that ignores the lse).
    """
    key = (backend.name, str(device), dtype, head_dim)
    if key in _SELF_CHECKS:
        return _SELF_CHECKS[key]
    g = torch.Generator().manual_seed(1234)
    C, scale = 80, head_dim ** -0.5  # 80: not a multiple of 32, so padded-lse kernels show their padding
    q, dout = (torch.randn(1, C, 4, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, 2 * C, 2, head_dim, generator=g).to(device, dtype) for _ in range(2))
    blocks = ((k[:, C:], v[:, C:], True), (k[:, :C], v[:, :C], False))
    tol = _CHECK_TOL.get(dtype, 5e-2)
    try:
        ref = [_math_forward(q, kb, vb, causal, scale) for kb, vb, causal in blocks]
        got = [backend.forward(q, kb, vb, causal, scale) for kb, vb, causal in blocks]
        pairs = [(a, b) for (ro, rl), (go, gl) in zip(ref, got) for a, b in ((go, ro), (gl, rl))]
        # the final merged (out, lse) of the two blocks, from the reference
        lse = torch.logaddexp(ref[0][1].double(), ref[1][1].double())
        w0 = torch.exp(ref[0][1].double() - lse).transpose(1, 2)[..., None]
        w1 = torch.exp(ref[1][1].double() - lse).transpose(1, 2)[..., None]
        out = (w0 * ref[0][0].double() + w1 * ref[1][0].double()).to(dtype)
        lse = lse.to(ref[0][1].dtype)  # fp32 (float64 for float64 inputs), as the pipeline keeps it
        for kb, vb, causal in blocks:
            r = _math_backward(dout, q, kb, vb, out, lse, causal, scale)
            b = backend.backward(dout, q, kb, vb, out, lse, causal, scale)
            pairs += list(zip(b, r))
        check_relative_errors(pairs, tol)
        result = None
    except Exception as e:  # noqa: BLE001 -- any failure disqualifies the kernel
        result = f"{type(e).__name__}: {e}"
    _SELF_CHECKS[key] = result
    return result


def get_backend(name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int,
                check: bool = True) -> AttentionBackend:
    """The backend called ``name``, or the best one for ``(device, dtype, head_dim)`` if None.

    Every backend passes :func:`self_check` before first use (automatic selection warns and moves
    on; ``check=False`` skips a named one's). Raises ``ValueError`` for an unknown name and
    ``RuntimeError`` when the named backend is not installed, cannot run here, or fails its check.
    """
    device = torch.device(device)
    if name is None:
        for candidate in auto_order(device, dtype, head_dim):
            b = BACKENDS[candidate]
            if not (b.supports(device, dtype, head_dim) and b.available()):
                continue
            failure = self_check(b, device, dtype, head_dim)
            if failure is None:
                return b
            warnings.warn(f"attention backend {candidate!r} failed its self-check on {device}, {dtype}, "
                          f"head_dim={head_dim} ({failure}); trying the next one", RuntimeWarning, stacklevel=2)
        raise RuntimeError(f"no attention backend for device={device}, dtype={dtype}, head_dim={head_dim}")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)} or None (auto)")
    b = BACKENDS[name]
    if not b.available():
        raise RuntimeError(f"attention backend {name!r} is not available here (needs {b.hint()})")
    if not b.supports(device, dtype, head_dim):
        raise RuntimeError(f"attention backend {name!r} does not support device={device}, dtype={dtype}, "
                           f"head_dim={head_dim}; pick another backend or None (auto)")
    failure = self_check(b, device, dtype, head_dim) if check else None
    if failure is not None:
        raise RuntimeError(f"attention backend {name!r} failed its self-check on {device}, {dtype}, "
                           f"head_dim={head_dim}: {failure}; pick another backend or None (auto)")
    return b


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)

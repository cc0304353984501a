"""Block attention kernels that return ``(out, lse)`` and a backward that takes the
*final merged* ``(out, lse)``.

Contract of every backend (layout ``[B, S, H, D]``, the flash-attn layout):

* ``forward(q, k, v, causal, scale) -> (out, lse)``: q ``[B, Sq, H, D]``, k/v
  ``[B, Sk, H_kv, D]`` with ``H % H_kv == 0`` (GQA); out ``[B, Sq, H, D]`` in q's dtype,
  lse ``[B, H, Sq]`` in fp32 (float64 for float64 inputs). ``causal`` is only used for
  diagonal blocks, where ``Sq == Sk`` and the mask is the plain lower triangle.
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` where ``out``
  and ``lse`` are the final values after merging every block of the row; then the
  result is exactly this block's contribution to the gradients. Gradients may come
  back in any float dtype; callers accumulate them in fp32.

Backends: ``cpu`` (torch's CPU flash kernel), ``cuda_flash`` and ``cuda_cudnn``
(torch's own CUDA kernels), ``cuda_efficient`` (torch's memory-efficient kernel, which
also covers fp32 on CUDA), ``flash_attn`` (the flash-attn package, when importable),
and ``math`` (a float64 reference for tests, any device).
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

aten = torch.ops.aten

ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionBackend:
    """One kernel family: how to run a block forward and backward, and where it applies."""

    name: str
    forward: ForwardFn
    backward: BackwardFn
    supports: Callable[[torch.device, torch.dtype, int], bool]  # (device, dtype, head_dim)
    available: Callable[[], bool]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _expand_kv(k: torch.Tensor, v: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Repeat KV heads for kernels without native GQA; returns the group size too."""
    group = num_heads // k.shape[2]
    if group == 1:
        return k, v, 1
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), group


def _fold_kv_grad(g: torch.Tensor, group: int) -> torch.Tensor:
    if group == 1:
        return g
    B, S, H, D = g.shape
    return g.view(B, S, H // group, group, D).sum(dim=3)


# ----------------------------------------------------------------------------- math (float64)

def _math_scores(q, k, causal, scale):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        Sq, Sk = s.shape[-2:]
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    qd, kd, vd = (t.to(torch.float64) for t in (q, k, v))
    kd, vd, _ = _expand_kv(kd, vd, q.shape[2])
    s = _math_scores(qd, kd, causal, scale)
    lse = torch.logsumexp(s, dim=-1)                      # [B, H, Sq]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    qd, kd, vd, od, dod = (t.to(torch.float64) for t in (q, k, v, out, dout))
    kd, vd, group = _expand_kv(kd, vd, q.shape[2])
    s = _math_scores(qd, kd, causal, scale)
    p = torch.exp(s - lse.to(torch.float64)[..., None])   # uses the *final* lse
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dod)
    dp = torch.einsum("bqhd,bkhd->bhqk", dod, vd)
    delta = (dod * od).sum(-1).transpose(1, 2)[..., None]  # [B, H, Sq, 1], from the *final* out
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qd) * scale
    return dq, _fold_kv_grad(dk, group), _fold_kv_grad(dv, group)


# ----------------------------------------------------------------------------- CPU (torch)

def _cpu_forward(q, k, v, causal, scale):
    k, v, _ = _expand_kv(k, v, q.shape[2])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, attn_mask=None, scale=scale)
    return _bhsd(out), lse


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    k, v, group = _expand_kv(k, v, q.shape[2])
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), 0.0, causal,
        attn_mask=None, scale=scale)
    return _bhsd(dq), _fold_kv_grad(_bhsd(dk), group), _fold_kv_grad(_bhsd(dv), group)


# ----------------------------------------------------------------------------- CUDA (torch)

def _cuda_flash_forward(q, k, v, causal, scale):
    k, v, _ = _expand_kv(k, v, q.shape[2])
    res = aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
    return _bhsd(res[0]), res[1]


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    k, v, group = _expand_kv(k, v, q.shape[2])
    Sq, Sk = q.shape[1], k.shape[1]
    # Dense batch: the forward's cumulative-length outputs are undefined tensors (None from
    # Python), and a defined one would select the varlen path. No dropout: the RNG state is unused.
    rng = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), None, None,
        Sq, Sk, 0.0, causal, rng, rng, scale=scale)
    return _bhsd(dq), _fold_kv_grad(_bhsd(dk), group), _fold_kv_grad(_bhsd(dv), group)


def _cuda_cudnn_forward(q, k, v, causal, scale):
    k, v, _ = _expand_kv(k, v, q.shape[2])
    res = aten._scaled_dot_product_cudnn_attention(_bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal,
                                                   False, scale=scale)
    lse = res[1]
    if lse.dim() == 4:  # some cuDNN versions return [B, H, Sq, 1]
        lse = lse.squeeze(-1)
    return _bhsd(res[0]), lse.float()


def _cuda_cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    k, v, group = _expand_kv(k, v, q.shape[2])
    Sq, Sk = q.shape[1], k.shape[1]
    rng = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.unsqueeze(-1).contiguous(), rng, rng,
        None, None, None, Sq, Sk, 0.0, causal, scale=scale)
    return _bhsd(dq), _fold_kv_grad(_bhsd(dk), group), _fold_kv_grad(_bhsd(dv), group)


def _cuda_efficient_forward(q, k, v, causal, scale):
    k, v, _ = _expand_kv(k, v, q.shape[2])
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(_bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0,
                                                                  causal, scale=scale)
    return _bhsd(out), lse[..., : q.shape[1]]  # lse may be padded along the query dim


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    k, v, group = _expand_kv(k, v, q.shape[2])
    seed = torch.zeros((), device=q.device, dtype=torch.int64)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), None, _bhsd(out), lse.contiguous(), seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale)
    return _bhsd(dq), _fold_kv_grad(_bhsd(dk), group), _fold_kv_grad(_bhsd(dv), group)


# ----------------------------------------------------------------------------- flash-attn (optional)

def _flash_attn_available() -> bool:
    try:
        import flash_attn.flash_attn_interface  # noqa: F401
    except Exception:
        return False
    return True


def _flash_attn_forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_func
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    # The private backward's signature changed across flash-attn releases: pass by name
    # and fill only the parameters this version has.
    from flash_attn import flash_attn_interface as fai
    fn = fai._flash_attn_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    values = dict(dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(), dq=dq, dk=dk,
                  dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1),
                  window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                  deterministic=False, rng_state=None)
    params = inspect.signature(fn).parameters
    fn(**{name: values[name] for name in params if name in values})
    return dq, dk, dv


# ----------------------------------------------------------------------------- registry

def _on(device_type: str, dtypes: tuple[torch.dtype, ...], max_head_dim: int = 1 << 30):
    return lambda device, dtype, head_dim: (device.type == device_type and dtype in dtypes
                                            and head_dim <= max_head_dim)


_HALF = (torch.float16, torch.bfloat16)
_ALWAYS = lambda: True  # noqa: E731

BACKENDS: dict[str, AttentionBackend] = {
    "flash_attn": AttentionBackend("flash_attn", _flash_attn_forward, _flash_attn_backward,
                                   _on("cuda", _HALF, 256), _flash_attn_available),
    "cuda_flash": AttentionBackend("cuda_flash", _cuda_flash_forward, _cuda_flash_backward,
                                   _on("cuda", _HALF, 256), torch.cuda.is_available),
    "cuda_cudnn": AttentionBackend("cuda_cudnn", _cuda_cudnn_forward, _cuda_cudnn_backward,
                                   _on("cuda", _HALF, 128), torch.cuda.is_available),
    "cuda_efficient": AttentionBackend("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward,
                                       _on("cuda", (torch.float32,) + _HALF), torch.cuda.is_available),
    "cpu": AttentionBackend("cpu", _cpu_forward, _cpu_backward,
                            _on("cpu", (torch.float32, torch.float64) + _HALF), _ALWAYS),
    "math": AttentionBackend("math", _math_forward, _math_backward, lambda *_: True, _ALWAYS),
}

# Preference order for automatic selection.
_AUTO_ORDER = ("flash_attn", "cuda_flash", "cuda_efficient", "cpu", "math")


_SELF_CHECKS: dict[tuple[str, str, torch.dtype, int], str | None] = {}
_CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-10}  # half precisions: 5e-2


def self_check(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Check ``backend`` once per (device, dtype, head_dim) against the float64 math kernel.

    Runs a GQA query block against a diagonal (causal) and an earlier (full) KV block,
    forward and the backward with the *merged* (out, lse), on random inputs. Catches
    kernels that fail on this build or GPU, and kernels whose lse is fake or whose
    backward ignores the lse it is given (both silently break the merge). Returns None
    when it passes, else what went wrong.
    """
    key = (backend.name, str(device), dtype, head_dim)
    if key in _SELF_CHECKS:
        return _SELF_CHECKS[key]
    g = torch.Generator().manual_seed(1234)
    C, scale = 64, head_dim ** -0.5
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
        for a, b in pairs:
            a, b = a.double(), b.double()
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
            if not err <= tol:  # also catches nan
                raise AssertionError(f"relative error {err:.2e} > {tol:.0e}")
        result = None
    except Exception as e:  # noqa: BLE001 -- any failure disqualifies the kernel
        result = f"{type(e).__name__}: {e}"
    _SELF_CHECKS[key] = result
    return result


def get_backend(name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """The backend called ``name``, or the best one for ``(device, dtype, head_dim)`` if None.

    Every backend passes :func:`self_check` before first use: automatic selection warns
    and moves on to the next candidate; a named backend that fails raises.
    Raises ``ValueError`` for an unknown name and ``RuntimeError`` when the named backend
    is not installed, cannot run on this device/dtype, or fails its self-check.
    """
    device = torch.device(device)
    if name is None:
        for candidate in _AUTO_ORDER:
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
        hint = "pip install flash-attn" if name == "flash_attn" else "a CUDA build of torch and a GPU"
        raise RuntimeError(f"attention backend {name!r} is not available here (needs {hint})")
    if not b.supports(device, dtype, head_dim):
        raise RuntimeError(f"attention backend {name!r} does not support device={device}, dtype={dtype}, "
                           f"head_dim={head_dim}; pick another backend or None (auto)")
    failure = self_check(b, device, dtype, head_dim)
    if failure is not None:
        raise RuntimeError(f"attention backend {name!r} failed its self-check on {device}, {dtype}, "
                           f"head_dim={head_dim}: {failure}; pick another backend or None (auto)")
    return b


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)

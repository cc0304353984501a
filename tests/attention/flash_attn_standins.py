"""Stand-ins for the flash-attn packages, with the exact private signatures of each release.

``install(monkeypatch, version)`` puts modules into ``sys.modules`` that look like:

* flash-attn 2.5.x / 2.6.x: ``flash_attn.flash_attn_interface._flash_attn_forward`` /
  ``_flash_attn_backward`` as plain functions (2.6 adds ``softcap``);
* flash-attn 2.7+: the same names as ``torch.library.custom_op`` s (``inspect.signature``
  sees ``(*args, **kwargs)``), ``window_size`` split in two, a 4-tuple forward;
* FlashAttention-3: top-level ``flash_attn_interface`` with keyword-defaulted custom ops.

Signatures follow Dao-AILab/flash-attention's ``flash_attn/flash_attn_interface.py`` at
those releases and ``hopper/flash_attn_interface.py``. The kernels are replaced by float64
reference math that honours the given (merged) ``out``/``lse`` in backward, like the real
ones, and they check what the real kernels require: fp16/bf16, head_dim a multiple of 8
(<= 256), ``H % H_kv == 0`` with *unexpanded* KV accepted, lse ``[B, H, Sq]`` fp32.
``CALLS`` records the k/v head counts each call received.
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import torch

CALLS: list[tuple[str, int, int]] = []  # (which, H of q, H_kv of k)


def _check(q, k, v):
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16"
    assert k.dtype == q.dtype and v.dtype == q.dtype
    assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, f"head_size {q.shape[-1]} must be a multiple of 8, <= 256"
    assert k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[-1] == k.shape[-1]
    assert q.shape[2] % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query"
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension"


def _scores(q, k, scale, causal):
    """float64 scores [B, H, Sq, Sk]; causal is bottom-right aligned, as in flash-attn 2.1+."""
    g = q.shape[2] // k.shape[2]
    qd, kd = q.double(), k.double().repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        Sq, Sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool).triu(Sk - Sq + 1), float("-inf"))
    return s


def _forward(q, k, v, scale, causal, which):
    _check(q, k, v)
    CALLS.append((which, q.shape[2], k.shape[2]))
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    g = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v.double().repeat_interleave(g, dim=2))
    return out.to(q.dtype), lse.float()


def _backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, which):
    _check(q, k, v)
    CALLS.append((which, q.shape[2], k.shape[2]))
    B, Sq, H, D = q.shape
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Sq) and lse.is_contiguous(), "softmax_lse layout"
    assert dout.shape == q.shape and out.shape == q.shape
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    g = H // k.shape[2]
    p = torch.exp(_scores(q, k, scale, causal) - lse.double()[..., None])     # from the given lse
    do, o = dout.double(), out.double()
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v.double().repeat_interleave(g, dim=2))
    ds = p * (dp - (do * o).sum(-1).transpose(1, 2)[..., None])               # from the given out
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, k.double().repeat_interleave(g, dim=2)) * scale)
    fold = lambda t: t.view(B, t.shape[1], H // g, g, D).sum(3)  # noqa: E731
    dk.copy_(fold(torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale))
    dv.copy_(fold(torch.einsum("bhqk,bqhd->bkhd", p, do)))
    return torch.empty(B, H, -(-Sq // 128) * 128, dtype=torch.float32)    # softmax_d, padded like the kernel's


def _no_extras(dropout_p, window, softcap=0.0, alibi_slopes=None):
    assert dropout_p == 0.0 and tuple(window) == (-1, -1) and softcap == 0.0 and alibi_slopes is None


# ----------------------------------------------------------------------------- 2.5.x

def _fwd_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    _no_extras(dropout_p, window_size, 0.0, alibi_slopes)
    out, lse = _forward(q, k, v, softmax_scale, causal, "2.5")
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def _bwd_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
            alibi_slopes, deterministic, rng_state=None):
    _no_extras(dropout_p, window_size, 0.0, alibi_slopes)
    sd = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, "2.5")
    return dq, dk, dv, sd


# ----------------------------------------------------------------------------- 2.6.x

def _fwd_26(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    _no_extras(dropout_p, window_size, softcap, alibi_slopes)
    out, lse = _forward(q, k, v, softmax_scale, causal, "2.6")
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def _bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, rng_state=None):
    _no_extras(dropout_p, window_size, softcap, alibi_slopes)
    sd = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, "2.6")
    return dq, dk, dv, sd


# ----------------------------------------------------------------------------- 2.7+ (custom ops)

@torch.library.custom_op("fpdt_standin_fa2::_flash_attn_forward", mutates_args=("q", "k", "v"), device_types=None)
def _fwd_27(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
            window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
            return_softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_extras(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes)
    out, lse = _forward(q, k, v, softmax_scale, causal, "2.7")
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("fpdt_standin_fa2::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types=None)
def _bwd_27(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
            dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
            rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _no_extras(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes)
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, "2.7")


# ----------------------------------------------------------------------------- FlashAttention-3

@torch.library.custom_op("fpdt_standin_fa3::_flash_attn_forward", mutates_args=(), device_types=None)
def _fwd_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: Optional[torch.Tensor] = None,
           v_new: Optional[torch.Tensor] = None, qv: Optional[torch.Tensor] = None,
           out_: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
           cu_seqlens_k: Optional[torch.Tensor] = None, cu_seqlens_k_new: Optional[torch.Tensor] = None,
           seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None,
           max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
           page_table: Optional[torch.Tensor] = None, kv_batch_idx: Optional[torch.Tensor] = None,
           leftpad_k: Optional[torch.Tensor] = None, rotary_cos: Optional[torch.Tensor] = None,
           rotary_sin: Optional[torch.Tensor] = None, seqlens_rotary: Optional[torch.Tensor] = None,
           q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
           v_descale: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
           window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
           rotary_interleaved: bool = True, scheduler_metadata: Optional[torch.Tensor] = None, num_splits: int = 1,
           pack_gqa: Optional[bool] = None, sm_margin: int = 0,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert k_new is None and cu_seqlens_q is None and page_table is None and out_ is None
    _no_extras(0.0, (window_size_left, window_size_right), softcap)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = _forward(q, k, v, scale, causal, "3")
    return out, lse, torch.empty(0), torch.empty(0)


@torch.library.custom_op("fpdt_standin_fa3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types=None)
def _bwd_3(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           softmax_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
           cu_seqlens_k: Optional[torch.Tensor] = None, sequed_q: Optional[torch.Tensor] = None,
           sequed_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
           max_seqlen_k: Optional[int] = None, dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None,
           dv: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, is_causal: bool = False,
           window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
           deterministic: bool = False, sm_margin: int = 0) -> torch.Tensor:
    assert cu_seqlens_q is None and sequed_q is None and max_seqlen_q is None
    assert dq is not None and dk is not None and dv is not None
    _no_extras(0.0, (window_size_left, window_size_right), softcap)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, scale, is_causal, "3")


_FUNCS = {"2.5": (_fwd_25, _bwd_25), "2.6": (_fwd_26, _bwd_26), "2.7": (_fwd_27, _bwd_27)}


def install(monkeypatch, version: str) -> None:
    """Make ``version`` (e.g. ``"2.6.3"``, ``"2.7.4.post1"``, or ``"fa3"``) the importable flash-attn."""
    CALLS.clear()
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    if version == "fa3":
        mod = types.ModuleType("flash_attn_interface")
        mod._flash_attn_forward, mod._flash_attn_backward = _fwd_3, _bwd_3
        monkeypatch.setitem(sys.modules, "flash_attn_interface", mod)
        return
    major, minor = (int(x) for x in version.split(".")[:2])
    api = "2.7" if (major, minor) >= (2, 7) else f"{major}.{minor}"
    fwd, bwd = _FUNCS.get(api, _FUNCS["2.5"])
    pkg, fai = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    fai._flash_attn_forward, fai._flash_attn_backward = fwd, bwd
    pkg.__version__, pkg.flash_attn_interface = version, fai
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fai)

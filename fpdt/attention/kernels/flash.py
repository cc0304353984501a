"""``flash_attn`` (flash-attn 2.5 and newer) and ``flash_attn3`` (FlashAttention-3's ``flash_attn_interface``).

Both take ``H_kv`` KV heads natively and return lse ``[B, H, Sq]`` fp32, which their backward
takes as it is; head dims not a multiple of 8 are zero-padded and sliced back (exact). The adapter
calls the private forward/backward (the public API has no backward from a merged ``(out, lse)``),
dispatching on the installed version: 2.5, 2.6, 2.7+ and FA3, whose signatures are those of the
stand-ins in ``tests/attention/test_kernels_flash_attn.py``; releases before 2.5 are refused.
"""

from __future__ import annotations

import re

import torch

from fpdt.attention.kernels.common import pad_head_dim

MIN_FLASH_ATTN = (2, 5)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``; None when the text does not start with a version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    return tuple(int(g or 0) for g in m.groups()) if m else None  # type: ignore[return-value]


def _fa2():
    """``(version, flash_attn_interface module)``; ``(None, None)`` when flash-attn does not import."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except Exception:  # noqa: BLE001 -- a broken build is as good as none
        return None, None
    return parse_version(getattr(flash_attn, "__version__", "")), flash_attn_interface


def fa2_api() -> str | None:
    """Which private API the installed flash-attn has: ``"2.5"``, ``"2.6"``, ``"2.7"`` or None."""
    version, fai = _fa2()
    if fai is None or version is None or version < MIN_FLASH_ATTN:
        return None
    return "2.7" if version >= (2, 7) else "2.6" if version >= (2, 6) else "2.5"


def fa2_available() -> bool:
    return fa2_api() is not None


def fa2_hint() -> str:
    version, fai = _fa2()
    if fai is None:
        return "pip install flash-attn, version 2.5 or newer"
    import flash_attn
    return (f"flash-attn >= {'.'.join(map(str, MIN_FLASH_ATTN))}; the installed one reports version "
            f"{getattr(flash_attn, '__version__', None)!r}: pip install -U flash-attn")


def fa2_forward(q, k, v, causal, scale):
    api, (_, fai) = fa2_api(), _fa2()
    D = q.shape[-1]
    q, k, v = (pad_head_dim(t, 8) for t in (q, k, v))
    if api == "2.7":
        out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
    elif api == "2.6":
        res = fai._flash_attn_forward(q, k, v, 0.0, scale, causal, (-1, -1), 0.0, None, False)
        out, lse = res[0], res[5]
    elif api == "2.5":
        res = fai._flash_attn_forward(q, k, v, 0.0, scale, causal, (-1, -1), None, False)
        out, lse = res[0], res[5]
    else:
        raise RuntimeError(f"flash-attn is not usable here (needs {fa2_hint()})")
    return out[..., :D], lse


def fa2_backward(dout, q, k, v, out, lse, causal, scale):
    api, (_, fai) = fa2_api(), _fa2()
    D = q.shape[-1]
    dout, q, k, v, out = (pad_head_dim(t, 8) for t in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    head = (dout, q, k, v, out, lse.contiguous(), dq, dk, dv, 0.0, scale, causal)
    if api == "2.7":
        fai._flash_attn_backward(*head, -1, -1, 0.0, None, False, None)
    elif api == "2.6":
        fai._flash_attn_backward(*head, (-1, -1), 0.0, None, False, None)
    elif api == "2.5":
        fai._flash_attn_backward(*head, (-1, -1), None, False, None)
    else:
        raise RuntimeError(f"flash-attn is not usable here (needs {fa2_hint()})")
    return dq[..., :D], dk[..., :D], dv[..., :D]


# ----------------------------------------------------------------------------- FlashAttention-3

def _fa3():
    try:
        import flash_attn_interface
    except Exception:  # noqa: BLE001
        return None
    ok = all(hasattr(flash_attn_interface, f) for f in ("_flash_attn_forward", "_flash_attn_backward"))
    return flash_attn_interface if ok else None


def fa3_available() -> bool:
    return _fa3() is not None


def fa3_hint() -> str:
    return "FlashAttention-3 (flash-attention's hopper/ package, imported as flash_attn_interface) and a Hopper GPU"


def fa3_forward(q, k, v, causal, scale):
    D = q.shape[-1]
    q, k, v = (pad_head_dim(t, 8) for t in (q, k, v))
    out, lse, *_ = _fa3()._flash_attn_forward(q, k, v, softmax_scale=scale, causal=causal)
    return out[..., :D], lse


def fa3_backward(dout, q, k, v, out, lse, causal, scale):
    D = q.shape[-1]
    dout, q, k, v, out = (pad_head_dim(t, 8) for t in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # positional up to causal: the dense call leaves the six varlen arguments None
    _fa3()._flash_attn_backward(dout, q, k, v, out, lse.contiguous(), None, None, None, None, None, None,
                                dq, dk, dv, scale, causal)
    return dq[..., :D], dk[..., :D], dv[..., :D]

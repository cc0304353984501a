"""The flash-attn adapters against stand-ins with each release's exact private signatures.

flash-attn is a CUDA-only build, so these run the adapter code paths on the CPU with the
stand-ins of :mod:`tests.attention.flash_attn_standins` (reference math, real signatures,
2.7+'s ``custom_op`` s included). Parity is against the float64 reference of
:mod:`tests.attention.reference`; the flash kernels take bf16/fp16, so tolerances are
the bf16 ones (2e-2).
"""

import dataclasses
import inspect
import sys

import pytest
import torch

from fpdt.attention import fpdt_attention
from fpdt.attention import kernels
from fpdt.attention.kernels import BACKENDS, get_backend, self_check
from fpdt.attention.kernels.flash import fa2_api, parse_version
from fpdt.attention.merge import OnlineSoftmax
from tests.attention import flash_attn_standins as standins
from tests.attention.reference import assert_rel_close, reference_attention, reference_lse

VERSIONS = ["2.5.9.post1", "2.6.3", "2.7.0", "2.7.4.post1", "2.8.3", "fa3"]
TOL = 2e-2


def _backend(version):
    return BACKENDS["flash_attn3" if version == "fa3" else "flash_attn"]


@pytest.fixture(autouse=True)
def fresh_self_checks(monkeypatch):
    monkeypatch.setattr(kernels, "_SELF_CHECKS", {})


def test_parse_version():
    assert parse_version("2.7.4.post1") == (2, 7, 4)
    assert parse_version("2.10.0") == (2, 10, 0) > parse_version("2.9.9")  # "2.10" < "2.9" as strings
    assert parse_version("2.6") == (2, 6, 0)
    assert parse_version("unknown") is None


@pytest.mark.parametrize("version,api", [("2.5.0", "2.5"), ("2.5.9.post1", "2.5"), ("2.6.3", "2.6"),
                                         ("2.7.0", "2.7"), ("2.10.1", "2.7"), ("2.4.2", None)])
def test_api_dispatch_on_parsed_version(monkeypatch, version, api):
    standins.install(monkeypatch, version)
    assert fa2_api() == api


def test_custom_op_signature_is_opaque(monkeypatch):
    """The 2.7+ stand-in reproduces what broke the old adapter: no named parameters to inspect."""
    standins.install(monkeypatch, "2.7.4.post1")
    from flash_attn import flash_attn_interface as fai
    assert list(inspect.signature(fai._flash_attn_backward).parameters) == ["args", "kwargs"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 36)])  # 36: padded to 40
def test_passes_self_check(monkeypatch, version, dtype, head_dim):
    standins.install(monkeypatch, version)
    assert self_check(_backend(version), torch.device("cpu"), dtype, head_dim) is None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("h_kv", [1, 2, 6])
def test_two_blocks_native_gqa_parity(monkeypatch, version, h_kv):
    """[earlier block | diagonal block] merged, then each block's backward from the merged
    (out, lse): matches full attention; KV reaches the kernel unexpanded."""
    standins.install(monkeypatch, version)
    be = _backend(version)
    torch.manual_seed(3)
    B, C, H, D = 2, 24, 6, 20
    q = torch.randn(B, C, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, 2 * C, h_kv, D, dtype=torch.bfloat16) for _ in range(2))
    qf = torch.cat([torch.zeros_like(q), q], 1).double().requires_grad_()
    kf, vf = k.double().requires_grad_(), v.double().requires_grad_()
    ref = reference_attention(qf, kf, vf)[:, C:]
    g = torch.randn_like(ref)
    ref.backward(g)
    scale = D ** -0.5

    acc = OnlineSoftmax(torch.float32)
    out1, lse1 = be.forward(q, k[:, C:], v[:, C:], True, scale)
    assert out1.shape == q.shape and lse1.shape == (B, H, C) and lse1.dtype == torch.float32
    assert_rel_close(lse1, reference_lse(q, k[:, C:]), TOL, "diagonal block lse")
    acc.update(out1, lse1)
    acc.update(*be.forward(q, k[:, :C], v[:, :C], False, scale))
    out, lse = acc.out.to(q.dtype), acc.lse
    assert_rel_close(out, ref, TOL, "merged out")
    gb = g.to(q.dtype)
    dq1, dk1, dv1 = be.backward(gb, q, k[:, C:], v[:, C:], out, lse, True, scale)
    dq0, dk0, dv0 = be.backward(gb, q, k[:, :C], v[:, :C], out, lse, False, scale)
    assert dk1.shape == (B, C, h_kv, D) and dq1.shape == q.shape
    assert_rel_close(dq0.double() + dq1.double(), qf.grad[:, C:], TOL, "dq")
    assert_rel_close(torch.cat([dk0, dk1], 1), kf.grad, TOL, "dk")
    assert_rel_close(torch.cat([dv0, dv1], 1), vf.grad, TOL, "dv")
    assert standins.CALLS and all(h_k == h_kv for _, _, h_k in standins.CALLS)  # native: never expanded


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4.post1", "fa3"])
def test_pipeline_parity_through_standin(monkeypatch, version):
    """fpdt_attention end to end (4 chunks, GQA 6:2, head_dim 24) on the stand-in kernel."""
    standins.install(monkeypatch, version)
    name = _backend(version).name
    # the stand-ins run on the CPU; the real kernels are CUDA-only
    monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], supports=lambda *_: True))
    torch.manual_seed(4)
    q = torch.randn(1, 64, 6, 24, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 64, 2, 24, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = fpdt_attention(q, k, v, num_chunks=4, backend=name)
    g = torch.randn_like(out)
    out.backward(g)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr)
    ref.backward(g.double())
    for what, a, b in (("out", out, ref), ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad)):
        assert_rel_close(a, b, TOL, f"{what} {version}")
    assert all(h_k == 2 for _, _, h_k in standins.CALLS)


def test_too_old_or_missing_flash_attn_is_refused_with_the_fix(monkeypatch):
    cuda = torch.device("cuda")
    standins.install(monkeypatch, "2.4.2")
    assert not BACKENDS["flash_attn"].available()
    with pytest.raises(RuntimeError,
                       match=r"'flash_attn' is not available.*flash-attn >= 2\.5.*'2\.4\.2'.*pip install -U"):
        get_backend("flash_attn", cuda, torch.bfloat16, 64)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    with pytest.raises(RuntimeError, match="'flash_attn' is not available.*pip install flash-attn"):
        get_backend("flash_attn", cuda, torch.bfloat16, 64)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    with pytest.raises(RuntimeError, match="'flash_attn3' is not available.*FlashAttention-3"):
        get_backend("flash_attn3", cuda, torch.bfloat16, 64)

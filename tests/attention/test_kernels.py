import pytest
import torch

from fpdt.attention.kernels import BACKENDS, get_backend
from fpdt.attention.merge import OnlineSoftmax, merge
from tests.attention.reference import assert_rel_close, reference_attention, reference_lse

CPU_BACKENDS = ["cpu", "math"]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_kv", [1, 3, 6])
def test_block_forward_matches_reference(name, causal, h_kv):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 12, 6, 40), torch.randn(2, 12, h_kv, 40), torch.randn(2, 12, h_kv, 40)
    out, lse = BACKENDS[name].forward(q, k, v, causal, 40 ** -0.5)
    assert lse.dtype == torch.float32 and lse.shape == (2, 6, 12)
    assert_rel_close(out, reference_attention(q, k, v, causal), 1e-5, "out")
    assert_rel_close(lse, reference_lse(q, k, causal), 1e-5, "lse")


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_two_blocks_merge_and_backward_with_final_lse(name):
    """A causal row split into [earlier block | diagonal block]: merged forward and the
    per-block backward (given the final out/lse) add up to full attention's."""
    torch.manual_seed(2)
    B, C, H, H_kv, D = 2, 8, 4, 2, 16
    q = torch.randn(B, C, H, D, dtype=torch.float64)
    k = torch.randn(B, 2 * C, H_kv, D, dtype=torch.float64)
    v = torch.randn(B, 2 * C, H_kv, D, dtype=torch.float64)
    be, scale = BACKENDS[name], D ** -0.5
    # reference: queries are the second chunk of a 2C causal sequence
    qf = torch.cat([torch.zeros_like(q), q], 1).requires_grad_()
    kf, vf = k.clone().requires_grad_(), v.clone().requires_grad_()
    ref = reference_attention(qf, kf, vf)[:, C:]
    g = torch.randn_like(ref)
    ref.backward(g)

    acc = OnlineSoftmax(torch.float64)
    acc.update(*be.forward(q, k[:, C:], v[:, C:], True, scale))
    acc.update(*be.forward(q, k[:, :C], v[:, :C], False, scale))
    assert_rel_close(acc.out, ref, 1e-10, "merged out")
    dq1, dk1, dv1 = be.backward(g, q, k[:, C:], v[:, C:], acc.out, acc.lse, True, scale)
    dq0, dk0, dv0 = be.backward(g, q, k[:, :C], v[:, :C], acc.out, acc.lse, False, scale)
    assert_rel_close(dq0 + dq1, qf.grad[:, C:], 1e-10, "dq")
    assert_rel_close(torch.cat([dk0, dk1], 1), kf.grad, 1e-10, "dk")
    assert_rel_close(torch.cat([dv0, dv1], 1), vf.grad, 1e-10, "dv")


def test_merge_never_makes_nan():
    out = torch.randn(1, 3, 2, 4)
    lse = torch.tensor([[[0.5, float("-inf"), float("-inf")], [1.0, float("-inf"), 2.0]]])
    other_lse = torch.tensor([[[float("-inf"), float("-inf"), 0.0], [1.0, 3.0, float("-inf")]]])
    merged_out, merged_lse = merge(out, lse, out * 2, other_lse)
    assert torch.isfinite(merged_out).all()
    assert merged_lse[0, 0, 1] == float("-inf")          # both sides empty stays empty
    assert merged_lse[0, 0, 0] == 0.5 and merged_lse[0, 1, 1] == 3.0
    # out is [B, S, H, D], lse [B, H, S]
    torch.testing.assert_close(merged_out[0, 0, 0], out[0, 0, 0])      # (s=0, h=0): only side a had mass
    torch.testing.assert_close(merged_out[0, 1, 1], 2 * out[0, 1, 1])  # (s=1, h=1): only side b had mass
    assert (merged_out[0, 1, 0] == 0).all()                            # (s=1, h=0): both empty -> 0, not nan
    torch.testing.assert_close(merged_out[0, 0, 1], 1.5 * out[0, 0, 1])  # (s=0, h=1): equal mass on both
    torch.testing.assert_close(merged_lse[0, 1, 0], torch.tensor(1.0 + 0.6931471805599453))


def test_backend_selection_and_errors():
    assert get_backend(None, torch.device("cpu"), torch.float32, 64).name == "cpu"
    assert get_backend("math", torch.device("cpu"), torch.bfloat16, 64).name == "math"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*choose one of"):
        get_backend("nope", torch.device("cpu"), torch.float32, 64)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'cuda_flash' is not available"):
            get_backend("cuda_flash", torch.device("cpu"), torch.float16, 64)
    with pytest.raises(RuntimeError, match="'cpu' does not support device=meta"):
        get_backend("cpu", torch.device("meta"), torch.float32, 64)


def _fake_lse_forward(q, k, v, causal, scale):
    out, lse = BACKENDS["cpu"].forward(q, k, v, causal, scale)
    return out, torch.zeros_like(lse)  # a kernel that returns a fake lse silently breaks the merge


def test_self_check_rejects_a_kernel_with_a_fake_lse(monkeypatch):
    from fpdt.attention import kernels

    broken = kernels.AttentionBackend("broken", _fake_lse_forward, BACKENDS["cpu"].backward,
                                      BACKENDS["cpu"].supports, lambda: True)
    monkeypatch.setitem(kernels.BACKENDS, "broken", broken)
    monkeypatch.setattr(kernels, "_AUTO_ORDER", ("broken",) + kernels._AUTO_ORDER)
    with pytest.warns(RuntimeWarning, match="'broken' failed its self-check.*relative error"):
        assert get_backend(None, torch.device("cpu"), torch.float32, 24).name == "cpu"
    with pytest.raises(RuntimeError, match="'broken' failed its self-check"):
        get_backend("broken", torch.device("cpu"), torch.float32, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_backend_passes_self_check(dtype):
    from fpdt.attention.kernels import self_check

    assert self_check(BACKENDS["cpu"], torch.device("cpu"), dtype, 40) is None


def test_cpu_path_expands_kv_and_sums_replica_grads_in_fp32():
    """The CPU kernel takes equal head counts: KV is expanded, and the G replica gradients
    of each KV head come back summed in fp32 (not rounded to bf16 first)."""
    assert not BACKENDS["cpu"].native_gqa and not BACKENDS["math"].native_gqa
    torch.manual_seed(5)
    q = torch.randn(1, 16, 6, 24, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 16, 2, 24, dtype=torch.bfloat16) for _ in range(2))
    be = BACKENDS["cpu"]
    out, lse = be.forward(q, k, v, True, 24 ** -0.5)
    dout = torch.randn_like(out)
    dq, dk, dv = be.backward(dout, q, k, v, out, lse, True, 24 ** -0.5)
    assert dk.shape == k.shape and dk.dtype == dv.dtype == torch.float32
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    reference_attention(qr, kr, vr).backward(dout.double())
    for name, a, b in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert_rel_close(a, b, 2e-2, name)


def test_auto_order_takes_cudnn_where_it_passes_the_self_check(monkeypatch):
    """cuDNN sits after torch's flash kernel and before the efficient one; a cuDNN that fails
    its self-check is skipped with a warning. CPU kernels stand in for the CUDA ones."""
    from dataclasses import replace

    from fpdt.attention import kernels

    order = kernels._AUTO_ORDER
    assert order.index("cuda_flash") < order.index("cuda_cudnn") < order.index("cuda_efficient")
    monkeypatch.setattr(kernels, "_SELF_CHECKS", {})
    for name in ("flash_attn3", "flash_attn", "cuda_flash"):
        monkeypatch.setitem(kernels.BACKENDS, name, replace(BACKENDS[name], available=lambda: False))
    cpu = BACKENDS["cpu"]
    for name in ("cuda_cudnn", "cuda_efficient"):
        monkeypatch.setitem(kernels.BACKENDS, name, replace(BACKENDS[name], forward=cpu.forward, backward=cpu.backward,
                                                            supports=lambda *_: True, available=lambda: True))
    assert get_backend(None, torch.device("cpu"), torch.float32, 32).name == "cuda_cudnn"
    monkeypatch.setattr(kernels, "_SELF_CHECKS", {})
    monkeypatch.setitem(kernels.BACKENDS, "cuda_cudnn", replace(kernels.BACKENDS["cuda_cudnn"],
                                                                forward=_fake_lse_forward))
    with pytest.warns(RuntimeWarning, match="'cuda_cudnn' failed its self-check"):
        assert get_backend(None, torch.device("cpu"), torch.float32, 32).name == "cuda_efficient"


def test_auto_order_follows_torchs_sdpa_where_it_prefers_cudnn(monkeypatch):
    """Where torch's SDPA dispatcher would run cuDNN (Hopper/Blackwell, recent torch and
    cuDNN), cuda_cudnn comes right after flash_attn3, ahead of the FlashAttention-2 kernels;
    elsewhere, and on any non-CUDA device (where torch is not asked), the fixed order holds."""
    from fpdt.attention import kernels
    from fpdt.attention.kernels import torch_cuda

    asked = []

    def choice(answer):
        def sdpa_choice(device, dtype, heads, kv_heads, head_dim, causal=True):
            asked.append((device.type, dtype, heads, kv_heads, head_dim))
            return answer
        return sdpa_choice

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch_cuda, "sdpa_choice", choice("cudnn"))
    order = kernels.auto_order(cuda, torch.bfloat16, 128)
    assert order[:3] == ("flash_attn3", "cuda_cudnn", "flash_attn")
    assert sorted(order) == sorted(kernels._AUTO_ORDER)
    assert asked[-1] == ("cuda", torch.bfloat16, 8, 2, 128)          # a GQA probe, as Llama-3 calls it
    assert kernels.auto_order(torch.device("cpu"), torch.float32, 64) == kernels._AUTO_ORDER
    assert len(asked) == 1
    for answer in ("flash", "efficient", "math", None):
        monkeypatch.setattr(torch_cuda, "sdpa_choice", choice(answer))
        assert kernels.auto_order(cuda, torch.bfloat16, 128) == kernels._AUTO_ORDER


def test_get_backend_tries_auto_order(monkeypatch):
    """Automatic selection walks auto_order(), not the fixed tuple: the first candidate that
    is available, supports the inputs and passes its self-check wins."""
    from dataclasses import replace

    from fpdt.attention import kernels

    monkeypatch.setattr(kernels, "_SELF_CHECKS", {})
    cpu = BACKENDS["cpu"]
    monkeypatch.setitem(kernels.BACKENDS, "cuda_cudnn", replace(BACKENDS["cuda_cudnn"], forward=cpu.forward,
                                                                backward=cpu.backward, supports=lambda *_: True,
                                                                available=lambda: True))
    monkeypatch.setattr(kernels, "auto_order", lambda *a, **k: ("flash_attn3", "cuda_cudnn", "cpu", "math"))
    monkeypatch.setitem(kernels.BACKENDS, "flash_attn3", replace(BACKENDS["flash_attn3"], available=lambda: False))
    assert get_backend(None, torch.device("cpu"), torch.float32, 32).name == "cuda_cudnn"


def test_sdpa_choice_is_torchs_dispatch(monkeypatch):
    """sdpa_choice asks torch's dispatcher, on the given device, for the same call Hugging
    Face's SDPA attention makes (GQA via enable_gqa, no mask, inputs that require grad)."""
    from torch.nn.attention import SDPBackend

    from fpdt.attention.kernels import torch_cuda

    names = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.MATH: "math", SDPBackend.EFFICIENT_ATTENTION: "efficient",
             SDPBackend.CUDNN_ATTENTION: "cudnn"}
    for dtype, heads, kv_heads, head_dim in ((torch.float32, 8, 2, 64), (torch.bfloat16, 6, 6, 40),
                                             (torch.float64, 3, 1, 16)):
        q = torch.zeros(1, heads, 128, head_dim, dtype=dtype, requires_grad=True)
        k = torch.zeros(1, kv_heads, 128, head_dim, dtype=dtype, requires_grad=True)
        want = names[SDPBackend(torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=heads != kv_heads))]
        assert torch_cuda.sdpa_choice(torch.device("cpu"), dtype, heads, kv_heads, head_dim) == want


    def no_answer(*args, **kwargs):
        raise RuntimeError("this torch cannot say")
    monkeypatch.setattr(torch, "_fused_sdp_choice", no_answer)
    assert torch_cuda.sdpa_choice(torch.device("cpu"), torch.float32, 5, 5, 24) is None    # not cached before
    monkeypatch.undo()                                                                    # a failure is not cached
    assert torch_cuda.sdpa_choice(torch.device("cpu"), torch.float32, 5, 5, 24) is not None
    with torch.no_grad():   # the probe is a training call whatever the caller's grad mode
        assert torch_cuda.sdpa_choice(torch.device("cpu"), torch.float64, 2, 1, 8, causal=False) == names[
            SDPBackend(torch._fused_sdp_choice(*(torch.zeros(1, h, 128, 8, dtype=torch.float64, requires_grad=True)
                                                 for h in (2, 1, 1)), enable_gqa=True))]

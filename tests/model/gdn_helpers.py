"""Shared set-up for the Gated DeltaNet tests: a tiny layer, Transformers' reference on the same
weights, and the comparison (importable by spawned ranks)."""

from __future__ import annotations

import torch

from fpdt.model.gated_deltanet import GatedDeltaNet

HIDDEN = 24
SHAPES = {"gva": (2, 4, 8, 6), "equal": (3, 3, 8, 5)}     # (Hk, HV, dk, dv)


def hf_layer(shape, seed: int = 0):
    """Transformers' ``Qwen3_5GatedDeltaNet`` (its PyTorch fallback) with random weights."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    hk, hv, dk, dv = shape
    config = Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_key_heads=hk, linear_num_value_heads=hv,
                               linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4,
                               num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():          # weights of every scale, norm weights away from 1
        for p in layer.parameters():
            if p is not layer.A_log:
                p.copy_(torch.randn(p.shape) * (0.2 if p.dim() > 1 else 0.5))
        layer.norm.weight.mul_(0.5).add_(1.0)
    return config, layer


def fpdt_layer(config, reference) -> GatedDeltaNet:
    layer = GatedDeltaNet.from_config(config)
    layer.load_state_dict(reference.state_dict())
    return layer


def reference_run(reference, x, dout, doc_ids=None):
    """Output and gradients (input first, then parameters by name) of Transformers' layer; with
    ``doc_ids`` each document of each row runs alone (the packed result must equal this)."""
    reference.zero_grad()
    x = x.detach().clone().requires_grad_()
    if doc_ids is None:
        out = reference(x)
    else:
        rows = []
        for b in range(x.shape[0]):
            ids = doc_ids[b]
            cuts = [0] + [t for t in range(1, ids.numel()) if ids[t] != ids[t - 1]] + [ids.numel()]
            rows.append(torch.cat([reference(x[b:b + 1, s:e]) for s, e in zip(cuts, cuts[1:])], 1))
        out = torch.cat(rows, 0)
    out.backward(dout)
    return out.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in reference.named_parameters()}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def fpdt_run(layer, x, dout, doc_ids=None, reduce=None):
    """Output and gradients of an fpdt layer (``x``/``dout``: this rank's shard); ``reduce(name,
    grad)`` sums a parameter gradient over the ranks (None: one rank)."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = layer(x, doc_ids=doc_ids)
    out.backward(dout)
    grads = {n: p.grad.clone() if reduce is None else reduce(p.grad.clone()) for n, p in layer.named_parameters()}
    return out.detach(), {"x": x.grad, **grads}


def check_against_references(run32, run64, reference, x, dout, doc_ids=None, where="", gather=None):
    """The layer (``run32`` / ``run64``: its fp32 / float64 output and gradients on ``x``, ``dout``
    (global), ``gather`` turning its results global) against :func:`float64_run`: float64 within
    1e-12; fp32 within 1e-5, or, where the problem's own conditioning is worse, no worse than twice
    Transformers' fp32 layer's error (``reference``, each document alone), itself checked < 1e-4."""
    gather = gather or (lambda r: r)
    exact = float64_run(reference, x, dout, doc_ids)
    hf_out, hf_grads = reference_run(reference, x, dout, doc_ids)
    want = {"out": exact[0], **exact[1]}
    hf = {"out": hf_out, **hf_grads}
    o64, g64 = gather(run64())
    o32, g32 = gather(run32())
    ours64, ours32 = {"out": o64, **g64}, {"out": o32, **g32}
    bad = {}
    for k in want:
        hf_err = rel(hf[k], want[k])
        assert hf_err < 1e-4, f"{where}: Transformers' fp32 {k} off the float64 reference by {hf_err:.2e}"
        if rel(ours64[k], want[k]) > 1e-12:
            bad[f"{k} (float64)"] = rel(ours64[k], want[k])
        if rel(ours32[k], want[k]) > max(1e-5, 2 * hf_err):
            bad[f"{k} (fp32; Transformers' {hf_err:.1e})"] = rel(ours32[k], want[k])
    assert not bad, f"{where}: relative errors against float64: {bad}"


def float64_run(reference, x, dout, doc_ids=None):
    """The float64 reference: Transformers' layer's weights, its math written out plainly (conv, L2
    norms, gates, the token-by-token rule, gated norm), each document alone; output and gradients
    as :func:`reference_run`."""
    from tests.ops.test_delta_rule import token_recurrence
    params = {n: p.detach().double().requires_grad_() for n, p in reference.named_parameters()}
    hk, hv = reference.num_k_heads, reference.num_v_heads
    dk, dv, K = reference.head_k_dim, reference.head_v_dim, reference.conv_kernel_size
    x = x.detach().double().requires_grad_()

    def one(xs):                                   # [1, T, hidden], one document
        T = xs.shape[1]
        mixed = xs @ params["in_proj_qkv.weight"].t()
        conv = torch.nn.functional.conv1d(mixed.transpose(1, 2), params["conv1d.weight"], padding=K - 1,
                                          groups=mixed.shape[-1])[..., :T]
        q, k, v = torch.nn.functional.silu(conv).transpose(1, 2).split([hk * dk, hk * dk, hv * dv], -1)

        def unit(t):
            t = t.reshape(1, T, hk, dk).repeat_interleave(hv // hk, 2)
            return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(xs @ params["in_proj_b.weight"].t())
        g = -params["A_log"].exp() * torch.nn.functional.softplus(xs @ params["in_proj_a.weight"].t() + params["dt_bias"])
        o, _ = token_recurrence(unit(q), unit(k), v.reshape(1, T, hv, dv), g, beta, None, dk ** -0.5)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + reference.layer_norm_epsilon) * params["norm.weight"]
        o = o * torch.nn.functional.silu((xs @ params["in_proj_z.weight"].t()).reshape(1, T, hv, dv))
        return o.flatten(2) @ params["out_proj.weight"].t()

    rows = []
    for b in range(x.shape[0]):
        ids = None if doc_ids is None else doc_ids[b]
        cuts = [0] + ([] if ids is None else [t for t in range(1, ids.numel()) if ids[t] != ids[t - 1]]) + [x.shape[1]]
        rows.append(torch.cat([one(x[b:b + 1, s:e]) for s, e in zip(cuts, cuts[1:])], 1))
    out = torch.cat(rows, 0)
    out.backward(dout.double())
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in params.items()}}

"""Tiny Qwen3.5 models (Gated DeltaNet + gated attention) for the hybrid tests, Transformers the reference.

Transformers runs its PyTorch fallbacks here (no fla, no causal-conv1d). The gradients of the
Gated DeltaNet gate parameters (``A_log``, ``dt_bias``, ``in_proj_a``) are sums over every token with
cancellation: rounding the weights to fp32 (a relative 6e-8 perturbation) and computing exactly in
float64 moves them by up to 6.7e-5 of their largest element (measured on ``"qwen35"``, three seeds),
and Transformers' own fp32 run lands 0.4-5e-5 from float64. No fp32 computation can be within 1e-5
of float64 there, so the hybrid tests compare fp32 against a float64 Transformers run: each tensor
within ``TOL``, or within twice the larger of Transformers' own fp32 error and that sensitivity,
measured per tensor on the same inputs (:func:`reference`, :func:`compare_hybrid`)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import transformers

import fpdt.model as fm
from tests.model.helpers import TOL, rel_err

L, A = "linear_attention", "full_attention"

# name -> Qwen3_5TextConfig kwargs. GDN Hk=2 HV=4 (sp 1, 2); "qwen35_sp4": heads that divide by 4 ranks.
QWEN35 = {
    "qwen35": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=8, partial_rotary_factor=0.25, layer_types=[L, L, L, A]),
    "qwen35_sp4": dict(hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                       linear_value_head_dim=8, partial_rotary_factor=0.5, layer_types=[L, A, L, A],
                       tie_word_embeddings=True),
}
_COMMON = dict(vocab_size=256, num_hidden_layers=4, max_position_embeddings=512, linear_conv_kernel_dim=4,
               attn_implementation="eager", initializer_range=0.05, rms_norm_eps=1e-6)


def qwen35_config(name: str = "qwen35", **changes) -> transformers.Qwen3_5TextConfig:
    return transformers.Qwen3_5TextConfig(**{**_COMMON, **QWEN35[name], **changes})


def qwen35_model(name: str = "qwen35", seed: int = 0, **changes) -> transformers.Qwen3_5ForCausalLM:
    """The fp32 Transformers model with seeded weights; norms, ``A_log`` and ``dt_bias`` perturbed so
    that their gradients are tested off the init."""
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(qwen35_config(name, **changes)).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "A_log")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def fpdt_qwen35(ref, **options) -> fm.FPDTForCausalLM:
    ours = fm.from_config(ref.config, **options)
    fm.load_hf_state_dict(ours, ref.state_dict())
    return ours


def reference(ref, ids, labels, rows=None):
    """``(fp32, float64, sensitivity)`` of Transformers: the first two ``(loss, {name: grad})``, the
    window as one sequence or with ``rows`` (document lengths per row) every document run alone; the
    last ``{name: error}``, the largest relative change of the float64 result over two runs with the
    weights perturbed by fp32's rounding (relative 6e-8)."""
    fp32 = _loss_and_grads(copy.deepcopy(ref).float(), ids, labels, rows)
    exact = _loss_and_grads(copy.deepcopy(ref).double(), ids, labels, rows)
    sensitivity = {n: 0.0 for n in ["loss", *exact[1]]}
    for seed in (0, 1):
        model = copy.deepcopy(ref).double()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 6e-8 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        loss, grads = _loss_and_grads(model, ids, labels, rows)
        sensitivity["loss"] = max(sensitivity["loss"], rel_err(loss, exact[0]))
        for n, grad in grads.items():
            sensitivity[n] = max(sensitivity[n], rel_err(grad, exact[1][n]))
    return fp32, exact, sensitivity


def _loss_and_grads(model, ids, labels, rows):
    if rows is None:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    else:
        losses, count = [], 0
        for b, lengths in enumerate(rows):
            start = 0
            for n in lengths:
                doc, target = ids[b:b + 1, start:start + n], labels[b, start + 1:start + n]
                start += n
                if n == 1:
                    continue
                logits = model(input_ids=doc, use_cache=False).logits[0, :-1]
                losses.append(F.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
                count += int((target != -100).sum())
        loss = torch.stack(losses).sum() / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def compare_hybrid(loss, grads: dict, refs, what: str) -> dict:
    """fp32 ``loss`` / ``grads`` against the float64 reference of :func:`reference`: within ``TOL``, or
    twice the larger of Transformers' own fp32 error and the sensitivity on that tensor; returns
    ``{name: (ours, yardstick)}``."""
    (loss32, grads32), (loss64, grads64), sensitivity = refs
    assert set(grads) == set(grads64), f"{what}: parameter sets differ: {set(grads) ^ set(grads64)}"
    errs = {"loss": (rel_err(loss, loss64), max(rel_err(loss32, loss64), sensitivity["loss"]))}
    errs.update({n: (rel_err(g, grads64[n]), max(rel_err(grads32[n], grads64[n]), sensitivity[n]))
                 for n, g in grads.items()})
    bad = {n: e for n, e in errs.items() if not e[0] <= max(TOL, 2 * e[1])}
    assert not bad, f"{what}: (ours, yardstick) errors against float64 beyond the tolerance: {bad}"
    return errs

"""Tiny Qwen3.5 models (Gated DeltaNet + gated attention) for the hybrid tests, Transformers the reference.

Transformers runs its PyTorch fallbacks here (no fla, no causal-conv1d). The gradients of the
Gated DeltaNet gate parameters (``A_log``, ``dt_bias``, ``in_proj_a``) are sums over every token with
cancellation: Transformers' own fp32 run lands up to 6e-4 from float64 on them (``"qwen35"``, 8
tokens; fpdt's 5.9e-4 there), so no fp32 computation is within 1e-5 of float64 on those tensors. The
hybrid tests compare fp32 against a float64 Transformers run with a float64 delta rule: each tensor
within ``TOL``, or no worse than twice Transformers' own fp32 error on it (:func:`reference`,
:func:`compare_hybrid`), the criterion of the Gated DeltaNet tests (``tests/model/gdn_helpers.py``);
tensors of fewer than 64 elements by the chance ratio of :func:`error_factor`."""

from __future__ import annotations

import contextlib
import copy
import sys

import torch
import torch.nn.functional as F
import transformers

import fpdt.model as fm
from fpdt.bench.parity import chance_ratio
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


def reference(ref, ids, labels, rows=None, scale: float = 1.0):
    """``(fp32, float64)`` Transformers results, each ``(loss, {name: grad})``: the window as one
    sequence, or with ``rows`` (document lengths per row) every document run alone. The float64 run's
    delta rule is the float64 token recurrence (Transformers' fallback computes it in fp32 whatever
    its input dtype). ``scale``: the gradients are those of ``loss * scale``, divided by ``scale``
    (the rounding of a backward whose incoming gradient is not 1)."""
    fp32 = _loss_and_grads(copy.deepcopy(ref).float(), ids, labels, rows, scale)
    with float64_delta_rule():
        exact = _loss_and_grads(copy.deepcopy(ref).double(), ids, labels, rows, scale)
    return fp32, exact


@contextlib.contextmanager
def float64_delta_rule():
    """Transformers' Qwen3.5 chunked delta rule replaced, for float64 inputs, by the float64
    token-by-token recurrence of ``tests/ops/test_delta_rule.py`` (same L2 norms, scale and head repeat)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    from tests.ops.test_delta_rule import token_recurrence

    modules = (mq, modeling_qwen3_5_moe, modeling_qwen3_next)     # the same fallback in each family
    original = mq.torch_chunk_gated_delta_rule

    def exact(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
        if query.dtype != torch.float64:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        if use_qk_l2norm_in_kernel:
            query, key = mq.l2norm(query), mq.l2norm(key)
        repeat = value.shape[2] // key.shape[2]
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        out, state = token_recurrence(query, key, value, g, beta, initial_state, query.shape[-1] ** -0.5)
        return out, state if output_final_state else None

    originals = [m.torch_chunk_gated_delta_rule for m in modules]
    for m in modules:
        m.torch_chunk_gated_delta_rule = exact
    try:
        yield
    finally:
        for m, f in zip(modules, originals):
            m.torch_chunk_gated_delta_rule = f


def _loss_and_grads(model, ids, labels, rows, scale: float = 1.0):
    if rows is None:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    else:
        losses, count, routed = [], 0, []
        moe = bool(getattr(model.config, "output_router_logits", False))
        for b, lengths in enumerate(rows):
            start = 0
            for n in lengths:
                doc, target = ids[b:b + 1, start:start + n], labels[b, start + 1:start + n]
                start += n
                if n == 1 and not moe:
                    continue
                out = model(input_ids=doc, use_cache=False, **({"output_router_logits": True} if moe else {}))
                routed.append(out.router_logits if moe else ())
                if n > 1:
                    losses.append(F.cross_entropy(out.logits[0, :-1], target, ignore_index=-100, reduction="sum"))
                    count += int((target != -100).sum())
        loss = torch.stack(losses).sum() / count
        if moe:      # the balancing loss over every token of the batch, as of the packed window
            layers = tuple(torch.cat(per_doc) for per_doc in zip(*routed))
            balancing = sys.modules[type(model).__module__].load_balancing_loss_func
            cfg = model.config
            loss = loss + cfg.router_aux_loss_coef * balancing(layers, cfg.num_experts, cfg.num_experts_per_tok)
    (loss * scale).backward()
    return loss.detach(), {n: p.grad.detach() / scale for n, p in model.named_parameters()}


def error_factor(n: int) -> float:
    """How much further from float64 than Transformers' fp32 an ``n``-element result may be: 2, or
    for fewer than 64 elements the ratio two ``n``-element rounding errors exceed by chance once in a
    thousand (:func:`fpdt.bench.parity.chance_ratio`: 3.5 for the 8 value heads' ``A_log`` and
    ``dt_bias`` of ``"qwen35_sp4"``, whose ratio is 2.0-2.1 on some CPUs and under 2 on others). The
    loss, one number, stays at 2."""
    return 2.0 if n >= 64 or n == 1 else max(2.0, chance_ratio(n))


def compare_hybrid(loss, grads: dict, refs, what: str) -> dict:
    """fp32 ``loss`` / ``grads`` against the float64 reference of :func:`reference`: within ``TOL``, or
    :func:`error_factor` times Transformers' own fp32 error on that tensor; returns ``{name: (ours, Transformers fp32)}``."""
    (loss32, grads32), (loss64, grads64) = refs
    assert set(grads) == set(grads64), f"{what}: parameter sets differ: {set(grads) ^ set(grads64)}"
    errs = {"loss": (rel_err(loss, loss64), rel_err(loss32, loss64))}
    errs.update({n: (rel_err(g, grads64[n]), rel_err(grads32[n], grads64[n])) for n, g in grads.items()})
    sizes = {n: g.numel() for n, g in grads.items()}
    bad = {n: e for n, e in errs.items() if not e[0] <= max(TOL, error_factor(sizes.get(n, 1)) * e[1])}
    assert not bad, f"{what}: (ours, Transformers fp32) errors against float64 beyond the tolerance: {bad}"
    return errs


def check_decoder_layer(ref_model, ours_model, layer: int) -> None:
    """Decoder layer ``layer`` of ``ours_model`` against ``ref_model``'s (Transformers, causal mask on
    attention layers): output, input gradient and every parameter gradient for a random output
    gradient, within 1e-5 of float64 or twice Transformers' own fp32 error."""
    B, S, hidden = 2, 12, ref_model.config.hidden_size
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(B, S, hidden, generator=g), torch.randn(B, S, hidden, generator=g)
    pos = torch.arange(S).expand(B, S)
    results = []
    for dtype in (torch.float32, torch.float64):
        m = copy.deepcopy(ref_model).to(dtype)
        h = x.to(dtype, copy=True).requires_grad_()
        cos_sin = m.model.rotary_emb(h, pos)
        causal = torch.full((S, S), float("-inf"), dtype=dtype).triu(1).expand(B, 1, S, S)
        mask = causal if m.config.layer_types[layer] == "full_attention" else None
        with float64_delta_rule():
            y = m.model.layers[layer](h, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
            y.backward(dy.to(dtype))
        results.append((y.detach(), h.grad, {n: p.grad for n, p in m.model.layers[layer].named_parameters()}))
    ours = ours_model.model.layers[layer]
    h = x.clone().requires_grad_()
    y = ours(h, pos, ours_model.model.rotary_emb)
    y.backward(dy)
    (y32, dx32, g32), (y64, dx64, g64) = results
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert set(grads) == set(g64)
    for what, mine, plain, exact in [("output", y, y32, y64), ("input grad", h.grad, dx32, dx64)] + \
            [(n, grads[n], g32[n], g64[n]) for n in grads]:
        assert rel_err(mine, exact) <= max(1e-5, 2 * rel_err(plain, exact)), (layer, what, rel_err(mine, exact))

"""Shared pieces of the model tests: tiny Hugging Face reference models and error metrics.

Transformers is the reference: every parity test builds the ``transformers`` model,
copies its weights into the FPDT model and compares loss and gradients.
"""

from __future__ import annotations

import torch
import transformers

import fpdt.model as fm

TOL = 1e-5  # max |a - b| / max |b| per tensor, fp32

_COMMON = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=512,
               attn_implementation="eager", initializer_range=0.05)

# name -> (transformers config class, kwargs); all fp32, tiny.
CONFIGS = {
    # GQA (6 q heads, 2 kv heads), odd widths, Llama-3.1 RoPE scaling that bites at these positions.
    "llama_gqa": (transformers.LlamaConfig, dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Qwen2: q/k/v biases, tied embeddings.
    "qwen2_tied": (transformers.Qwen2Config, dict(
        hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, rope_theta=1000000.0)),
    # Llama with all attention + MLP biases, untied, MHA, explicit head_dim != hidden / heads,
    # an RMSNorm epsilon that is not the default.
    "llama_bias": (transformers.LlamaConfig, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        attention_bias=True, mlp_bias=True, rms_norm_eps=1e-3)),
    # Mistral without a window, linear RoPE scaling.
    "mistral": (transformers.MistralConfig, dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, sliding_window=None,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # MQA: one KV head for 4 query heads (replicated under sequence parallelism).
    "llama_mqa": (transformers.LlamaConfig, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1)),
    # Shapes that divide by 4 ranks after GQA replication: 8 heads of 12, 2 kv heads.
    "llama_sp4": (transformers.LlamaConfig, dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2)),
}

MODEL_CLASSES = {transformers.LlamaConfig: transformers.LlamaForCausalLM,
                 transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
                 transformers.MistralConfig: transformers.MistralForCausalLM}


def hf_config(name: str):
    cls, kw = CONFIGS[name]
    return cls(**_COMMON, **kw)


def hf_model(name: str, seed: int = 0):
    """The fp32 Transformers model for ``CONFIGS[name]`` with seeded random weights."""
    cfg = hf_config(name)
    torch.manual_seed(seed)
    model = MODEL_CLASSES[type(cfg)](cfg).float()
    with torch.no_grad():  # non-trivial norm weights and biases, so their gradients are tested too
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def tokens(vocab: int, B: int, S: int, seed: int = 1, ignore: bool = True):
    """Random ids ``[B, S]`` and labels with a few ``-100`` spans (aligned, unshifted, as in HF)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, 2:7] = -100
        labels[-1, S // 2: S // 2 + 3] = -100
    return ids, labels


def hf_loss_and_grads(model, ids, labels):
    """Reference loss (float) and ``{name: grad}`` from Transformers."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def fpdt_from_hf(model, **options):
    """An FPDT model with ``model``'s weights."""
    ours = fm.from_config(model.config, **options)
    fm.load_hf_state_dict(ours, model.state_dict())
    return ours


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


BF16_SLACK = 1.25
"""A bf16 result may be this much further from float64 than the plain bf16 computation is
(the criterion of ``tests/ops/test_lora.py``)."""


BF16_FLOOR = 2.0 ** -6
"""Two bf16 units in the last place (relative to a tensor's largest element): a bf16 model's result
this close to float64 is rounding, whatever the yardstick says."""


MODEL_SLACK, MODEL_MEDIAN_SLACK = 2.0, 1.1
"""Through a whole model the two bf16 computations round in different places and their errors
against float64 scatter around each other (per-tensor ratios 0.68-1.95 on the tiny Llama, the
largest where the attention backward's per-chunk dk/dv blocks leave the kernel in bf16 before
their fp32 sum): each tensor within ``MODEL_SLACK`` times plain bf16's error, and the median
ratio within ``MODEL_MEDIAN_SLACK`` (measured 0.87-1.0). A real defect is many times bf16's error."""


def compare_bf16(loss, grads: dict, plain_loss, plain_grads: dict, exact_loss, exact_grads: dict, what: str) -> dict:
    """A bf16 model's loss and every gradient against float64 (``exact_*``), with the plain bf16
    computation's (``plain_*``) own error as the yardstick (:data:`MODEL_SLACK`, or
    :data:`BF16_FLOOR`); returns ``{name: (ours, plain)}`` errors."""
    assert set(grads) == set(exact_grads), f"{what}: parameter sets differ: {set(grads) ^ set(exact_grads)}"
    errors = {"loss": (rel_err(loss, exact_loss), rel_err(plain_loss, exact_loss))}
    errors.update({n: (rel_err(g, exact_grads[n]), rel_err(plain_grads[n], exact_grads[n])) for n, g in grads.items()})
    bad = {n: e for n, e in errors.items() if not e[0] <= max(BF16_FLOOR, MODEL_SLACK * e[1])}
    assert not bad, f"{what}: (ours, plain bf16) errors against float64 beyond the yardstick: {bad}"
    ratios = sorted(e[0] / max(e[1], BF16_FLOOR) for e in errors.values())
    median = ratios[len(ratios) // 2]
    assert median <= MODEL_MEDIAN_SLACK, f"{what}: median error ratio to plain bf16 {median:.3g}: {errors}"
    return errors


def assert_no_worse_than_bf16(got: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """``got`` (a bf16 path) is within :data:`BF16_SLACK` times the error of ``plain`` (the plain
    autograd computation in bf16) against ``exact`` (float64), both by :func:`rel_err`."""
    mine, yard = rel_err(got, exact), rel_err(plain, exact)
    assert mine <= BF16_SLACK * yard, f"{what}: {mine:.3g} from float64, plain bf16 {yard:.3g}"


def compare(loss, grads: dict, ref_loss, ref_grads: dict, what: str, tol: float = TOL) -> dict:
    """Assert loss and every gradient are within ``tol``; return the errors."""
    errs = {"loss": rel_err(loss, ref_loss)}
    assert set(grads) == set(ref_grads), f"{what}: parameter sets differ: {set(grads) ^ set(ref_grads)}"
    for n, g in grads.items():
        errs[n] = rel_err(g, ref_grads[n])
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{what}: relative errors above {tol}: {bad}"
    return errs

"""The planner's memory-bound traffic against a count of the model's own ops.

:func:`fpdt.plan.time_model.elementwise_bytes` is a per-token formula whose coefficients
were fitted to counted bytes. Here a dispatch mode counts, in one forward + backward of the
real model, the bytes every op reads and writes except what the time model counts
elsewhere: GEMMs, attention kernels, views and allocations, and the fp32 weight-gradient
accumulation (``wgrad_accumulation``: adds into the accumulators and the casts of the
partials they add). Shapes drawn here were not among those fitted; the formula must stay
within 10% of the count, for bf16 and fp32, both LM-head modes, 1-4 chunks, GQA, with and
without the recompute forward, at the default loss chunks (128 tokens) and at the budget rule's
(``ceil(2 u V / hidden)``, given explicitly: one vocabulary slice per chunk in "recompute").
"""

import random

import pytest
import torch
from torch.utils._pytree import tree_leaves

import fpdt.model as fm
from fpdt.plan import load_model_config
from fpdt.plan.setup import Setup
from fpdt.model.loss import default_loss_chunks
from fpdt.plan.time_model import elementwise_bytes
from tests.plan.dispatch_traffic import AccumulatorWatch, nbytes, storage_ptr

NOT_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
               "lift_fresh", "zeros", "zeros_like", "fill_", "zero_"}
COUNTED_ELSEWHERE = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}


class _ElementwiseTraffic(AccumulatorWatch):
    def on_op(self, name, func, args, kwargs, out) -> None:
        if name in NOT_TRAFFIC or name in COUNTED_ELSEWHERE or name.startswith("_scaled_dot_product"):
            return
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(storage_ptr(t) in self.accumulators for t in ins + outs):
            # an add into an accumulator: its partial's cast was accumulation traffic too
            self.bytes -= sum(self.casts.pop(storage_ptr(t), 0) for t in ins)
            return
        mutable = func._schema.is_mutable
        if not mutable and outs and all(storage_ptr(t) in {storage_ptr(i) for i in ins} for t in outs):
            return                                                   # a view
        moved = sum(nbytes(t) for t in ins if t.numel() > 1) + sum(nbytes(t) for t in (ins[:1] if mutable else outs))
        self.bytes += moved
        if name == "_to_copy" and out.dtype == torch.float32 and ins[0].dtype != torch.float32:
            self.casts[self.remember(out)] = moved


def _case(rng: random.Random):
    heads = rng.choice([4, 6, 8])
    kv = rng.choice([k for k in (1, 2, heads) if heads % k == 0])
    d = rng.choice([16, 32])
    return dict(hidden=heads * d, heads=heads, kv=kv, d=d, inter=rng.choice([200, 344, 512]),
                vocab=rng.choice([1000, 3000, 5000]), layers=rng.choice([1, 2]), tokens=rng.choice([512, 768]),
                u=rng.choice([1, 2, 4]))


@pytest.mark.slow
@pytest.mark.parametrize("seed,dtype,wgrad,checkpoint,rule", [
    (1, torch.bfloat16, "recompute", "on", False),
    (2, torch.bfloat16, "accumulate", "on", False),
    (3, torch.float32, "recompute", "on", False),
    (4, torch.float32, "accumulate", "on", False),
    (5, torch.bfloat16, "recompute", "off", False),
    (3, torch.float32, "recompute", "on", True),
    (1, torch.bfloat16, "recompute", "on", True),
])
def test_elementwise_bytes_within_ten_percent_of_the_count(seed, dtype, wgrad, checkpoint, rule):
    c = _case(random.Random(seed))
    loss_chunks = default_loss_chunks(c["vocab"], c["hidden"], c["u"]) if rule else None
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c["vocab"],
           "hidden_size": c["hidden"], "intermediate_size": c["inter"], "num_hidden_layers": c["layers"],
           "num_attention_heads": c["heads"], "num_key_value_heads": c["kv"], "head_dim": c["d"],
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1 << 20,
           "tie_word_embeddings": False, "rope_theta": 10000.0}
    torch.manual_seed(seed)
    model = fm.from_config(cfg, dtype=dtype, num_chunks=c["u"], offload=False, checkpointing=checkpoint,
                           lm_head_wgrad=wgrad, mlp_chunks=2 * c["u"], loss_chunks=loss_chunks)
    inputs = model.prepare_inputs(torch.randint(0, c["vocab"], (1, c["tokens"])))
    model(**inputs).backward()      # the attention kernel's first-use self-check outside the count
    model.zero_grad(set_to_none=True)
    h, q, kv = c["hidden"], c["heads"] * c["d"], c["kv"] * c["d"]
    counter = _ElementwiseTraffic([(c["inter"], h), (h, c["inter"]), (q, h), (kv, h), (c["vocab"], h)])
    with counter:
        model(**inputs).backward()
    s = Setup.build(seq_len=c["tokens"], chunk_size=c["tokens"] // c["u"], checkpointing=checkpoint, offload=False,
              dtype="bf16" if dtype == torch.bfloat16 else "fp32", lm_head_wgrad=wgrad, mlp_chunks=2 * c["u"],
              loss_chunks=loss_chunks)
    planned = elementwise_bytes(load_model_config(cfg), s)
    assert planned == pytest.approx(counter.bytes, rel=0.10), c

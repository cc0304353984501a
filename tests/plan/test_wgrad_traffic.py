"""The planner's weight-gradient accumulation traffic against what the model's backward does.

:func:`fpdt.plan.time_model.wgrad_accumulation_bytes` counts, per backward, the device
bytes of adding each chunk's ``dW`` partial into its fp32 accumulator. Here a dispatch
mode watches one forward + backward of the real model and adds up the same traffic from
the ops it sees on the fp32 accumulators: the GEMM writing a partial, its cast to fp32,
the in-place add (two reads, one write), and in fp32 the GEMM that adds into the
accumulator itself (``addmm_``: read and write). The two must agree exactly, for bf16 and fp32, several chunk
counts, both LM-head modes and GQA.
"""

import pytest
import torch

import fpdt.model as fm
from fpdt.plan import load_model_config
from fpdt.plan.setup import Setup
from fpdt.plan.time_model import accumulation_bytes_per_weight, wgrad_accumulation_bytes
from tests.plan.dispatch_traffic import AccumulatorWatch, nbytes, storage_ptr

class _AccumulationTraffic(AccumulatorWatch):
    """Bytes moved by fp32 weight-gradient accumulation, from the ops seen.

    An in-place add into an accumulator (or into a slice of one) reads both operands and
    writes the sum; its other operand is the chunk's partial, written by its GEMM, and in low
    precision first cast to fp32 (the cast reads the bf16 partial and writes the fp32 one);
    ``addmm_`` into an accumulator (fp32) reads and writes it.
    """

    def on_op(self, name, func, args, kwargs, out) -> None:
        if name == "_to_copy" and out.dtype == torch.float32 and args[0].dtype in (torch.bfloat16, torch.float16):
            self.casts[self.remember(out)] = nbytes(args[0])
        elif name == "add_" and args[0].dtype == torch.float32 and storage_ptr(args[0]) in self.accumulators:
            acc, part = args[0], args[1]
            self.bytes += 3 * nbytes(acc)                                 # acc and partial read, acc written
            cast_in = self.casts.pop(storage_ptr(part), None)
            self.bytes += nbytes(part) if cast_in is None else 2 * cast_in + nbytes(part)   # GEMM write (+ cast)
        elif name == "addmm_" and storage_ptr(args[0]) in self.accumulators:
            self.bytes += 2 * nbytes(args[0])


CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 48,
       "intermediate_size": 136, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
       "head_dim": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1 << 20,
       "tie_word_embeddings": False, "rope_theta": 10000.0}


def _weight_shapes(cfg: dict):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    return [(i, h), (h, i), (q, h), (kv, h), (v, h)]


@pytest.mark.parametrize("dtype,seq_len,u,wgrad", [
    (torch.bfloat16, 240, 1, "accumulate"),
    (torch.bfloat16, 240, 4, "accumulate"),
    (torch.bfloat16, 240, 3, "recompute"),
    (torch.float32, 240, 2, "accumulate"),
    (torch.float32, 240, 4, "recompute"),
    (torch.bfloat16, 250, 5, "accumulate"),    # chunk counts that do not divide the tokens
])
def test_planned_accumulation_bytes_match_the_backward(dtype, seq_len, u, wgrad):
    torch.manual_seed(0)
    model = fm.from_config(CFG, dtype=dtype, num_chunks=u, offload=True, checkpointing="offload",
                           lm_head_wgrad=wgrad)
    inputs = model.prepare_inputs(torch.randint(0, CFG["vocab_size"], (1, seq_len)))
    counter = _AccumulationTraffic(_weight_shapes(CFG))
    with counter:
        model(**inputs).backward()
    s = Setup.build(seq_len=seq_len, chunk_size=seq_len // u, dtype="bf16" if dtype == torch.bfloat16 else "fp32",
              lm_head_wgrad=wgrad)
    planned = wgrad_accumulation_bytes(load_model_config(CFG), s)
    assert sum(planned.values()) == counter.bytes
    assert (planned["lm_head"] == 0) == (wgrad == "recompute")


def test_bytes_per_weight():
    assert accumulation_bytes_per_weight(2) == 20 and accumulation_bytes_per_weight(4) == 16


def test_accumulation_time_favours_big_chunks_and_the_recomputed_head():
    """More chunks, more full-size partials: the step-time term grows with the chunk count
    at a fixed length, and the planner picks the recomputed LM-head gradient when the
    accumulator's traffic costs more than one more head GEMM (Llama-3's 128K vocabulary)."""
    from fpdt.plan import Choice, Cluster, GPU_PRESETS, evaluate, plan
    cfg, cluster = load_model_config("llama-3-8b"), Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8)
    t = {c: evaluate(cfg, Setup.build(seq_len=128 * 1024, chunk_size=c, hp=8), cluster)["step_time_split_s"]
         for c in (16 * 1024, 64 * 1024)}
    assert t[16 * 1024]["wgrad_accumulation"] > 3 * t[64 * 1024]["wgrad_accumulation"] > 0
    out = plan(cfg, cluster, seq_len=128 * 1024, choice=Choice(chunk_size=16 * 1024))
    assert out["setup"]["lm_head_wgrad"] == "recompute"

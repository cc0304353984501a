"""Device peak of one whole training step of a small model (Llama, Qwen3.5, Qwen3-MoE), streamed or not, counted exactly
by :class:`fpdt.memory.MemoryAccountant` (``profiling/streamed_peak.py``, ``tests/model/test_streaming.py``)."""

from __future__ import annotations

import gc
import time

import torch

import fpdt.model as fm
from fpdt.memory.accountant import MemoryAccountant, chunk_unit
from fpdt.offload import HostPeak

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1 << 20,
    "tie_word_embeddings": False, "rope_theta": 10000.0,
}
_SMALL = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=1 << 20, tie_word_embeddings=False)
CONFIGS = {
    "llama": CONFIG,
    # GDN Hk = 1, HV = 2 (dk = dv = 64), then gated attention with partial rotary: Qwen3.5's proportions
    "qwen35": {**_SMALL, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
               "intermediate_size": 352, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
               "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
               "partial_rotary_factor": 0.25, "layer_types": ["linear_attention", "full_attention"]},
    # 8 experts, top 2, the balancing loss on
    "qwen3_moe": {**_SMALL, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "intermediate_size": 352, "moe_intermediate_size": 96, "num_experts": 8,
                  "num_experts_per_tok": 2, "norm_topk_prob": True, "output_router_logits": True,
                  "router_aux_loss_coef": 0.01},
}


def measure(seq: int, chunk: int, stream: bool, model_name: str = "llama") -> dict:
    """One counted training step of ``CONFIGS[model_name]`` (bf16, one rank, ``offload=True``,
    ``checkpointing="offload"``, ``u = seq / chunk``, ``stream_layers=stream``) on the CPU: the device
    peak (bytes and chunk units) above parameters and gradients, the host peak, wall and CPU seconds."""
    u = seq // chunk
    config = CONFIGS[model_name]
    torch.manual_seed(0)
    model = fm.from_config(config, dtype=torch.bfloat16, num_chunks=u, offload=True, checkpointing="offload",
                           stream_layers=stream)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, config["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    inputs = model.prepare_inputs(ids[:, :-1], labels=ids[:, 1:], shift=False)
    model(**inputs).backward()          # first-use kernel checks outside the count
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    with MemoryAccountant("cpu") as acct, HostPeak() as host:
        loss = model(**inputs)
        loss.backward()
        del loss
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"model": model_name, "seq_len": seq, "chunk": chunk, "u": u, "stream_layers": stream,
            "device_peak_bytes": acct.device_peak,
            "device_peak_U": acct.device_peak / chunk_unit(chunk, config["hidden_size"]),
            "host_peak_bytes": host.above_start, "wall_s": wall, "cpu_s": cpu}

"""Device peak of one whole training step of a small Llama, streamed or not, counted exactly
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


def measure(seq: int, chunk: int, stream: bool) -> dict:
    """One counted training step of :data:`CONFIG` (bf16, one rank, ``offload=True``,
    ``checkpointing="offload"``, ``u = seq / chunk``, ``stream_layers=stream``) on the CPU: the device
    peak (bytes and chunk units) above parameters and gradients, the host peak, wall and CPU seconds."""
    u = seq // chunk
    torch.manual_seed(0)
    model = fm.from_config(CONFIG, dtype=torch.bfloat16, num_chunks=u, offload=True, checkpointing="offload",
                           stream_layers=stream)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    inputs = model.prepare_inputs(ids[:, :-1], labels=ids[:, 1:], shift=False)
    model(**inputs).backward()          # first-use kernel checks outside the count
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    with MemoryAccountant("cpu") as acct, HostPeak() as host:
        loss = model(**inputs)
        loss.backward()
        del loss
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seq_len": seq, "chunk": chunk, "u": u, "stream_layers": stream, "device_peak_bytes": acct.device_peak,
            "device_peak_U": acct.device_peak / chunk_unit(chunk, CONFIG["hidden_size"]),
            "host_peak_bytes": host.above_start, "wall_s": wall, "cpu_s": cpu}

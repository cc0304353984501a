"""Device peak of one whole training step against the sequence length, streamed and not.

The small Llama of ``tests/memory/test_model_budget.py`` (2 layers, hidden 256, bf16), or with
``--model`` a small Qwen3.5 (a Gated DeltaNet and a gated attention layer) or Qwen3-MoE, one
rank, ``offload=True``, ``checkpointing="offload"``, fixed token chunk ``--chunk`` (so ``u``
grows with ``S``); the device bytes counted exactly by :class:`fpdt.memory.MemoryAccountant`
(parameters and their pre-allocated gradients are the baseline). Prints one JSON line per
length and mode; ``--plot`` writes the figure.

    python -m profiling.streamed_peak --lengths 4096,8192,16384 --chunk 1024 --out benchmarks/results/cpu/streamed_peak.jsonl
    python -m profiling.streamed_peak --model qwen35 --lengths 1024,4096,16384 --chunk 256
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
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


def _emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def summary(rows: list[dict]) -> dict:
    """Medians of one length's interleaved steps per mode, and streamed / unstreamed ratios."""
    med = {}
    for stream in (False, True):
        mine = [r for r in rows if r["stream_layers"] is stream]
        med[stream] = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "device_peak_bytes")}
    return {"summary": True, "seq_len": rows[0]["seq_len"], "chunk": rows[0]["chunk"], "repeats": len(rows) // 2,
            "median": {"unstreamed": med[False], "streamed": med[True]},
            "ratio_streamed_over_unstreamed": {k: med[True][k] / med[False][k] for k in med[True]}}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for stream, label in ((False, "not streamed"), (True, "stream_layers")):
        pts = sorted({(r["seq_len"], r["device_peak_bytes"] / 2 ** 20) for r in rows
                      if not r.get("summary") and r["stream_layers"] is stream})
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xlabel("tokens (1K-token chunks)")
    ax.set_ylabel("device peak of a step (MiB, counted)")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--model", choices=sorted(CONFIGS), default="llama")
    p.add_argument("--out", help="append the JSON lines here too")
    p.add_argument("--plot", help="write the figure here (PNG)")
    p.add_argument("--repeats", type=int, default=1, help="steps per length and mode, interleaved; with more than "
                   "one, a last line per length gives the medians and the streamed / unstreamed ratios")
    args = p.parse_args()
    rows = []
    for seq in (int(x) for x in args.lengths.split(",")):
        for _ in range(args.repeats):
            for stream in (False, True):         # interleaved
                rows.append(measure(seq, args.chunk, stream, args.model))
                _emit(rows[-1], args.out)
        if args.repeats > 1:
            _emit(summary([r for r in rows if r["seq_len"] == seq]), args.out)
    if args.plot:   # every row of --out (earlier runs' too), else this run's
        if args.out:
            with open(args.out) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

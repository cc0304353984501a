"""Peak memory and step time of the FPDT model with each memory feature toggled.

Model: Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 heads / 8 KV heads of 64, SwiGLU
8192, vocab 128,256, tied embeddings, Llama-3.1 RoPE), random weights, bf16 parameters,
no download. One device, batch 1, one forward+backward per step (no optimizer: the
optimizer's memory does not depend on these features). For each global sequence length
(32K, 128K, 512K tokens) it reports peak device memory over the measured steps -- on CUDA
``max_memory_allocated`` with ``max_memory_reserved`` beside it, on the CPU the memory
accountant's count of tensors created by the steps (parameters not included; see
:class:`fpdt.memory.accountant.RegionMemory`) -- and the median step time for:

* a ladder that switches the features on one after the other, starting from the plain
  model (unchunked attention, plain MLP, full-logits loss, no checkpointing):
  chunked attention -> + attention offload -> + chunked MLP -> + chunked loss ->
  + checkpoint offload (per-layer checkpointing with host-offloaded layer inputs);
* "all on minus one": every feature on except one, to show what each one is worth alone.

Runs that run out of memory are reported as ``OOM``. The table is written as markdown to
``benchmarks/results/model_memory_<device>.md``.

**GPU figures are owed**: this script was written in a session without a GPU; only the
CPU ``--tiny`` run (tiny model, short sequences, counted memory) has been executed.
Run it on one GPU and commit the resulting table::

    python -m profiling.model_memory                      # 32K, 128K, 512K; chunk size 32K
    python -m profiling.model_memory --seq-lens 32768 131072 --chunk-size 65536

CPU smoke run (what the test suite runs)::

    python -m profiling.model_memory --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

import fpdt.model as fm
from fpdt.bench.timing import sync
from fpdt.memory.accountant import RegionMemory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURES = ("chunked_attention", "offload", "chunked_mlp", "chunked_loss", "checkpoint_offload")

LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
TINY = {**LLAMA32_1B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def feature_sets() -> list[tuple[str, frozenset[str]]]:
    """(row label, features on): the ladder, then all-on-minus-one."""
    rows = [("plain (all off)", frozenset())]
    on: list[str] = []
    for f in FEATURES:
        on.append(f)
        rows.append((("+ " if len(on) > 1 else "") + f.replace("_", " "), frozenset(on)))
    rows[-1] = ("all on", rows[-1][1])
    for f in FEATURES:
        rows.append((f"all on, no {f.replace('_', ' ')}", frozenset(FEATURES) - {f}))
    return rows


def options_for(features: frozenset[str], seq_len: int, chunk_size: int) -> dict:
    """FPDT options for a feature set at ``seq_len`` tokens (global chunk ``chunk_size``)."""
    chunks = max(1, seq_len // chunk_size) if "chunked_attention" in features else 1
    return {
        "num_chunks": chunks,
        "offload": "offload" in features,
        "mlp_chunks": None if "chunked_mlp" in features else 0,     # None: 2 x attention chunks (min 2)
        "loss_chunks": None if "chunked_loss" in features else 0,   # None: ceil(2 V / hidden)
        "checkpointing": "offload" if "checkpoint_offload" in features else "off",
    }


RUNTIME = os.environ.get("FPDT_RUNTIME") or None   # the device runtime: $FPDT_RUNTIME (e.g. sim), else automatic


def _step(model: fm.FPDTForCausalLM, inputs: dict) -> float:
    model.zero_grad(set_to_none=True)
    sync(inputs["input_ids"].device, RUNTIME)
    start = time.perf_counter()
    loss = model(**inputs)
    loss.backward()
    sync(inputs["input_ids"].device, RUNTIME)
    return time.perf_counter() - start


def measure(model: fm.FPDTForCausalLM, seq_len: int, options: dict, warmup: int, iters: int) -> tuple:
    """-> (:class:`MemoryPeaks` of the warm-up and timed steps, median step seconds) or ("OOM", None).
    On the CPU the times include the accountant's overhead."""
    device = model.lm_head.weight.device
    model.configure(**options)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
    inputs = fm.prepare_inputs(ids, sp_size=1, rank=0, num_chunks=options["num_chunks"])
    try:
        with RegionMemory(device, fresh_cache=True) as region:
            times = [_step(model, inputs) for _ in range(warmup + iters)][warmup:]
        return region.peaks, statistics.median(times)
    except torch.cuda.OutOfMemoryError:
        return "OOM", None
    finally:
        model.zero_grad(set_to_none=True)
        del inputs, ids
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _fmt(result: tuple) -> str:
    peaks, secs = result
    if peaks == "OOM":
        return "OOM"
    return f"{peaks.describe()} / {secs:.3f} s"


def _label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def render(rows: list[tuple[str, dict[int, tuple]]], seq_lens: list[int], header: list[str]) -> str:
    lines = header + ["", "| configuration | " + " | ".join(f"{_label(s)} tokens" for s in seq_lens) + " |",
                      "|---|" + "---|" * len(seq_lens)]
    for label, results in rows:
        lines.append(f"| {label} | " + " | ".join(_fmt(results[s]) for s in seq_lens) + " |")
    lines += ["", "Cells: peak device memory allocated (reserved) on CUDA, or counted by the CPU accountant "
                  "(tensors created by the steps, parameters not included) / median forward+backward time "
                  "per step (batch 1, no optimizer)."]
    return "\n".join(lines) + "\n"


def _fields(peaks):
    return dataclasses.asdict(peaks) if dataclasses.is_dataclass(peaks) else peaks     # or "OOM"


def main(argv: list[str] | None = None) -> list[tuple[str, dict[int, tuple]]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model and sequences (CPU smoke run)")
    p.add_argument("--seq-lens", type=int, nargs="+", help="global sequence lengths (default 32K 128K 512K)")
    p.add_argument("--chunk-size", type=int, help="global attention chunk length (default 32K; tiny: 32)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default=None, help="markdown output path (default benchmarks/results/...)")
    p.add_argument("--json", help="also write the rows here: per feature set and length, its options, the "
                                  "peaks (fpdt.memory.MemoryPeaks fields) and the step seconds")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = TINY if args.tiny else LLAMA32_1B
    seq_lens = args.seq_lens or ([64, 128, 256] if args.tiny else [32768, 131072, 524288])
    chunk = args.chunk_size or (32 if args.tiny else 32768)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = fm.from_config(config, device=device, dtype=dtype, runtime=RUNTIME)

    rows = []
    for label, features in feature_sets():
        results = {s: measure(model, s, options_for(features, s, chunk), args.warmup, args.iters) for s in seq_lens}
        rows.append((label, results))
        print(f"{label:40s} " + "  ".join(_fmt(results[s]) for s in seq_lens), flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = ("tiny-" if args.tiny else "") + name.lower().replace(" ", "-")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"model_memory_{tag}.md")
    params = sum(p.numel() for p in model.parameters())
    header = [f"# fpdt.model memory features: {'tiny' if args.tiny else 'Llama-3.2-1B-shaped'} model on {name}", "",
              f"- {params / 1e6:.1f}M parameters ({dtype}), {config['num_hidden_layers']} layers, hidden "
              f"{config['hidden_size']}, vocab {config['vocab_size']}; global attention chunk {chunk} tokens",
              f"- torch {torch.__version__}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
              f"{args.warmup} warm-up + median of {args.iters} steps"]
    if device.type != "cuda":
        header.append("- CPU smoke run: memory is the accountant's count and times mean nothing; "
                      "**GPU figures are owed**")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(render(rows, seq_lens, header))
    print(f"wrote {out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"label": label, "features": sorted(features),
                        "lengths": {str(n): {"options": options_for(features, n, chunk),
                                             "peaks": _fields(results[n][0]), "seconds": results[n][1]}
                                    for n in seq_lens}}
                       for (label, results), (_, features) in zip(rows, feature_sets())], f, indent=2)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

"""Device memory and step time of a Transformers model with and without ``fpdt.hf``, beside ``fpdt.model``.

Same model (a small Llama by default: hidden 512, 4 layers, GQA 8/2, SwiGLU 1408, vocab 32K,
random weights), same tokens, one forward + backward (batch 1, no optimizer: its memory
does not depend on the strategy), activation checkpointing on in every strategy:

* ``hf``: the Transformers model as is (SDPA, ``activation_checkpointing_enable()``, its own loss);
* ``alst``: DeepSpeed's long-sequence recipe on the same Transformers model (``TiledMLP``,
  ``TiledFusedLogitsLoss``, checkpoint offload; ``profiling/strategies.py``, whose
  docstring says how its offload is counted on the CPU);
* ``hf+fpdt``: the same model after ``fpdt.hf.apply_fpdt`` with its defaults (FPDT attention
  with chunked q/k/v projections, lean RMSNorm, chunked MLP and loss), attention offload off;
* ``hf+fpdt offload``: the same with ``offload=True``;
* ``hf+fpdt offload, ckpt offload``: also ``checkpointing="offload"`` (fpdt's own layer
  checkpoint, layer inputs in host memory) instead of Transformers' checkpointing;
* ``fpdt.model``: the model rebuilt as :class:`fpdt.model.FPDTForCausalLM` with every
  feature (chunked projections, attention offload, offloaded layer-input checkpoints).

Per trial: the device peak (CUDA: ``max_memory_allocated``; CPU: the memory accountant's
count of the tensors the step creates, :class:`fpdt.memory.accountant.RegionMemory`), the
host-stash peak and the step time. Per strategy: the least-squares slope of device bytes
per 1K tokens, and its ratio to ``hf``'s, ``alst``'s and ``fpdt.model``'s. Offload on the CPU runs
under the simulated runtime (``FPDT_RUNTIME=sim``, which this script passes as ``runtime=``), so its host
tier is counted.

    FPDT_RUNTIME=sim python -m profiling.hf_integration                 # CPU, 4K/8K/16K tokens
    python -m profiling.hf_integration --seq-lens 32768 65536 131072     # one GPU, bf16
    python -m profiling.hf_integration --tiny                            # the suite's smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import time
import warnings

import numpy as np
import torch

from fpdt.bench.timing import sync
from fpdt.bench.environment import default_device
from profiling.bench_common import header, results_dir, write_json

STRATEGIES = ("hf", "alst", "hf+fpdt", "hf+fpdt offload", "hf+fpdt offload, ckpt offload", "fpdt.model")
SMALL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
RUNTIME = os.environ.get("FPDT_RUNTIME") or None   # the device runtime: $FPDT_RUNTIME (e.g. sim), else automatic


def build(strategy: str, base, cfg: dict, seq_len: int, chunk: int, device: torch.device):
    """``(step, what it ran)``: a closure running one forward + backward of ``strategy``."""
    import fpdt.hf
    import fpdt.model as fm

    u = max(1, seq_len // chunk)
    ids = torch.randint(0, base.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    if strategy == "alst":
        from profiling.strategies import build_alst

        alst = build_alst({"model_type": "llama", **cfg}, seq_len, chunk, device, base.dtype)
        inputs = alst.prepare(ids.to(device))
        return (lambda: alst.forward_backward(inputs)), alst.notes
    if strategy == "fpdt.model":
        model = fm.from_config(base.config, num_chunks=u, offload=True, checkpointing="offload", runtime=RUNTIME,
                               lm_head_wgrad="recompute", device=device, dtype=base.dtype)
        fm.load_hf_state_dict(model, base.state_dict())
        inputs = {k: v.to(device) for k, v in model.prepare_inputs(ids).items()}
        return (lambda: model(**inputs).backward()), f"u={u}"
    model = copy.deepcopy(base).to(device)
    own_checkpoint = strategy.endswith("ckpt offload")
    if strategy != "hf":
        fpdt.hf.apply_fpdt(model, num_chunks=u, offload="offload" in strategy, runtime=RUNTIME,
                           checkpointing="offload" if own_checkpoint else "off")
    model.train()
    if not own_checkpoint:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()                          # the older name is deprecated in Transformers 5
    if strategy == "hf":
        ids = ids.to(device)
        return (lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward()), "sdpa"
    inputs = {k: v.to(device) for k, v in fpdt.hf.prepare_inputs(model, ids).items()}
    return (lambda: model(**inputs).loss.backward()), f"u={u}"


def trial(strategy: str, base, cfg: dict, seq_len: int, chunk: int, device: torch.device) -> dict:
    from fpdt.memory.accountant import RegionMemory

    step, what = build(strategy, base, cfg, seq_len, chunk, device)
    rec = {"strategy": strategy, "seq_len": seq_len, "setting": what}
    try:
        with RegionMemory(device, fresh_cache=True) as rm:
            t0 = time.perf_counter()
            step()
            sync(device)
            rec["step_s"] = time.perf_counter() - t0
        rec.update(status="ok", device_peak_bytes=rm.peaks.allocated, host_stash_peak_bytes=rm.peaks.host_stash)
    except torch.OutOfMemoryError as e:
        rec.update(status="oom", error=str(e).splitlines()[0])
    del step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def warm_up(cfg, dtype, device) -> None:
    """Run the attention kernel's first-use self-check before anything is measured."""
    from fpdt.attention import fpdt_attention

    D = cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(1, 8, cfg.num_attention_heads, D, dtype=dtype, device=device, requires_grad=True)
    kv = torch.randn(1, 8, cfg.num_key_value_heads, D, dtype=dtype, device=device, requires_grad=True)
    fpdt_attention(q, kv, kv, num_chunks=2).sum().backward()


def slopes(trials: list[dict]) -> dict:
    """Least-squares device bytes per 1K tokens per strategy, and the ratios to hf, alst and fpdt.model."""
    out = {}
    for s in STRATEGIES:
        pts = [(t["seq_len"], t["device_peak_bytes"]) for t in trials if t["strategy"] == s and t["status"] == "ok"]
        if len(pts) >= 2:
            x, y = np.array(pts, dtype=float).T
            out[s] = {"device_bytes_per_1k_tokens": float(np.polyfit(x, y, 1)[0] * 1024)}
    for s, v in out.items():
        for base in ("hf", "alst", "fpdt.model"):
            if base in out:
                v[f"ratio_to_{base}"] = v["device_bytes_per_1k_tokens"] / out[base]["device_bytes_per_1k_tokens"]
    return out


def table(trials: list[dict], fit: dict, counted: bool) -> str:
    step = "step (s, under the accountant)" if counted else "step (s)"
    rows = [f"| strategy | tokens | device peak (MiB) | host stash (MiB) | {step} |", "|---|---|---|---|---|"]
    for t in trials:
        if t["status"] != "ok":
            rows.append(f"| {t['strategy']} | {t['seq_len']} | {t['status']} | | |")
            continue
        rows.append(f"| {t['strategy']} | {t['seq_len']} | {t['device_peak_bytes'] / 2**20:.1f} | "
                    f"{t['host_stash_peak_bytes'] / 2**20:.1f} | {t['step_s']:.2f} |")
    rows += ["", "| strategy | device MiB per 1K tokens | x hf | x alst | x fpdt.model |", "|---|---|---|---|---|"]
    for s, v in fit.items():
        rows.append(f"| {s} | {v['device_bytes_per_1k_tokens'] / 2**20:.2f} | "
                    + " | ".join(f"{v.get(f'ratio_to_{b}', float('nan')):.3f}" for b in ("hf", "alst", "fpdt.model"))
                    + " |")
    return "\n".join(rows)


def markdown(result: dict) -> str:
    """The results file as markdown: what ran, the trials and the slopes."""
    m, cpu = result["model"], result["device_type"] == "cpu"
    what = (f"Llama, hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, GQA {m['num_attention_heads']}/"
            f"{m['num_key_value_heads']}, vocab {m['vocab_size']}, {result['dtype'].replace('torch.', '')}, "
            f"{result['chunk_size']}-token chunks, one forward + backward, activation checkpointing on; "
            f"{result['device']}")
    note = (" Device memory is counted by the accountant; the step times include its per-op "
            "bookkeeping, which weighs on the strategies that run more ops, so they are no speed "
            "comparison.") if cpu else ""
    return f"{what}.{note}\n\n{table(result['trials'], result['slopes'], cpu)}\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="global tokens (default 4K 8K 16K)")
    p.add_argument("--chunk-size", type=int, default=None, help="global tokens per FPDT chunk (default 2K)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths (CPU smoke test)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    device = default_device()
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    seq_lens = args.seq_lens or ([128, 256] if args.tiny else [4096, 8192, 16384])
    chunk = args.chunk_size or (64 if args.tiny else 2048)
    shape = TINY if args.tiny else SMALL
    cfg = transformers.LlamaConfig(**shape, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(dtype)
    warm_up(cfg, dtype, device)
    trials = []
    for strategy in args.strategies:
        for s in seq_lens:
            rec = trial(strategy, base, shape, s, chunk, device)
            trials.append(rec)
            print(rec, flush=True)
    fit = slopes(trials)
    result = {**header("hf_integration.py", args), "model": cfg.to_dict(), "dtype": str(dtype),
              "chunk_size": chunk, "trials": trials, "slopes": fit}
    out = results_dir(args.tiny, args.out_dir)
    path = write_json(os.path.join(out, "hf_integration.json"), result)
    md = markdown(result)
    with open(os.path.join(out, "hf_integration.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

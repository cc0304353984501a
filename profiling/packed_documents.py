"""Packed documents on the CPU: one training step (forward + backward) of the same model on the
same tokens, with document masking (positions restarting at every document) and without (one
causal window), interleaved in one process.

Reports per variant the step times (median of ``--repeats``), the time inside the attention
kernels (dense and document-masked blocks: ``PipelineSpec.block_forward/block_backward``,
timed around each call) and inside the whole projected-attention function (q/k/v projections,
RoPE, all-to-alls, merges and kernels, forward and backward; ``o_proj`` excluded), the
attention blocks run and skipped, and the (query, key) pairs computed. Before timing, checks
that the masked model's loss equals the token-weighted mean of each document's loss run alone.

    OMP_NUM_THREADS=2 python -m profiling.packed_documents --seq-len 32768 --doc-len 2048

Writes ``packed_documents-<seq>-<doc>.json`` under ``benchmarks/results/<device>/<date>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import fpdt.attention.pipeline as pipeline
import fpdt.attention.projected_attention as projected
from fpdt.model import from_config
from fpdt.bench.environment import cpu_name
from profiling.bench_common import results_dir

MODEL = {  # a small Llama: attention is a large part of a 32K-token step, a step fits minutes on 2 cores
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 256,
    "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 1 << 20, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False,
}


class Timers:
    """Wall time inside the attention kernels and the projected-attention function."""

    def __init__(self):
        self.kernel = 0.0
        self.attention = 0.0
        self.calls = 0

    def install(self):
        spec = pipeline.PipelineSpec
        fwd, bwd = spec.block_forward, spec.block_backward
        run_f, run_b = projected.run_forward, projected.run_backward

        def timed(fn, field):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(self, field, getattr(self, field) + time.perf_counter() - t)
                    if field == "kernel":
                        self.calls += 1
            return wrapper

        spec.block_forward, spec.block_backward = timed(fwd, "kernel"), timed(bwd, "kernel")
        projected.run_forward, projected.run_backward = timed(run_f, "attention"), timed(run_b, "attention")

    def take(self):
        got = (self.kernel, self.attention, self.calls)
        self.kernel = self.attention = 0.0
        self.calls = 0
        return got


def documents(seq_len: int, doc_len: int) -> torch.Tensor:
    return torch.arange(seq_len).remainder(doc_len)[None]          # positions restarting per document


def check_loss(model, ids, pos, doc_len):
    """The masked loss vs each document alone (fp32): the run's correctness check."""
    with torch.no_grad():
        packed = model(ids, labels=_labels(ids, pos), position_ids=pos).item()
        alone, n = 0.0, 0
        for s in range(0, ids.shape[1], doc_len):
            d = ids[:, s:s + doc_len]
            valid = doc_len - 1
            alone += model(d, labels=_labels(d, pos[:, :doc_len]), position_ids=pos[:, :doc_len]).item() * valid
            n += valid
    return packed, alone / n


def _labels(ids, pos):
    """Next-token labels; a document's last token predicts nothing (the next one starts a new document)."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, :-1][pos[:, 1:] == 0] = -100
    return labels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--num-chunks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loss-chunks", type=int, default=32, help="fused LM head + loss chunks (1K tokens at 32K)")
    ap.add_argument("--mlp-chunks", type=int, default=8)
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = from_config(MODEL, num_chunks=args.num_chunks, loss_chunks=args.loss_chunks, mlp_chunks=args.mlp_chunks)
    S = args.seq_len
    ids = torch.randint(0, MODEL["vocab_size"], (1, S))
    restart = documents(S, args.doc_len)
    variants = {"masked": restart, "unmasked": torch.arange(S)[None]}
    labels = {"masked": _labels(ids, restart), "unmasked": _labels(ids, restart)}   # same targets
    timers = Timers()
    timers.install()
    runs = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, pos in variants.items():                     # interleaved: masked, unmasked, masked, ...
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            loss = model(ids, labels=labels[name], position_ids=pos)
            loss.backward()
            step = time.perf_counter() - t
            kernel, attention, calls = timers.take()
            runs[name].append(dict(step_s=step, attention_kernels_s=kernel, attention_s=attention,
                                   kernel_calls=calls, loss=loss.item()))
            print(f"repeat {r} {name}: step {step:.1f} s, attention {attention:.1f} s (kernels {kernel:.1f} s)",
                  flush=True)
            write(args, runs, None, None, restart)
    packed, alone = check_loss(model, ids, restart, args.doc_len) if args.doc_len < S else (None, None)
    print(f"masked loss {packed}, documents alone {alone}", flush=True)
    write(args, runs, packed, alone, restart)


def write(args, runs, packed, alone, restart):
    """The result JSON (rewritten after every step, so an interrupted run keeps what it measured)."""
    S = args.seq_len
    from fpdt.attention.ring_costs import attention_costs
    summary = {}
    for name, rows in runs.items():
        if not rows:
            return
        med = {k: statistics.median(row[k] for row in rows) for k in ("step_s", "attention_kernels_s", "attention_s")}
        doc = None if name == "unmasked" else torch.cumsum((restart == 0).long(), 1) - 1
        cost = attention_costs(seq_len=S, num_heads=MODEL["num_attention_heads"],
                               num_kv_heads=MODEL["num_key_value_heads"], head_dim=MODEL["head_dim"],
                               num_chunks=args.num_chunks, doc_ids=doc)
        summary[name] = dict(median=med, attention_share=med["attention_s"] / med["step_s"],
                             kernel_share=med["attention_kernels_s"] / med["step_s"],
                             blocks=cost.touches, blocks_without_documents=args.num_chunks * (args.num_chunks + 1) // 2,
                             pairs_per_head=cost.attention_pairs, runs=rows)
    m, u = summary["masked"]["median"], summary["unmasked"]["median"]
    result = dict(
        what="one forward+backward step, fp32, same model and tokens, masked (positions restarting every "
             "doc_len tokens) vs unmasked (one causal window), interleaved in one process",
        cpu=cpu_name(), threads=torch.get_num_threads(), torch=torch.__version__, model=MODEL,
        seq_len=S, doc_len=args.doc_len, num_chunks=args.num_chunks, loss_chunks=args.loss_chunks,
        mlp_chunks=args.mlp_chunks, repeats_done=min(len(r) for r in runs.values()),
        loss_masked=packed, loss_documents_alone=alone,
        step_ratio_masked_over_unmasked=m["step_s"] / u["step_s"],
        attention_ratio_masked_over_unmasked=m["attention_s"] / u["attention_s"],
        kernel_ratio_masked_over_unmasked=m["attention_kernels_s"] / u["attention_kernels_s"],
        variants=summary)
    path = os.path.join(results_dir(False, args.out_dir), f"packed_documents-{S}-{args.doc_len}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if packed is not None:
        print(json.dumps({k: v for k, v in result.items() if k not in ("variants", "model")}, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()

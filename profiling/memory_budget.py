"""The device-memory table of docs/memory.md, counted with :class:`fpdt.memory.accountant.MemoryAccountant`.

Rows (device working set only; host-stash buffers from the pool, the caller's inputs and
weights, and gradients allocated before the step are not counted):

* attention core (``fpdt_attention``), GQA 4:1 (hidden 256 = 4 q heads x 64, 1 KV head),
  bf16, ``offload=True``, one rank: forward working set beyond its full-sequence output and
  backward working set beyond the input gradients, in ``U`` (one bf16 chunk of hidden
  states), at u = 4, 8, 16 (same S) and u = 32 (same chunk size as u = 8);
* the ratio of working-set bytes (the larger of the two above) at u = 8 over u = 4 (same S);
* a 2-layer model of that shape under ``checkpointing="offload"``, whole forward +
  backward, in ``Nd`` (one full-sequence bf16 hidden tensor);
* device bytes per added token from 8K to 16K tokens, fpdt beside ALST and Hugging Face
  (and fpdt without offload), on a Llama with hidden 512, 4 layers, GQA 8/2, vocab 32000,
  fp32, fpdt with ``offload=True``, ``checkpointing="offload"``, 1K-token chunks: measured by
  :mod:`bytes_per_token` (what is counted is stated there), each trial in a fresh process.
  ``--skip-large`` leaves it out (it takes tens of minutes on a 2-core CPU);
  ``--strategies fpdt --reuse <previous .json>`` re-runs only the fpdt rows.

The markdown goes to ``benchmarks/results/<device>/<UTC date>/memory_budget.md`` (the whole
result, every trial, to ``memory_budget.json`` beside it), headed by the exact command.

    python -m profiling.memory_budget [--skip-large] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys

import torch

import fpdt.model as fm
from fpdt.attention import fpdt_attention
from fpdt.memory.accountant import MemoryAccountant, chunk_unit, sequence_unit
from profiling import bench_common as bc
from profiling import bytes_per_token as bpt

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 1, 64
SMALL_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": HIDDEN,
    "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "max_position_embeddings": 65536, "tie_word_embeddings": False, "rope_theta": 10000.0,
}


def attention_core(seq: int, u: int, offload: bool = True, heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
                   dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0) -> dict:
    """One rank's ``fpdt_attention`` forward + backward; bytes beyond output / input grads."""
    H, H_kv, D = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, H, D, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, seq, H_kv, D, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(1, seq, H_kv, D, generator=g).to(device, dtype).requires_grad_()
    dout = torch.randn(1, seq, H, D, generator=g).to(device, dtype)
    with MemoryAccountant(device) as acct:
        with acct.phase("fwd"):
            out = fpdt_attention(q, k, v, num_chunks=u, offload=offload)
        with acct.phase("bwd"):
            out.backward(dout)
    fwd, bwd = acct.phases["fwd"], acct.phases["bwd"]
    grads = sum(t.numel() * t.element_size() for t in (q, k, v))
    return {
        "U": chunk_unit(seq // u, H * D),
        "fwd_beyond_output": fwd.peak - out.numel() * out.element_size(),
        "bwd_beyond_grads": bwd.peak_above_start - grads,
        "call_peak": acct.device_peak,
        "host_peak": acct.host_peak,
        "cuda_allocated_peak": acct.cuda_allocated_peak,
        "cuda_reserved_peak": acct.cuda_reserved_peak,
    }


def model_step(config: dict, seq: int, dtype: torch.dtype, device: str = "cpu", **options) -> dict:
    """One forward + backward of a random model; parameters and pre-allocated grads are baseline."""
    torch.manual_seed(0)
    model = fm.from_config(config, device=device, dtype=dtype, **options)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, config["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs = model.prepare_inputs(ids[:, :-1].to(device), labels=ids[:, 1:].to(device), shift=False)
    with MemoryAccountant(device) as acct:
        with acct.phase("fwd"):
            loss = model(**inputs)
        with acct.phase("bwd"):
            loss.backward()
        del loss
    out = {"peak": acct.device_peak, "host_peak": acct.host_peak, "fwd_peak": acct.phases["fwd"].peak,
           "cuda_allocated_peak": acct.cuda_allocated_peak, "cuda_reserved_peak": acct.cuda_reserved_peak,
           "Nd": sequence_unit(seq, config["hidden_size"])}
    del model, inputs
    gc.collect()
    return out


def table(device: str = "cpu") -> list[tuple[str, str]]:
    rows = []
    base = 1024
    for u in (4, 8, 16, 32):
        seq = base if u < 32 else 128 * 32           # u = 32 at u = 8's chunk size (128 tokens)
        r = attention_core(seq, u, device=device)
        rows.append((f"attention fwd beyond output, u={u} (S={seq})", f"{r['fwd_beyond_output'] / r['U']:.2f} U"))
        rows.append((f"attention bwd beyond input grads, u={u} (S={seq})", f"{r['bwd_beyond_grads'] / r['U']:.2f} U"))
    r4, r8 = attention_core(base, 4, device=device), attention_core(base, 8, device=device)
    ws = lambda r: max(r["fwd_beyond_output"], r["bwd_beyond_grads"])  # noqa: E731
    rows.append(("working-set bytes(u=8) / bytes(u=4), S=1024", f"{ws(r8) / ws(r4):.3f}"))
    m = model_step(SMALL_MODEL, 1024, torch.bfloat16, device, num_chunks=4, offload=True, checkpointing="offload")
    rows.append(("2-layer model, checkpointing=offload, S=1024, u=4, fwd+bwd", f"{m['peak'] / m['Nd']:.2f} Nd"))
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-large", action="store_true", help="leave out the bytes-per-added-token section")
    p.add_argument("--skip-table", action="store_true", help="leave out the U / Nd table (attention core, 2 layers)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--strategies", nargs="+", default=list(bpt.DEFAULT_STRATEGIES), choices=bpt.st.STRATEGIES)
    p.add_argument("--lengths", nargs=2, type=int, default=[8192, 16384], metavar=("L1", "L2"))
    p.add_argument("--reuse", default=None, help="a previous memory_budget.json: keep its trials of strategies "
                                                 "not run now")
    p.add_argument("--chunk-size", type=int, default=1024, help="fpdt's attention chunk (tokens)")
    p.add_argument("--tiny", action="store_true", help="bytes per token on a tiny model, trials in-process "
                                                      "(smoke run; results to .../cpu-smoke)")
    p.add_argument("--trial-timeout-s", type=float, default=1800.0)
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/<device>/<UTC date>")
    args = p.parse_args(argv)
    command = "python -m profiling.memory_budget" + "".join(" " + shlex.quote(a) for a in (argv or []))
    head = bc.header("memory_budget.py", args)
    result = {**head, "command": command, "rows": None, "bytes_per_token": None}
    parts = [f"# Device memory budget\n\nCommand: `{command}`  \nDevice `{head['device']}`, commit "
             f"{head['commit']}, {head['date_utc']}, torch {head['torch']}. Counted on the CPU by "
             f"`fpdt.memory.accountant.MemoryAccountant` (live tensor bytes); no GPU figures.\n"]
    if not args.skip_table:
        attention_core(256, 2, device=args.device)   # the kernel's first-use self-check, outside every row
        rows = table(args.device)
        result["rows"] = rows
        parts.append("\n".join(["## U / Nd table\n", "| what | measured |", "|---|---|"]
                               + [f"| {a} | {b} |" for a, b in rows]) + "\n")
    if not args.skip_large:
        reuse = None
        if args.reuse:
            with open(args.reuse) as f:
                reuse = (json.load(f).get("bytes_per_token") or {}).get("trials")
        r = bpt.measure(args.strategies, args.lengths, args.chunk_size, tiny=args.tiny, in_process=args.tiny,
                        timeout_s=args.trial_timeout_s, reuse=reuse)
        result["bytes_per_token"] = r
        parts.append("## Device bytes per added token: fpdt, ALST, Hugging Face\n\n"
                     + (bpt.__doc__.split("\n\n", 1)[1].split("\n\n    python")[0]) + "\n\n" + bpt.markdown(r))
    text = "\n".join(parts)
    print(text)
    out_dir = bc.results_dir(args.tiny, args.out_dir)
    with open(os.path.join(out_dir, "memory_budget.md"), "w") as f:
        f.write(text)
    bc.write_json(os.path.join(out_dir, "memory_budget.json"), result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

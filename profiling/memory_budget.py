"""Issue 8's device-memory table, counted with :class:`fpdt.profiling.memory.MemoryAccountant`.

Rows (device working set only; host-stash buffers from the pool, the caller's inputs and
weights, and gradients allocated before the step are not counted):

* attention core (``fpdt_attention``), GQA 4:1 (hidden 256 = 4 q heads x 64, 1 KV head),
  bf16, ``offload=True``, one rank: forward working set beyond its full-sequence output and
  backward working set beyond the input gradients, in ``U`` (one bf16 chunk of hidden
  states), at u = 4, 8, 16 (same S) and u = 32 (same chunk size as u = 8);
* the ratio of working-set bytes (the larger of the two above) at u = 8 over u = 4 (same S);
* a 2-layer model of that shape under ``checkpointing="offload"``, whole forward +
  backward, in ``Nd`` (one full-sequence bf16 hidden tensor);
* device bytes per added token from 8K to 16K tokens on a Llama with hidden 512,
  4 layers, GQA 8/2, vocab 32000, fp32, ``offload=True``, ``checkpointing="offload"``,
  1K-token chunks (``--skip-large`` leaves it out; it takes a few minutes on a CPU).

On CUDA each row also gives ``max_memory_allocated``/``max_memory_reserved``.

    python profiling/memory_budget.py [--skip-large] [--out benchmarks/results/memory_budget.md]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

import fpdt.model as fm
from fpdt.attention import fpdt_attention
from fpdt.profiling.memory import MemoryAccountant, chunk_unit, sequence_unit

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 1, 64
SMALL_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": HIDDEN,
    "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "max_position_embeddings": 65536, "tie_word_embeddings": False, "rope_theta": 10000.0,
}
LARGE_MODEL = {**SMALL_MODEL, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}


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


def table(skip_large: bool = False, device: str = "cpu") -> list[tuple[str, str]]:
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
    if not skip_large:
        opts = dict(offload=True, checkpointing="offload")
        a = model_step(LARGE_MODEL, 8192, torch.float32, device, num_chunks=8, **opts)
        b = model_step(LARGE_MODEL, 16384, torch.float32, device, num_chunks=16, **opts)
        rows.append(("device bytes per added token 8K->16K (hidden 512, 4 layers, fp32, 1K chunks)",
                     f"{(b['peak'] - a['peak']) / 8192 / 1000:.1f} KB (peaks {a['peak'] / 2**20:.1f} / "
                     f"{b['peak'] / 2**20:.1f} MiB)"))
    return rows


def main(argv: list[str] | None = None) -> list[tuple[str, str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-large", action="store_true", help="leave out the 8K->16K model row")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="also write the table as markdown here")
    args = p.parse_args(argv)
    rows = table(args.skip_large, args.device)
    lines = ["| what | measured |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

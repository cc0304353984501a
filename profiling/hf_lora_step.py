"""PEFT LoRA training step through ``fpdt.hf`` against plain PEFT, in one process.

The same Llama (hidden 512, 4 layers, GQA 8/2, SwiGLU 1408, vocabulary 32K, random weights by
default), the same LoRA adapters (rank 8 on all seven projections) and the same tokens; each
repetition runs one forward + backward of each model in turn, so a loaded machine slows both
alike, and the ratio of their median CPU times (``time.process_time``; the first repetition is a
warm-up) is what is reported. ``--loss-chunks`` sets fpdt's LM-head loss chunks (default: the
model's rule, ``ceil(2 u V / hidden)`` with at least 128 tokens a chunk). The output names the
loss chunk count the step ran with and the ``fpdt`` package it imported (run with
``PYTHONPATH`` at the checkout you mean to measure).

    python -m profiling.hf_lora_step                       # 4K tokens, 1K-token chunks, one thread
    python -m profiling.hf_lora_step --loss-chunks 16
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-chunks", type=int, default=4)
    p.add_argument("--loss-chunks", type=int)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> dict:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    import fpdt.hf
    from fpdt.model.loss import floored_loss_chunks

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=max(4096, args.seq_len))
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    plain, ours = (peft.get_peft_model(copy.deepcopy(base), lora) for _ in range(2))
    kw = {"num_chunks": args.num_chunks, **({"loss_chunks": args.loss_chunks} if args.loss_chunks is not None else {})}
    fpdt.hf.apply_fpdt(ours, **kw)
    loss_chunks = ours.fpdt.loss_chunks if args.loss_chunks is not None else \
        floored_loss_chunks(ours.fpdt.loss_chunks, args.seq_len)

    def plain_step():
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def fpdt_step():
        loss = ours(**fpdt.hf.prepare_inputs(ours, ids)).loss
        loss.backward()
        return loss.detach()

    cpu = {"plain": [], "fpdt": []}
    losses = {}
    for _ in range(args.reps):
        for name, step in (("plain", plain_step), ("fpdt", fpdt_step)):
            t = time.process_time()
            losses[name] = float(step())
            cpu[name].append(time.process_time() - t)
    median = {k: sorted(v[1:] or v)[len(v[1:] or v) // 2] for k, v in cpu.items()}
    out = {"seq_len": args.seq_len, "hidden": args.hidden, "options": kw, "loss_chunks": loss_chunks,
           "fpdt": fpdt.__file__, "loss": losses, "cpu_s": median, "ratio": median["fpdt"] / median["plain"]}
    print(f"plain PEFT {median['plain']:.2f} s, fpdt.hf {median['fpdt']:.2f} s CPU per step ({loss_chunks} loss "
          f"chunks; fpdt from {fpdt.__file__}); ratio {out['ratio']:.2f} "
          f"(losses {losses['plain']:.6f} / {losses['fpdt']:.6f})")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

"""Your own DeepSpeed training loop on a Transformers model, made sequence-parallel by fpdt.

Everything here is the usual Transformers + DeepSpeed loop; the fpdt lines are marked
``# fpdt``: one call that puts FPDT attention, the chunked MLP and the chunked loss into
the model, one that gives each rank its slice of the sequence, and the gradient scale.

    # CPU, 2 processes, the tiny model on the shipped text (about a minute)
    torchrun --standalone --nproc_per_node 2 examples/hf_deepspeed/train.py \\
        --model-config examples/tiny-llama/config.json --tokenizer examples/tiny-llama/tokenizer.json \\
        --data examples/data/jargon-file-4.4.7.txt --seq-len 512 --chunks 2 --steps 20 \\
        --deepspeed examples/hf_deepspeed/ds_zero3.json
    # GPUs: --model /path/to/Llama-3.2-1B --seq-len 262144 --chunks 4 --offload (bf16 in the JSON)

All ranks form one sequence-parallel group; each holds ``seq_len / world`` tokens.
"""

from __future__ import annotations

import argparse
import warnings
import json
import os

import numpy as np
import torch
import torch.distributed as dist

import fpdt.hf  # fpdt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Transformers checkpoint directory")
    src.add_argument("--model-config", help="a config.json: random weights (seeded by --seed)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the --model directory's)")
    p.add_argument("--data", required=True, help="text (.txt, .jsonl), tokens (.npy, .bin) or a directory")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--chunks", type=int, default=1, help="FPDT attention chunks per rank")
    p.add_argument("--offload", action="store_true", help="attention chunks to pinned host memory (CUDA)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", help="append {step, loss} per step")
    return p.parse_args(argv)


def token_windows(args, eos_id):
    """``--data`` (text, .jsonl, .npy/.bin, or a directory of them, read as ``fpdt-train`` reads
    it) as consecutive windows of ``seq_len`` tokens."""
    from fpdt.train.data import load_tokens

    tokenizer = args.tokenizer or (os.path.join(args.model, "tokenizer.json") if args.model else None)
    ids = np.asarray(load_tokens(args.data, tokenizer_path=tokenizer, eos_id=eos_id), dtype=np.int64)
    n = len(ids) // args.seq_len
    if n == 0:
        raise SystemExit(f"{args.data} has {len(ids)} tokens, fewer than --seq-len {args.seq_len}")
    return [torch.from_numpy(ids[k * args.seq_len:(k + 1) * args.seq_len]) for k in range(n)]


# Deprecation notices of DeepSpeed's, Transformers' and accelerate's own calls (e.g. the
# torch.distributed collectives ZeRO-3 uses): nothing this script can act on, repeated every step.
for _module in (r"torch\.distributed", r"deepspeed", r"transformers", r"accelerate"):
    warnings.filterwarnings("ignore", category=FutureWarning, module=_module)


def main(argv=None) -> list[float]:
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    args = parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    started_here = not dist.is_initialized()
    if started_here:
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    with open(args.deepspeed) as f:
        ds_config = json.load(f)
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    torch.manual_seed(args.seed)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config), dtype=dtype)

    sp = dist.get_world_size()
    model.train()                        # from_pretrained returns eval mode, where nothing is checkpointed
    fpdt.hf.apply_fpdt(model, num_chunks=args.chunks, offload=args.offload,   # fpdt
                       checkpointing="offload" if args.offload else "on")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    windows = token_windows(args, model.config.eos_token_id)
    losses = []
    for step in range(args.steps):
        window = windows[step % len(windows)].unsqueeze(0)                    # [1, S], the same on every rank
        inputs = fpdt.hf.prepare_inputs(model, window)                        # fpdt: this rank's [1, S / sp]
        loss = engine(**{k: v.to(device) for k, v in inputs.items()}).loss   # global mean, same on every rank
        engine.backward(loss * sp)   # fpdt: DeepSpeed averages over all ranks; SP ranks' shares must add up
        engine.step()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
            if args.log_json:
                with open(args.log_json, "a") as f:
                    f.write(json.dumps({"step": step + 1, "loss": loss.item()}) + "\n")
    if started_here:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()

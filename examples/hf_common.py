"""What the two Transformers examples (``hf_deepspeed/train.py``, ``hf_trainer/train.py``) share:
their model, data and FPDT flags, the model they load, and the token windows they train on.

Public fpdt API only: ``fpdt.train.load_tokens`` reads ``--data`` as ``fpdt-train`` reads it.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from fpdt.train import load_tokens


def parser(description: str, offload_help: str) -> argparse.ArgumentParser:
    """A parser with the flags both examples take: the model (a checkpoint or a config.json),
    the tokenizer and data, ``--seq-len``, ``--chunks``, ``--offload`` and ``--seed``."""
    p = argparse.ArgumentParser(description=description)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Transformers checkpoint directory")
    src.add_argument("--model-config", help="a config.json: random weights (seeded by --seed)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the --model directory's)")
    p.add_argument("--data", required=True, help="text (.txt, .jsonl), tokens (.npy, .bin) or a directory")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--chunks", type=int, default=1, help="FPDT attention chunks per rank")
    p.add_argument("--offload", action="store_true", help=offload_help)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p


def load_model(args, dtype: torch.dtype):
    """``--model``'s weights, or random ones (seeded by ``--seed``) for ``--model-config``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config), dtype=dtype)


def token_windows(args, eos_id: int | None) -> list[torch.Tensor]:
    """``--data`` (text, .jsonl, .npy/.bin, or a directory of them, read as ``fpdt-train`` reads
    it) as consecutive windows of ``seq_len`` tokens."""
    tokenizer = args.tokenizer or (os.path.join(args.model, "tokenizer.json") if args.model else None)
    ids = np.asarray(load_tokens(args.data, tokenizer_path=tokenizer, eos_id=eos_id), dtype=np.int64)
    n = len(ids) // args.seq_len
    if n == 0:
        raise SystemExit(f"{args.data} has {len(ids)} tokens, fewer than --seq-len {args.seq_len}")
    return [torch.from_numpy(ids[k * args.seq_len:(k + 1) * args.seq_len]) for k in range(n)]

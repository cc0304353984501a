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

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import fpdt.hf  # fpdt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # examples/: hf_common.py
import hf_common  # noqa: E402


def parse_args(argv=None):
    p = hf_common.parser(__doc__.splitlines()[0], "attention chunks to pinned host memory (CUDA)")
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON")
    p.add_argument("--log-json", help="append {step, loss} per step")
    return p.parse_args(argv)


# Deprecation notices of DeepSpeed's, Transformers' and accelerate's own calls (e.g. the
# torch.distributed collectives ZeRO-3 uses): nothing this script can act on, repeated every step.
for _module in (r"torch\.distributed", r"deepspeed", r"transformers", r"accelerate"):
    warnings.filterwarnings("ignore", category=FutureWarning, module=_module)


def main(argv=None) -> list[float]:
    import deepspeed
    args = parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    started_here = not dist.is_initialized()
    if started_here:
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    with open(args.deepspeed) as f:
        ds_config = json.load(f)
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    model = hf_common.load_model(args, dtype)

    sp = dist.get_world_size()
    model.train()                        # from_pretrained returns eval mode, where nothing is checkpointed
    fpdt.hf.apply_fpdt(model, num_chunks=args.chunks, offload=args.offload,   # fpdt
                       checkpointing="offload" if args.offload else "on")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    windows = hf_common.token_windows(args, model.config.eos_token_id)
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

"""Hugging Face's Trainer with its DeepSpeed sequence parallelism, running FPDT.

This is the Trainer setup DeepSpeed's ALST documents (accelerate's ``ParallelismConfig`` with
``sp_backend="deepspeed"``, a DeepSpeed config, batches with ``position_ids``); the fpdt lines
are marked ``# fpdt``: one call that puts FPDT attention, the chunked MLP and loss and the
checkpointing into the model, and fpdt's ``ParallelismConfig`` for it.

    # CPU, 2 processes, the tiny model on the shipped text (about a minute)
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer/train.py \\
        --model-config examples/tiny-llama/config.json --tokenizer examples/tiny-llama/tokenizer.json \\
        --data examples/data/jargon-file-4.4.7.txt --seq-len 512 --chunks 2 --steps 20
    # GPUs: --model /path/to/Llama-3.2-1B --seq-len 262144 --chunks 4 --offload --bf16

All ranks form one sequence-parallel group (``--sp``, default: every rank); each holds
``seq_len / sp`` tokens of a window. Every window's length must be divisible by
``sp * chunks``. With ``--sp`` below the world size the groups train on different windows
(data parallelism over them; on the CPU this needs a torch whose gloo all-gather backward
works on a subgroup, pytorch/pytorch#120213, which the Trainer's loss aggregation uses);
``--sp 1`` is data parallelism alone, FPDT's chunking and offload within each rank.

``--lora-rank R`` fine-tunes LoRA adapters (PEFT) on every linear of the decoder layers instead
of the whole model: ``get_peft_model`` before ``apply_fpdt``, which then runs the adapters on
the q/k/v and MLP projections inside its chunked functions.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

import fpdt.hf  # fpdt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # examples/: hf_common.py
import hf_common  # noqa: E402


def parse_args(argv=None):
    p = hf_common.parser(__doc__.splitlines()[0], "attention chunks and layer inputs to pinned host memory (CUDA)")
    p.add_argument("--sp", type=int, help="sequence-parallel degree (default: the world size)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optim", default="adamw_torch", help="a TrainingArguments optim name")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (PEFT); 0: full fine-tuning")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: twice the rank)")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--deepspeed", default=os.path.join(HERE, "ds_zero3.json"), help="DeepSpeed JSON")
    p.add_argument("--output-dir", default=os.path.join("runs", "hf_trainer"))
    return p.parse_args(argv)


def token_windows(args, eos_id) -> list[dict[str, torch.Tensor]]:
    """``--data``'s windows of ``seq_len`` tokens (:func:`hf_common.token_windows`), each with its
    labels and the ``position_ids`` that DeepSpeed's sequence-parallel data adapter requires."""
    return [{"input_ids": w, "labels": w.clone(), "position_ids": torch.arange(args.seq_len)}
            for w in hf_common.token_windows(args, eos_id)]


def build_trainer(args):
    import deepspeed
    from transformers import Trainer, TrainingArguments

    on_gpu = torch.cuda.is_available()
    # DeepSpeed's communication layer, over torch.distributed (which it starts unless already started):
    # the Trainer's sequence-parallel setup builds its groups through it.
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    sp = args.sp or dist.get_world_size()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    # TrainingArguments before the model: with ZeRO-3 the weights are partitioned as they load.
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, optim=args.optim, max_grad_norm=args.max_grad_norm,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, bf16=args.bf16,
        logging_steps=1, save_strategy="no", report_to=[], seed=args.seed, use_cpu=not on_gpu,
        deepspeed=args.deepspeed,
        parallelism_config=fpdt.hf.trainer_parallelism_config(sp_size=sp))                       # fpdt
    model = hf_common.load_model(args, dtype)
    if args.lora_rank:
        model = with_lora(model, args)
    fpdt.hf.apply_fpdt(model, group="trainer", num_chunks=args.chunks, offload=args.offload,   # fpdt
                       checkpointing="offload" if args.offload else "on")
    return Trainer(model=model, args=training, train_dataset=token_windows(args, model.config.eos_token_id))


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model, args):
    """``model`` with PEFT LoRA adapters (seeded by ``--seed``) on every linear of its decoder layers."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                        lora_dropout=args.lora_dropout, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


# Deprecation notices of DeepSpeed's, Transformers' and accelerate's own calls (e.g. the
# torch.distributed collectives ZeRO-3 uses): nothing this script can act on, repeated every step.
for _module in (r"torch\.distributed", r"deepspeed", r"transformers", r"accelerate"):
    warnings.filterwarnings("ignore", category=FutureWarning, module=_module)


def main(argv=None) -> list[float]:
    trainer = build_trainer(parse_args(argv))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    main()

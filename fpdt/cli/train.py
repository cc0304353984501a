"""``fpdt-train``: command line, set-up in order, and the run.

Order of set-up (each step needs the previous one):

1. parse flags, read the DeepSpeed JSON, merge the FPDT options, validate everything
   that needs no process group (:mod:`fpdt.train.config`, :mod:`fpdt.train.preflight`:
   sizes, the model's config.json and weights, heads vs sp, batch arithmetic, paths, the
   ``--resume`` checkpoint) and load the data, so that a bad input fails in seconds;
2. process group (gloo on CPU, NCCL on CUDA; a 1-process group without a launcher),
   then DeepSpeed's communication layer on top of it, then the SP groups;
3. the model (seeded, so every rank builds the same random weights);
4. ``deepspeed.initialize`` (ZeRO partitions the model here, unless it already is: see
   :func:`build_model`), resume, train, save.

With ``--lora-rank`` (or ``--lora-init``) step 3 attaches LoRA adapters and freezes the rest
(:mod:`fpdt.train.lora`); the memory check, the FLOPs, the checkpoints and the export follow.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import sys
import time
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from fpdt.attention.kernels import BACKENDS
from fpdt.offload.nvme import NVMeError, NVMeTier
from fpdt.offload.runtime import RUNTIMES
from fpdt.plan import trainer_run
from fpdt.plan.memory_model import saved_attention_bytes
from fpdt.train import lora, preflight, saving, zero, zero_load
from fpdt.comm import PLACEMENTS
from fpdt.options import ATTENTION_CHECKPOINT_MODES, CHECKPOINT_MODES, LM_HEAD_WGRAD_MODES
from fpdt.model.moe import moe_kernel
from fpdt.train.config import (PRECISIONS, ConfigError, TrainerOptions, RunLayout, ds_dtype_name, ds_zero_stage, load_ds_config,
                               cpu_runtime, merge_flags, unknown_ds_keys, validate)
from fpdt.train.data import (PACKINGS, DataError, PackedWindows, Windows, bin_dtype_for_vocab, check_vocab, list_data_files,
                             load_documents, load_tokens)
from fpdt.train.errors import RunError, debug_enabled, report, this_rank
from fpdt.train.loop import CommFailure, DeviceOutOfMemory, LoopSpec, NonFiniteStep, NVMeFault, run_steps
from fpdt.train.metrics import ModelShape, resolve_peak_flops
from fpdt.train.parallel import ParallelState, build_parallel_state, env_world_size, init_distributed, pick_device
from fpdt.train.progress import Progress, StepRecord, summary

ENV_RUNTIME = "FPDT_RUNTIME"
"""The environment variable that sets ``--runtime``'s default (:func:`fpdt_options`)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fpdt-train",
        description="Train a Llama-family model on long sequences with FPDT and DeepSpeed ZeRO. "
                    "Runs as one process (CPU or one GPU) or under torchrun / deepspeed.")
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (config.json + safetensors)")
    src.add_argument("--model-config", metavar="JSON", help="config.json (or its directory): random init with --seed")
    m.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json for text data (default: next to the model)")
    d = p.add_argument_group("data")
    d.add_argument("--data", required=True, metavar="PATH", help=".npy/.bin token ids, .txt/.jsonl text, or a directory")
    d.add_argument("--data-dtype", choices=["uint16", "uint32"],
                   help="element type of .bin files (default: uint16 when the vocabulary has at most 65536 ids, "
                        "else uint32)")
    d.add_argument("--seq-len", type=int, required=True, help="global tokens per training sequence")
    d.add_argument("--shuffle", action="store_true", help="visit windows in a seeded random order")
    d.add_argument("--pack-documents", nargs="?", const="in-order", choices=PACKINGS, metavar="PACKING",
                   help="windows of documents (each .txt file, each .jsonl line; .npy/.bin streams split after "
                        "every eos_token_id): positions restart and attention is masked at each document, whose "
                        "last token predicts nothing; a document longer than --seq-len is split, each "
                        "continuation from position 0. PACKING: in-order (default: whole documents in order, "
                        "next fit), best-fit (whole documents, each window filled from a buffer of the next "
                        "1024: less padding) or split (full windows, a document crossing a window's end "
                        "continues in the next)")
    f = p.add_argument_group("FPDT (flags win over the \"fpdt\" section of the DeepSpeed JSON)")
    f.add_argument("--sp", type=int, help="sequence-parallel size (divides the world size; default 1); "
                                         "shorthand for --hp SP --cp 1")
    f.add_argument("--hp", type=int, help="2D mesh: head-parallel (Ulysses) degree (default: 1 with --cp)")
    f.add_argument("--cp", type=int, help="2D mesh: context-parallel (ring attention) degree (default 1)")
    f.add_argument("--placement", choices=PLACEMENTS,
                   help="2D mesh placement: HP ranks adjacent (head_first, default) or CP ranks adjacent")
    f.add_argument("--inner-ring", type=int, help="double-ring inner size (divides --cp; default: one ring)")
    f.add_argument("--chunk-size", type=int,
                   help="global tokens per FPDT chunk, a multiple of sp (2 x hp x cp on a 2D mesh) dividing "
                        "--seq-len (default: 65536, or the whole sequence when shorter; else the largest such "
                        "chunk below 64K, down to 8K; else the whole sequence)")
    f.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="offload attention chunks to pinned host memory (CUDA only; default: on with CUDA, "
                        "off elsewhere)")
    f.add_argument("--mlp-chunks", type=int, help="MLP chunks (default ceil(2 u intermediate / hidden); 0 = unchunked)")
    f.add_argument("--loss-chunks", type=int, help="loss chunks (default ceil(2 vocab / hidden); 0 = unchunked)")
    f.add_argument("--lm-head-wgrad", choices=LM_HEAD_WGRAD_MODES,
                   help="LM-head weight gradient: recomputed logits in backward, no fp32 [vocab, hidden] "
                        "buffer (recompute, default: faster and smaller on an H100 at Llama-3 shapes) or that "
                        "buffer summed over the loss chunks (accumulate)")
    f.add_argument("--checkpoint-device-layers", type=int, metavar="K",
                   help="with --checkpoint offload, keep the last K decoder layers' inputs on the GPU instead of "
                        "the host (default 0), for runs whose host memory is the limit; fpdt-plan suggests K")
    f.add_argument("--nvme-path", metavar="DIR",
                   help="with --checkpoint offload, a directory on a local NVMe drive for the layer checkpoints "
                        "(the NVMe tier, docs/nvme.md); each rank writes under DIR/rank{R}/ and removes its files "
                        "at exit. Default: off (host memory)")
    f.add_argument("--nvme-layers", type=int, metavar="K",
                   help="with --nvme-path, only the first K decoder layers' checkpoints (input, saved attention "
                        "output) go to disk, the rest stay in host memory (default: the fewest that bring the "
                        "memory check's predicted host offload within the node's available memory, as the start-up "
                        "line says)")
    f.add_argument("--stream-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="run every layer a chunk at a time with the residual stream in host memory: device memory "
                        "flat in the sequence length (implies --offload and --checkpoint offload). Default: on when "
                        "the run's memory check predicts the device does not hold it otherwise")
    f.add_argument("--attention-checkpoint", choices=list(ATTENTION_CHECKPOINT_MODES),
                   help="with checkpointing, whether a layer's recompute runs the attention forward again "
                        "(recompute) or reads the attention output and lse its forward kept beside the layer input "
                        "(save: 3 attention passes instead of 4). Default: save for as many layers as the run's "
                        "memory check predicts the host and device hold, else recompute")
    f.add_argument("--save-attention-layers", type=int, metavar="K",
                   help="with --attention-checkpoint save, only the first K layers save (default: every layer when "
                        "given save; as many as fit when left to choose)")
    f.add_argument("--attention-backend", choices=list(BACKENDS), metavar="KERNEL",
                   help=f"attention kernel, one of {', '.join(BACKENDS)} (default: automatic, the first in that "
                        f"order that is installed, fits the device, dtype and head size and passes its "
                        f"self-check; cuDNN ahead of FlashAttention-2 where torch's own SDPA prefers it)")
    f.add_argument("--checkpoint", choices=CHECKPOINT_MODES,
                   help="activation checkpointing; offload keeps layer inputs on the host (CUDA only; "
                        "default: offload with CUDA, off elsewhere)")
    f.add_argument("--runtime", choices=list(RUNTIMES),
                   help="device runtime of the offload copies: sim runs them on simulated CUDA streams, which "
                        "allows --offload and --checkpoint offload on the CPU (to test them); sync; cuda "
                        f"(default: ${ENV_RUNTIME} if set, else cuda on CUDA and sync elsewhere)")
    lora.add_arguments(p)
    r = p.add_argument_group("run")
    r.add_argument("--deepspeed", metavar="JSON",
                   help="DeepSpeed config (optimizer, precision, ZeRO, ...; default: ZeRO-3, AdamW lr 1e-3, "
                        "bf16 on CUDA, fp32 elsewhere)")
    r.add_argument("--steps", type=int, required=True, help="total optimizer steps (a resumed run counts on)")
    r.add_argument("--seed", type=int, default=0, help="seed for random init and --shuffle")
    r.add_argument("--log-json", metavar="FILE", help="append one JSON object per step to FILE")
    r.add_argument("--mem-accounting", action=argparse.BooleanOptionalAction, default=True,
                   help="on the CPU, count each step's device working set for peak_mem_gib with a dispatch mode "
                        "(it costs step time: docs/train.md); --no-mem-accounting skips it and logs "
                        "peak_mem_gib as null on the CPU. No effect on CUDA, where the allocator's peaks are read")
    r.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (default: datasheet / measured)")
    r.add_argument("--save-dir", metavar="DIR", help="write DeepSpeed checkpoints here")
    r.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    r.add_argument("--resume", metavar="PATH", help="continue from a --save-dir (newest) or one step<N> dir")
    r.add_argument("--keep-last", type=int, default=0, metavar="N",
                   help="after each save keep only the newest N checkpoints (never the one 'latest' names; "
                        "default 0: keep all)")
    r.add_argument("--export-hf", metavar="DIR",
                   help="at the end, also write a Hugging Face checkpoint, or for a LoRA run a PEFT adapter "
                        "directory (needs --save-dir)")
    r.add_argument("--skip-nonfinite", type=int, default=0, metavar="N",
                   help="skip (do not apply) up to N steps whose loss is not finite; default 0: stop at the first, "
                        "naming the step and the last good checkpoint")
    r.add_argument("--dist-timeout-min", type=float, default=30.0, metavar="MIN",
                   help="minutes a collective waits for the other ranks before the run stops with an error "
                        "(a rank that died or stalls; default 30)")
    r.add_argument("--debug", action="store_true", help="show the full traceback of an error (also: FPDT_DEBUG=1)")
    r.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


def fpdt_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {"sp": args.sp, "hp": args.hp, "cp": args.cp, "placement": args.placement,
            "inner_ring": args.inner_ring, "chunk_size": args.chunk_size, "offload": args.offload,
            "mlp_chunks": args.mlp_chunks, "loss_chunks": args.loss_chunks, "lm_head_wgrad": args.lm_head_wgrad,
            "attention_backend": args.attention_backend, "checkpoint": args.checkpoint,
            "checkpoint_device_layers": args.checkpoint_device_layers,
            "attention_checkpoint": args.attention_checkpoint, "save_attention_layers": args.save_attention_layers,
            "runtime": args.runtime, "stream_layers": args.stream_layers, "nvme_path": args.nvme_path,
            "nvme_layers": args.nvme_layers}


def fpdt_options(args: argparse.Namespace, section: dict[str, Any] | None, device_type: str | None = None,
                 said: list[str] | None = None) -> TrainerOptions:
    """The run's FPDT options: flags (and what they imply) > the ``"fpdt"`` JSON section >
    ``$FPDT_RUNTIME`` (the ``runtime`` default, read here only: the library takes the runtime as
    an option) > defaults; given the ``device_type``, offload on a CPU on the simulated runtime
    (:func:`fpdt.train.config.cpu_runtime`). The start-up lines saying so are appended to ``said``."""
    env = os.environ.get(ENV_RUNTIME, "").strip()
    if env and env not in RUNTIMES:
        raise ConfigError(f"{ENV_RUNTIME}={env!r} is not a device runtime: use one of {', '.join(RUNTIMES)}, "
                          f"or unset it")
    opts, overrode = merge_flags(fpdt_flags(args), section, defaults={"runtime": env or None})
    sim = None
    if device_type is not None:
        opts, sim = cpu_runtime(opts, device_type)
    (said if said is not None else []).extend(line for line in (overrode, sim) if line)
    return opts


def _check_args(args: argparse.Namespace) -> None:
    for flag, value in (("--steps", args.steps), ("--save-every", args.save_every), ("--keep-last", args.keep_last),
                        ("--skip-nonfinite", args.skip_nonfinite)):
        if value < 0:
            raise ConfigError(f"{flag} {value} must be >= 0")
    if args.steps == 0:
        raise ConfigError("--steps 0 trains nothing; pass the total number of optimizer steps, N >= 1 "
                          "(a resumed run counts on from its saved step)")
    if not args.dist_timeout_min > 0:
        raise ConfigError(f"--dist-timeout-min {args.dist_timeout_min} must be a positive number of minutes")
    for flag, value in (("--save-every", args.save_every), ("--export-hf", args.export_hf),
                        ("--keep-last", args.keep_last)):
        if value and not args.save_dir:
            raise ConfigError(f"{flag} needs --save-dir DIR (checkpoints are written there"
                              f"{'; the export is made from the last one' if flag == '--export-hf' else ''})")
    if args.tokenizer is not None and not os.path.isfile(args.tokenizer):
        raise ConfigError(f"--tokenizer {args.tokenizer}: no such file; pass a tokenizer.json")


# ----------------------------------------------------------------------------- set-up pieces

def model_dir(args: argparse.Namespace) -> str:
    path = args.model or args.model_config
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def build_model(args: argparse.Namespace, opts: TrainerOptions, plan: RunLayout, ps: ParallelState, dtype: torch.dtype,
                ds_config: dict[str, Any] | None = None, lora_spec=None):
    """The FPDT model in ``dtype``; with ``lora_spec`` (:func:`fpdt.train.lora.spec_from_args`)
    LoRA adapters attached to it (in ``dtype``, seeded with ``--seed``, or ``--lora-init``'s)
    and every other parameter frozen, on each of the three paths below.

    * ``--model DIR`` with ZeRO-3 in ``ds_config``: built under ``deepspeed.zero.Init`` and
      the checkpoint streamed in one tensor at a time (:mod:`fpdt.train.zero_load`), so a
      rank never holds more than its shards plus one full tensor.
    * ``--model DIR`` otherwise: the whole checkpoint on every rank's host (ZeRO-1/2 keep
      full parameters on every rank anyway).
    * ``--model-config`` (random init): always the full model on every rank, seeded, which
      ``deepspeed.initialize`` partitions under ZeRO-3. :func:`fpdt.model.from_config` draws
      every full tensor from one seeded stream in a fixed order, so the weights are the
      same for any world size or ZeRO stage and equal to a single-process model's (the
      parity tests rely on this). Under ``zero.Init`` each module would instead draw its
      own default init at construction, giving other weights; reproducing the stream would
      need a gather and a rank-0 draw per parameter, which is not done. Random init of a
      model that does not fit on one host is therefore not supported.
    """
    from fpdt import model as fm

    options = opts.model_options(plan, mesh=ps.mesh) if ps.mesh is not None else \
        opts.model_options(plan, group=ps.sp_group)
    kw = dict(options=options)
    torch.manual_seed(args.seed)  # same random weights on every rank
    if args.model and ds_config is not None and ds_zero_stage(ds_config) == 3:
        model = zero_load.from_pretrained_zero3(args.model, ds_config, dtype=dtype, device=ps.device, **kw)
    elif args.model:
        model = fm.from_pretrained(args.model, dtype=dtype, **kw)
    else:
        model = fm.from_config(args.model_config, dtype=dtype, **kw)
    if lora_spec is not None:
        lora.attach(model, lora_spec, seed=args.seed, dtype=dtype, init=args.lora_init)
    return model


def load_windows(args: argparse.Namespace, hf_config: dict, vocab_size: int,
                 plan: RunLayout) -> tuple[Windows | PackedWindows, str | None]:
    tokenizer = args.tokenizer or os.path.join(model_dir(args), "tokenizer.json")
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if args.data_dtype and not any(f.endswith(".bin") for f in list_data_files(args.data)):
        raise DataError(f"--data-dtype {args.data_dtype} is for raw .bin token files, and --data {args.data} has none "
                        f"(text is tokenized, .npy files carry their dtype); drop --data-dtype")
    eos = eos if isinstance(eos, int) else None
    source = dict(bin_dtype=args.data_dtype or bin_dtype_for_vocab(vocab_size), tokenizer_path=tokenizer, eos_id=eos)
    if args.pack_documents:
        tokens, lengths = load_documents(args.data, **source)
        check_vocab(tokens, vocab_size, args.data)
        pad = hf_config.get("pad_token_id")
        pad = pad if isinstance(pad, int) and 0 <= pad < vocab_size else (eos if eos is not None else 0)
        # with a ring, each window's documents in the order that evens out the CP ranks' attention work
        windows = PackedWindows(tokens, lengths, args.seq_len, pad_id=pad, shuffle=args.shuffle, seed=args.seed,
                                packing=args.pack_documents, balance_cp=plan.cp, balance_chunks=plan.num_chunks)
        return windows, tokenizer if os.path.isfile(tokenizer) else None
    tokens = load_tokens(args.data, **source)
    check_vocab(tokens, vocab_size, args.data)
    windows = Windows(tokens, args.seq_len, shuffle=args.shuffle, seed=args.seed)
    return windows, tokenizer if os.path.isfile(tokenizer) else None


def run_info(args: argparse.Namespace, plan: RunLayout, micro: int, gas: int) -> dict[str, Any]:
    """What decides which windows a step reads, and in what order (compared on resume)."""
    return {"seq_len": plan.seq_len, "dp": plan.dp, "micro_batch": micro, "grad_accum": gas,
            "shuffle": args.shuffle, "seed": args.seed, "data": os.path.abspath(args.data),
            # None: unpacked, as runs before packing; True: in order, as runs before the other packings
            "pack_documents": None if not args.pack_documents else
            True if args.pack_documents == "in-order" else args.pack_documents,
            # packed windows are arranged for the ring (PackedWindows.arrangement); None: not arranged
            "balanced_cp": plan.cp if args.pack_documents and plan.cp > 1 else None}


# ----------------------------------------------------------------------------- the run

def run(args: argparse.Namespace) -> list[StepRecord]:
    """Everything ``fpdt-train`` does; returns this rank's step records."""
    started = time.perf_counter()
    # 1. everything that needs no process group: flags, configs, model source, data, checkpoint
    _check_args(args)
    lora_spec = lora.spec_from_args(args)
    device = pick_device()
    ds_config, section = load_ds_config(args.deepspeed, device.type)
    said: list[str] = list(unknown_ds_keys(ds_config))
    opts = fpdt_options(args, section, device.type, said)
    world = dist.get_world_size() if dist.is_initialized() else env_world_size()
    plan = validate(opts, args.seq_len, world, device.type, ds_config)
    dtype_name = ds_dtype_name(ds_config)
    source, notes, lora_spec = preflight_checks(args, plan, ds_config, dtype_name, opts.checkpoint_device_layers,
                                                lora_spec, opts.save_attention_layers, opts.nvme_layers)
    lora_record = lora.record(lora_spec, args.model, args.model_config, args.seed, source.config)
    kernel = preflight.attention_kernel(opts.backend, device, PRECISIONS[dtype_name], source.config.head_dim)
    windows, tokenizer = load_windows(args, source.config.to_hf(), source.config.vocab_size, plan)

    # 2. process groups
    timeout = timedelta(minutes=args.dist_timeout_min)
    init_distributed(device, timeout)
    opts, plan, streaming = _choose_streaming(source, plan, opts, ds_config, dtype_name, device, world,
                                              not kernel.native_gqa, lora_spec.rank if lora_spec else 0)
    memory = check_memory(source, plan, opts, ds_config, dtype_name, device, kernel_expands_gqa=not kernel.native_gqa,
                          lora_rank=lora_spec.rank if lora_spec else 0)
    memory = replace(memory, lines=(*said, *streaming, *memory.lines))
    opts = _with_choices(opts, memory)
    opts, memory = _with_tier(opts, memory, plan, source.config, dtype_name)
    zero.init_deepspeed_comm(device, timeout)
    ps = build_parallel_state(plan.sp, device, cp=plan.cp, placement=plan.placement, inner_ring=plan.inner_ring,
                              timeout=timeout)

    # 3. model, engine, resume
    model = build_model(args, opts, plan, ps, PRECISIONS[dtype_name], ds_config, lora_spec)
    hf_config = model.config.to_hf()
    engine = zero.build_engine(model, ds_config)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    info = run_info(args, plan, micro, gas)
    start, rng = 0, None
    if args.resume:
        state = saving.load(engine, args.resume, ps.rank, lora=lora_spec is not None)
        start, rng = state["step"], state["rng"]
        for diff in saving.check_same_run(state["run"], info):
            _say(ps, f"warning: the resumed run differs from the saved one, so its next step is not the "
                     f"one the saved run would have taken ({diff})")
    if args.save_dir and ps.is_main:
        saving.write_model_files(args.save_dir, hf_config, tokenizer, lora_spec,
                                     os.path.abspath(args.model) if args.model else None)

    # 4. train
    peak, peak_src = resolve_peak_flops(device, dtype_name, args.peak_tflops)
    _say(ps, f"fpdt-train: world={ps.world_size} sp={plan.sp} (hp={plan.hp} cp={plan.cp}) dp={plan.dp} "
             f"seq_len={plan.seq_len} "
             f"chunk={plan.chunk_size} chunks={plan.num_chunks} offload={'on' if plan.offload else 'off'} "
             f"checkpoint={plan.checkpoint} attention={kernel.name}{_experts_words(model, device, dtype_name)} "
             f"micro_batch={micro} grad_accum={gas} dtype={dtype_name} "
             f"{windows.describe()} steps {start}->{args.steps} "
             f"peak={'n/a' if peak is None else f'{peak / 1e12:.3g}'} TFLOP/s ({peak_src})"
             + _choices_words(memory, model.config.num_layers, opts.checkpoint_device_layers))
    for line in memory.lines + tuple(f"warning: {n}" for n in notes):
        _say(ps, line)
    if lora_spec is not None:
        resumed = os.path.join(*saving.resolve(args.resume)) if args.resume else None
        _say(ps, lora.describe(model, lora_spec, args.lora_init, resumed))
    progress = Progress(args.steps, start, ps.is_main, args.log_json, resumed=bool(args.resume))
    spec = LoopSpec(plan=plan, parallel=ps, micro_batch=micro, grad_accum=gas, shape=ModelShape.from_config(model.config),
                    peak_flops=peak, recompute=plan.checkpoint != "off", skip_nonfinite=args.skip_nonfinite,
                    mem_accounting=args.mem_accounting, lora=lora_spec, runtime=opts.runtime,
                    nvme_path=opts.nvme_path, nvme_tier=opts.nvme_tier)
    saver = Saver(args, engine, ps, info, dtype_name, progress, lora_record)

    def on_step_end(done: int) -> None:
        if args.save_dir and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            saver.save(done)

    if rng is not None:
        saving.set_rng_state(rng)   # last: the set-up above may draw (e.g. the CPU peak's matmuls)
    try:
        records = run_steps(engine, windows, spec, start, args.steps, progress, on_step_end)
    except NonFiniteStep as e:
        raise RunError(f"{e}; the run stopped without saving. {saver.last_good_hint()}",
                       same_on_every_rank=True) from e
    except CommFailure as e:
        raise RunError(str(e)) from e
    except NVMeFault as e:
        raise RunError(f"{e}, and nothing was saved for it. {saver.resume_hint()}", same_on_every_rank=True) from e
    except DeviceOutOfMemory as e:
        raise RunError(trainer_run.out_of_memory_advice(e.step, plan, opts, memory.estimate, e.detail,
                                                        memory.capacity_bytes,
                                                        memory.recommend() if memory.recommend else None,
                                                        source.config_path, args.deepspeed,
                                                        lora_spec.rank if lora_spec else 0)) from e
    finally:
        progress.close()
        _close_tier(opts)
    if args.save_dir and args.steps not in saver.saved and start >= args.steps:
        saver.save(args.steps)
    if args.export_hf:
        _export_at_end(args, ps)
    _say(ps, summary(records, start, time.perf_counter() - started, saver.last if args.save_dir else None,
                     args.export_hf, trainer_run.prediction(memory.estimate, memory.capacity_bytes,
                                                            _predicted_step(source, plan, opts, ds_config, dtype_name,
                                                                            device, kernel, lora_spec))))
    return records


def _predicted_step(source, plan: RunLayout, opts: TrainerOptions, ds_config: dict[str, Any], dtype_name: str,
                    device: torch.device, kernel, lora_spec) -> float | None:
    """fpdt-plan's step time for this run on this GPU (:func:`fpdt.plan.trainer_run.step_time`), or None."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return trainer_run.step_time(source.config, plan, opts, ds_config, dtype_name, props.name, props.total_memory,
                                 trainer_run.ranks_on_this_node(plan.world_size, torch.cuda.device_count()),
                                 not kernel.native_gqa, lora_spec.rank if lora_spec else 0)


def _close_tier(opts: TrainerOptions) -> None:
    """With the NVMe tier, close its stores: the files go with the run, not at the interpreter's exit."""
    if opts.nvme_tier is not None:
        opts.nvme_tier.close(raise_errors=False)


def _with_choices(opts: TrainerOptions, memory: MemoryCheck) -> TrainerOptions:
    """``opts`` with the choices the memory check made (or the ones given): the attention
    checkpoint and, with the NVMe tier, ``nvme_layers``."""
    if memory.attention is not None:
        opts = replace(opts, attention_checkpoint=memory.attention.mode,
                       save_attention_layers=memory.attention.layers if memory.attention.mode == "save" else None)
    if memory.nvme is not None:
        opts = replace(opts, nvme_layers=memory.nvme.layers)
    return opts


def _experts_words(model, device, dtype_name: str) -> str:
    """`` experts=E/k (kernel)`` for an MoE model (its kernel: :func:`fpdt.model.moe.moe_kernel`), else empty."""
    moe = model.config.moe
    if moe is None:
        return ""
    kernel = moe_kernel(torch.device(device), PRECISIONS[dtype_name], model.config.hidden_size, moe.moe_intermediate_size)
    return f" experts={moe.num_experts}/top{moe.top_k} ({kernel})"


def _choices_words(memory: MemoryCheck, num_layers: int, device_layers: int) -> str:
    """The start-up line's words for those choices, and why."""
    words = [memory.attention.line(num_layers)] if memory.attention is not None else []
    if memory.nvme is not None:
        words.append(memory.nvme.line(num_layers - device_layers))
    return "".join(f" {w}" for w in words)


def preflight_checks(args: argparse.Namespace, plan: RunLayout, ds_config: dict[str, Any], dtype_name: str,
                     device_layers: int = 0, lora_spec=None,
                     save_layers: int | None = None,
                     nvme_layers: int | None = None) -> tuple[preflight.ModelSource, list[str], Any]:
    """The checks of :mod:`fpdt.train.preflight` and :mod:`fpdt.train.lora` for this run
    (before any process group). Returns the model source, warnings to print and the LoRA spec for
    this model (:func:`fpdt.train.lora.for_model`)."""
    source = preflight.model_source(args.model, args.model_config)
    lora_spec = lora.for_model(lora_spec, source.config, args.lora_targets is not None or bool(args.lora_init))
    lora.check_plan(lora_spec, plan.mlp_chunks, source.config_path, source.config, args.lora_init)
    preflight.check_heads(source.config, plan.hp, source.config_path, "--sp" if plan.cp == 1 else "--hp")
    preflight.check_device_layers(source.config, device_layers, source.config_path)
    preflight.check_save_layers(source.config, save_layers, source.config_path)
    preflight.check_nvme_layers(source.config, nvme_layers, source.config_path)
    preflight.check_batch_size(ds_config, plan.world_size)
    preflight.check_save_dir(args.save_dir)
    preflight.check_output_dir("--export-hf", args.export_hf)
    preflight.check_output_file("--log-json", args.log_json)
    preflight.check_skip_nonfinite(args.skip_nonfinite, ds_config, plan.world_size)
    notes = []
    if args.resume:
        saved = preflight.check_resume(args.resume, steps=args.steps, world_size=plan.world_size, precision=dtype_name,
                                       model=source, zero_stage=ds_zero_stage(ds_config),
                                       default_config=args.deepspeed is None)
        notes = lora.check_resume(args.resume, saved.lora,
                                  lora.record(lora_spec, args.model, args.model_config, args.seed, source.config))
    return source, notes, lora_spec


@dataclass(frozen=True)
class MemoryCheck:
    """The planner's view of this run (:mod:`fpdt.plan.trainer_run`)."""

    estimate: Any
    """:class:`fpdt.plan.memory_model.MemoryEstimate`, or None when the model cannot describe the run."""
    capacity_bytes: float | None
    """The GPU's memory (None on the CPU)."""
    recommend: Callable[[], Any] | None
    """On CUDA: the planner's :class:`fpdt.plan.trainer_run.Recommendation`, searched on the
    first call only (a warning or an out-of-memory line needs it; a run that fits never does)."""
    lines: tuple[str, ...]
    """What to print at start-up: the prediction, a device-memory warning, or why there is none."""
    attention: trainer_run.AttentionCheckpoint | None = None
    """The run's ``attention_checkpoint`` / ``save_attention_layers``: as given, or chosen here
    from the predicted memory (:func:`fpdt.plan.trainer_run.attention_checkpoint`)."""
    nvme: trainer_run.NVMeLayers | None = None
    """With ``--nvme-path``: the run's ``nvme_layers``, as given or chosen here from the
    predicted host memory (:func:`fpdt.plan.trainer_run.nvme_layers`)."""


def _choose_streaming(source: preflight.ModelSource, plan: RunLayout, opts: TrainerOptions, ds_config: dict[str, Any],
                      dtype_name: str, device: torch.device, world: int, expands_gqa: bool,
                      lora_rank: int) -> tuple[TrainerOptions, RunLayout, tuple[str, ...]]:
    """The run with ``stream_layers`` as given, or on CUDA chosen by the predicted device peak
    (:func:`fpdt.plan.trainer_run.stream_layers`); the start-up line that says why when it was chosen."""
    if opts.stream_layers is not None or device.type != "cuda":
        return opts, plan, ()
    capacity = torch.cuda.get_device_properties(device).total_memory
    ranks = trainer_run.ranks_on_this_node(plan.world_size, torch.cuda.device_count())

    def estimate(o: TrainerOptions, p: RunLayout):
        return trainer_run.estimate(source.config, p, o, ds_config, dtype_name, device.type, ranks, expands_gqa,
                                    lora_rank)

    streamed_opts = replace(opts, stream_layers=True)
    try:
        unstreamed = estimate(opts, plan)
        streamed_plan = validate(streamed_opts, plan.seq_len, world, device.type, ds_config)
    except Exception:  # noqa: BLE001 -- a run the planner's model cannot describe, or not streamable: as given
        return opts, plan, ()
    chosen, why = trainer_run.stream_layers(None, unstreamed, lambda: estimate(streamed_opts, streamed_plan), capacity)
    return (streamed_opts, streamed_plan, (f"fpdt-train: {why}",)) if chosen else (opts, plan, ())


def check_memory(source: preflight.ModelSource, plan: RunLayout, opts: TrainerOptions, ds_config: dict[str, Any],
                 dtype_name: str, device: torch.device, kernel_expands_gqa: bool | None = None,
                 lora_rank: int = 0) -> MemoryCheck:
    """The host check of :mod:`fpdt.plan.trainer_run`, decided once for all ranks on the
    node whose offload exceeds its available memory the most (every rank reaches the one
    collective and raises the same :class:`ConfigError`), and on CUDA the device-memory
    warning and the planner's settings. A run the planner's model cannot describe is not
    stopped: it goes on without them, with a note. ``lora_rank``: a LoRA run's, predicted as
    such (:func:`fpdt.plan.trainer_run.estimate`) and, on CUDA, given the planner's
    settings for LoRA of that rank (:func:`fpdt.plan.trainer_run.recommend`)."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    ranks = trainer_run.ranks_on_this_node(plan.world_size, gpus)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    available = float(psutil.virtual_memory().available)
    est, notes, parts = None, [], {}
    try:
        est = trainer_run.estimate(source.config, plan, opts, ds_config, dtype_name, device.type, ranks,
                                   kernel_expands_gqa, lora_rank)
    except Exception as e:  # noqa: BLE001 -- a limit of the planner's model never stops a run the trainer can run
        notes.append(f"note: fpdt-plan's model cannot describe this run ({type(e).__name__}: {e}); no memory "
                     f"prediction or host check")
    nvme, est = _choose_nvme_layers(source, plan, opts, ds_config, dtype_name, device, est, available, ranks,
                                    kernel_expands_gqa, lora_rank)
    if nvme is not None:
        opts = replace(opts, nvme_layers=nvme.layers)
    attention, est = _choose_attention_checkpoint(source, plan, opts, ds_config, dtype_name, device, est, available,
                                                  capacity, ranks, kernel_expands_gqa, lora_rank)
    if est is not None:
        parts = trainer_run.host_offload_bytes(est)
    worst_rank, need, worst_available, worst_ranks = _worst_node(sum(parts.values()), available, ranks, device)
    me = dist.get_rank() if dist.is_initialized() else 0
    error = trainer_run.host_memory_error(need, worst_available, worst_ranks, plan.seq_len,
                                          parts if worst_rank == me else None,
                                          "this node" if plan.world_size == 1 else f"rank {worst_rank}'s node")
    if error is not None:
        raise error
    if est is None:
        return MemoryCheck(None, capacity, None, tuple(notes), attention, nvme)
    recommend = None
    if capacity is not None:
        recommend = functools.cache(functools.partial(_recommend, source.config, plan, opts, ds_config, ranks, capacity,
                                                      available, lora_rank))
    lines = (trainer_run.prediction_line(est, capacity),
             trainer_run.device_memory_warning(est, capacity, recommend) if capacity else None)
    return MemoryCheck(est, capacity, recommend, tuple(line for line in lines if line), attention, nvme)


def _choose_nvme_layers(source: preflight.ModelSource, plan: RunLayout, opts: TrainerOptions, ds_config: dict[str, Any],
                        dtype_name: str, device: torch.device, est, available: float, ranks: int,
                        kernel_expands_gqa: bool | None, lora_rank: int) -> tuple[trainer_run.NVMeLayers | None, Any]:
    """The run's ``nvme_layers`` (:func:`fpdt.plan.trainer_run.nvme_layers`; None without
    ``--nvme-path``) and its memory estimate with it. Left to choose (no ``--nvme-layers``),
    every rank computes the fewest its node's host memory needs, against the run as given (an
    attention checkpoint still to choose as recompute), and all take the largest (one
    all-reduce), so that every rank builds the same model."""
    if opts.nvme_path is None:
        return None, est
    cfg, given = source.config, opts.nvme_layers
    if est is None:
        why = (f"--nvme-layers {given}" if given is not None else
               "fpdt-plan's model cannot describe this run, so every offloaded layer goes to disk")
        return trainer_run.NVMeLayers(given, why), est

    @functools.cache
    def estimate_with(k: int):
        return trainer_run.estimate(cfg, plan, replace(opts, nvme_layers=k), ds_config, dtype_name, device.type, ranks,
                                    kernel_expands_gqa, lora_rank)

    def host_need(k: int) -> float:
        return sum(trainer_run.host_offload_bytes(estimate_with(k)).values())

    choice = trainer_run.nvme_layers(given, cfg.num_layers - opts.checkpoint_device_layers, host_need, available)
    if given is not None:
        return choice, est
    k = _on_every_rank(choice.layers, device, dist.ReduceOp.MAX)
    if k != choice.layers:
        choice = trainer_run.NVMeLayers(k, f"the fewest first layers on disk that bring every node's predicted host "
                                           f"offload within its available memory ({choice.layers} would do on this one)")
    return choice, estimate_with(k)


def _choose_attention_checkpoint(source: preflight.ModelSource, plan: RunLayout, opts: TrainerOptions,
                                 ds_config: dict[str, Any], dtype_name: str, device: torch.device, est, available: float,
                                 capacity: float | None, ranks: int, kernel_expands_gqa: bool | None,
                                 lora_rank: int) -> tuple[trainer_run.AttentionCheckpoint, Any]:
    """The run's attention checkpoint (:func:`fpdt.plan.trainer_run.attention_checkpoint`) and
    its memory estimate with it. Left to choose (no ``--save-attention-layers``, not
    ``recompute``), every rank computes how many layers' saved outputs its node's host memory
    and its GPU hold beside the recompute estimate ``est``, and all take the smallest (one
    all-reduce), so that every rank builds the same model."""
    cfg = source.config
    choose = (plan.checkpoint != "off" and opts.attention_checkpoint != "recompute"
              and opts.save_attention_layers is None)
    fit, per_layer = 0, None
    if choose and est is not None:
        setup = trainer_run.planned_setup(plan, opts, ds_config, dtype_name, device.type, kernel_expands_gqa,
                                          cfg.head_dim)
        per_layer = saved_attention_bytes(cfg, setup)
        fit = trainer_run.saving_layers_that_fit(cfg, setup, est, available, capacity, ranks)
    if choose:
        fit = _smallest_on_any_rank(fit, device)
    if choose and est is None:
        mode = "save" if opts.attention_checkpoint == "save" else "recompute"
        why = "fpdt-plan's model cannot describe this run, so nothing predicts room for saved outputs"
        return trainer_run.AttentionCheckpoint(mode, None, f"{opts.attention_checkpoint or 'default'}: {why}"), est
    attention = trainer_run.attention_checkpoint(opts.attention_checkpoint, opts.save_attention_layers,
                                                 plan.checkpoint, fit, cfg.num_layers, per_layer)
    if choose and attention.mode == "save":
        chosen = replace(opts, attention_checkpoint="save", save_attention_layers=attention.layers)
        est = trainer_run.estimate(cfg, plan, chosen, ds_config, dtype_name, device.type, ranks, kernel_expands_gqa,
                                   lora_rank)
    return attention, est


def _smallest_on_any_rank(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks (one all-reduce; itself on one process)."""
    return _on_every_rank(value, device, dist.ReduceOp.MIN)


def _on_every_rank(value: int, device: torch.device, op) -> int:
    """``value`` reduced by ``op`` over the ranks (one all-reduce; itself on one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op)
    return int(t.item())


def _recommend(*args) -> trainer_run.Recommendation:
    """:func:`fpdt.plan.trainer_run.recommend`, or why there is no suggestion."""
    try:
        return trainer_run.recommend(*args)
    except Exception as e:  # noqa: BLE001 -- as in check_memory: advice only
        return trainer_run.Recommendation(None, f"fpdt-plan cannot suggest settings ({type(e).__name__}: {e})")


def _worst_node(need: float, available: float, ranks: int, device: torch.device) -> tuple[int, float, float, int]:
    """``(rank, need, available, ranks on its node)`` of the rank whose node's offload exceeds
    its available memory the most, from every rank's figures (one all-gather)."""
    mine = torch.tensor([need, available, float(ranks)], dtype=torch.float64, device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return 0, need, available, ranks
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    figures = [tuple(float(x) for x in row.tolist()) for row in rows]
    worst = max(range(len(figures)), key=lambda r: figures[r][0] - figures[r][1])
    n, a, k = figures[worst]
    return worst, n, a, int(k)


class Saver:
    """Saves checkpoints, says so (step, path, size), applies ``--keep-last``, and
    remembers the last one for error messages."""

    def __init__(self, args: argparse.Namespace, engine, ps: ParallelState, info: dict[str, Any], precision: str,
                 progress: Progress, lora_record: dict[str, Any] | None = None) -> None:
        self.args, self.engine, self.ps, self.info, self.precision = args, engine, ps, info, precision
        self.lora_record = lora_record
        self.progress = progress
        self.saved: set[int] = set()
        self.last: str | None = None

    def save(self, step: int) -> None:
        tag_dir = saving.save(self.engine, self.args.save_dir, step, self.ps.rank, self.info, self.precision,
                                  self.lora_record)
        self.saved.add(step)
        self.last = tag_dir
        if not self.ps.is_main:
            return
        size = saving.dir_size(tag_dir)
        line = f"saved step {step} to {tag_dir} ({size / 2 ** 20:.1f} MiB)"
        removed = saving.prune(self.args.save_dir, self.args.keep_last)
        if removed:
            line += f"; removed {', '.join(removed)} (--keep-last {self.args.keep_last})"
        self._say(line)

    def _say(self, line: str) -> None:
        if self.progress.enabled:
            self.progress.write(line)
        else:
            _say(self.ps, line)

    def resume_hint(self) -> str:
        """Where the run can resume from: the last checkpoint saved (or resumed from), or that there is none."""
        last = self.last or self.args.resume
        if last is None:
            return "No checkpoint was saved (pass --save-dir and --save-every N to keep one)"
        return f"Last checkpoint: {last} (resume with --resume {last})"

    def last_good_hint(self) -> str:
        last = self.last
        if last is None and self.args.resume:
            last = self.args.resume
        if last is None:
            return ("No checkpoint was saved (pass --save-dir and --save-every N to keep one); lower the learning "
                    "rate or pass --skip-nonfinite N to skip such steps")
        return (f"Last good checkpoint: {last} (resume with --resume {last}, e.g. with a lower learning rate), "
                f"or pass --skip-nonfinite N to skip such steps")


def _with_tier(opts: TrainerOptions, memory: MemoryCheck, plan: RunLayout, config,
               dtype_name: str) -> tuple[TrainerOptions, MemoryCheck]:
    """``opts`` holding the run's NVMe tier (:func:`_nvme_tier`), ``memory`` with its start-up line."""
    tier, lines = _nvme_tier(opts, plan, config, dtype_name)
    return replace(opts, nvme_tier=tier), replace(memory, lines=(*memory.lines, *lines))


def _nvme_tier(opts, plan: RunLayout, config, dtype_name: str) -> tuple[NVMeTier | None, tuple[str, ...]]:
    """The NVMe tier the run's model uses and its start-up line (backend, bytes per step) after
    its preflight; None and nothing without ``--nvme-path``."""
    if opts.nvme_path is None:
        return None, ()
    from fpdt.train.nvme_aio import setup_tier
    tokens = plan.seq_len // plan.sp
    saving = 0
    if getattr(opts, "attention_checkpoint", None) == "save":
        saving = config.num_layers if opts.save_attention_layers is None else opts.save_attention_layers
    saved = tokens * config.num_heads * (config.head_dim * PRECISIONS[dtype_name].itemsize + 4) if saving else 0
    try:
        line, tier = setup_tier(opts.nvme_path, config.num_layers, tokens, config.hidden_size,
                                PRECISIONS[dtype_name].itemsize, opts.checkpoint_device_layers,
                                nvme_layers=getattr(opts, "nvme_layers", None), saved_layers=saving, saved_bytes=saved,
                                num_chunks=getattr(plan, "num_chunks", 1),
                                rank=dist.get_rank() if dist.is_initialized() else 0)
    except NVMeError as e:
        raise ConfigError(str(e)) from None
    return tier, (line,)


def _say(ps: ParallelState, message: str) -> None:
    if ps.is_main:
        print(message, file=sys.stderr, flush=True)


def _export_at_end(args: argparse.Namespace, ps: ParallelState) -> None:
    from fpdt.train.export import export_checkpoint

    if ps.is_main:
        export_checkpoint(args.save_dir, args.export_hf)
        print(f"wrote {args.export_hf}", file=sys.stderr, flush=True)
    dist.barrier()


INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""


def interrupted_line(args: argparse.Namespace, argv: list[str], world_size: int | None = None) -> str:
    """The one line ``fpdt-train`` prints after Ctrl-C: the newest complete checkpoint (every
    rank's files there and whole, :func:`fpdt.train.saving.last_complete`, for ``world_size``
    ranks, default this run's; one being written when the run stopped is skipped) and the command
    that resumes from it, or that none was saved."""
    head = "fpdt-train: interrupted (Ctrl-C)"
    world = this_rank()[1] if world_size is None else world_size
    found = saving.last_complete(args.save_dir, world) if args.save_dir else None
    if found is None and args.resume:
        try:
            found = saving.inspect(args.resume)
        except Exception:  # noqa: BLE001 -- only a hint
            found = None
    if found is None:
        if args.save_dir:
            return (f"{head} before any checkpoint in {args.save_dir} was complete: nothing to resume from "
                    f"(--save-every N saves every N steps)")
        return f"{head}: nothing was saved (pass --save-dir DIR --save-every N to keep checkpoints to --resume from)"
    kept, skip = [], False
    for a in argv:                  # the same command, with --resume naming the checkpoint
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            kept.append(a)
    command = " ".join(shlex.quote(a) for a in ["fpdt-train", *kept, "--resume", found.tag_dir])
    return (f"{head}; the last complete checkpoint is {found.tag_dir} (step {found.step}); resume with: {command}")


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within it, SIGTERM (a scheduler's stop) ends the run as Ctrl-C does: the stack unwinds, so
    the NVMe tier's files are removed and the resume line is printed. The trainer's own handler,
    restored on exit; the library installs none (``docs/nvme.md``)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status: 0, 2 for a bad input (flags, configs,
    data, checkpoint), 1 for a run that had to stop, 130 after Ctrl-C (one line naming the last
    complete checkpoint and the command that resumes from it, :func:`interrupted_line`). Errors
    are one line on stderr (see :mod:`fpdt.train.errors`); ``--debug`` or ``FPDT_DEBUG=1`` shows
    the traceback instead."""
    args = build_parser().parse_args(argv)
    # DeepSpeed's ZeRO-3 still calls collectives that torch >= 2.13 marks deprecated; the
    # warning would repeat inside the progress bar on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    zero.quiet_deepspeed_warnings()
    owns_group = not (dist.is_available() and dist.is_initialized())   # else the caller's, left as it is
    try:
        with terminate_as_interrupt():
            run(args)
    except KeyboardInterrupt:
        if debug_enabled(args.debug):
            raise
        if this_rank()[0] == 0:
            print(interrupted_line(args, sys.argv[1:] if argv is None else argv), file=sys.stderr, flush=True)
        if dist.is_initialized():  # no teardown: a process group torn down mid-collective can hang or abort
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(INTERRUPTED)
        return INTERRUPTED
    except Exception as e:  # noqa: BLE001 -- every error becomes one line (see fpdt.train.errors)
        if debug_enabled(args.debug):
            raise
        status = report("fpdt-train", e)
        if isinstance(e, CommFailure) or isinstance(e.__cause__, CommFailure):
            # A peer that stalled leaves gloo/NCCL threads blocked: tearing the process group
            # down at interpreter exit can then abort (SIGABRT, "terminate called ...") and turn
            # the clean one-line exit into a crash. The line is printed; leave without teardown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    if owns_group and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()                  # an orderly teardown, every rank together, not gloo's at exit
        dist.destroy_process_group()
    return 0

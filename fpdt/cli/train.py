"""``fpdt-train``: command line, set-up in order, and the run.

Order of set-up (each step needs the previous one):

1. parse flags, read the DeepSpeed JSON, merge the FPDT options, validate everything
   that needs no process group (:mod:`fpdt.train.config`, :mod:`fpdt.train.preflight`:
   sizes, the model's config.json and weights, heads vs sp, batch arithmetic, paths, the
   ``--resume`` checkpoint) and load the data, so that a bad input fails in seconds (:func:`prepare`);
2. process group (gloo on CPU, NCCL on CUDA; a 1-process group without a launcher); the
   planner's decisions and memory check (:func:`fpdt.plan.decide.decide_run`, agreed by every
   rank) and the NVMe tier; then DeepSpeed's communication layer on top of it, then the SP groups;
3. the model (seeded, so every rank builds the same random weights);
4. ``deepspeed.initialize`` (ZeRO partitions the model here, unless it already is: see
   :func:`build_model`), resume, train, save.

With ``--lora-rank`` (or ``--lora-init``) step 3 attaches LoRA adapters and freezes the rest
(:mod:`fpdt.train.lora`); the memory check, the FLOPs, the checkpoints and the export follow.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from fpdt.offload.nvme import NVMeError, NVMeTier
from fpdt.offload.runtime import RUNTIMES
from fpdt.plan import decide, trainer_run
from fpdt.train import lora, preflight, saving, zero, zero_load
from fpdt.options import OPTION_FLAGS, add_option_flags, flag_values
from fpdt.model.moe import moe_kernel
from fpdt.train.config import (PRECISIONS, ConfigError, TrainerOptions, RunLayout, ds_dtype_name, ds_zero_stage, load_ds_config,
                               cpu_runtime, merge_flags, unknown_ds_keys, validate)
from fpdt.train.data import (PACKINGS, DataError, PackedWindows, Windows, bin_dtype_for_vocab, check_vocab, list_data_files,
                             load_documents, load_tokens)
from fpdt.train.errors import RunError, debug_enabled, report, this_rank
from fpdt.train.loop import CommFailure, DeviceOutOfMemory, LoopSpec, NonFiniteStep, NVMeFault, run_steps
from fpdt.train.metrics import ModelShape, resolve_peak_flops
from fpdt.train.parallel import (ParallelState, build_parallel_state, env_world_size, init_distributed,
                                 launcher_environment_restored, pick_device)
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
    add_option_flags(d, ["seq_len"], required=("seq_len",))
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
    add_option_flags(f, [name for name in OPTION_FLAGS if name != "seq_len"])
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
    """The FPDT flags of ``args`` by their ``"fpdt"`` JSON keys (None: not given)."""
    return {OPTION_FLAGS[name].json_key: value for name, value in flag_values(args, OPTION_FLAGS).items()
            if OPTION_FLAGS[name].json_key}


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

@dataclass(frozen=True)
class Prepared:
    """What step 1 (no process group) found: the configuration, the model source and the data."""

    device: torch.device
    ds_config: dict[str, Any]
    dtype_name: str
    opts: TrainerOptions
    plan: RunLayout
    source: preflight.ModelSource
    notes: list[str]
    said: list[str]
    lora_spec: Any
    kernel: Any
    windows: Windows | PackedWindows
    tokenizer: str | None

    @property
    def lora_rank(self) -> int:
        return self.lora_spec.rank if self.lora_spec else 0


def prepare(args: argparse.Namespace) -> Prepared:
    """Step 1: flags, configs, model source, data, checkpoint; every check that needs no process group."""
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
    kernel = preflight.attention_kernel(opts.backend, device, PRECISIONS[dtype_name], source.config.head_dim)
    windows, tokenizer = load_windows(args, source.config.to_hf(), source.config.vocab_size, plan)
    return Prepared(device, ds_config, dtype_name, opts, plan, source, notes, said, lora_spec, kernel, windows,
                    tokenizer)


def this_node(device: torch.device, world_size: int) -> decide.Node:
    """This node as the planner sees it: the GPU's memory, the ranks sharing the node, the host's available memory."""
    cuda = device.type == "cuda"
    return decide.Node(device.type, torch.cuda.get_device_properties(device).total_memory if cuda else None,
                       trainer_run.ranks_on_this_node(world_size, torch.cuda.device_count() if cuda else None),
                       float(psutil.virtual_memory().available))


def decided(p: Prepared) -> decide.Decision:
    """Step 2's decisions (:func:`fpdt.plan.decide.decide_run`), with the NVMe tier set up for them."""
    d = decide.decide_run(p.source.config, p.plan, p.opts, p.ds_config, p.dtype_name,
                          this_node(p.device, p.plan.world_size), not p.kernel.native_gqa, p.lora_rank,
                          decide.Ranks(p.device))
    tier, lines = _nvme_tier(d.opts, d.plan, p.source.config, p.ds_config, p.dtype_name)
    return replace(d, opts=replace(d.opts, nvme_tier=tier),
                   memory=replace(d.memory, lines=(*p.said, *d.memory.lines, *lines)))


@dataclass(frozen=True)
class Started:
    """Step 3: the parallel state, the engine, where training starts and the saver."""

    ps: ParallelState
    model: Any
    engine: Any
    micro: int
    gas: int
    start: int
    rng: Any
    saver: Saver
    peak_flops: float | None


def run(args: argparse.Namespace) -> list[StepRecord]:
    """Everything ``fpdt-train`` does; returns this rank's step records."""
    started = time.perf_counter()
    p = prepare(args)
    timeout = timedelta(minutes=args.dist_timeout_min)
    init_distributed(p.device, timeout)
    d = decided(p)
    zero.init_deepspeed_comm(p.device, timeout)
    ps = build_parallel_state(d.plan.sp, p.device, cp=d.plan.cp, placement=d.plan.placement,
                              inner_ring=d.plan.inner_ring, timeout=timeout)
    s = start(args, p, d, ps)
    try:
        records = train(args, p, d, s)
    finally:
        _close_tier(d.opts)
    if args.save_dir and args.steps not in s.saver.saved and s.start >= args.steps:
        s.saver.save(args.steps)
    if args.export_hf:
        _export_at_end(args, ps)
    _say(ps, summary(records, s.start, time.perf_counter() - started, s.saver.last if args.save_dir else None,
                     args.export_hf, trainer_run.prediction(d.memory.estimate, d.memory.capacity_bytes,
                                                            _predicted_step(p, d))))
    return records


def start(args: argparse.Namespace, p: Prepared, d: decide.Decision, ps: ParallelState) -> Started:
    """Step 3: the model, the engine, the resumed state; the start-up lines."""
    model = build_model(args, d.opts, d.plan, ps, PRECISIONS[p.dtype_name], p.ds_config, p.lora_spec)
    hf_config = model.config.to_hf()
    engine = zero.build_engine(model, p.ds_config)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    info = run_info(args, d.plan, micro, gas)
    begin, rng = 0, None
    if args.resume:
        state = saving.load(engine, args.resume, ps.rank, lora=p.lora_spec is not None)
        begin, rng = state["step"], state["rng"]
        for diff in saving.check_same_run(state["run"], info):
            _say(ps, f"warning: the resumed run differs from the saved one, so its next step is not the "
                     f"one the saved run would have taken ({diff})")
    if args.save_dir and ps.is_main:
        saving.write_model_files(args.save_dir, hf_config, p.tokenizer, p.lora_spec,
                                 os.path.abspath(args.model) if args.model else None)
    peak = resolve_peak_flops(p.device, p.dtype_name, args.peak_tflops)
    _say(ps, startup_line(args, p, d, ps, model, micro, gas, begin, peak))
    for line in d.memory.lines + tuple(f"warning: {n}" for n in p.notes):
        _say(ps, line)
    if p.lora_spec is not None:
        resumed = os.path.join(*saving.resolve(args.resume)) if args.resume else None
        _say(ps, lora.describe(model, p.lora_spec, args.lora_init, resumed))
    progress = Progress(args.steps, begin, ps.is_main, args.log_json, resumed=bool(args.resume))
    lora_record = lora.record(p.lora_spec, args.model, args.model_config, args.seed, p.source.config)
    saver = Saver(args, engine, ps, info, p.dtype_name, progress, lora_record)
    return Started(ps, model, engine, micro, gas, begin, rng, saver, peak[0])


def startup_line(args: argparse.Namespace, p: Prepared, d: decide.Decision, ps: ParallelState, model, micro: int,
                 gas: int, begin: int, peak_and_source: tuple[float | None, str]) -> str:
    """The first start-up line: the mesh, the chunking, the choices and the peak FLOP/s."""
    plan, (peak, peak_src) = d.plan, peak_and_source
    return (f"fpdt-train: world={ps.world_size} sp={plan.sp} (hp={plan.hp} cp={plan.cp}) dp={plan.dp} "
            f"seq_len={plan.seq_len} "
            f"chunk={plan.chunk_size} chunks={plan.num_chunks} offload={'on' if plan.offload else 'off'} "
            f"checkpoint={plan.checkpoint} attention={p.kernel.name}{_experts_words(model, p.device, p.dtype_name)} "
            f"micro_batch={micro} grad_accum={gas} dtype={p.dtype_name} "
            f"{p.windows.describe()} steps {begin}->{args.steps} "
            f"peak={'n/a' if peak is None else f'{peak / 1e12:.3g}'} TFLOP/s ({peak_src})"
            + d.memory.words(model.config.num_layers, d.opts.checkpoint_device_layers))


def train(args: argparse.Namespace, p: Prepared, d: decide.Decision, s: Started) -> list[StepRecord]:
    """Step 4: the steps, saving as asked; a failure becomes one :class:`RunError` line."""
    plan, opts, saver = d.plan, d.opts, s.saver
    spec = LoopSpec(plan=plan, parallel=s.ps, micro_batch=s.micro, grad_accum=s.gas,
                    shape=ModelShape.from_config(s.model.config), peak_flops=s.peak_flops,
                    recompute=plan.checkpoint != "off", skip_nonfinite=args.skip_nonfinite,
                    mem_accounting=args.mem_accounting, lora=p.lora_spec, runtime=opts.runtime,
                    nvme_path=opts.nvme_path, nvme_tier=opts.nvme_tier)

    def on_step_end(done: int) -> None:
        if args.save_dir and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            saver.save(done)

    if s.rng is not None:
        saving.set_rng_state(s.rng)   # last: the set-up above may draw (e.g. the CPU peak's matmuls)
    try:
        return run_steps(s.engine, p.windows, spec, s.start, args.steps, saver.progress, on_step_end)
    except NonFiniteStep as e:
        raise RunError(f"{e}; the run stopped without saving. {saver.last_good_hint()}",
                       same_on_every_rank=True) from e
    except CommFailure as e:
        raise RunError(str(e)) from e
    except NVMeFault as e:
        raise RunError(f"{e}, and nothing was saved for it. {saver.resume_hint()}", same_on_every_rank=True) from e
    except DeviceOutOfMemory as e:
        m = d.memory
        raise RunError(trainer_run.out_of_memory_advice(e.step, plan, opts, m.estimate, e.detail, m.capacity_bytes,
                                                        m.recommend() if m.recommend else None,
                                                        p.source.config_path, args.deepspeed, p.lora_rank)) from e
    finally:
        saver.progress.close()


def _predicted_step(p: Prepared, d: decide.Decision) -> float | None:
    """fpdt-plan's step time for this run on this GPU (:func:`fpdt.plan.trainer_run.step_time`), or None."""
    if p.device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(p.device)
    return trainer_run.step_time(p.source.config, d.plan, d.opts, p.ds_config, p.dtype_name, props.name,
                                 props.total_memory,
                                 trainer_run.ranks_on_this_node(d.plan.world_size, torch.cuda.device_count()),
                                 not p.kernel.native_gqa, p.lora_rank)


def _close_tier(opts: TrainerOptions) -> None:
    """With the NVMe tier, close its stores: the files go with the run, not at the interpreter's exit."""
    if opts.nvme_tier is not None:
        opts.nvme_tier.close(raise_errors=False)


def _experts_words(model, device, dtype_name: str) -> str:
    """`` experts=E/k (kernel)`` for an MoE model (its kernel: :func:`fpdt.model.moe.moe_kernel`), else empty."""
    moe = model.config.moe
    if moe is None:
        return ""
    kernel = moe_kernel(torch.device(device), PRECISIONS[dtype_name], model.config.hidden_size, moe.moe_intermediate_size)
    return f" experts={moe.num_experts}/top{moe.top_k} ({kernel})"


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
    preflight.check_layer_counts(source.config, source.config_path, checkpoint_device_layers=device_layers,
                                 save_attention_layers=save_layers, nvme_layers=nvme_layers)
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


def _nvme_tier(opts: TrainerOptions, plan: RunLayout, config, ds_config: dict[str, Any],
               dtype_name: str) -> tuple[NVMeTier | None, tuple[str, ...]]:
    """The NVMe tier the run's model uses and its start-up line (backend, bytes per micro-batch:
    :func:`fpdt.plan.decide.nvme_need`) after its free-space preflight; None and nothing without ``--nvme-path``."""
    if opts.nvme_path is None:
        return None, ()
    from fpdt.train.nvme_aio import setup_tier
    need = decide.nvme_need(config, plan, opts, ds_config, dtype_name)
    try:
        line, tier = setup_tier(opts.nvme_path, need, rank=dist.get_rank() if dist.is_initialized() else 0)
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
        with launcher_environment_restored(), terminate_as_interrupt():
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

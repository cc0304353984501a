"""Trainer configuration: the FPDT options, the DeepSpeed JSON, and their validation.

DeepSpeed's own settings stay in the ``--deepspeed`` JSON, handed to ``deepspeed.initialize``
(minus ``"fpdt"``); FPDT's (:class:`TrainerOptions`) come from flags, which win, or that JSON's
``"fpdt"`` section (unknown keys are errors). :func:`validate` checks all that needs no process
group, each error naming the fix (``docs/train.md``).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import torch

from fpdt.layout import chunk_split, chunking_problems
from fpdt.offload import runtime_name
from fpdt.options import (DERIVED_OPTIONS, OPTION_FLAGS, FPDTOptions, LayoutOptions, ResolvedLayout, as_flag,
                          attention_checkpoint_given, device_defaults)

DEFAULT_CHUNK_TOKENS = 65536
"""Global chunk when ``chunk_size`` is not given: the FPDT paper's sweet spot on A100 (arXiv:2408.16978),
where attention hides the chunk copies; see :func:`default_chunk_size`."""


class ConfigError(ValueError):
    """A bad trainer configuration; the message says what to change."""


@dataclass(frozen=True)
class TrainerOptions(FPDTOptions, LayoutOptions):
    """``fpdt-train``'s FPDT settings: :class:`fpdt.options.FPDTOptions` and
    :class:`fpdt.options.LayoutOptions` (the mesh degrees and the global chunk length, from which
    the trainer derives the model's ``group`` / ``mesh`` and ``num_chunks``: :func:`validate`,
    :meth:`model_options`). From flags, or the ``"fpdt"`` section of the DeepSpeed JSON
    (:data:`FPDT_KEYS`). A layout field not given: ``sp`` 1 (or ``hp * cp``), ``placement``
    ``"head_first"``, ``chunk_size`` :func:`default_chunk_size`."""

    offload: bool | None = None
    """As :attr:`FPDTOptions.offload`; ``None``: on with CUDA when the sequence has more than one
    chunk (the FPDT design; one chunk has nothing to pipeline), off on other devices."""
    checkpointing: str | None = None
    """As :attr:`FPDTOptions.checkpointing` (flag ``--checkpoint``, JSON key ``"checkpoint"``);
    ``None``: ``"offload"`` with CUDA (the FPDT design), ``"off"`` on other devices."""
    stream_layers: bool | None = None
    """As :attr:`FPDTOptions.stream_layers`; ``None``: on when the run's memory check predicts that the
    device does not hold it otherwise (:func:`fpdt.plan.trainer_run.stream_layers`). On, ``offload``
    and ``checkpoint`` default to on and ``"offload"``."""
    attention_checkpoint: str | None = None
    """As :attr:`FPDTOptions.attention_checkpoint`; ``None``: ``"save"`` for as many layers as
    the run's own memory check predicts the host and device hold, else ``"recompute"``
    (:func:`fpdt.plan.trainer_run.attention_checkpoint`; the start-up line says which and why)."""
    def model_options(self, run: RunLayout, group=None, mesh=None) -> FPDTOptions:
        """The model's :class:`FPDTOptions` for the validated ``run`` (its chunk count and the
        device defaults it resolved) on ``group`` or ``mesh``. An ``attention_checkpoint`` still
        to be chosen (None) is ``"recompute"`` here: ``fpdt-train`` chooses it from its memory
        check before it builds the model (:func:`fpdt.plan.decide.decide_run`)."""
        return replace(_resolved(self, run.offload, run.checkpoint), num_chunks=run.num_chunks, group=group,
                       mesh=mesh).validate()


_KEY_OF_FIELD = {name: f.json_key for name, f in OPTION_FLAGS.items() if f.json_key not in (None, name)}
"""Option fields whose flag and JSON key say it differently (``--checkpoint``, ``--attention-backend``)."""
FPDT_KEYS = tuple(_KEY_OF_FIELD.get(f.name, f.name) for f in fields(TrainerOptions) if f.name not in DERIVED_OPTIONS)
"""The keys of the ``"fpdt"`` JSON section (and the names :func:`merge_options` takes flags by)."""
_FIELD_OF_KEY = {key: field for field, key in _KEY_OF_FIELD.items()}


def option_key(field: str) -> str:
    """The flag / ``"fpdt"`` JSON key of an options field (``checkpointing``: ``checkpoint``)."""
    return _KEY_OF_FIELD.get(field, field)


def option_field(key: str) -> str:
    """The options field a flag / ``"fpdt"`` JSON key sets (``checkpoint``: ``checkpointing``)."""
    return _FIELD_OF_KEY.get(key, key)


def _unknown_key_error(key: str) -> ConfigError:
    near = difflib.get_close_matches(key, FPDT_KEYS, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    error = ConfigError(f'unknown key {key!r} in the "fpdt" section of the DeepSpeed JSON{hint}; '
                        f"valid keys: {', '.join(FPDT_KEYS)}")
    error.worded = True             # in the JSON's terms already: no flag names put in (in_flag_terms)
    return error


IMPLIED = {"stream_layers": (True, {"offload": True, "checkpoint": "offload", "checkpoint_device_layers": 0})}
"""Flag key -> (value, the settings that value implies): a flag given with that value sets them
too, over the JSON section, unless their own flags are given."""


def merge_options(flags: Mapping[str, Any], section: Mapping[str, Any] | None,
                  defaults: Mapping[str, Any] | None = None) -> TrainerOptions:
    """Combine flags > ``"fpdt"`` JSON section > ``defaults`` > the fields' defaults into
    :class:`TrainerOptions` (unknown section keys refused; the values are :func:`validate`'s to check).

    ``flags`` and ``defaults`` map :data:`FPDT_KEYS` to values, ``None`` meaning "not given".
    """
    return merge_flags(flags, section, defaults)[0]


def merge_flags(flags: Mapping[str, Any], section: Mapping[str, Any] | None,
                defaults: Mapping[str, Any] | None = None) -> tuple[TrainerOptions, str | None]:
    """:func:`merge_options`, with the settings a given flag implies (:data:`IMPLIED`) applied
    over the JSON section, and the one line that says which of the section's settings the flags
    overrode (None when none did)."""
    section = dict(section or {})
    for key in section:
        if key not in FPDT_KEYS:
            raise _unknown_key_error(key)
    given = {k: v for k, v in flags.items() if v is not None}
    for key, (value, implied) in IMPLIED.items():
        if given.get(key) == value:
            given.update({k: (v, key) for k, v in implied.items() if flags.get(k) is None})
    merged: dict[str, Any] = {}
    overrode = []
    for key in FPDT_KEYS:
        if key in given:
            value, by = given[key] if isinstance(given[key], tuple) else (given[key], None)
            merged[option_field(key)] = value
            if key in section and section[key] != value:
                overrode.append(f"{as_flag(option_field(key), value)} over {json.dumps({key: section[key]})[1:-1]}"
                                + (f" (implied by {as_flag(by, flags[by])})" if by else ""))
        elif key in section:
            merged[option_field(key)] = section[key]
        elif (defaults or {}).get(key) is not None:
            merged[option_field(key)] = defaults[key]
    opts = TrainerOptions(**merged)       # the values are checked once, by validate()
    line = f'fpdt-train: flags win over the DeepSpeed JSON\'s "fpdt" section: {"; ".join(overrode)}' if overrode else None
    return opts, line


def cpu_runtime(opts: TrainerOptions, device_type: str) -> tuple[TrainerOptions, str | None]:
    """On a device without CUDA, attention offload and offloaded checkpoints (given, or implied by
    ``stream_layers``) run on the simulated runtime (``runtime="sim"``) unless a runtime is given;
    returns the options and the start-up line that says so (None when nothing was chosen)."""
    if device_type == "cuda" or opts.runtime is not None:
        return opts, None
    offload, checkpoint = device_defaults(device_type, 2, opts.offload, opts.checkpointing, bool(opts.stream_layers))
    if not (offload is True or checkpoint == "offload"):
        return opts, None
    what = " and ".join(w for w, on in (("--offload", offload is True), ("--checkpoint offload", checkpoint == "offload"))
                        if on)
    verb = "run" if " and " in what else "runs"
    return replace(opts, runtime="sim"), (f"fpdt-train: on the {device_type}, {what} {verb} on the simulated CUDA "
                                          f"runtime (--runtime sim): to test the offload paths, not for speed")


def _as_key(problem: str) -> str:
    """An :meth:`FPDTOptions.problems` line with its leading field named as the flag / JSON key."""
    name, sep, rest = problem.partition("=")
    return option_key(name) + sep + rest


def _resolved(opts: TrainerOptions, offload: Any, checkpointing: Any) -> FPDTOptions:
    """The model's options with the run's ``offload`` / ``checkpointing`` and the attention
    checkpoint as given (:func:`fpdt.options.attention_checkpoint_given`), not validated."""
    shared = {f.name: getattr(opts, f.name) for f in fields(FPDTOptions)}
    shared.update(offload=offload, checkpointing=checkpointing, stream_layers=bool(opts.stream_layers),
                  attention_checkpoint=attention_checkpoint_given(opts.attention_checkpoint, opts.save_attention_layers))
    return FPDTOptions(**shared)


# ----------------------------------------------------------------------------- DeepSpeed JSON

DEFAULT_DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1_000_000_000,
}
"""Used when no ``--deepspeed`` JSON is given: ZeRO-3, AdamW (torch implementation, so
nothing is JIT-compiled), lr 1e-3, clipping at 1.0; fp32, plus bf16 on CUDA
(:func:`load_ds_config`)."""


def load_ds_config(source: str | os.PathLike | Mapping[str, Any] | None,
                   device_type: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read the DeepSpeed JSON. Returns ``(deepspeed_dict_without_fpdt, fpdt_section)``.

    ``source`` is a path, an already-parsed dict (not modified) or ``None`` for
    :data:`DEFAULT_DS_CONFIG`, which trains in bf16 when ``device_type`` is ``"cuda"``
    (fp32 elsewhere: CPU kernels without native bf16 compute in fp32 anyway). A given JSON's
    precision is DeepSpeed's to read, untouched.
    """
    if source is None:
        cfg = copy.deepcopy(DEFAULT_DS_CONFIG)
        if device_type == "cuda":
            cfg["bf16"] = {"enabled": True}
    elif isinstance(source, Mapping):
        cfg = copy.deepcopy(dict(source))
    else:
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ConfigError(f"--deepspeed {path}: no such file")
        with open(path) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--deepspeed {path} is not valid JSON: {e}") from e
    _refuse_auto(cfg)
    section = cfg.pop("fpdt", None) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(f'the "fpdt" section of the DeepSpeed JSON must be an object, got {section!r}')
    if "train_micro_batch_size_per_gpu" not in cfg and "train_batch_size" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = 1
    return cfg, dict(section)


def _refuse_auto(cfg: Any, path: str = "") -> None:
    """``"auto"`` is Hugging Face's Trainer's placeholder, filled in from its own arguments."""
    items = cfg.items() if isinstance(cfg, Mapping) else enumerate(cfg) if isinstance(cfg, list) else ()
    for key, value in items:
        where = f"{path}.{key}" if path else str(key)
        if value == "auto":
            raise ConfigError(f"DeepSpeed JSON: {where}='auto' is filled in by Hugging Face's Trainer, which "
                              f"fpdt-train is not: give the value, or leave the key out for DeepSpeed's default")
        _refuse_auto(value, where)


DS_TOP_LEVEL_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "amp", "torch_autocast", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler",
    "activation_checkpointing", "sparse_attention", "data_efficiency", "curriculum_learning", "dataloader_drop_last",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "aio", "elasticity", "autotuning",
    "compression_training", "checkpoint", "data_types", "communication_data_type",
    "seq_parallel_communication_data_type", "pipeline", "progressive_layer_drop", "eigenvalue", "quantize_training",
    "disable_allgather", "hybrid_engine", "nebula", "weight_quantization", "use_node_local_storage", "load_universal",
    "graph_harvesting", "compile", "timers", "sequence_parallel_size", "tensor_parallel", "gradient_accumulation_dtype",
    "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size", "mics_shard_size",
    "mics_hierarchical_params_gather", "expert_parallel", "zenflow", "train_batch_size_per_gpu")
"""Top-level keys of DeepSpeed's JSON (its config documentation, DeepSpeed 0.19); one not here
gets a warning (:func:`unknown_ds_keys`), since DeepSpeed ignores it without a word."""


def unknown_ds_keys(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """One warning line per top-level key of the DeepSpeed JSON that DeepSpeed does not know,
    naming the closest known key."""
    out = []
    for key in cfg:
        if key in DS_TOP_LEVEL_KEYS or not isinstance(key, str):
            continue
        near = difflib.get_close_matches(key, DS_TOP_LEVEL_KEYS, n=1, cutoff=0.5)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        out.append(f"warning: the DeepSpeed JSON's key {key!r} is not one DeepSpeed reads{hint}: it is ignored, "
                   f"and what it sets keeps DeepSpeed's default")
    return tuple(out)


def ds_zero_stage(cfg: Mapping[str, Any]) -> int:
    return int((cfg.get("zero_optimization") or {}).get("stage", 0))


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The training precisions :func:`ds_dtype_name` names, as torch dtypes (``fpdt-train``'s and
``fpdt-plan``'s)."""


def ds_dtype_name(cfg: Mapping[str, Any]) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: the training precision the JSON asks for."""
    if (cfg.get("bf16") or {}).get("enabled", False):
        return "bf16"
    if (cfg.get("fp16") or {}).get("enabled", False):
        return "fp16"
    return "fp32"


# ----------------------------------------------------------------------------- validation

@dataclass(frozen=True, kw_only=True)
class RunLayout(ResolvedLayout):
    """The validated shape of a run: the layout resolved (:class:`~fpdt.options.ResolvedLayout`), the
    world size, the chunking and the device defaults; ``sp``, ``dp``, ``num_chunks`` computed."""

    world_size: int
    """Number of processes."""
    seq_len: int
    """Global tokens per sequence S (one window is S + 1 tokens)."""
    mlp_chunks: int | None
    """MLP chunks over the local sequence (None: the model's rule, ``ceil(2 u I / hidden)``)."""
    offload: bool = False
    """Attention chunks in pinned host memory (the option, or its device default)."""
    checkpoint: str = "off"
    """Activation checkpointing mode (the option, or its device default)."""

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world_size / sp`` groups, each training distinct windows."""
        return self.world_size // self.sp

    @property
    def num_chunks(self) -> int:
        """Attention chunks u = S / C (also the chunks per rank in the FPDT layout)."""
        return self.seq_len // self.chunk_size

    @property
    def local_seq_len(self) -> int:
        """Tokens per rank, S / P."""
        return self.seq_len // self.sp


def validate(opts: TrainerOptions, seq_len: int, world_size: int, device_type: str,
             ds_config: Mapping[str, Any]) -> RunLayout:
    """The one check of a run's :class:`TrainerOptions` and shape before it starts (layout, chunking, the
    options with the device defaults, the device); returns the :class:`RunLayout`. Raises
    :class:`ConfigError` naming the values that fail and the fix."""
    if seq_len < 1:
        raise ConfigError(f"--seq-len {seq_len} must be a positive number of tokens")
    for problem in opts.layout_problems():
        raise ConfigError(f"fpdt option {_as_key(problem)}")
    hp, cp = opts.degrees()
    sp = hp * cp
    if world_size % sp != 0:
        what = f"--sp {sp}" if cp == 1 else f"--hp {hp} x --cp {cp} = {sp}"
        raise ConfigError(
            f"{what} does not divide the world size {world_size}; choose an sp that "
            f"divides {world_size} (the remaining factor is data parallel), or launch a "
            f"multiple of {sp} processes")
    split = chunk_split(sp, zigzag=cp > 1)
    chunk = default_chunk_size(seq_len, split) if opts.chunk_size is None else opts.chunk_size
    for problem in chunking_problems(seq_len, chunk, hp, cp):
        raise ConfigError(problem)
    num_chunks = seq_len // chunk
    offload, checkpoint = device_defaults(device_type, num_chunks, opts.offload, opts.checkpointing,
                                          bool(opts.stream_layers))
    for problem in _resolved(opts, offload, checkpoint).problems():
        default = "" if opts.checkpointing is not None else \
            f" (checkpointing={checkpoint!r} is fpdt-train's default on {device_type}; --checkpoint sets it)"
        raise ConfigError(f"fpdt option {_as_key(problem)}{default}")
    _check_device_options(offload, checkpoint, device_type, ds_config, opts.runtime)
    return RunLayout(world_size=world_size, seq_len=seq_len, chunk_size=chunk, mlp_chunks=opts.mlp_chunks, hp=hp,
                     cp=cp, placement=opts.placement, inner_ring=opts.inner_ring, offload=offload, checkpoint=checkpoint)


def default_chunk_size(seq_len: int, split: int) -> int:
    """The global chunk when none is given: :data:`DEFAULT_CHUNK_TOKENS`, or the whole
    sequence when it is no longer; when 64K does not divide the sequence, the largest chunk
    below it, down to 8K, that does and that is a multiple of ``split`` (:func:`fpdt.layout.chunk_split`). With no
    such chunk: the whole sequence, one chunk (the
    trainer's start-up line shows the chunking; ``--chunk-size`` sets it)."""
    if seq_len <= DEFAULT_CHUNK_TOKENS:
        return seq_len
    smallest = DEFAULT_CHUNK_TOKENS // 8     # below this the chunk copies outrun attention (FPDT, arXiv:2408.16978)
    for chunk in range(DEFAULT_CHUNK_TOKENS - DEFAULT_CHUNK_TOKENS % split, smallest - 1, -split):
        if seq_len % chunk == 0:
            return chunk
    return seq_len


def _check_device_options(offload: bool, checkpoint: str, device_type: str, ds_config: Mapping[str, Any],
                          runtime: Any) -> None:
    if device_type == "cuda":
        return
    if runtime_name(runtime) == "cuda":
        raise ConfigError(f"--runtime cuda needs a CUDA device; this run is on {device_type}: use --runtime sim "
                          f"(simulated copy streams) or sync, or leave it out")
    # Offload on the CPU only makes sense to test the offload paths: allowed when a device
    # runtime was chosen explicitly (--runtime sim simulates the copy streams).
    simulated = runtime_name(runtime) in ("sim", "sync")
    if offload and not simulated:
        raise ConfigError(f"--offload needs a CUDA device (pinned host memory and copy streams); "
                          f"this run is on {device_type}: pass --no-offload or set \"offload\": false "
                          f"(to test the offload paths on the CPU, pass --runtime sim or set FPDT_RUNTIME=sim)")
    if checkpoint == "offload" and not simulated:
        raise ConfigError(f"checkpoint mode 'offload' needs a CUDA device; this run is on "
                          f"{device_type}: use --checkpoint on (or off), or pass --runtime sim (or set "
                          f"FPDT_RUNTIME=sim) to test it on the CPU")
    if ds_dtype_name(ds_config) == "fp16":
        raise ConfigError(f"fp16 training needs a CUDA device (loss scaling kernels); this run is on "
                          f"{device_type}: use \"bf16\": {{\"enabled\": true}} or fp32 in the DeepSpeed JSON")

"""The FPDT options: one dataclass, one default per field, one validation.

:class:`FPDTOptions` is what every entry point holds or builds:

* :func:`fpdt.model.from_config` / :func:`fpdt.model.from_pretrained` (keyword arguments or
  ``options=``) and ``model.configure(**changes)``;
* :func:`fpdt.hf.apply_fpdt` (the same keywords, or ``options=``);
* ``fpdt-train``: its flags and the ``"fpdt"`` section of the DeepSpeed JSON fill
  :class:`fpdt.train.config.TrainerOptions`, which adds the mesh degrees and the global chunk
  length and builds this object for the model (:meth:`TrainerOptions.model_options`);
* ``fpdt-plan``: each :class:`fpdt.plan.setup.Setup` it evaluates holds one (``setup.options``);
  what a caller fixes is named by these fields (:class:`fpdt.plan.planner.Choice`).

The defaults are the measured faster or leaner choice where two exist (``lm_head_wgrad``, see
``docs/memory.md`` and ``benchmarks/README.md``) and the chunk rules the memory budgets assume
(:mod:`fpdt.model.chunks`). Allowed values live here only (:data:`CHECKPOINT_MODES`,
:data:`LM_HEAD_WGRAD_MODES`, :data:`ATTENTION_CHECKPOINT_MODES`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

import torch.distributed as dist

from fpdt.attention.kernels import BACKENDS
from fpdt.comm import PLACEMENTS, SequenceMesh
from fpdt.offload.nvme import NVMeTier
from fpdt.offload.runtime import RUNTIMES, Runtime

CHECKPOINT_MODES = ("off", "on", "offload")
"""Per-layer activation checkpointing: none, layer inputs kept on the device, or on the host."""
LM_HEAD_WGRAD_MODES = ("accumulate", "recompute")
"""How the chunked loss forms the LM-head weight gradient (:mod:`fpdt.model.loss`)."""
ATTENTION_CHECKPOINT_MODES = ("recompute", "save")
"""What a checkpointed layer keeps of its attention: nothing (the recompute runs the attention
forward again), or the attention output and its log-sum-exp (the recompute skips the kernel)."""


class OptionsError(ValueError):
    """An option has a value no entry point accepts; the message names the option and the fix."""


@dataclass(frozen=True)
class FPDTOptions:
    """Memory and parallelism options of an FPDT model (the same for ``fpdt.model``, ``fpdt.hf``
    and ``fpdt-train``). Change them later with ``model.configure(**changes)``."""

    # Each field's meaning, default and interplay: docs/model.md#memory-options (one table).
    num_chunks: int = 1
    """Attention chunks per rank ``u``; ``S`` divisible by ``P * u`` (``2 * hp * cp * u`` on a mesh)."""
    offload: bool = False
    """Attention chunks in pinned host memory between forward and backward (:func:`device_defaults`)."""
    checkpointing: str = "off"
    """:data:`CHECKPOINT_MODES`: no layer checkpoint, layer inputs on the device, or on the host."""
    checkpoint_device_layers: int = 0
    """With ``"offload"``: the last this many layers keep their input on the device."""
    nvme_path: str | None = None
    """With ``"offload"``: the NVMe tier's directory (``docs/nvme.md``); None: off."""
    nvme_tier: NVMeTier | None = None
    """With ``nvme_path``: the :class:`fpdt.offload.nvme.NVMeTier` of the stores; None: the model's own."""
    nvme_layers: int | None = None
    """With ``nvme_path``: only the first this many layers go to disk (None: every offloaded layer)."""
    stream_layers: bool = False
    """Every layer as passes over its chunks, residual stream on the host (:mod:`fpdt.model.streaming`)."""
    attention_checkpoint: str = "recompute"
    """:data:`ATTENTION_CHECKPOINT_MODES`; ``"save"`` keeps attention outputs for the recompute."""
    save_attention_layers: int | None = None
    """With ``"save"``: only the first this many layers save (None: every layer)."""
    backend: str | None = None
    """Attention kernel (:data:`fpdt.attention.kernels.BACKENDS`); None: automatic."""
    mlp_chunks: int | None = None
    """MLP token chunks; None: ``ceil(2 u I / hidden)``; 0: the plain MLP."""
    loss_chunks: int | None = None
    """LM head + loss token chunks; None: ``ceil(2 u V / hidden)``; 0: full logits."""
    lm_head_wgrad: str = "recompute"
    """:data:`LM_HEAD_WGRAD_MODES`: the chunked loss's LM-head weight gradient."""
    group: dist.ProcessGroup | None = None
    """Sequence-parallel group; None: the default group if initialised, else a world of 1."""
    mesh: SequenceMesh | None = None
    """A 2D hp x cp :class:`fpdt.comm.SequenceMesh` instead of ``group`` (mesh layout inputs)."""
    runtime: str | Runtime | None = None
    """:data:`fpdt.offload.runtime.RUNTIMES` name or instance; None: cuda on a GPU, else sync."""

    # ---------------------------------------------------------------- construction
    @classmethod
    def build(cls, options: FPDTOptions | None = None, **changes: Any) -> FPDTOptions:
        """``options`` (default: all defaults) with ``changes`` applied, validated: how the
        public constructors take either an options object or its fields as keywords."""
        return (options or cls()).updated(**changes)

    def updated(self, **changes: Any) -> FPDTOptions:
        """A validated copy with ``changes``; an unknown name is a ``TypeError`` listing the valid ones."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"unknown FPDT options {unknown}; valid: {sorted(names)}")
        return replace(self, **changes).validate()

    # ---------------------------------------------------------------- validation
    def validate(self) -> FPDTOptions:
        """Raise :class:`OptionsError` for a value no entry point accepts; return ``self``."""
        for problem in self.problems():
            raise OptionsError(problem)
        return self

    def problems(self) -> list[str]:
        """Every reason these options are invalid (empty when they are valid), each naming the fix."""
        out = []
        if not _is_int(self.num_chunks) or self.num_chunks < 1:
            out.append(f"num_chunks={self.num_chunks!r} must be an integer >= 1")
        if not isinstance(self.offload, bool):
            out.append(f"offload={self.offload!r} must be True or False")
        for name in ("mlp_chunks", "loss_chunks"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                out.append(f"{name}={value!r} must be >= 0 (0 = unchunked) or None (default)")
        out += _choice("checkpointing", self.checkpointing, CHECKPOINT_MODES)
        out += _choice("lm_head_wgrad", self.lm_head_wgrad, LM_HEAD_WGRAD_MODES)
        out += _choice("attention_checkpoint", self.attention_checkpoint, ATTENTION_CHECKPOINT_MODES)
        if not _is_int(self.checkpoint_device_layers) or self.checkpoint_device_layers < 0:
            out.append(f"checkpoint_device_layers={self.checkpoint_device_layers!r} must be an integer >= 0")
        elif self.checkpoint_device_layers and self.checkpointing != "offload":
            out.append(f"checkpoint_device_layers={self.checkpoint_device_layers} keeps some offloaded layer "
                       f"inputs on the device: it needs checkpointing='offload' (now {self.checkpointing!r})")
        out += _nvme_problems(self)
        if not isinstance(self.stream_layers, bool):
            out.append(f"stream_layers={self.stream_layers!r} must be True or False")
        elif self.stream_layers:
            out += _streaming_problems(self)
        if self.save_attention_layers is not None and (not _is_int(self.save_attention_layers)
                                                       or self.save_attention_layers < 0):
            out.append(f"save_attention_layers={self.save_attention_layers!r} must be an integer >= 0, "
                       f"or None (every layer)")
        out += self._saving_problems()
        if self.backend is not None and self.backend not in BACKENDS:
            out.append(f"backend={self.backend!r} must be one of {tuple(BACKENDS)}, or None (automatic)")
        if self.runtime is not None and not isinstance(self.runtime, Runtime) and self.runtime not in RUNTIMES:
            out.append(f"runtime={self.runtime!r} must be one of {RUNTIMES} (\"sim\": simulated CUDA streams on "
                       f"the CPU), a fpdt.offload.Runtime, or None (automatic: cuda on a CUDA device, else sync)")
        if self.mesh is not None and self.group is not None:
            out.append("set either group= (plain Ulysses) or mesh= (hp x cp), not both")
        return out

    def _saving_problems(self) -> list[str]:
        """Saving attention outputs needs a layer recompute to skip, and a layer count needs saving."""
        if self.checkpointing not in CHECKPOINT_MODES or self.attention_checkpoint not in ATTENTION_CHECKPOINT_MODES:
            return []     # reported above
        counted = _is_int(self.save_attention_layers) and self.save_attention_layers >= 0
        if counted and self.attention_checkpoint != "save":
            return [f"save_attention_layers={self.save_attention_layers!r} counts the layers that save their "
                    f"attention output: it needs attention_checkpoint='save' (now {self.attention_checkpoint!r}); "
                    f"set attention_checkpoint='save', or drop save_attention_layers"]
        if self.attention_checkpoint == "save" and self.checkpointing == "off":
            return ["attention_checkpoint='save' keeps each checkpointed layer's attention output for its "
                    "recompute, and checkpointing='off' recomputes nothing: set checkpointing='on' or 'offload', "
                    "or attention_checkpoint='recompute'"]
        return []

    def check_layers(self, num_layers: int) -> None:
        """Raise :class:`OptionsError` for the first of :func:`layer_count_problems`."""
        for problem in layer_count_problems(num_layers, **{name: getattr(self, name) for name in LAYER_COUNTS}):
            raise OptionsError(problem)


LAYER_COUNTS = ("checkpoint_device_layers", "save_attention_layers", "nvme_layers")
"""The options that count decoder layers, checked against a model by :func:`layer_count_problems`."""
_ALL_LAYERS = {"checkpoint_device_layers": " (all of them is checkpointing='on')",
               "save_attention_layers": ", or leave it out (every layer)",
               "nvme_layers": ", or leave it out (every offloaded layer; fpdt-train chooses the fewest the host needs)"}


def layer_count_problems(num_layers: int, **counts: Any) -> list[str]:
    """Why layer counts (:data:`LAYER_COUNTS` by name) exceed a model's ``num_layers``: every entry point's
    check. A count that is not an integer >= 0 is :meth:`FPDTOptions.problems`' to report."""
    return [f"{name}={k} is more than the model's {num_layers} decoder layers; use at most {num_layers}"
            f"{_ALL_LAYERS[name]}" for name, k in counts.items() if _is_int(k) and k > num_layers]


@dataclass(frozen=True)
class LayoutOptions:
    """How a sequence is cut over ranks and chunks: the sequence-parallel mesh (Ulysses ``hp`` x
    ring ``cp``) and the global chunk length, as a caller gives them. Data only, and defined here
    once: ``fpdt-train``'s options and the planner's :class:`fpdt.plan.planner.Choice` are each one
    of these plus their own fields. A field left None is chosen by whoever resolves it
    (``fpdt-train``: :meth:`degrees` and its default chunk; ``fpdt-plan``: its search), into a
    :class:`ResolvedLayout`."""

    sp: int | None = None
    """Sequence-parallel size ``P = hp * cp``; given alone, shorthand for ``hp = sp, cp = 1``."""
    hp: int | None = None
    """Head-parallel (Ulysses all-to-all) degree."""
    cp: int | None = None
    """Context-parallel (ring attention) degree; with ``cp > 1`` the sequence is cut into
    ``2 * cp`` zigzag pieces, so ``S`` must be a multiple of ``2 * hp * cp * u``."""
    placement: str | None = None
    """2D mesh placement (:data:`fpdt.comm.PLACEMENTS`): ``"head_first"`` (the default: HP ranks
    adjacent, the all-to-all inside a node) or ``"context_first"`` (ring traffic inside a node)."""
    inner_ring: int | None = None
    """Double-ring inner size (divides ``cp``; e.g. NICs per node); None: one ring."""
    chunk_size: int | None = None
    """Global tokens per FPDT chunk ``C`` (the post-all-to-all chunk): ``u = S / C`` chunks,
    each rank holding ``C / P`` tokens of every chunk."""

    def degrees(self) -> tuple[int, int]:
        """``(hp, cp)``: as given; ``sp`` alone is ``(sp, 1)``; one of ``hp`` / ``cp`` with ``sp``
        makes the other ``sp`` divided by it; otherwise a degree not given is 1."""
        hp, cp = self.hp, self.cp
        if hp is None and cp is None:
            return (1 if self.sp is None else self.sp), 1
        if hp is not None and cp is not None:
            return hp, cp
        given = hp if hp is not None else cp
        other = 1
        if _is_int(self.sp) and _is_int(given) and given >= 1 and self.sp % given == 0:
            other = self.sp // given
        return (given, other) if hp is not None else (other, given)

    def resolved(self) -> dict[str, Any]:
        """The :class:`ResolvedLayout` fields these values give: ``(hp, cp)`` from :meth:`degrees`,
        the rest as given (a conflict with ``sp`` is :meth:`layout_problems`')."""
        hp, cp = self.degrees()
        return dict(hp=hp, cp=cp, placement=self.placement, inner_ring=self.inner_ring, chunk_size=self.chunk_size)

    def layout_problems(self) -> list[str]:
        """Every reason these values are invalid whatever the run (empty when valid), each
        naming the fix; what depends on the sequence or the world is checked where they are known."""
        out = [f"{name}={value!r} must be an integer >= 1" for name in ("sp", "hp", "cp", "inner_ring", "chunk_size")
               if (value := getattr(self, name)) is not None and (not _is_int(value) or value < 1)]
        if self.placement is not None and self.placement not in PLACEMENTS:
            out.append(f"placement={self.placement!r} must be one of {PLACEMENTS}")
        if out:
            return out
        hp, cp = self.degrees()
        if self.sp is not None and self.sp != hp * cp:
            out.append(f"sp={self.sp} does not match hp={hp} x cp={cp} = {hp * cp}: sp is hp x cp (give sp alone "
                       f"for plain Ulysses, or hp and cp; one of them with sp makes the other sp divided by it)")
        if self.inner_ring is not None and cp % self.inner_ring:
            out.append(f"inner_ring={self.inner_ring} must divide cp={cp}: it is the ranks of one inner ring "
                       f"(e.g. NICs per node)")
        return out


@dataclass(frozen=True, kw_only=True)
class ResolvedLayout:
    """A layout with its mesh chosen, the base of ``fpdt-train``'s :class:`fpdt.train.config.RunLayout`
    and ``fpdt-plan``'s :class:`fpdt.plan.setup.Setup`: the degrees ``hp`` and ``cp`` (a caller's
    :class:`LayoutOptions` give them by :meth:`LayoutOptions.resolved`), ``placement``
    ``"head_first"`` when None, ``inner_ring`` and ``chunk_size`` as there. ``sp`` is computed."""

    hp: int = 1
    cp: int = 1
    placement: str | None = None
    inner_ring: int | None = None
    chunk_size: int | None = None

    def __post_init__(self):
        if self.placement is None:
            object.__setattr__(self, "placement", "head_first")

    @property
    def sp(self) -> int:
        """Sequence-parallel size ``P = hp * cp``."""
        return self.hp * self.cp

    def degrees(self) -> tuple[int, int]:
        return self.hp, self.cp

    def layout_problems(self) -> list[str]:
        """:meth:`LayoutOptions.layout_problems` of these values."""
        return LayoutOptions(hp=self.hp, cp=self.cp, placement=self.placement, inner_ring=self.inner_ring,
                             chunk_size=self.chunk_size).layout_problems()


OPTION_NAMES = tuple(f.name for f in fields(FPDTOptions))
DERIVED_OPTIONS = ("num_chunks", "group", "mesh", "nvme_tier")
"""Options ``fpdt-train`` and ``fpdt-plan`` derive instead of taking them from a caller:
``num_chunks`` is ``seq_len / chunk_size``, the group or mesh is built from the mesh degrees,
the NVMe tier's stores are opened by the trainer."""


def device_defaults(device_type: str, num_chunks: int = 2, offload: bool | None = None,
                    checkpointing: str | None = None, stream_layers: bool = False) -> tuple[bool, str]:
    """``(offload, checkpointing)`` of a run on ``device_type``: the given values, else the FPDT
    design on CUDA (attention offload when there is more than one chunk to pipeline, layer inputs
    checkpointed to the host) and neither elsewhere (both need pinned memory and copy streams).

    ``fpdt-train`` and ``fpdt-plan`` use this: they know the run's device. :class:`FPDTOptions`'
    own defaults stay ``(False, "off")`` on every device: ``fpdt.model`` and ``fpdt.hf`` take
    the options before the model is moved to its device, and a library user's model does not
    change its memory and speed with where it happens to be built. Pass
    ``dict(zip(("offload", "checkpointing"), device_defaults("cuda", u)))`` to get the trainer's.
    With ``stream_layers`` both default to what streaming needs (on, ``"offload"``) on any device."""
    cuda = device_type == "cuda"
    return (offload if offload is not None else stream_layers or (cuda and num_chunks > 1),
            checkpointing if checkpointing is not None else ("offload" if cuda or stream_layers else "off"))


def attention_checkpoint_given(mode: str | None, save_layers: int | None) -> str:
    """The ``attention_checkpoint`` of an entry point that may leave it open (``fpdt-train``,
    ``fpdt-plan``: None): as given, else ``"save"`` when a saving-layer count is given, else
    ``"recompute"`` (what the options are validated with before the entry point chooses)."""
    if mode is not None:
        return mode
    return "save" if save_layers is not None else "recompute"


def _streaming_problems(o: FPDTOptions) -> list[str]:
    """What ``stream_layers=True`` refuses: the layer inputs on the host are its checkpoints, and
    every chunk it does not compute on lives on the host, the attention's included."""
    out = []
    if o.checkpointing != "offload":
        out.append(f"stream_layers=True keeps each layer's input in host memory as its checkpoint: set "
                   f"checkpointing='offload' (now {o.checkpointing!r})")
    if o.offload is not True:
        out.append("stream_layers=True keeps the attention's chunks in host memory too: set offload=True")
    if _is_int(o.checkpoint_device_layers) and o.checkpoint_device_layers:
        out.append(f"stream_layers=True keeps no layer input on the device: set checkpoint_device_layers=0 "
                   f"(now {o.checkpoint_device_layers})")
    return out


def _nvme_problems(o: FPDTOptions) -> list[str]:
    """``nvme_path`` is a directory path, and only the host-offloaded checkpoints go there;
    ``nvme_layers`` counts layers of that tier."""
    if o.nvme_layers is not None and (not _is_int(o.nvme_layers) or o.nvme_layers < 0):
        return [f"nvme_layers={o.nvme_layers!r} must be an integer >= 0, or None (every offloaded layer)"]
    if o.nvme_layers is not None and o.nvme_path is None:
        return [f"nvme_layers={o.nvme_layers} counts the layers whose checkpoints go to the NVMe tier: it needs "
                f"nvme_path (a directory on a local drive); set nvme_path, or drop nvme_layers"]
    if o.nvme_tier is not None and not isinstance(o.nvme_tier, NVMeTier):
        return [f"nvme_tier={o.nvme_tier!r} must be a fpdt.offload.nvme.NVMeTier, or None (the model opens its own)"]
    if o.nvme_path is None:
        return []
    if not isinstance(o.nvme_path, str) or not o.nvme_path.strip():
        return [f"nvme_path={o.nvme_path!r} must be a directory path (a non-empty string), or None (off)"]
    if o.checkpointing != "offload":
        return [f"nvme_path={o.nvme_path!r} holds the host-offloaded layer checkpoints: it needs "
                f"checkpointing='offload' (now {o.checkpointing!r}); set checkpointing='offload', or drop nvme_path"]
    return []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> list[str]:
    return [] if value in allowed else [f"{name}={value!r} must be one of {allowed}"]


@dataclass(frozen=True)
class Flag:
    """How an option is typed on ``fpdt-train`` / ``fpdt-plan``'s command line (:func:`add_option_flags`)."""

    flag: str
    type: Any                     # int, str, bool (a --x/--no-x switch) or a tuple of the allowed values
    help: str
    json_key: str | None          # the key of the DeepSpeed JSON's "fpdt" section; None: none
    default: str = ""             # fpdt-train's default, as --help says it
    plan_default: str | None = None   # fpdt-plan's, where it differs (it chooses what it is not told)
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments."""
        return self.flag[2:].replace("-", "_")


_CHOOSE = "choose"
OPTION_FLAGS: dict[str, Flag] = {
    "seq_len": Flag("--seq-len", int, "global tokens per sequence", None),
    "sp": Flag("--sp", int, "sequence-parallel size hp x cp (divides the world size)", "sp",
               "1; given alone, --hp SP --cp 1", "every GPU"),
    "hp": Flag("--hp", int, "2D mesh: head-parallel (Ulysses) degree", "hp", "1 with --cp", _CHOOSE),
    "cp": Flag("--cp", int, "2D mesh: context-parallel (ring attention) degree", "cp", "1", _CHOOSE),
    "placement": Flag("--placement", PLACEMENTS, "2D mesh placement: HP ranks adjacent (head_first) or CP ranks "
                      "adjacent (context_first)", "placement", "head_first", _CHOOSE),
    "inner_ring": Flag("--inner-ring", int, "double-ring inner size (divides --cp)", "inner_ring", "one ring"),
    "chunk_size": Flag("--chunk-size", int, "global tokens per FPDT chunk, a multiple of sp (2 x hp x cp on a 2D "
                       "mesh) dividing --seq-len", "chunk_size", "65536, or the whole sequence when shorter; else the "
                       "largest such chunk below 64K, down to 8K; else the whole sequence", _CHOOSE),
    "offload": Flag("--offload", bool, "offload attention chunks to pinned host memory",
                    "offload", "on with CUDA when there is more than one chunk, off elsewhere; on the CPU only with "
                    "--runtime sim",
                    "on when there is more than one chunk"),
    "checkpointing": Flag("--checkpoint", CHECKPOINT_MODES, "activation checkpointing; offload keeps layer inputs "
                          "on the host", "checkpoint", "offload with CUDA, off elsewhere; offload on the CPU only "
                          "with --runtime sim",
                          "offload"),
    "checkpoint_device_layers": Flag(
        "--checkpoint-device-layers", int, "with --checkpoint offload, keep the last K decoder layers' inputs on the "
        "GPU instead of the host, for runs whose host memory is the limit; fpdt-plan suggests K",
        "checkpoint_device_layers", "0", "0, or the fewest that make the host memory fit when it is what does not",
        "K"),
    "nvme_path": Flag("--nvme-path", str, "with --checkpoint offload, a directory on a local NVMe drive for the layer "
                      "checkpoints (the NVMe tier, docs/nvme.md); each rank writes under DIR/rank{R}/ and removes its "
                      "files at exit", "nvme_path", "off: host memory", metavar="DIR"),
    "nvme_layers": Flag("--nvme-layers", int, "with the NVMe tier, only the first K decoder layers' checkpoints "
                        "(input, saved attention output) go to disk, the rest stay in host memory", "nvme_layers",
                        "the fewest that bring the memory check's predicted host offload within the node's available "
                        "memory, as the start-up line says", "the fewest that make the host memory fit", "K"),
    "stream_layers": Flag("--stream-layers", bool, "run every layer a chunk at a time with the residual stream in "
                          "host memory: device memory flat in the sequence length (implies --offload and --checkpoint "
                          "offload)", "stream_layers", "on when the run's memory check predicts the device does not "
                          "hold it otherwise", "choose, only when the run does not fit otherwise"),
    "attention_checkpoint": Flag(
        "--attention-checkpoint", ATTENTION_CHECKPOINT_MODES, "with checkpointing, whether a layer's recompute runs "
        "the attention forward again (recompute) or reads the attention output and lse its forward kept beside the "
        "layer input (save: 3 attention passes instead of 4)", "attention_checkpoint",
        "save for as many layers as the run's memory check predicts the host and device hold, else recompute",
        "choose, save for as many layers as fit"),
    "save_attention_layers": Flag("--save-attention-layers", int, "with --attention-checkpoint save, only the first "
                                  "K layers save", "save_attention_layers", "every layer when given save; as many as "
                                  "fit when left to choose", "as many as fit", "K"),
    "backend": Flag("--attention-backend", tuple(BACKENDS), f"attention kernel, one of {', '.join(BACKENDS)}; one "
                    "that repeats the KV heads (cuda_efficient, cpu, math) holds more per block", "attention_backend",
                    "automatic, the first in that order that is installed, fits the device, dtype and head size and "
                    "passes its self-check; cuDNN ahead of FlashAttention-2 where torch's own SDPA prefers it",
                    "automatic; the attention rate is the calibration's for the kernel when op_latency.py --backends "
                    "timed it, else the calibration's (automatic kernel's) or the datasheet's", "KERNEL"),
    "mlp_chunks": Flag("--mlp-chunks", int, "MLP token chunks (0 = unchunked)", "mlp_chunks",
                       "ceil(2 u intermediate / hidden)"),
    "loss_chunks": Flag("--loss-chunks", int, "LM-head + loss token chunks (0 = unchunked)", "loss_chunks",
                        "ceil(2 u vocab / hidden)"),
    "lm_head_wgrad": Flag("--lm-head-wgrad", LM_HEAD_WGRAD_MODES, "LM-head weight gradient: recomputed logits in "
                          "backward, no fp32 [vocab, hidden] buffer (recompute: faster and smaller on an H100 at "
                          "Llama-3 shapes) or that buffer summed over the loss chunks (accumulate)", "lm_head_wgrad",
                          "recompute", _CHOOSE),
    "runtime": Flag("--runtime", RUNTIMES, "device runtime of the offload copies: sim runs them on simulated CUDA "
                    "streams, which allows --offload and --checkpoint offload on the CPU (to test them); sync; cuda",
                    "runtime", "$FPDT_RUNTIME if set, else cuda on CUDA and sync elsewhere"),
}
"""Option name -> its flag, declared once: both command lines add them with :func:`add_option_flags`
and read them back with :func:`flag_values`, and word a library message in them with
:func:`in_flag_terms`; the JSON keys are ``fpdt-train``'s ``"fpdt"`` section's."""


def add_option_flags(parser: Any, names: Any, prog: str = "fpdt-train", required: tuple[str, ...] = ()) -> None:
    """Add the flags of the options ``names`` (keys of :data:`OPTION_FLAGS`) to an argparse
    parser or group, with ``prog``'s default in their help; every one defaults to None (not given)."""
    import argparse
    for name in names:
        f = OPTION_FLAGS[name]
        default = f.plan_default if prog == "fpdt-plan" and f.plan_default is not None else f.default
        kw: dict[str, Any] = {"help": f.help + (f" (default: {default})" if default else ""), "metavar": f.metavar}
        if f.type is bool:
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        elif isinstance(f.type, tuple):
            kw["choices"] = list(f.type)
        else:
            kw["type"] = f.type
        parser.add_argument(f.flag, required=name in required, **kw)


def flag_values(args: Any, names: Any) -> dict[str, Any]:
    """``{option name: value}`` of the flags of ``names`` in parsed ``args`` (None: not given)."""
    return {name: getattr(args, OPTION_FLAGS[name].dest) for name in names}


_NAME_OF = {**{f.json_key: name for name, f in OPTION_FLAGS.items() if f.json_key}, **{n: n for n in OPTION_FLAGS}}
_SETTING = re.compile(r"\b(" + "|".join(sorted(_NAME_OF, key=len, reverse=True)) +
                      r")=('[^']*'|\"[^\"]*\"|True|False|None|-?\d+)")


_BARE = re.compile(r"\b(" + "|".join(n for n in OPTION_FLAGS if "_" in n) + r")\b(?!=)")
"""A name of several words, standing alone (``drop save_attention_layers``)."""


def as_flag(name: str, value: Any) -> str:
    """``name=value`` as typed on the command line: ``--checkpoint offload``, ``--no-offload``."""
    flag = OPTION_FLAGS[name].flag
    if OPTION_FLAGS[name].type is bool:
        return flag if value else "--no-" + flag[2:]
    return flag if value is None else f"{flag} {value}"


def in_flag_terms(message: str) -> str:
    """A message worded in option names (``set checkpointing='offload' (now 'off')``) worded in
    the flags of :data:`OPTION_FLAGS` (``pass --checkpoint offload (now off)``); a JSON key names
    its option too (``checkpoint=``)."""
    def flag(m: re.Match) -> str:
        name, raw = _NAME_OF[m.group(1)], m.group(2)
        if raw[0] in "'\"" and OPTION_FLAGS[name].type is int:
            return f"{OPTION_FLAGS[name].flag} {raw}"           # a string where a number belongs: kept quoted
        value = {"True": True, "False": False, "None": None}.get(raw, raw.strip("'\""))
        return f"no {OPTION_FLAGS[name].flag}" if value is None else as_flag(name, value)
    text = _SETTING.sub(flag, message.replace("fpdt option ", ""))
    text = _BARE.sub(lambda m: OPTION_FLAGS[m.group(1)].flag, text)
    text = re.sub(r"\bset (--)", r"pass \1", text)
    return re.sub(r"\(now '([^']*)'\)", r"(now \1)", text)

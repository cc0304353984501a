"""One training configuration the planner evaluates: what runs where, how it is cut.

Units used throughout :mod:`fpdt.plan` (those of the device-memory issue):

* ``T = S / (hp * cp)``: tokens of the sequence on one rank (batch ``B`` multiplies).
* ``Nd = B * T * hidden * e``: one full-length hidden-state tensor of one rank, ``e`` bytes
  per element (2 for bf16, 4 for fp32).
* ``U = Nd / u``: the same for one FPDT chunk (``u = S / chunk_size`` chunks per rank).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from fpdt.model.config import ModelConfig
from fpdt.model.layer_checkpoints import saving_layers
from fpdt.plan.models import model_spec
from fpdt.options import (DERIVED_OPTIONS, LAYER_COUNTS, OPTION_NAMES, FPDTOptions, LayoutOptions, ResolvedLayout,
                          device_defaults,
                          layer_count_problems)
from fpdt.layout import chunking_problems
from fpdt.train.config import PRECISIONS, option_key

ZERO_REDUCE_BUCKET = 5e8
"""DeepSpeed's default ``reduce_bucket_size`` (elements): with ``contiguous_gradients`` (also
its default) ZeRO-2/3 allocate a bucket of that many gradient elements on the device at
start-up and keep it."""
ZERO_SUB_GROUP = 1e9
"""DeepSpeed's default ZeRO-3 ``sub_group_size`` (elements per optimizer sub-group)."""
DTYPES = {name: PRECISIONS[name].itemsize for name in ("bf16", "fp32")}
"""The precisions the planner plans, and their bytes per element."""
_GPU_OFFLOAD, _GPU_CHECKPOINTING = device_defaults("cuda")
GPU_OPTIONS = FPDTOptions(offload=_GPU_OFFLOAD, checkpointing=_GPU_CHECKPOINTING)
"""The model options ``fpdt-train`` runs with on a GPU when given none
(:func:`fpdt.options.device_defaults`: attention offload, offloaded layer-input
checkpoints; :class:`fpdt.options.FPDTOptions`' defaults for the rest): a :class:`Setup`'s
default, and the base of what a :class:`fpdt.plan.planner.Choice` leaves open."""
def chunk_count_problems(options: FPDTOptions) -> list[str]:
    """Why the options' MLP / loss chunk counts cannot be planned (None = the default, fine)."""
    return [f"{name}={n}: the planner models the chunked MLP and loss; give at least 1 chunk "
            f"(0, unchunked, is a trainer option the planner does not model)"
            for name in ("mlp_chunks", "loss_chunks") if (n := getattr(options, name)) is not None and n < 1]


def option_problems(options: FPDTOptions, num_layers: int) -> list[str]:
    """Why ``options`` cannot be planned for a model of ``num_layers`` decoder layers (empty
    when they can), each naming the fix: :meth:`FPDTOptions.problems`, then the layer counts
    against the model (:func:`fpdt.options.layer_count_problems`, the check every entry point makes)."""
    return options.problems() + layer_count_problems(num_layers, **{n: getattr(options, n) for n in LAYER_COUNTS})


def doc_len_problems(doc_len: Any) -> list[str]:
    """Why a packed documents' mean length cannot be planned (None: one document per sequence, fine)."""
    if doc_len is None or _positive(doc_len):
        return []
    return [f"--doc-len {doc_len!r} must be a whole number of tokens, at least 1 (the mean document length)"]


def split_options(changes: dict[str, Any], own: set[str], what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``changes`` as ``(own fields, FPDTOptions fields)``; a name that is neither (or one the
    planner derives, :data:`DERIVED_OPTIONS`) is a ``TypeError`` naming the valid ones."""
    settable = set(OPTION_NAMES) - set(DERIVED_OPTIONS)
    unknown = sorted(set(changes) - own - settable)
    if unknown:
        raise TypeError(f"unknown {what} settings {unknown}; valid: {sorted(own | settable)}")
    return ({k: v for k, v in changes.items() if k in own},
            {k: v for k, v in changes.items() if k not in own})


@dataclass(frozen=True)
class RunSettings:
    """What a planned run sets beside its layout and model options, the same for a
    :class:`Setup` and a :class:`fpdt.plan.planner.Choice`: ZeRO, precision, batch, LoRA and
    packed documents."""

    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_param: bool = False
    dtype: str = "bf16"
    batch: int = 1
    """Sequences per SP group per micro step."""
    reduce_bucket_size: float = ZERO_REDUCE_BUCKET
    sub_group_size: float = ZERO_SUB_GROUP
    contiguous_gradients: bool = True
    """DeepSpeed ZeRO settings that allocate device memory (``zero_optimization`` keys; its
    defaults unless given)."""
    lora_rank: int = 0
    """PEFT LoRA adapters of this rank on every decoder linear, the rest frozen (``fpdt.hf``: fp32
    adapters, their gradients and AdamW moments; no base or LM-head weight gradient); 0: full."""
    doc_len: int | None = None
    """Packed documents of this mean length (:mod:`fpdt.plan.documents`), each attending within
    itself; None: one document per sequence."""

    def run_settings(self) -> dict[str, Any]:
        """These fields by name, to carry from one object to another (a choice to its setups)."""
        return {f.name: getattr(self, f.name) for f in fields(RunSettings)}


@dataclass(frozen=True, kw_only=True)
class Setup(ResolvedLayout, RunSettings):
    """A complete training configuration on a cluster (one sequence per SP group): the
    layout (:class:`~fpdt.options.ResolvedLayout`: ``hp``, ``cp``, ``sp = hp * cp`` computed), the
    sequence length, the :class:`RunSettings` and the model's :class:`~fpdt.options.FPDTOptions`.
    Build one with :meth:`build` (options as keywords; ``sp`` read as ``fpdt-train`` reads it)."""

    seq_len: int
    """Global sequence length ``S``; ``u = S / chunk_size`` chunks per rank (``options.num_chunks``)."""
    options: FPDTOptions = GPU_OPTIONS
    """The model's options (checkpointing and its device layers, attention offload, saved
    attention, MLP / loss chunks, LM-head mode, kernel); ``num_chunks`` is set from
    ``seq_len / chunk_size`` and there is no process group. Default: :data:`GPU_OPTIONS`."""
    kernel_expands_gqa: bool = False
    """The attention kernel repeats K/V heads (the CPU kernel); False for flash-attn/cuDNN,
    which take GQA natively (the GPU presets)."""

    def __post_init__(self):
        if self.chunk_size is None:
            raise TypeError("Setup needs chunk_size (the global FPDT chunk length)")
        super().__post_init__()
        u = self.seq_len // self.chunk_size if isinstance(self.chunk_size, int) and self.chunk_size >= 1 else 1
        # (a chunk that does not divide the sequence is reported by problems(), not here)
        object.__setattr__(self, "options", replace(self.options, num_chunks=max(1, u), group=None, mesh=None))

    @classmethod
    def build(cls, seq_len: int, chunk_size: int, options: FPDTOptions = GPU_OPTIONS, **changes: Any) -> Setup:
        """A setup from its coordinates and :class:`FPDTOptions` fields as keywords
        (``checkpointing="on", lm_head_wgrad="accumulate"``), applied over ``options``."""
        own, opts = split_options(changes, _OWN_FIELDS | {"sp"}, "Setup")
        return cls(seq_len=seq_len, chunk_size=chunk_size, options=replace(options, **opts), **_degrees(own))

    def updated(self, **changes: Any) -> Setup:
        """A copy with ``changes`` to its own fields or to its options' (by field name; ``sp``
        as :meth:`build` reads it)."""
        own, opts = split_options(changes, _OWN_FIELDS | {"sp"}, "Setup")
        return replace(self, options=replace(self.options, **opts), **_degrees(own))

    def as_dict(self) -> dict[str, Any]:
        """The flat record ``fpdt-plan`` prints (its ``"setup"``): the coordinates, and the
        options it plans by their ``fpdt-train`` flag names (``checkpoint``)."""
        return {option_key(name): getattr(self.options if name in OPTION_NAMES else self, name)
                for name in _PRINTED}

    def saving_layers(self, num_layers: int) -> tuple[int, int]:
        """``(host, device)``: how many layers save their attention output, by where it lives.
        The saving layers are the first ``save_attention_layers`` (all when None); a saved
        output lives where its layer's input checkpoint does: on the host under
        ``checkpointing="offload"`` except for the last ``checkpoint_device_layers`` layers,
        on the device under ``"on"``. 0 and 0 with ``"recompute"`` or ``checkpointing="off"``."""
        o = self.options
        n = saving_layers(o, num_layers)            # the model's own count (0 without saving)
        if o.checkpointing != "offload":
            return 0, n
        on_device = max(0, n - (num_layers - o.checkpoint_device_layers))
        return n - on_device, on_device

    @property
    def num_chunks(self) -> int:
        """``u``: FPDT chunks per rank (``S / C``)."""
        return self.options.num_chunks

    @property
    def local_tokens(self) -> int:
        """``T``: tokens per rank (per sequence)."""
        return self.seq_len // self.sp

    @property
    def rank_tokens(self) -> int:
        """Tokens per rank per micro step: ``batch`` sequences of :attr:`local_tokens`."""
        return self.batch * self.local_tokens

    @property
    def elem_bytes(self) -> int:
        return DTYPES[self.dtype]

    def problems(self, cfg: ModelConfig, world: int) -> list[str]:
        """Why this setup cannot run at all (empty when it can); each names the fix."""
        out = option_problems(self.options, cfg.num_layers) + self.layout_problems()
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        out += doc_len_problems(self.doc_len)
        if self.lora_rank < 0:
            out.append(f"lora_rank={self.lora_rank} must be >= 0 (0: full fine-tuning)")
        if self.zero_stage not in (0, 1, 2, 3):
            out.append(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.offload_param and self.zero_stage != 3:
            out.append("parameter offload needs ZeRO stage 3")
        if not _positive(self.hp, self.cp, self.chunk_size):
            return out      # reported by layout_problems()
        if world % self.sp:
            out.append(f"hp x cp = {self.hp} x {self.cp} must divide the {world} GPUs")
        elif cfg.num_heads % self.hp:
            out.append(f"hp={self.hp} must divide the {cfg.num_heads} query heads")
        out += hybrid_problems(cfg, self.hp, self.cp)
        out += chunk_count_problems(self.options)
        out += chunking_problems(self.seq_len, self.chunk_size, self.hp, self.cp)
        return out


def hybrid_problems(cfg: ModelConfig, hp: int, cp: int) -> list[str]:
    """Why a model with Gated DeltaNet layers cannot run on an ``hp x cp`` mesh (empty when it can)."""
    g = model_spec(cfg).gdn
    if g is None:
        return []
    out = []
    if cp > 1:
        out.append(f"cp={cp}: the model's Gated DeltaNet layers run under Ulysses only (passing their state "
                   f"between context-parallel ranks is not implemented); use cp 1")
    if g.key_heads % hp or g.value_heads % hp:
        out.append(f"hp={hp} must divide the Gated DeltaNet's {g.key_heads} key and {g.value_heads} value heads")
    return out


def _degrees(own: dict[str, Any]) -> dict[str, Any]:
    """``own`` with a given ``sp`` read into ``hp`` and ``cp`` (:meth:`LayoutOptions.degrees`)."""
    if "sp" not in own:
        return own
    layout = LayoutOptions(sp=own.pop("sp"), hp=own.get("hp"), cp=own.get("cp"))
    for problem in layout.layout_problems():
        raise ValueError(problem)
    hp, cp = layout.degrees()
    return {**own, "hp": hp, "cp": cp}


def _positive(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)


_OWN_FIELDS = {f.name for f in fields(Setup)} - {"options"}
_PRINTED = ("seq_len", "chunk_size", "hp", "cp", "placement", "inner_ring", "checkpointing",
            "checkpoint_device_layers", "offload", "zero_stage", "offload_optimizer", "offload_param", "dtype",
            "batch", "mlp_chunks", "loss_chunks", "lm_head_wgrad", "reduce_bucket_size", "sub_group_size",
            "contiguous_gradients", "kernel_expands_gqa", "attention_checkpoint", "save_attention_layers",
            "doc_len", "lora_rank", "stream_layers", "nvme_path", "nvme_layers")
""":meth:`Setup.as_dict`'s keys, in ``fpdt-plan``'s order (``--json`` prints them so)."""

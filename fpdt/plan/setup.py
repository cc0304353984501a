"""One training configuration the planner evaluates: what runs where, how it is cut.

Units used throughout :mod:`fpdt.plan` (those of the device-memory issue):

* ``T = S / (hp * cp)``: tokens of the sequence on one rank (batch ``B`` multiplies).
* ``Nd = B * T * hidden * e``: one full-length hidden-state tensor of one rank, ``e`` bytes
  per element (2 for bf16, 4 for fp32).
* ``U = Nd / u``: the same for one FPDT chunk (``u = S / chunk_size`` chunks per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from fpdt.model.config import ModelConfig
from fpdt.options import CHECKPOINT_MODES, LM_HEAD_WGRAD_MODES, FPDTOptions
from fpdt.train.config import chunk_split

ZERO_REDUCE_BUCKET = 5e8
"""DeepSpeed's default ``reduce_bucket_size`` (elements): with ``contiguous_gradients`` (also
its default) ZeRO-2/3 allocate a bucket of that many gradient elements on the device at
start-up and keep it."""
ZERO_SUB_GROUP = 1e9
"""DeepSpeed's default ZeRO-3 ``sub_group_size`` (elements per optimizer sub-group)."""
PLACEMENTS = ("head_first", "context_first")


def chunk_count_problems(mlp_chunks: int | None, loss_chunks: int | None) -> list[str]:
    """Why these MLP / loss chunk counts cannot be planned (None = the default, fine)."""
    return [f"{name}={n}: the planner models the chunked MLP and loss; give at least 1 chunk "
            f"(0, unchunked, is a trainer option the planner does not model)"
            for name, n in (("mlp_chunks", mlp_chunks), ("loss_chunks", loss_chunks)) if n is not None and n < 1]
DTYPES = {"bf16": 2, "fp32": 4}


def device_layer_problems(k, checkpoint: str, num_layers: int) -> list[str]:
    """Why ``k`` last layers' inputs cannot stay on the device under ``checkpoint`` (empty
    when they can; 0 always can), naming the fix."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= num_layers:
        return [f"--checkpoint-device-layers {k!r} must be an integer from 0 to the model's {num_layers} layers"]
    if k and checkpoint != "offload":
        return [f"--checkpoint-device-layers {k} keeps some offloaded layer inputs on the GPU: it needs "
                f"--checkpoint offload (not {checkpoint})"]
    return []


@dataclass(frozen=True)
class Setup:
    """A complete training configuration on a cluster (one sequence per SP group)."""

    seq_len: int
    """Global sequence length ``S``."""
    chunk_size: int
    """Global FPDT chunk length ``C``; ``u = S / C`` chunks per rank."""
    hp: int = 1
    """Ulysses (head-parallel) degree."""
    cp: int = 1
    """Context-parallel (ring) degree; ``hp * cp`` is the sequence-parallel group."""
    placement: str = "head_first"
    inner_ring: int | None = None
    checkpoint: str = "offload"
    checkpoint_device_layers: int = 0
    """With ``checkpoint="offload"``: the last this many layers keep their input on the
    device (the model's option of the same name)."""
    offload: bool = True
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_param: bool = False
    dtype: str = "bf16"
    batch: int = 1
    """Sequences per SP group per micro step."""
    mlp_chunks: int | None = None
    """None: the options' default (ceil(2 u I / hidden), :class:`fpdt.options.FPDTOptions`)."""
    loss_chunks: int | None = None
    """None: the model's default (ceil(2 u V / hidden))."""
    lm_head_wgrad: str = FPDTOptions.lm_head_wgrad
    """The chunked loss's LM-head weight gradient (:mod:`fpdt.model.loss`): an fp32
    ``[V, hidden]`` accumulator, or recomputed logits in backward (one more LM-head GEMM)."""
    reduce_bucket_size: float = ZERO_REDUCE_BUCKET
    sub_group_size: float = ZERO_SUB_GROUP
    contiguous_gradients: bool = True
    """DeepSpeed ZeRO settings that allocate device memory (``zero_optimization`` keys)."""
    kernel_expands_gqa: bool = False
    """The attention kernel repeats K/V heads (the CPU kernel); False for flash-attn/cuDNN,
    which take GQA natively (the GPU presets)."""
    lora_rank: int = 0
    """PEFT LoRA adapters of this rank on every decoder linear, the rest frozen (``fpdt.hf``:
    fp32 adapters, their gradients and AdamW moments; no weight gradients for the base, no
    LM-head gradient); 0 trains every weight."""

    @property
    def sp(self) -> int:
        return self.hp * self.cp

    @property
    def num_chunks(self) -> int:
        return self.seq_len // self.chunk_size

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
        out = []
        if self.checkpoint not in CHECKPOINT_MODES:
            out.append(f"checkpoint={self.checkpoint!r} must be one of {CHECKPOINT_MODES}")
        out += device_layer_problems(self.checkpoint_device_layers, self.checkpoint, cfg.num_layers)
        if self.lm_head_wgrad not in LM_HEAD_WGRAD_MODES:
            out.append(f"lm_head_wgrad={self.lm_head_wgrad!r} must be one of {LM_HEAD_WGRAD_MODES}")
        if self.placement not in PLACEMENTS:
            out.append(f"placement={self.placement!r} must be one of {PLACEMENTS}")
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if self.lora_rank < 0:
            out.append(f"lora_rank={self.lora_rank} must be >= 0 (0: full fine-tuning)")
        if self.zero_stage not in (0, 1, 2, 3):
            out.append(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.offload_param and self.zero_stage != 3:
            out.append("parameter offload needs ZeRO stage 3")
        if self.hp < 1 or self.cp < 1 or world % self.sp:
            out.append(f"hp x cp = {self.hp} x {self.cp} must divide the {world} GPUs")
        elif cfg.num_heads % self.hp:
            out.append(f"hp={self.hp} must divide the {cfg.num_heads} query heads")
        if self.inner_ring is not None and (self.inner_ring < 1 or self.cp % self.inner_ring):
            out.append(f"inner_ring={self.inner_ring} must divide cp={self.cp}")
        out += chunk_count_problems(self.mlp_chunks, self.loss_chunks)
        if self.chunk_size < 1 or self.seq_len % self.chunk_size:
            out.append(f"chunk_size={self.chunk_size} must divide seq_len={self.seq_len}")
        elif self.chunk_size % chunk_split(self.sp, self.cp):
            out.append(f"chunk_size={self.chunk_size} must be a multiple of {chunk_split(self.sp, self.cp)} "
                       f"(hp x cp{' x 2 for the zigzag ring split' if self.cp > 1 else ''})")
        return out

"""``FPDTAttention``: a Llama-style attention layer that runs the FPDT pipeline."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fpdt.attention.output_projection import StashedInput, output_projection
from fpdt.attention.projected_attention import projected_fpdt_attention
from fpdt.attention.rope import RotaryEmbedding
from fpdt.attention.saved_attention import SavedAttention
from fpdt.comm import SequenceMesh
from fpdt.offload import Runtime
from fpdt.ops.projections import read_output_projection, read_projections


class FPDTAttention(nn.Module):
    """Llama-family self-attention over a sequence-parallel, chunked, offloadable sequence.

    Parameters match Hugging Face's ``LlamaAttention`` (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``), so checkpoints map one to one.

    Per chunk of the local sequence: q/k/v projections, RoPE at the tokens' global
    positions, Ulysses all-to-all, chunked attention with the online-softmax merge, and
    the all-to-all back; then ``o_proj`` over the local sequence. See
    :mod:`fpdt.attention.projected_attention` for what is saved for backward.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: model shape (``head_dim`` defaults
            to ``hidden_size // num_heads``).
        qkv_bias, o_bias: biases on the q/k/v and output projections.
        num_chunks: chunks per rank ``u`` (may be reassigned later); ``S`` must be divisible
            by ``sp * u``.
        offload: keep chunks in (pinned) host memory between forward and backward.
        group: sequence-parallel process group; None = default group (world of 1 if
            torch.distributed is not initialised).
        mesh: a 2D :class:`fpdt.comm.SequenceMesh` (hp x cp) instead of ``group``; inputs
            and position ids are then in the mesh layout (may be reassigned later).
        backend: attention kernel name, None = automatic.
        runtime: device runtime of the offload copies (:attr:`fpdt.options.FPDTOptions.runtime`;
            may be reassigned later), None = automatic.

    The projections may be plain ``nn.Linear`` with the LoRA adapters :func:`fpdt.model.lora.add_lora`
    attached, or PEFT LoRA layers (:mod:`fpdt.ops.projections`): their terms run inside the chunked
    q/k/v projection, and on ``o_proj`` inside the chunked output projection
    (:mod:`fpdt.attention.output_projection`, which saves at most its input). ``q_norm`` /
    ``k_norm`` (Qwen3; None elsewhere): per-head RMSNorms of q and k before RoPE, read directly.
    :meth:`from_projections` builds one around existing projection modules (``fpdt.hf`` does,
    keeping a Transformers model's parameter names).

    ``o_proj_input_from_stash`` (True; a model sets it False under a layer checkpoint, whose
    recompute holds one layer's tensors anyway): with
    ``offload``, ``o_proj`` keeps no copy of its input for backward; its backward reads it a
    chunk at a time from the attention's ``o`` chunks in the host stash (one chunk and the
    next on the device, never the full-length input; the price is one more host -> device
    copy and, with P > 1, one more all-to-all of each ``o`` chunk:
    :mod:`fpdt.attention.output_projection`).

    Note for ZeRO-3: the q/k/v weights (and ``o_proj``'s when it has an adapter or reads its
    input from the stash) and the adapters are read inside custom autograd Functions rather
    than through the ``nn.Linear`` modules' forward, so a ZeRO-3 wrapper must register them as
    external parameters of this module (the trainer does).
    """

    projection_fix = "use plain nn.Linear or PEFT LoRA projections"
    """The fix a refused projection's error names (:mod:`fpdt.ops.projections`)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, qkv_bias: bool = False, o_bias: bool = False,
                 num_chunks: int = 1, offload: bool = False, group: dist.ProcessGroup | None = None,
                 mesh: SequenceMesh | None = None, backend: str | None = None, softmax_scale: float | None = None,
                 runtime: Runtime | str | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.num_chunks = num_chunks
        self.offload = offload
        self.group = group
        self.mesh = mesh
        self.backend = backend
        self.runtime = runtime
        self.softmax_scale = softmax_scale
        self.stash_label: str | None = None  # names this layer's chunks in offload errors, e.g. "layer 2"
        self.o_proj_input_from_stash = True    # see the class docstring
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=o_bias)
        self.q_norm = self.k_norm = None

    @classmethod
    def from_projections(cls, projections: dict[str, nn.Module], num_heads: int, num_kv_heads: int, head_dim: int,
                         softmax_scale: float | None = None) -> "FPDTAttention":
        """An attention over existing modules: ``projections`` maps ``q_proj``, ``k_proj``,
        ``v_proj``, ``o_proj`` (and optionally ``q_norm``, ``k_norm``) to them; they become its
        children under those names."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        for name, value in dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, num_chunks=1,
                                offload=False, group=None, mesh=None, backend=None, runtime=None,
                                softmax_scale=softmax_scale, stash_label=None, o_proj_input_from_stash=True).items():
            setattr(self, name, value)
        self.q_norm = self.k_norm = None
        for name, module in projections.items():
            setattr(self, name, module)
        return self

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                rope: RotaryEmbedding | None = None, doc_ids: torch.Tensor | None = None,
                saved: SavedAttention | None = None, *, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                o_proj_from_stash: bool | None = None) -> torch.Tensor:
        """``hidden_states`` ``[B, S_local, hidden]`` and ``position_ids`` ``[B, S_local]`` (global
        positions, FPDT layout) -> ``[B, S_local, hidden]``. RoPE from ``rope`` at ``position_ids``,
        or from the tables ``cos_sin`` ``[B or 1, S_local, D]`` each; neither skips it. ``doc_ids``:
        packed documents ``[B, S]`` of the global sequence in global order (None: one document;
        see :func:`fpdt.attention.fpdt_attention`). ``saved``: the layer checkpoint's saved
        attention outputs (:mod:`fpdt.attention.saved_attention`), or None. ``o_proj_from_stash``
        overrides ``o_proj_input_from_stash`` for this call."""
        B, S_local, _ = hidden_states.shape
        if position_ids is not None and position_ids.shape != (B, S_local):
            raise ValueError(f"position_ids must be [B, S_local]=[{B}, {S_local}], got {tuple(position_ids.shape)}")
        owner = type(self).__name__
        proj = read_projections({"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj}, owner,
                                self.projection_fix, self.training)
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, norm_eps(self.q_norm))
        cos, sin = cos_sin if cos_sin is not None else (None, None)
        from_stash = self.o_proj_input_from_stash if o_proj_from_stash is None else o_proj_from_stash
        sink = [] if from_stash and self.offload and torch.is_grad_enabled() else None
        attn = projected_fpdt_attention(
            hidden_states, *proj.bases, heads=(self.num_heads, self.num_kv_heads, self.head_dim),
            position_ids=position_ids, rope=rope, cos=cos, sin=sin, group=self.group, mesh=self.mesh,
            num_chunks=self.num_chunks, offload=self.offload, backend=self.backend, softmax_scale=self.softmax_scale,
            label=self.stash_label, qk_norm=qk_norm, adapters=proj.adapters, doc_ids=doc_ids, stash_sink=sink,
            saved=saved, runtime=self.runtime)
        attn = attn.reshape(B, S_local, self.num_heads * self.head_dim)
        source = StashedInput(*sink[0]) if sink else None    # empty: the call kept nothing for backward
        o_proj = read_output_projection(self.o_proj, owner, self.training)
        if o_proj is None or (o_proj.adapters is None and source is None):
            return self.o_proj(attn)         # as itself: keeps its input, the rule of a plain linear
        base = o_proj.bases[0]
        return output_projection(attn, base.weight, base.bias, o_proj.adapters, self.num_chunks, source)


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon (fpdt's ``eps``, Transformers' ``variance_epsilon``)."""
    return float(norm.eps if hasattr(norm, "eps") else norm.variance_epsilon)

"""``FPDTAttention``: a Llama-style attention layer that runs the FPDT pipeline."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fpdt.attention.projected_attention import projected_fpdt_attention
from fpdt.attention.rope import RotaryEmbedding
from fpdt.attention.saved_attention import SavedAttention
from fpdt.comm import SequenceMesh
from fpdt.offload import Runtime
from fpdt.ops.projections import read_output_projection, read_projections


class FPDTAttention(nn.Module):
    """Llama-family self-attention over a sequence-parallel, chunked, offloadable sequence, with
    Hugging Face's parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; Qwen3's
    ``q_norm`` / ``k_norm``, else None).

    Per chunk: projections, RoPE, all-to-all (or the 2D ``mesh``), attention, all-to-all back,
    ``o_proj`` (:mod:`fpdt.attention.projected_attention`). The options are attributes the apply
    steps set (:mod:`fpdt.model.apply`); projections may carry LoRA (:mod:`fpdt.ops.projections`);
    an ``o_proj`` they cannot read runs as itself on the full-length output. Weights read directly
    are ZeRO-3 external parameters; :meth:`from_projections` wraps existing modules (``fpdt.hf``).

    Qwen3.5's gated attention: ``output_gate`` (``q_proj`` gives ``[query | gate]`` per head,
    ``2 H D`` outputs; ``o_proj`` reads ``o * sigmoid(gate)``), ``rotary_dim`` (RoPE on the first
    ``rotary_dim`` channels of each head; the rotary table must have that width),
    ``qk_norm_zero_centred`` (the q/k norms multiply by ``1 + weight``).
    """

    projection_fix = "use plain nn.Linear or PEFT LoRA projections"
    """The fix a refused projection's error names (:mod:`fpdt.ops.projections`)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, qkv_bias: bool = False, o_bias: bool = False,
                 num_chunks: int = 1, offload: bool = False, group: dist.ProcessGroup | None = None,
                 mesh: SequenceMesh | None = None, backend: str | None = None, softmax_scale: float | None = None,
                 runtime: Runtime | str | None = None, output_gate: bool = False, rotary_dim: int | None = None,
                 qk_norm_zero_centred: bool = False):
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
        self.output_gate, self.rotary_dim, self.qk_norm_zero_centred = output_gate, rotary_dim, qk_norm_zero_centred
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=o_bias)
        self.q_norm = self.k_norm = None

    @classmethod
    def from_projections(cls, projections: dict[str, nn.Module], num_heads: int, num_kv_heads: int, head_dim: int,
                         softmax_scale: float | None = None, *, output_gate: bool = False,
                         rotary_dim: int | None = None, qk_norm_zero_centred: bool = False) -> "FPDTAttention":
        """An attention over existing modules: ``projections`` maps ``q_proj``, ``k_proj``,
        ``v_proj``, ``o_proj`` (and optionally ``q_norm``, ``k_norm``) to them; they become its
        children under those names. The keyword options as the constructor's."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        for name, value in dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, num_chunks=1,
                                offload=False, group=None, mesh=None, backend=None, runtime=None,
                                softmax_scale=softmax_scale, stash_label=None, output_gate=output_gate,
                                rotary_dim=rotary_dim, qk_norm_zero_centred=qk_norm_zero_centred).items():
            setattr(self, name, value)
        self.q_norm = self.k_norm = None
        for name, module in projections.items():
            setattr(self, name, module)
        return self

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                rope: RotaryEmbedding | None = None, doc_ids: torch.Tensor | None = None,
                saved: SavedAttention | None = None, *, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                norm: nn.Module | None = None, donate: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
        """``hidden_states`` ``[B, S_local, hidden]`` and ``position_ids`` ``[B, S_local]`` (global
        positions, FPDT layout) -> ``[B, S_local, hidden]``. RoPE from ``rope`` at ``position_ids``,
        or from the tables ``cos_sin`` ``[B or 1, S_local, D]`` each; neither skips it. ``doc_ids``:
        packed documents ``[B, S]`` of the global sequence in global order (None: one document;
        see :func:`fpdt.attention.fpdt_attention`). ``saved``: the layer checkpoint's saved
        attention outputs (:mod:`fpdt.attention.saved_attention`), or None. ``norm``: the layer's
        input RMSNorm (``weight``, ``eps``, ``zero_centred``), applied a chunk at a time inside; ``donate``:
        as :func:`fpdt.attention.projected_fpdt_attention` takes it, used only with ``norm`` inside."""
        B, S_local, _ = hidden_states.shape
        input_norm = None
        if norm is not None and (getattr(norm, "zero_centred", False) or norm.weight.dtype == hidden_states.dtype):
            input_norm = (norm.weight, norm_eps(norm), getattr(norm, "zero_centred", False))
        elif norm is not None:       # the norm's output dtype is not the input's: as itself
            hidden_states = norm(hidden_states)
        if position_ids is not None and position_ids.shape != (B, S_local):
            raise ValueError(f"position_ids must be [B, S_local]=[{B}, {S_local}], got {tuple(position_ids.shape)}")
        owner = type(self).__name__
        proj = read_projections({"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj}, owner,
                                self.projection_fix, self.training)
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, norm_eps(self.q_norm))
        cos, sin = cos_sin if cos_sin is not None else (None, None)
        o_proj = read_output_projection(self.o_proj, owner, self.training)
        out = projected_fpdt_attention(
            hidden_states, *proj.bases, heads=(self.num_heads, self.num_kv_heads, self.head_dim),
            position_ids=position_ids, rope=rope, cos=cos, sin=sin, group=self.group, mesh=self.mesh,
            num_chunks=self.num_chunks, offload=self.offload, backend=self.backend, softmax_scale=self.softmax_scale,
            label=self.stash_label, qk_norm=qk_norm, adapters=proj.adapters, doc_ids=doc_ids, saved=saved,
            runtime=self.runtime, o_proj=None if o_proj is None else o_proj.bases[0],
            o_adapters=None if o_proj is None else o_proj.adapters, output_gate=self.output_gate,
            rotary_dim=self.rotary_dim, qk_norm_zero_centred=self.qk_norm_zero_centred, input_norm=input_norm,
            donate=donate if input_norm is not None else None)
        if o_proj is None:                   # as itself, on the full-length attention output
            if self.output_gate:
                raise ValueError(f"output_gate=True needs an o_proj fpdt reads (a plain or LoRA linear), got "
                                 f"{type(self.o_proj).__name__}")
            return self.o_proj(out.reshape(B, S_local, self.num_heads * self.head_dim))
        return out


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon (fpdt's ``eps``, Transformers' ``variance_epsilon``)."""
    return float(norm.eps if hasattr(norm, "eps") else norm.variance_epsilon)

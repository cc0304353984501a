"""``GatedDeltaNet``: Qwen3.5's linear-attention token mixer over FPDT chunks and Ulysses ranks."""

from __future__ import annotations

import torch
from torch import nn

from fpdt.model.gdn_chunks import GatedDeltaNetFunction, GDNShape, build_gdn_spec, gated_rms_norm
from fpdt.ops.causal_conv import conv_kernel
from fpdt.ops.delta_rule import delta_rule_kernel
from fpdt.ops.projections import ProjectionError, read_projections


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet with Transformers' ``Qwen3_5GatedDeltaNet`` parameter names and shapes:
    ``in_proj_qkv`` ``[2 Hk dk + HV dv, hidden]``, ``in_proj_z`` ``[HV dv, hidden]``, ``in_proj_b``,
    ``in_proj_a`` ``[HV, hidden]``, ``conv1d`` (depthwise, no bias, weight ``[C, 1, K]``), ``dt_bias``,
    ``A_log`` ``[HV]``, ``norm.weight`` ``[dv]`` (gated RMSNorm), ``out_proj`` ``[hidden, HV dv]``.

    ``num_chunks``, ``offload``, ``group``, ``mesh`` (cp must be 1), ``backend`` (unused: the
    kernel is automatic, :meth:`kernel_name`), ``runtime`` and ``stash_label`` are attributes the
    apply steps set, as on :class:`fpdt.attention.FPDTAttention`. Every parameter is read directly
    by :class:`fpdt.model.gdn_chunks.GatedDeltaNetFunction` (ZeRO-3 external parameters)."""

    projection_fix = ("use plain nn.Linear or plain LoRA (fpdt's or PEFT's) on in_proj_qkv, in_proj_z, in_proj_b, "
                      "in_proj_a and out_proj")
    """The fix a refused projection's error names (:mod:`fpdt.ops.projections`)."""

    read_children = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")
    """The children whose parameters the Function reads directly (:mod:`fpdt.model.external_params`)."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int = 4, eps: float = 1e-6):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.shape = GDNShape(num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size, eps)
        self.hidden_size = hidden_size
        for name, value in dict(num_chunks=1, offload=False, group=None, mesh=None, backend=None, runtime=None,
                                stash_label=None).items():
            setattr(self, name, value)
        s = self.shape
        self.input_projections(hidden_size)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, conv_kernel_size, groups=s.conv_dim, bias=False,
                                padding=conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(s.value_dim, hidden_size, bias=False)

    projection_names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    """The projections as stored (checked by :func:`fpdt.ops.projections.read_projections`)."""

    def input_projections(self, hidden_size: int) -> None:
        s = self.shape
        self.in_proj_qkv = nn.Linear(hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, s.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, s.num_v_heads, bias=False)

    def projection_weights(self, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The stored projections' weights (in :attr:`projection_names` order) as ``(qkv, z, b, a, out)``."""
        return weights

    @classmethod
    def from_config(cls, config) -> "GatedDeltaNet":
        """One layer from a Transformers config with Qwen3.5's ``linear_*`` fields."""
        return cls(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                   config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                   config.rms_norm_eps)

    def kernel_name(self) -> str:
        """The delta-rule kernel on this module's device, for the start-up line: ``"fla"`` or ``"torch"``."""
        return delta_rule_kernel(self.A_log.device)

    def conv_kernel_name(self) -> str:
        """The conv's kernel on this module's device: ``"causal-conv1d"`` or ``"torch"`` (packed
        documents always run the PyTorch masked sum)."""
        return conv_kernel(self.A_log.device)

    def forward(self, hidden_states: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states`` ``[B, S_local, hidden]`` (this rank's tokens, FPDT layout) ->
        ``[B, S_local, hidden]``. ``doc_ids``: ``[B, S]`` document ids of the global window in global
        order (None: one document); a document start resets the state and the conv window."""
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [B, S_local, {self.hidden_size}], got "
                             f"{tuple(hidden_states.shape)}")
        spec, weights, adapters = self.spec_and_weights(hidden_states.shape, hidden_states.device, doc_ids)
        layout, lora = (None, ()) if adapters is None else (adapters.layout, adapters.tensors)
        for_backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                       for t in (hidden_states, *weights, *lora))
        return GatedDeltaNetFunction.apply(hidden_states, *weights, spec, for_backward, layout, *lora)

    def spec_and_weights(self, shape, device: torch.device, doc_ids: torch.Tensor | None):
        """One call's :class:`fpdt.model.gdn_chunks.GDNSpec` for hidden states of ``shape``
        ``[B, S_local, hidden]``, the nine tensors :class:`GatedDeltaNetFunction` reads and the projections'
        LoRA adapters (None without; errors name the fix)."""
        spec = build_gdn_spec(shape, device, self.shape, group=self.group, mesh=self.mesh, num_chunks=self.num_chunks,
                              offload=self.offload, doc_ids=doc_ids, label=self.stash_label, runtime=self.runtime)
        proj = read_projections({n: getattr(self, n) for n in self.projection_names}, type(self).__name__,
                                self.projection_fix, self.training)
        if proj.adapters is not None and self.projection_names != GatedDeltaNet.projection_names:
            raise ProjectionError(f"LoRA on {type(self).__name__}'s fused projections {self.projection_names} is not "
                                  f"supported yet: {self.projection_fix}")
        qkv, z, b, a, out = self.projection_weights(tuple(base.weight for base in proj.bases))
        return spec, (qkv, z, b, a, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, out), proj.adapters

    def extra_repr(self) -> str:
        s = self.shape
        return (f"hidden={self.hidden_size}, Hk={s.num_k_heads}, HV={s.num_v_heads}, dk={s.head_k_dim}, "
                f"dv={s.head_v_dim}, conv={s.conv_kernel}, num_chunks={self.num_chunks}, offload={self.offload}")


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet: :class:`GatedDeltaNet` with Transformers' ``Qwen3NextGatedDeltaNet``
    projections, ``in_proj_qkvz`` ``[Hk (2 dk + 2 r dv), hidden]`` (per key head: its q, k, then the
    ``r = HV / Hk`` value heads' v and z) and ``in_proj_ba`` ``[Hk 2 r, hidden]`` (per key head: ``r``
    b, then ``r`` a). The forward regroups the weights' rows into Qwen3.5's ``[Q | K | V]``, ``z``,
    ``b``, ``a`` (views and a concatenation, so gradients reach the fused weights)."""

    projection_fix = "leave in_proj_qkvz, in_proj_ba and out_proj out of the LoRA targets"
    read_children = ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj")
    projection_names = ("in_proj_qkvz", "in_proj_ba", "out_proj")

    def input_projections(self, hidden_size: int) -> None:
        s = self.shape
        self.in_proj_qkvz = nn.Linear(hidden_size, s.conv_dim + s.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * s.num_v_heads, bias=False)

    def projection_weights(self, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        qkvz, ba, out = weights
        s = self.shape
        r, hk, hidden = s.num_v_heads // s.num_k_heads, s.num_k_heads, qkvz.shape[1]
        q, k, v, z = qkvz.view(hk, -1, hidden).split([s.head_k_dim, s.head_k_dim, r * s.head_v_dim,
                                                       r * s.head_v_dim], dim=1)
        b, a = ba.view(hk, 2 * r, hidden).split([r, r], dim=1)
        qkv = torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)])
        return qkv, z.reshape(-1, hidden), b.reshape(-1, hidden), a.reshape(-1, hidden), out


class GatedRMSNorm(nn.Module):
    """``norm(x) * weight * silu(gate)`` over the last dim (Transformers' ``Qwen3_5RMSNormGated``); the
    layer's Function reads its ``weight`` directly."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)

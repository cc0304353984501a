"""LoRA fine-tuning of fpdt's own model: adapters on the decoder's linear projections, the rest
frozen, saved and loaded in PEFT's adapter format.

:func:`add_lora` gives each targeted ``nn.Linear`` ``lora_A`` (kaiming-uniform) and ``lora_B``
(zeros), ``lora_scaling`` (``alpha / r``, or ``alpha / sqrt(r)``) and ``lora_dropout``, computed
inside the chunked functions that read the projection's weight. Parameter names are PEFT's less
its ``base_model.model.`` prefix and adapter name; :func:`save_adapter` / :func:`load_adapter`
write and read PEFT adapter directories. Dropout masks are fpdt's own (``docs/model.md``, LoRA).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from fpdt.model.moe import ChunkedMoE

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
GDN_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""A Gated DeltaNet layer's projections (Qwen3.5's ``linear_attn``)."""
DEFAULT_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
"""The attention and dense MLP projections: :class:`LoraSpec`'s default."""
LORA_TARGETS = DEFAULT_TARGETS + GDN_TARGETS
"""The projections of a dense or hybrid decoder layer that may carry an adapter. A layer without the
module a name belongs to (an attention layer's ``in_proj_qkv``, a Gated DeltaNet layer's ``q_proj``, a
mixture-of-experts layer's ``gate_proj``: its fused experts are no ``nn.Linear``) gets none there."""
SHARED_EXPERT_TARGETS = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                         "shared_expert_gate")
"""A mixture-of-experts layer's shared expert and its sigmoid gate (Qwen3.5-MoE, Qwen3-Next), named as
PEFT's ``target_modules`` reach them (and not the fused experts)."""
ALL_TARGETS = LORA_TARGETS + SHARED_EXPERT_TARGETS
"""Every target name, in the order :class:`LoraSpec` keeps them."""
PEFT_FUSES_MLP_NAMES = ("qwen3_moe", "qwen3_next")
"""Model types on which PEFT (0.21, converting Transformers v4 expert names) turns any target name ending in
``gate_proj`` / ``up_proj`` / ``down_proj``, ``shared_expert.gate_proj`` included, into the fused experts'
``target_parameters``: there a saved shared-expert adapter would load onto the experts."""

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """What :func:`add_lora` attaches: rank ``r``, ``alpha`` (default ``2 r``), dropout
    probability, target projections (names from :data:`ALL_TARGETS`), rsLoRA scaling."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank {self.rank!r} must be a positive integer")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"LoRA alpha {self.alpha!r} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout {self.dropout!r} must be in [0, 1)")
        targets = tuple(self.targets)
        unknown = [t for t in targets if t not in ALL_TARGETS]
        if not targets or unknown or len(set(targets)) != len(targets):
            raise ValueError(f"LoRA targets {list(targets)}: name each of {list(ALL_TARGETS)} at most once, "
                             f"at least one")
        object.__setattr__(self, "targets", tuple(t for t in ALL_TARGETS if t in targets))

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _projections(model: nn.Module, targets: tuple[str, ...]):
    """``(layer index, name, nn.Linear)`` of every targeted projection, in layer order: an MoE MLP's
    only through :data:`SHARED_EXPERT_TARGETS`, a dense MLP's only through :data:`MLP_TARGETS`."""
    for i, layer in enumerate(model.model.layers):
        for name in targets:
            owner = layer.self_attn if name in ATTENTION_TARGETS else layer.linear_attn if name in GDN_TARGETS \
                else layer.mlp
            if owner is None or isinstance(owner, ChunkedMoE) != (name in SHARED_EXPERT_TARGETS):
                continue
            if name in SHARED_EXPERT_TARGETS:
                if not hasattr(owner, "shared_expert"):
                    continue
                owner, name = (owner.shared_expert, name.partition(".")[2]) if "." in name else (owner, name)
            yield i, name, getattr(owner, name)


def target_of(name: str) -> str:
    """The target an adapter parameter belongs to: ``model.layers.3.mlp.shared_expert.up_proj.lora_A.weight``
    -> ``shared_expert.up_proj``, ``model.layers.0.self_attn.q_proj.lora_B.weight`` -> ``q_proj``."""
    parts = name.split(".lora_")[0].split(".")
    return ".".join(parts[-2:]) if parts[-2] == "shared_expert" else parts[-1]


def add_lora(model: nn.Module, spec: LoraSpec, *, seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """Attach LoRA adapters to ``model`` (a :class:`fpdt.model.FPDTForCausalLM`), freeze the rest.

    ``lora_A`` is drawn from a CPU generator seeded with ``seed`` in layer order, the same on every
    rank whatever the world size. ``dtype``: the adapters' (default fp32, as PEFT). Returns
    ``model``, with ``model.lora`` set to ``spec``.
    """
    if getattr(model, "lora", None) is not None:
        raise ValueError("the model already has LoRA adapters")
    problem = moe_target_problem(spec.targets, model.config)
    if problem:
        raise ValueError(f"LoRA targets: {problem}")
    gdn = [t for t in spec.targets if t in GDN_TARGETS]
    if gdn and not model.config.has_linear_attention:
        raise ValueError(f"LoRA targets {gdn} are Gated DeltaNet projections, and this model has no Gated DeltaNet "
                         f"layer: target {list(DEFAULT_TARGETS)}")
    model.requires_grad_(False)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = dtype or torch.float32
    for _, _, linear in _projections(model, spec.targets):
        device = linear.weight.device
        a = nn.Linear(linear.in_features, spec.rank, bias=False, device="cpu", dtype=torch.float32)
        b = nn.Linear(spec.rank, linear.out_features, bias=False, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5), generator=gen)   # nn.Linear's (and PEFT's) init
            b.weight.zero_()
        linear.lora_A = a.to(device=device, dtype=dtype)
        linear.lora_B = b.to(device=device, dtype=dtype)
        linear.lora_scaling = spec.scaling
        linear.lora_dropout = spec.dropout
    model.lora = spec
    return model


def moe_target_problem(targets, config) -> str | None:
    """Why ``targets`` do not fit a model of ``config`` (a :class:`fpdt.model.ModelConfig`) as to its
    experts, or None: dense MLP names on a mixture-of-experts model (PEFT maps ``gate_proj`` /
    ``up_proj`` / ``down_proj`` onto the fused experts as well, so an export would not say what was
    trained), shared-expert names on a model without a shared expert."""
    moe = config.moe
    shared = [t for t in targets if t in SHARED_EXPERT_TARGETS]
    if shared and (moe is None or not moe.shared_expert_intermediate_size):
        return (f"{', '.join(shared)} name a mixture-of-experts layer's shared expert, and this model has none; "
                f"leave them out")
    fused = [t for t in shared if "." in t]
    if fused and config.model_type in PEFT_FUSES_MLP_NAMES:
        return (f"{', '.join(fused)} on {config.model_type}: PEFT maps names ending in gate_proj / up_proj / "
                f"down_proj onto this model's fused experts, so a saved adapter would load onto the experts; "
                f"target shared_expert_gate and the attention (docs/moe.md, LoRA)")
    mlp = [t for t in targets if t in MLP_TARGETS]
    if mlp and moe is not None:
        instead = ("the shared expert's sigmoid gate as shared_expert_gate and "
                   if config.model_type in PEFT_FUSES_MLP_NAMES and moe.shared_expert_intermediate_size else
                   f"the shared expert as {', '.join(SHARED_EXPERT_TARGETS)} and "
                   if moe.shared_expert_intermediate_size else "")
        return (f"{', '.join(mlp)} on a mixture-of-experts model: PEFT maps these names onto the fused experts "
                f"too, so an export would not say what was trained; target {instead}the attention as "
                f"{', '.join(ATTENTION_TARGETS)}; LoRA on the routed experts goes through PEFT's target_parameters "
                f"with fpdt.hf (docs/moe.md, LoRA)")
    return None


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``....lora_A.weight`` / ``....lora_B.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under the model's own names (see the module docstring)."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}


def peft_adapter_config(spec: LoraSpec, base_model_name_or_path: str | None = None) -> dict:
    """``adapter_config.json`` as PEFT writes it for these adapters (PEFT fills the fields it
    does not find with its defaults)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.lora_alpha,
        "lora_dropout": spec.dropout, "target_modules": list(spec.targets), "bias": "none",
        "use_rslora": spec.rslora, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path,
    }


def save_adapter(state: dict[str, torch.Tensor], spec: LoraSpec, path: str | os.PathLike, *,
                 base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None) -> None:
    """Write ``state`` (:func:`adapter_state_dict`, or the adapters of a trained checkpoint) as a
    PEFT adapter directory. ``dtype`` converts on the way out (default: as they are)."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    names = [n for n in state if is_adapter(n)]
    if not names:
        raise ValueError("no LoRA adapter tensors to save (names end in .lora_A.weight / .lora_B.weight)")
    tensors = {PEFT_PREFIX + n: state[n].detach().to(device="cpu", dtype=dtype or state[n].dtype).contiguous()
               for n in names}
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_adapter_config(spec, base_model_name_or_path), f, indent=2)


def read_adapter_config(path: str | os.PathLike) -> LoraSpec:
    """The :class:`LoraSpec` of a PEFT adapter directory; refuses what fpdt does not compute."""
    with open(os.path.join(os.fspath(path), ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: a {cfg.get('peft_type')} adapter; fpdt trains plain LoRA")
    for key, plain in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if cfg.get(key, plain) != plain:
            raise ValueError(f"{path}: {key}={cfg[key]!r} is not plain LoRA, which is what fpdt computes")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("modules_to_save"):
        raise ValueError(f"{path}: per-module ranks/alphas or modules_to_save are not supported")
    targets = cfg.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    return LoraSpec(rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", 8)), dropout=float(cfg.get("lora_dropout", 0.0)),
                    targets=tuple(targets), rslora=bool(cfg.get("use_rslora", False)))


def load_adapter(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy a PEFT adapter directory's weights into ``model``'s adapters (attached with the
    same :class:`LoraSpec`); refuses missing, unexpected or misshapen tensors."""
    from safetensors.torch import load_file

    spec = read_adapter_config(path)
    if getattr(model, "lora", None) is None:
        raise ValueError("the model has no LoRA adapters: fpdt.model.lora.add_lora(model, read_adapter_config(path)) "
                         "first")
    if (spec.rank, spec.targets) != (model.lora.rank, model.lora.targets):
        raise ValueError(f"{path} holds rank {spec.rank} adapters on {list(spec.targets)}; the model's are rank "
                         f"{model.lora.rank} on {list(model.lora.targets)}")
    saved = {k.removeprefix(PEFT_PREFIX).replace(".default.", "."): v
             for k, v in load_file(os.path.join(os.fspath(path), ADAPTER_WEIGHTS)).items()}
    params = adapter_state_dict(model)
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model's adapters: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            if saved[name].shape != p.shape:
                raise ValueError(f"{path}: {name} is {tuple(saved[name].shape)}, the model's {tuple(p.shape)}")
            p.copy_(saved[name])

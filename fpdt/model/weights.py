"""Hugging Face checkpoints in and out (construction is :mod:`fpdt.model.build`).

``config.json`` plus ``model.safetensors`` or index-sharded safetensors, tensor names the model's
own (tied embeddings: no ``lm_head.weight``), read shard by shard straight to the target device
and dtype. :func:`checkpoint_files`, :func:`ignored_tensor` and the ``check_*`` functions are
shared with ``fpdt.train.zero_load``, so both accept and refuse the same checkpoints.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from fpdt.model.config import ModelConfig
from fpdt.model.lora import is_adapter

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# Keys some older checkpoints carry that hold no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Tensors of parts fpdt does not build, as Transformers' Qwen3_5ForCausalLM skips them: the vision
# tower of the vision-language layout and the multi-token-prediction head.
_IGNORED_PREFIXES = {"qwen3_5_text": ("model.visual.", "mtp."), "qwen3_5_moe_text": ("model.visual.", "mtp."),
                     "qwen3_next": ("mtp.",)}
# Mixtral's hub names (``block_sparse_moe``, experts' ``w1`` / ``w3`` / ``w2``) -> Transformers 5's (fpdt's).
_MIXTRAL_HUB = re.compile(r"^(.*)\.block_sparse_moe\.(gate\.weight|experts\.\d+\.w[123]\.weight)$")
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory, in index order."""
    index = os.path.join(path, SAFE_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    single = os.path.join(path, SAFE_SINGLE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no {SAFE_SINGLE} or {SAFE_INDEX} in {path!r} (only safetensors checkpoints are "
                            f"supported; convert .bin checkpoints with transformers first)")


def _load_file(model: nn.Module, file: str, device: torch.device, dtype: torch.dtype | None,
               experts: dict | None = None) -> set[str]:
    from safetensors import safe_open

    # safetensors reads CUDA tensors directly; other devices go through host memory.
    read_on = str(device) if device.type == "cuda" else "cpu"
    with safe_open(file, framework="pt", device=read_on) as f:
        return load_hf_state_dict(model, ((k, f.get_tensor(k)) for k in f.keys()), device=device, dtype=dtype,
                                  check_complete=False, experts=experts)


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_experts(items: Iterable[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor],
                  pending: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The hub's per-expert tensors (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) as the fused
    ``experts.gate_up_proj`` / ``experts.down_proj`` once a layer's are all read (``pending`` holds
    them across shards); other tensors pass through."""
    for name, tensor in items:
        m = _PER_EXPERT.match(name)
        if m is None or f"{m[1]}.down_proj" not in params:
            yield name, tensor
            continue
        prefix, e, kind = m[1], int(m[2]), m[3]
        num_experts = params[f"{prefix}.down_proj"].shape[0]
        layer = pending.setdefault(prefix, {})
        layer[(kind, e)] = tensor
        if len(layer) == 3 * num_experts:
            del pending[prefix]
            yield f"{prefix}.gate_up_proj", torch.stack([torch.cat([layer[("gate_proj", i)], layer[("up_proj", i)]])
                                                         for i in range(num_experts)])
            yield f"{prefix}.down_proj", torch.stack([layer[("down_proj", i)] for i in range(num_experts)])


def expert_slot(name: str, params: Mapping[str, torch.Tensor]) -> tuple[str, int, slice] | None:
    """Where a hub per-expert tensor goes in the fused parameters: ``(parameter name, expert, rows)``
    (``gate_proj`` the first ``I`` rows of ``gate_up_proj``, ``up_proj`` the next), or None for
    other names. ``params`` maps names to parameters or their full shapes."""
    m = _PER_EXPERT.match(name)
    if m is None or f"{m[1]}.down_proj" not in params:
        return None
    shape = params[f"{m[1]}.down_proj"]
    ffn = (shape if isinstance(shape, tuple) else tuple(shape.shape))[2]
    if m[3] == "down_proj":
        return f"{m[1]}.down_proj", int(m[2]), slice(None)
    return f"{m[1]}.gate_up_proj", int(m[2]), slice(0, ffn) if m[3] == "gate_proj" else slice(ffn, 2 * ffn)


def per_expert(name: str, p: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused expert parameter as the hub's per-expert tensors (views); others as themselves."""
    prefix, _, attr = name.rpartition(".")
    if not prefix.endswith(".mlp.experts") or attr not in ("gate_up_proj", "down_proj"):
        yield name, p
    elif attr == "down_proj":
        yield from ((f"{prefix}.{e}.down_proj.weight", p[e]) for e in range(p.shape[0]))
    else:
        ffn = p.shape[1] // 2
        for e in range(p.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", p[e, :ffn]
            yield f"{prefix}.{e}.up_proj.weight", p[e, ffn:]


def load_hf_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                       check_complete: bool = True, experts: dict | None = None) -> set[str]:
    """Assign Hugging Face-named tensors as the model's parameters; returns the names used.

    Parameters are *replaced* (so this also materialises a meta-device model). ``device``
    defaults to each parameter's current device (CPU for meta parameters), ``dtype`` to
    the tensor's own. Unknown names raise; with ``check_complete`` so do missing ones. Per-expert
    tensors are fused (:func:`fused_experts`; ``experts`` carries a layer's across calls).
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    params = dict(model.named_parameters())  # tied lm_head.weight appears only as the embedding
    pending = {} if experts is None else experts
    renamed = ((model_name(n, model.config), t) for n, t in items)
    items = fused_experts(((n, t) for n, t in renamed if n is not None), params, pending)
    tied = model.config.tie_word_embeddings
    used: set[str] = set()
    unexpected = []
    for name, tensor in items:
        if name not in params:
            unexpected.append(name)
            continue
        old = params[name]
        check_shape(name, tensor.shape, old.shape)
        target = torch.device(device) if device is not None else (old.device if not old.is_meta else torch.device("cpu"))
        value = tensor.detach().to(device=target, dtype=dtype or tensor.dtype, copy=False)
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=old.requires_grad))
        used.add(name)
    if experts is None and pending:
        unexpected += [f"{prefix}.* ({len(layer)} per-expert tensors, incomplete)" for prefix, layer in pending.items()]
    check_unexpected(unexpected)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if check_complete:
        check_missing(model, used)
        model.reset_rope(model.lm_head.weight.device)  # a meta-built model has no RoPE buffer yet
    return used


def ignored_tensor(name: str, config: ModelConfig) -> bool:
    """Whether checkpoint tensor ``name`` is skipped on loading: buffers some older
    checkpoints store (``...rotary_emb.inv_freq``), ``lm_head.weight`` when the
    embeddings are tied (the model's head *is* the embedding; some checkpoints duplicate it), and
    the parts of a Qwen3.5 checkpoint fpdt does not build (vision tower, MTP head)."""
    return (name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")
            or name.startswith(_IGNORED_PREFIXES.get(config.model_type, ())))


def model_name(name: str, config: ModelConfig) -> str | None:
    """The model's parameter name for checkpoint tensor ``name`` (the decoder under
    ``config.text_prefix``, e.g. ``model.language_model.`` of the vision-language layout, becomes
    ``model.``), or None when the tensor is skipped (:func:`ignored_tensor`)."""
    if ignored_tensor(name, config):
        return None
    if config.model_type == "mixtral":
        name = _from_mixtral_hub(name)
    prefix = config.text_prefix + "."
    if prefix != "model." and name.startswith(prefix):
        return "model." + name[len(prefix):]
    return name


def _from_mixtral_hub(name: str) -> str:
    m = _MIXTRAL_HUB.match(name)
    if m is None:
        return name
    tail = m[2]
    if tail.startswith("experts."):
        _, e, w, _ = tail.split(".")
        tail = f"experts.{e}.{_MIXTRAL_W[w]}.weight"
    return f"{m[1]}.mlp.{tail}"


def hub_name(name: str, config: ModelConfig) -> str:
    """The name a checkpoint stores parameter (or per-expert tensor) ``name`` under: the model's own,
    Mixtral's in the hub's layout (``block_sparse_moe``, ``w1`` / ``w3`` / ``w2``), which every
    Transformers version loads."""
    if config.model_type != "mixtral" or ".mlp." not in name:
        return name
    head, _, tail = name.partition(".mlp.")
    parts = tail.split(".")
    if parts[0] == "experts" and len(parts) == 4:
        inverse = {v: k for k, v in _MIXTRAL_W.items()}
        tail = f"experts.{parts[1]}.{inverse[parts[2]]}.weight"
    return f"{head}.block_sparse_moe.{tail}"


def check_shape(name: str, checkpoint_shape, model_shape) -> None:
    """Raise ``ValueError`` when a checkpoint tensor's shape differs from its parameter's."""
    if tuple(checkpoint_shape) != tuple(model_shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(checkpoint_shape)} != model shape {tuple(model_shape)}")


def check_unexpected(names: list[str]) -> None:
    """Raise ``ValueError`` naming checkpoint tensors (not ignored) the model does not have."""
    if names:
        raise ValueError(f"checkpoint tensors the model does not have: {sorted(names)[:10]}"
                         f"{' ...' if len(names) > 10 else ''}")


def check_missing(model: nn.Module, loaded: set[str]) -> None:
    """Raise ``ValueError`` when parameters of ``model`` (by name) are not in ``loaded``."""
    missing = [n for n, _ in model.named_parameters() if n not in loaded and not is_adapter(n)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs: {missing[:10]}")


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view into a larger storage (one expert of a fused parameter):
    safetensors refuses tensors that share memory."""
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * units[unit])
    return int(text)


def save_pretrained(model: nn.Module, path: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None) -> None:
    """Write ``config.json`` and safetensors (sharded above ``max_shard_size``) that
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads unchanged.

    ``dtype`` converts on the way out (default: as the parameters are). Parameters may
    live on any device; they are copied to host one shard at a time.
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    dtype = _resolve_dtype(dtype)
    # tied lm_head.weight is not listed: not stored, as in HF; LoRA adapters go to save_adapter
    named = [(hub_name(n, model.config), t) for name, p in model.named_parameters() if not is_adapter(name)
             for n, t in per_expert(name, p)]
    if any(p.is_meta for _, p in named):
        raise ValueError("cannot save a model that is still on the meta device")
    limit = _parse_size(max_shard_size)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, p in named:
        nbytes = p.numel() * (dtype or p.dtype).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, p))
        size += nbytes
    for old in (SAFE_SINGLE, SAFE_INDEX):  # a previous save with other sharding must not linger
        if os.path.exists(os.path.join(path, old)):
            os.remove(os.path.join(path, old))
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = SAFE_SINGLE if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _own_storage(p.detach().to(device="cpu", dtype=dtype or p.dtype).contiguous()) for n, p in shard}
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    if len(shards) > 1:
        with open(os.path.join(path, SAFE_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    out_dtype = dtype or named[0][1].dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(str(out_dtype).removeprefix("torch.")), f, indent=2)

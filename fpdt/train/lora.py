"""LoRA fine-tuning in ``fpdt-train``: flags, checks made before any process group, the adapters
on the built model, and what a checkpoint records of them.

``--lora-rank R`` attaches :func:`fpdt.model.add_lora` adapters (``--lora-targets``) alike on every
rank, in the training dtype, and freezes the rest; ``--lora-init DIR`` starts from a PEFT adapter
directory, whose config is then the spec (contradicting flags are refused). :func:`record` goes
into the trainer file; :func:`check_resume` refuses a resume with another spec or base.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, Mapping

from fpdt.model import ModelConfig
from fpdt.model.config import LINEAR_ATTENTION
from fpdt.model.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ALL_TARGETS, ATTENTION_TARGETS, DEFAULT_TARGETS,
                             GDN_TARGETS, MLP_TARGETS, PEFT_PREFIX, SHARED_EXPERT_TARGETS, LoraSpec, moe_target_problem,
                             read_adapter_config)
from fpdt.train.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``LoRA`` group of ``fpdt-train``'s flags."""
    g = parser.add_argument_group("LoRA (base frozen; default: train every weight)")
    g.add_argument("--lora-rank", type=int, metavar="R",
                   help="train LoRA adapters of rank R on the decoder projections instead of every weight "
                        "(0 or absent: full training)")
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha; scaling alpha / R (default 2 R)")
    g.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default 0)")
    g.add_argument("--lora-targets", metavar="LIST",
                   help=f"comma-separated projections that get adapters, of {','.join(ALL_TARGETS)} (default: "
                        f"{','.join(DEFAULT_TARGETS)}; on a model with Gated DeltaNet layers "
                        f"{','.join(GDN_TARGETS)} too; on a mixture-of-experts model the attention's only, its "
                        f"shared expert's when named: {','.join(SHARED_EXPERT_TARGETS)})")
    g.add_argument("--lora-rslora", action="store_true", help="rsLoRA scaling alpha / sqrt(R)")
    g.add_argument("--lora-init", metavar="DIR",
                   help="start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                        "instead of fresh adapters; the other --lora-* flags are read from its config and may be "
                        "left out")


def spec_from_args(args: argparse.Namespace) -> LoraSpec | None:
    """The run's :class:`LoraSpec`, or None for full training. Refuses ``--lora-*`` options
    without ``--lora-rank``/``--lora-init``, values out of range, unknown targets, and flags
    that contradict ``--lora-init``'s ``adapter_config.json``."""
    given = [(flag, value) for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-dropout", args.lora_dropout),
                                               ("--lora-targets", args.lora_targets),
                                               ("--lora-rslora", True if args.lora_rslora else None))
             if value is not None]
    if args.lora_rank is not None and args.lora_rank < 0:
        raise ConfigError(f"--lora-rank {args.lora_rank} must be >= 1 (LoRA) or 0 (full training)")
    if args.lora_init:
        return _from_init(args.lora_init, args.lora_rank, given)
    if not args.lora_rank:
        if given:
            flags = ", ".join(flag for flag, _ in given)
            raise ConfigError(f"{flags} need{'s' if len(given) == 1 else ''} --lora-rank R (or --lora-init DIR): "
                              f"without it the run trains every weight")
        return None
    if args.lora_alpha is not None and not args.lora_alpha > 0:
        raise ConfigError(f"--lora-alpha {args.lora_alpha} must be > 0 (the scaling is alpha / rank)")
    if args.lora_dropout is not None and not 0.0 <= args.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout {args.lora_dropout} must be in [0, 1)")
    targets = parse_targets(args.lora_targets) if args.lora_targets is not None else DEFAULT_TARGETS
    return LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout or 0.0, targets=targets,
                    rslora=args.lora_rslora)


def parse_targets(text: str) -> tuple[str, ...]:
    """``--lora-targets q_proj,v_proj`` -> ``("q_proj", "v_proj")``, each known and named once."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in ALL_TARGETS]
    if not names or unknown or len(set(names)) != len(names):
        what = (f"unknown {', '.join(unknown)}" if unknown else "no projection" if not names else "a name repeated")
        raise ConfigError(f"--lora-targets {text}: {what}; give a comma-separated list of {','.join(ALL_TARGETS)} "
                          f"(each at most once)")
    return tuple(names)


def _from_init(path: str, rank: int | None, given: list[tuple[str, Any]]) -> LoraSpec:
    if not os.path.isdir(path):
        raise ConfigError(f"--lora-init {path}: no such directory; pass a PEFT adapter directory "
                          f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(path, name)):
            raise ConfigError(f"--lora-init {path}: no {name} in the directory; pass a PEFT adapter directory "
                              f"(PEFT's save_pretrained, fpdt-export of a LoRA run)")
    try:
        spec = read_adapter_config(path)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--lora-init {path}: {ADAPTER_CONFIG}: {e}") from None
    theirs = {"--lora-rank": spec.rank, "--lora-alpha": spec.lora_alpha, "--lora-dropout": spec.dropout,
              "--lora-targets": ",".join(spec.targets), "--lora-rslora": spec.rslora}
    ours = dict(([("--lora-rank", rank)] if rank is not None else []) + given)
    if "--lora-targets" in ours:
        ours["--lora-targets"] = ",".join(t for t in ALL_TARGETS if t in parse_targets(ours["--lora-targets"]))
    bad = [f"{flag} (its config: {'use_rslora false' if flag == '--lora-rslora' else theirs[flag]})"
           if flag == "--lora-rslora" else f"{flag} {value} (its config: {theirs[flag]})"
           for flag, value in ours.items()
           if (float(value) != float(theirs[flag]) if flag in ("--lora-alpha", "--lora-dropout") else
               value != theirs[flag])]
    if bad:
        raise ConfigError(f"--lora-init {path}: {'; '.join(bad)}: with --lora-init the LoRA settings are its "
                          f"{ADAPTER_CONFIG}'s; leave those flags out or give its values")
    return spec


def for_model(spec: LoraSpec | None, cfg: ModelConfig, targets_given: bool) -> LoraSpec | None:
    """``spec`` for a model of ``cfg``: without ``--lora-targets`` (``targets_given`` False) a model
    with Gated DeltaNet layers gets adapters on their projections too, and a mixture-of-experts model
    on its attention only; dense MLP targets on a mixture-of-experts model, shared-expert targets on a
    model without a shared expert and Gated DeltaNet targets on a model without such layers are refused."""
    if spec is None:
        return None
    if cfg.moe is not None and not targets_given:
        spec = dataclasses.replace(spec, targets=tuple(t for t in spec.targets if t not in MLP_TARGETS))
    problem = moe_target_problem(spec.targets, cfg)
    if problem:
        raise ConfigError(f"--lora-targets: {problem}")
    gdn = [t for t in spec.targets if t in GDN_TARGETS]
    if not cfg.has_linear_attention:
        if gdn:
            raise ConfigError(f"--lora-targets {','.join(gdn)}: Gated DeltaNet projections, and the model has no "
                              f"Gated DeltaNet layer (layer_types); target {','.join(DEFAULT_TARGETS)}")
        return spec
    if targets_given or gdn:
        return spec
    return dataclasses.replace(spec, targets=spec.targets + GDN_TARGETS)


def adapter_shapes(cfg: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of the adapters :func:`fpdt.model.add_lora` attaches to a
    model of ``cfg`` (names as :func:`fpdt.model.adapter_state_dict` gives them): attention
    projections on attention layers (a gated attention's ``q_proj`` twice as wide), Gated DeltaNet
    projections on its layers, MLP projections on dense-MLP layers, shared-expert ones on MoE layers."""
    h, qd, kvd, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    dims = {"q_proj": (h, qd * (2 if cfg.attn_output_gate else 1)), "k_proj": (h, kvd), "v_proj": (h, kvd),
            "o_proj": (qd, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    shared = cfg.moe.shared_expert_intermediate_size if cfg.moe is not None else 0
    if shared:
        dims.update({"shared_expert.gate_proj": (h, shared), "shared_expert.up_proj": (h, shared),
                     "shared_expert.down_proj": (shared, h), "shared_expert_gate": (h, 1)})
    if cfg.has_linear_attention:
        kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
        dims.update(in_proj_qkv=(h, 2 * kd + vd), in_proj_z=(h, vd), in_proj_b=(h, cfg.linear_num_value_heads),
                    in_proj_a=(h, cfg.linear_num_value_heads), out_proj=(vd, h))
    out = {}
    for i in range(cfg.num_layers):
        gdn = cfg.layer_type(i) == LINEAR_ATTENTION
        for name in spec.targets:
            if name in MLP_TARGETS or name in SHARED_EXPERT_TARGETS:
                if cfg.is_moe_layer(i) != (name in SHARED_EXPERT_TARGETS) or name not in dims:
                    continue
                owner = "mlp"
            elif (name in ATTENTION_TARGETS) == gdn:
                continue
            else:
                owner = "linear_attn" if gdn else "self_attn"
            fan_in, fan_out = dims[name]
            out[f"model.layers.{i}.{owner}.{name}.lora_A.weight"] = (spec.rank, fan_in)
            out[f"model.layers.{i}.{owner}.{name}.lora_B.weight"] = (fan_out, spec.rank)
    return out


def peft_key(name: str) -> str:
    """A key of ``adapter_model.safetensors`` as a model parameter name (PEFT's prefix and
    adapter name dropped, as :func:`fpdt.model.load_adapter` reads them)."""
    return name.removeprefix(PEFT_PREFIX).replace(".default.", ".")


def check_plan(spec: LoraSpec | None, mlp_chunks: int, config_path: str, cfg: ModelConfig,
               init: str | None = None) -> None:
    """Before any process group: adapters on MLP projections need the chunked MLP, and a
    ``--lora-init`` directory's tensors must fit this model (names and shapes, read from the
    safetensors header)."""
    if spec is None:
        return
    mlp = [t for t in spec.targets if t in MLP_TARGETS]
    if mlp_chunks == 0 and mlp:
        raise ConfigError(f"--mlp-chunks 0 (the unchunked MLP, from the flag or the DeepSpeed JSON's \"fpdt\" "
                          f"section) cannot carry LoRA adapters on {', '.join(mlp)}: they run inside the chunked "
                          f"MLP; leave --mlp-chunks at its default (or >= 1), or leave the MLP projections out of "
                          f"--lora-targets")
    if init is None:
        return
    from safetensors import safe_open

    want = adapter_shapes(cfg, spec)
    with safe_open(os.path.join(init, ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
        have = {peft_key(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [f"{n} {have[n]} (the model's {want[n]})" for n in sorted(set(want) & set(have)) if have[n] != want[n]]
    if missing or unexpected or wrong:
        parts = ([f"missing {', '.join(missing[:2])}{' ...' if len(missing) > 2 else ''}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected[:2])}{' ...' if len(unexpected) > 2 else ''}"]
                 if unexpected else []) + wrong[:2]
        raise ConfigError(f"--lora-init {init}: its adapters do not fit the model of {config_path} "
                          f"({'; '.join(parts)}); pass adapters trained for this model")


def attach(model, spec: LoraSpec, *, seed: int, dtype, init: str | None = None):
    """Attach the adapters to a built model (ordinary or ``zero.Init``-partitioned: the
    adapters are ordinary parameters that ``deepspeed.initialize`` partitions), freeze the
    rest, and copy ``--lora-init``'s tensors in. Returns ``model``."""
    from fpdt.model import add_lora, load_adapter

    add_lora(model, spec, seed=seed, dtype=dtype)
    if init is not None:
        load_adapter(model, init)
    return model


def describe(model, spec: LoraSpec, init: str | None, resumed: str | None = None) -> str:
    """The start-up line of a LoRA run: the spec, the trainable share, and where the adapters
    come from: the checkpoint ``resumed`` (its ``step<N>`` dir) on ``--resume``, else
    ``--lora-init``'s directory ``init`` or a fresh init."""
    from fpdt.model import adapter_state_dict

    n = sum(int(getattr(p, "ds_numel", p.numel())) for p in adapter_state_dict(model).values())
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    return (f"LoRA: rank {spec.rank}, alpha {spec.lora_alpha:g} (scaling {spec.scaling:g}{', rsLoRA' if spec.rslora else ''}), "
            f"dropout {spec.dropout:g}, on {','.join(spec.targets)}: {n:,} trainable parameters of {total:,} "
            f"({100 * n / total:.3g}%), from {f'checkpoint {resumed}' if resumed else init or 'a fresh init'}")


# ----------------------------------------------------------------------------- checkpoints

def record(spec: LoraSpec | None, model: str | None, model_config: str | None, seed: int,
           config: ModelConfig | None = None) -> dict[str, Any] | None:
    """What the trainer file keeps of a LoRA run (None for full training): the spec, and where the
    frozen base comes from (a random base: ``--seed`` and :func:`drawn_config`).
    """
    if spec is None:
        return None
    return {"rank": spec.rank, "alpha": spec.lora_alpha, "dropout": spec.dropout, "targets": list(spec.targets),
            "rslora": spec.rslora,
            "base": {"model": os.path.abspath(model) if model else None,
                     "model_config": os.path.abspath(model_config) if model_config else None, "seed": seed,
                     "config": drawn_config(config) if model is None and config is not None else None}}


def drawn_config(cfg: ModelConfig) -> dict[str, Any]:
    """Every field of a parsed model config but the original dict: what :func:`fpdt.model.from_config`
    draws the random base from with the seed and what decides how it computes, so another value of
    any is another base.
    """
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name != "hf_config":
            value = getattr(cfg, f.name)
            out[f.name] = dict(value) if isinstance(value, Mapping) else value
    return out


def spec_from_record(rec: dict[str, Any]) -> LoraSpec:
    """The :class:`LoraSpec` a checkpoint's :func:`record` describes."""
    return LoraSpec(rank=int(rec["rank"]), alpha=float(rec["alpha"]), dropout=float(rec["dropout"]),
                    targets=tuple(rec["targets"]), rslora=bool(rec["rslora"]))


def _spec_text(rec: dict[str, Any]) -> str:
    return (f"rank {rec['rank']}, alpha {rec['alpha']:g}, dropout {rec['dropout']:g}, targets "
            f"{','.join(rec['targets'])}{', rsLoRA' if rec['rslora'] else ''}")


def check_resume(path: str, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """Refuse a resume whose LoRA spec (or LoRA vs full training), seed or drawn model config differs
    from the checkpoint's; returns warnings (a ``--model`` at another path, an unrecorded config).
    """
    if saved is None and current is None:
        return []
    if saved is None:
        raise ConfigError(f"--resume {path}: the checkpoint is of full training (every weight), this run trains "
                          f"LoRA adapters; resume without the --lora-* flags, or start a LoRA run from an export "
                          f"(fpdt-export, then --model)")
    if current is None:
        raise ConfigError(f"--resume {path}: the checkpoint is of a LoRA run ({_spec_text(saved)}), this run trains "
                          f"every weight; resume with --lora-rank {saved['rank']} and the same --lora-* flags")
    keys = ("rank", "alpha", "dropout", "targets", "rslora")
    if any(saved[k] != current[k] for k in keys):
        raise ConfigError(f"--resume {path}: the checkpoint's LoRA adapters are {_spec_text(saved)}; this run's are "
                          f"{_spec_text(current)}; resume with the --lora-* flags it was trained with")
    a, b = saved["base"], current["base"]
    if (a["model"] is None) != (b["model"] is None):
        was = f"--model {a['model']}" if a["model"] else f"--model-config {a['model_config']} (random, --seed {a['seed']})"
        raise ConfigError(f"--resume {path}: the checkpoint's frozen base came from {was}; the checkpoint holds only "
                          f"the adapters, so resume with that base")
    if a["model"] is None and a["seed"] != b["seed"]:
        raise ConfigError(f"--resume {path}: the checkpoint's frozen base was drawn with --seed {a['seed']}, this "
                          f"run's with --seed {b['seed']}; the checkpoint holds only the adapters, so resume with "
                          f"--seed {a['seed']}")
    if a["model"] is None:
        return _check_drawn_config(path, a, b)
    if a["model"] != b["model"]:
        return [f"the checkpoint's adapters were trained on --model {a['model']}, this run reads {b['model']} "
                f"(the checkpoint holds only the adapters: it must be the same base)"]
    return []


def _check_drawn_config(path: str, saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The random base's config, field by field (only the fields the checkpoint records)."""
    theirs, ours = saved.get("config"), current.get("config") or {}
    if theirs is None:
        return [f"the checkpoint does not record the model config its random base was drawn from (it was written "
                f"before fpdt-train recorded it), so only its architecture and --seed are checked: resume with the "
                f"--model-config it was trained with ({saved['model_config']})"]
    diffs = [f"{k} {theirs[k]!r} (this run's {ours.get(k)!r})" for k in theirs if theirs[k] != ours.get(k)]
    if diffs:
        raise ConfigError(f"--resume {path}: the checkpoint's frozen base was drawn (--seed {saved['seed']}) from a "
                          f"model config with {', '.join(diffs)}, so this run's base would be another; the checkpoint "
                          f"holds only the adapters, so resume with a --model-config with the checkpoint's values "
                          f"(it was {saved['model_config']})")
    return []

"""Shared pieces of the trainer tests: a tiny model config, token data, DeepSpeed configs,
and the single-process reference training they are compared with."""

from __future__ import annotations

import copy
import json
import os
import warnings

import numpy as np
import torch

from fpdt.train.parallel import LAUNCHER_VARIABLES

VOCAB = 256
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 1024, "initializer_range": 0.02, "tie_word_embeddings": False,
}
SGD = {"type": "SGD", "params": {"lr": 0.5}}
SGD_CLIP = 0.0     # DeepSpeed clips at 1.0 unless told otherwise: off, so the raw gradient scale shows
ADAMW_CLIP = 1.0
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                                     "torch_adam": True}}


def ds_config(optimizer: dict, clip: float, stage: int = 3, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "optimizer": optimizer,
           "gradient_clipping": clip,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "steps_per_print": 10 ** 9}
    if optimizer["type"] not in ("Adam", "AdamW"):  # DeepSpeed's own check for torch.optim classes under ZeRO
        cfg["zero_allow_untested_optimizer"] = True
    cfg.update(extra)
    return cfg


def write_fixture(tmp: str, n_tokens: int = 4000, seed: int = 1) -> tuple[str, str]:
    """-> (config.json path, tokens .npy path) under ``tmp``."""
    os.makedirs(tmp, exist_ok=True)
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(TINY_CONFIG, f)
    # Zipf-ish ids so that training visibly lowers the loss.
    rng = np.random.default_rng(seed)
    tokens = np.minimum(rng.zipf(1.3, n_tokens), VOCAB) - 1
    data_path = os.path.join(tmp, "tokens.npy")
    np.save(data_path, tokens.astype(np.int32))
    return cfg_path, data_path


def logged_losses(path: str) -> list[float]:
    """The ``loss`` of every record of a ``--log-json`` file, in order."""
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def fresh_env(*drop: str) -> dict:
    """This process's environment as a child process a user starts would see it: without the launcher
    variables an in-process ``fpdt-train`` run left here (they would send the child to a port a live
    group of this process holds) and torchrun's ``LOCAL_WORLD_SIZE``, and without ``drop``."""
    gone = {*LAUNCHER_VARIABLES, "LOCAL_WORLD_SIZE", *drop}
    return {k: v for k, v in os.environ.items() if k not in gone}


def write_json(path: str, obj: dict) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


def reference_losses(cfg_path: str | None, data_path: str, seq_len: int, steps: int, seqs_per_step: int,
                     optimizer: dict, clip: float, seed: int = 0, pretrained: str | None = None,
                     precision: str = "fp32") -> list[float]:
    """Single-process, unsharded training on the same windows: window ``k`` is
    ``tokens[k*(S+1) : (k+1)*(S+1)]`` and step ``t`` trains windows ``t*n .. t*n+n-1``
    as one batch (``n`` = sequences per step over all data-parallel groups), clipping the
    gradient norm at ``clip`` (0: no clipping) as DeepSpeed does. The model is
    ``from_config(cfg_path)`` seeded with ``seed``, or ``from_pretrained(pretrained)``.
    ``precision``: ``"fp32"`` or ``"fp64"`` throughout, or ``"bf16"`` as DeepSpeed's bf16 runs
    it (bf16 weights, activations and gradients; the gradients cast to fp32 for the clipping and
    the optimizer, which updates fp32 master weights that are rounded to bf16 after each step). The
    master weights start as the bf16 weights cast back to fp32, as DeepSpeed's bf16 optimizers build
    them from the module's bf16 parameters: from the unrounded fp32 weights instead, the trajectory
    differs from DeepSpeed's by each weight's initial rounding (a 7x larger loss error at step 3
    with SGD at lr 0.5, where the rounded start matches a one-rank fpdt-train run bit for bit)."""
    from fpdt.model import from_config, from_pretrained

    torch.manual_seed(seed)
    if pretrained is not None:
        model = from_pretrained(pretrained, dtype=torch.float32)
    else:
        model = from_config(cfg_path, dtype=torch.float32)    # the same initial weights at every precision
    if precision == "fp64":
        model = model.to(torch.float64)
    work = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16" else model
    if work is not model:
        with torch.no_grad():
            for master, low in zip(model.parameters(), work.parameters()):
                master.copy_(low)
    params = dict(optimizer["params"])
    params.pop("torch_adam", None)
    opt = getattr(torch.optim, optimizer["type"])(model.parameters(), **params)
    tokens = np.load(data_path).astype(np.int64)
    losses = []
    for t in range(steps):
        win = [tokens[k * (seq_len + 1):(k + 1) * (seq_len + 1)] for k in range(t * seqs_per_step, (t + 1) * seqs_per_step)]
        batch = torch.from_numpy(np.stack(win))
        loss = work(batch[:, :-1], labels=batch[:, 1:])
        opt.zero_grad()
        work.zero_grad()
        loss.backward()
        if work is not model:
            for master, low in zip(model.parameters(), work.parameters()):
                master.grad = low.grad.to(master.dtype)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if work is not model:
            with torch.no_grad():
                for master, low in zip(model.parameters(), work.parameters()):
                    low.copy_(master)
        losses.append(loss.item())
    return losses


def check_memory_fields(log_path: str, offload: bool) -> None:
    """Every record of a CPU run's ``--log-json`` has a positive, finite ``peak_mem_gib`` (the
    accountant's step peak), ``peak_reserved_gib`` null, and a host stash > 0 exactly when
    attention or checkpoint offload is on."""
    import math

    with open(log_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert records, log_path
    for rec in records:
        mem, stash = rec["peak_mem_gib"], rec["host_stash_gib"]
        assert mem is not None and math.isfinite(mem) and mem > 0, rec
        assert rec["peak_reserved_gib"] is None, rec
        assert (stash > 0) if offload else (stash == 0), rec


def node(available: float):
    """A node of 8 GPUs of 80 GiB with ``available`` bytes of host memory, as the planner's
    :func:`fpdt.plan.decide.decide_run` takes it."""
    from fpdt.plan.decide import Node
    return Node("cuda", 80 * 2 ** 30, 8, available)


def quiet() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


# ----------------------------------------------------------------------------- LoRA: PEFT on the Transformers model

def peft_name(ours: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` (fpdt's adapter name) -> PEFT's
    parameter name (``base_model.model.`` prefix, adapter ``default``)."""
    head, _, tail = ours.rpartition(".lora_")
    kind = tail.split(".")[0]
    return f"base_model.model.{head}.lora_{kind}.default.weight"


def peft_model(base_dir: str, *, adapter_dir: str | None = None, spec=None, adapters: dict | None = None):
    """The fp32 Transformers model of ``base_dir`` with PEFT LoRA adapters, trainable: loaded
    from ``adapter_dir``, or made for ``spec`` (:class:`fpdt.model.LoraSpec`) with ``adapters``
    (fpdt's names, e.g. :func:`fpdt.model.adapter_state_dict`) copied in."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                             attn_implementation="eager")
    if adapter_dir is not None:
        return peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=spec.rank, lora_alpha=spec.lora_alpha, lora_dropout=spec.dropout, target_modules=list(spec.targets),
        use_rslora=spec.rslora))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapters.items():
            params[peft_name(name)].copy_(value)
    return model


def windows_batch(tokens: np.ndarray, seq_len: int, ks) -> torch.Tensor:
    """Windows ``ks`` (``tokens[k*(S+1) : (k+1)*(S+1)]``) as a ``[len(ks), S + 1]`` batch."""
    return torch.from_numpy(np.stack([tokens[k * (seq_len + 1):(k + 1) * (seq_len + 1)] for k in ks]))


def causal_lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of a Transformers (or PEFT) model on ``batch [B, S + 1]``, with
    fpdt's label convention (``batch[:, 1:]`` are the labels of ``batch[:, :-1]``)."""
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def peft_reference_losses(model, data_path: str, seq_len: int, steps: int, seqs_per_step: int, optimizer: dict,
                          clip: float) -> list[float]:
    """:func:`reference_losses` for a PEFT model: only its trainable (adapter) parameters are
    optimised, and clipped, as DeepSpeed does with the frozen base left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(optimizer["params"])
    kw.pop("torch_adam", None)
    opt = getattr(torch.optim, optimizer["type"])(params, **kw)
    tokens = np.load(data_path).astype(np.int64)
    losses = []
    for t in range(steps):
        loss = causal_lm_loss(model, windows_batch(tokens, seq_len, range(t * seqs_per_step, (t + 1) * seqs_per_step)))
        opt.zero_grad()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(loss.item())
    return losses

"""The four long-sequence training strategies the measurement scripts compare, on one model.

Each ``build_<strategy>(cfg, seq_len, chunk_size, device, dtype)`` returns a
:class:`Trainee`: the model's parameters and decoder layers, a ``step(ids)`` closure that
runs one full training step (forward, backward, AdamW step) on ``ids`` ``[1, S]``, and the
two halves of it without the optimizer: ``prepare(ids)`` (inputs and labels, data-loader
work) and ``forward_backward(inputs)``. Weights are random (seeded by the caller); every
strategy sees the same model shape and the same tokens.

* ``fpdt``: :mod:`fpdt.model` with chunked attention (``S / chunk_size`` chunks),
  attention offload, chunked MLP and loss (model defaults), ``checkpointing="offload"``,
  and ``fpdt-train``'s LM-head weight-gradient mode (:data:`LM_HEAD_WGRAD`).
* ``fpdt-no-offload``: the same without any host offload (``offload=False``,
  ``checkpointing="on"``).
* ``hf``: ``transformers`` ``LlamaForCausalLM`` with SDPA attention and gradient
  checkpointing (non-reentrant), full-logits loss.
* ``alst``: DeepSpeed's long-sequence recipe for a Hugging Face model on one GPU, set up as
  DeepSpeed documents it: ``TiledMLP`` patched into ``LlamaMLP.forward`` (shards =
  ``ceil(S / hidden)``, the docstring's rule), ``TiledFusedLogitsLoss`` for the LM head and
  loss (as many shards as fpdt's loss chunks), gradient checkpointing with DeepSpeed's
  checkpoint offload (``CheckpointHiddenStatesOffload``) held over forward *and* backward.

**ALST on the CPU.** DeepSpeed's offload engine skips tensors that are not on an
accelerator, so on the CPU its offload would be a no-op and its layer inputs would count
as device memory. :func:`cpu_offload_hooks` hooks the engine's offload entry point
instead: ``_should_skip`` keeps every test except "not on an accelerator", and the host
copies are drawn from (and returned to) an :class:`fpdt.offload.HostBufferPool`, the pool
the memory accountant recognises as host stash. Everything else is DeepSpeed's own code:
which inputs are offloaded, the newest one kept on the device, and every restored input
kept until the context exits (so its peak comes in the first layer's backward).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from fpdt.train.config import TrainerOptions

DEFAULT_STRATEGIES = ("fpdt", "fpdt-no-offload", "hf", "alst")
"""What the suite's comparisons run by default."""
STRATEGIES = DEFAULT_STRATEGIES + ("fpdt-save", "fpdt-stream")
"""``fpdt-save``: ``fpdt`` with ``attention_checkpoint="save"`` (every layer keeps its attention
output and lse on the host; the recompute runs no attention kernel). ``fpdt-stream``: ``fpdt`` with
``stream_layers=True`` (every layer a chunk at a time, the residual stream on the host)."""


@dataclass
class Trainee:
    params: list
    step: Callable[[torch.Tensor], float]
    """Runs forward + backward + optimizer step on ``ids`` ``[1, S]``; returns the loss."""
    recompute: bool
    """Whether the layer forward runs twice (activation checkpointing), for HFU."""
    notes: str = ""
    prepare: Callable[[torch.Tensor], dict] | None = None
    """``ids`` ``[1, S]`` -> the model's inputs and labels (what a data loader would hand over)."""
    forward_backward: Callable[..., torch.Tensor] | None = None
    """``forward_backward(inputs, on_backward=None)``: forward, then ``on_backward()`` if given,
    then backward (gradients accumulate into ``.grad``; no optimizer step); returns the loss."""
    layers: list = field(default_factory=list)
    """The decoder layers, in order (for per-layer hooks)."""
    optimizer_step: Callable[[], None] | None = None
    """The AdamW step on the accumulated gradients, then ``zero_grad(set_to_none=True)``."""
    optimizer: torch.optim.Optimizer | None = None

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors (AdamW moments, step counters) now."""
        if self.optimizer is None:
            return 0
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if torch.is_tensor(t))


def _trainee(params, prepare, forward_backward, recompute: bool, notes: str, layers) -> Trainee:
    """A :class:`Trainee` whose ``step`` is ``prepare`` + ``forward_backward`` + ``optimizer_step``."""
    params = list(params)
    opt = _adamw(params)

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(ids):
        loss = forward_backward(prepare(ids))
        optimizer_step()
        return float(loss.detach())
    return Trainee(params, step, recompute, notes, prepare, forward_backward, list(layers), optimizer_step, opt)


def missing_packages(strategy: str) -> str | None:
    """Why ``strategy`` cannot run here (a missing package), or None."""
    import importlib.util
    need = {"hf": ["transformers"], "alst": ["transformers", "deepspeed"]}.get(strategy, [])
    missing = [p for p in need if importlib.util.find_spec(p) is None]
    return f"missing package(s): {', '.join(missing)}" if missing else None


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-5, foreach=False)


LM_HEAD_WGRAD = TrainerOptions().lm_head_wgrad
"""The fpdt strategies' LM-head weight gradient: ``fpdt-train``'s default (``"recompute"``
since 2026-11-24; results before that ran the model's default, ``"accumulate"``)."""


def attention_kernel(strategy: str, cfg: dict, device, dtype, backend: str | None = None) -> str | None:
    """The attention kernel ``strategy`` runs here: for the fpdt strategies the
    :mod:`fpdt.attention.kernels` backend (``backend``, or the automatic choice, which this
    call self-checks once); for ``hf`` and ``alst``, ``"sdpa:<kernel>"``, the kernel torch's
    ``scaled_dot_product_attention`` dispatches their calls to (None if torch cannot say)."""
    from fpdt.model import ModelConfig
    shape = ModelConfig.from_hf(cfg)
    device = torch.device(device)
    if strategy.startswith("fpdt"):
        from fpdt.attention.kernels import get_backend
        return get_backend(backend, device, dtype, shape.head_dim).name
    from fpdt.attention.kernels.torch_cuda import sdpa_choice
    choice = sdpa_choice(device, dtype, shape.num_heads, shape.num_kv_heads, shape.head_dim)
    return None if choice is None else f"sdpa:{choice}"


def layer_kernels(cfg: dict, device, dtype) -> dict:
    """The kernels fpdt's other layers run here, by :mod:`fpdt.ops` and :mod:`fpdt.model.moe`'s own
    choice: ``delta_rule`` (``"fla"``/``"torch"``) and ``conv`` for Gated DeltaNet layers, ``experts``
    (``"grouped_mm"``/``"loop"``) for MoE layers; empty for a model with neither."""
    from fpdt.model import ModelConfig
    shape, device = ModelConfig.from_hf(cfg), torch.device(device)
    out = {}
    if shape.has_linear_attention:
        from fpdt.ops.causal_conv import conv_kernel
        from fpdt.ops.delta_rule import delta_rule_kernel
        out.update(delta_rule=delta_rule_kernel(device), conv=conv_kernel(device))
    if shape.moe is not None:
        from fpdt.model.moe import moe_kernel
        out["experts"] = moe_kernel(device, dtype, shape.hidden_size, shape.moe.moe_intermediate_size)
    return out


def build_fpdt(cfg: dict, seq_len: int, chunk_size: int, device, dtype, offload: bool = True,
               backend: str | None = None, attention_checkpoint: str = "recompute",
               stream_layers: bool = False) -> Trainee:
    """``backend``: the attention kernel (None: automatic selection); ``attention_checkpoint``,
    ``stream_layers``: the model options of those names."""
    import fpdt.model as fm
    chunks = max(1, seq_len // min(chunk_size, seq_len))
    model = fm.from_config(cfg, device=device, dtype=dtype, num_chunks=chunks, offload=offload,
                           checkpointing="offload" if offload else "on", lm_head_wgrad=LM_HEAD_WGRAD, backend=backend,
                           attention_checkpoint=attention_checkpoint, stream_layers=stream_layers)

    def forward_backward(inputs, on_backward=None):
        loss = model(**inputs)
        if on_backward is not None:
            on_backward()
        loss.backward()
        return loss
    return _trainee(model.parameters(), model.prepare_inputs, forward_backward, True,
                    f"num_chunks={chunks}, mlp_chunks={model.mlp_chunks}, loss_chunks={model.loss_chunks}, "
                    f"lm_head_wgrad={LM_HEAD_WGRAD}, attention_checkpoint={attention_checkpoint}",
                    model.model.layers)


def fpdt_loss_chunks(cfg: dict, seq_len: int, chunk_size: int) -> int:
    """The loss chunks ``build_fpdt`` would use (a shape-only model on the meta device)."""
    import fpdt.model as fm
    chunks = max(1, seq_len // min(chunk_size, seq_len))
    return fm.from_config(cfg, device="meta", num_chunks=chunks, offload=True, checkpointing="offload").loss_chunks


def _hf_model(cfg: dict, device, dtype):
    """Transformers' causal LM of ``cfg`` (any ``model_type`` it knows: Llama, Qwen3.5's hybrid,
    Qwen3-MoE), SDPA attention, gradient checkpointing."""
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                        if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(hf_cfg).to(device=device, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


def build_hf(cfg: dict, seq_len: int, chunk_size: int, device, dtype) -> Trainee:
    model = _hf_model(cfg, device, dtype)

    def forward_backward(inputs, on_backward=None):
        loss = model(**inputs).loss              # labels = input_ids: the model shifts them
        if on_backward is not None:
            on_backward()
        loss.backward()
        return loss
    return _trainee(model.parameters(), lambda ids: {"input_ids": ids, "labels": ids}, forward_backward, True,
                    "sdpa, gradient checkpointing", model.model.layers)


@contextlib.contextmanager
def cpu_offload_hooks(engine_cls):
    """Make DeepSpeed's activation offload engine offload CPU tensors into a host pool.

    See the module docstring. Restores the engine's methods on exit.
    """
    from fpdt.offload import HostBufferPool
    pool = HostBufferPool(pin_memory=False)
    saved = {n: engine_cls.__dict__[n] for n in ("_should_skip", "_empty_cpu_like", "_pool_cpu_buffer")}

    def _should_skip(self, tensor):      # DeepSpeed's tests minus "not on an accelerator"
        return (self._num_bytes(tensor) < self.min_offload_bytes or isinstance(tensor, torch.nn.Parameter)
                or (tensor.numel() > 1 and 0 in tensor.stride()))

    def _empty_cpu_like(self, tensor):
        return pool.acquire(tuple(tensor.size()), tensor.dtype), self._buffer_key(tensor)

    def _pool_cpu_buffer(self, key, tensor):
        pool.release(tensor)

    engine_cls._should_skip, engine_cls._empty_cpu_like, engine_cls._pool_cpu_buffer = (
        _should_skip, _empty_cpu_like, _pool_cpu_buffer)
    try:
        yield pool
    finally:
        for name, fn in saved.items():
            setattr(engine_cls, name, fn)


def build_alst(cfg: dict, seq_len: int, chunk_size: int, device, dtype, loss_shards: int | None = None) -> Trainee:
    """``loss_shards``: ``TiledFusedLogitsLoss`` shards; None = fpdt's loss chunks at the same
    length and chunk size (:func:`fpdt_loss_chunks`)."""
    import torch.nn.functional as F
    from deepspeed.runtime.activation_checkpointing import offload_activations as oa
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from transformers.models.llama import modeling_llama

    def tiled_mlp_forward(self, x):              # DeepSpeed's documented LlamaMLP patch (one process)
        num_shards = math.ceil(x.shape[-2] / x.shape[-1])
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return TiledMLP.apply(mlp_forward, self, x, num_shards, compute_params)

    original_mlp_forward = modeling_llama.LlamaMLP.forward
    modeling_llama.LlamaMLP.forward = tiled_mlp_forward   # before the model is built, as documented
    try:
        model = _hf_model(cfg, device, dtype)
    finally:
        modeling_llama.LlamaMLP.forward = original_mlp_forward
    patched = {id(m): m for m in model.modules() if isinstance(m, modeling_llama.LlamaMLP)}
    for m in patched.values():                 # keep the tiled forward on this model's MLPs only
        m.forward = tiled_mlp_forward.__get__(m)
    shards = loss_shards or fpdt_loss_chunks(cfg, seq_len, chunk_size)
    on_cpu = torch.device(device).type == "cpu"

    def loss_fn(self, x, y):
        logits = self.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)

    def prepare(ids):
        return {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)}

    def forward_backward(inputs, on_backward=None):
        ids, labels = inputs["input_ids"], inputs["labels"]
        hooks = cpu_offload_hooks(oa._ActivationOffloadEngine) if on_cpu else contextlib.nullcontext()
        with hooks, oa.get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=not on_cpu):
            hidden = model.model(input_ids=ids).last_hidden_state
            loss = TiledFusedLogitsLoss.apply(loss_fn, model, hidden, labels, None, min(shards, ids.shape[1]),
                                              [model.lm_head.weight], "mean")
            if on_backward is not None:
                on_backward()
            loss.backward()
        return loss
    return _trainee(model.parameters(), prepare, forward_backward, True,
                    f"TiledMLP shards ceil(S/hidden), TiledFusedLogitsLoss shards {shards}, "
                    f"checkpoint offload{' (CPU hook)' if on_cpu else ''}", model.model.layers)


def build(strategy: str, cfg: dict, seq_len: int, chunk_size: int, device, dtype,
          backend: str | None = None) -> Trainee:
    """The :class:`Trainee` of ``strategy`` (one of :data:`STRATEGIES`); ``backend``: the fpdt
    strategies' attention kernel (None: automatic; the peers always run torch's SDPA)."""
    if strategy == "fpdt":
        return build_fpdt(cfg, seq_len, chunk_size, device, dtype, offload=True, backend=backend)
    if strategy == "fpdt-save":
        return build_fpdt(cfg, seq_len, chunk_size, device, dtype, offload=True, backend=backend,
                          attention_checkpoint="save")
    if strategy == "fpdt-stream":
        return build_fpdt(cfg, seq_len, chunk_size, device, dtype, offload=True, backend=backend, stream_layers=True)
    if strategy == "fpdt-no-offload":
        return build_fpdt(cfg, seq_len, chunk_size, device, dtype, offload=False, backend=backend)
    if strategy == "hf":
        return build_hf(cfg, seq_len, chunk_size, device, dtype)
    if strategy == "alst":
        return build_alst(cfg, seq_len, chunk_size, device, dtype)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")

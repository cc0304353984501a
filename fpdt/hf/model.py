"""Put FPDT's sequence-parallel, chunked pieces into an existing Transformers causal LM.

:func:`apply_fpdt` changes a ``*ForCausalLM`` instance in place (its class and weights stay
Transformers', so its checkpoints, ``save_pretrained`` and DeepSpeed work as before):

* **attention**: the model's attention implementation becomes FPDT attention
  (:mod:`fpdt.hf.attention`): Ulysses all-to-all over the SP group (or the 2D mesh),
  chunked online-softmax attention, finished chunks offloaded to host with ``offload``;
* **MLP** (``mlp_chunks``): each decoder layer's SwiGLU runs over token chunks with the
  intermediates recomputed in backward (:class:`fpdt.model.mlp.ChunkedSwiGLUFunction`);
* **loss** (``loss_chunks``): with ``shift_labels``, the forward returns the global
  token-mean cross-entropy from the final hidden states a chunk of logits at a time
  (:func:`fpdt.model.loss.sequence_parallel_lm_loss`) and no logits;
* **checkpointing** (``"on"`` / ``"offload"``): each decoder layer under fpdt's own
  activation checkpoint (:mod:`fpdt.model.checkpointing`), with ``"offload"`` the layer
  inputs in host memory, fetched one layer ahead in backward. Or leave it ``"off"`` and use
  Transformers' ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable()``,
  its older name), which works with FPDT attention:
  the attention's saved chunks are freed with the checkpointed region
  (:mod:`fpdt.attention.saved_stash`).
* **ZeRO-3**: when DeepSpeed is installed, the weights those chunked functions read
  without calling their ``nn.Linear`` (and the LoRA adapters' weights) are registered as
  external parameters of the module that reads them, so ZeRO-3 gathers them there;
* **LoRA** (PEFT): LoRA layers on the q/k/v and MLP projections are computed inside the
  chunked functions (:mod:`fpdt.hf.adapters`, :mod:`fpdt.ops.lora`); the frozen base weights
  get no gradient computation at all;
* **RMSNorm** (``lean_norms``): the models' RMSNorms run :func:`fpdt.model.rmsnorm.rms_norm`
  (same numerics; saves the input and one fp32 scale per token instead of Transformers'
  fp32 copy of the input and copy of the normalised output);
* **q/k/v projections** (``chunked_qkv``): each layer's q/k/v projections (Qwen3: and its
  per-head q/k norms) and RoPE run
  chunk by chunk inside the FPDT attention (as in :class:`fpdt.model.FPDTForCausalLM`), so
  the layer's full-length local q/k/v never exist; RoPE is the model's own
  ``position_embeddings``, sliced per chunk;
* **RoPE** (``dynamic``, ``longrope``): these pick their frequencies from the largest position
  a forward sees; the rotary embedding's forward is replaced so that, under sequence
  parallelism, every rank sees the window's largest position (one all-reduce per forward).
* **packed documents** (:mod:`fpdt.hf.documents`): position ids that restart at 0, as
  ``DataCollatorWithFlattening`` makes them (or its ``cu_seq_lens_q/k``, or ``doc_ids`` from
  :func:`prepare_inputs`), mask the attention at every document boundary; the forward finds the
  window's documents once (under SP one all-gather of the positions) and hands their ids to every
  attention call.

What stays Transformers': embeddings, RoPE's tables (``(cos, sin)`` of every local token,
``2 D / hidden`` of a hidden-state tensor, which :class:`fpdt.model.FPDTForCausalLM` does not
hold) and the output projection (and the q/k/v projections with ``chunked_qkv=False``).

Gradient convention, as :class:`fpdt.model.FPDTForCausalLM`: the loss value is the same on
every SP rank; parameter gradients **summed** over the SP group are those of the global
mean. DeepSpeed averages over all ranks, so back-propagate ``loss * sp``. Not so with
``group="trainer"`` (:mod:`fpdt.hf.trainer`): there the backward already sums the Trainer's
per-rank loss weights over the group.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fpdt.comm import SequenceMesh
from fpdt.comm.ulysses import group_rank, group_size
from fpdt.hf.attention import (FPDTHFError, check_chunked_qkv, chunked_qkv_attention_forward,
                               plain_linears, register_settings)
from fpdt.hf.adapters import lean_lora, read_parameters, read_projections
from fpdt.hf.documents import pop_explicit_documents, window_doc_ids
from fpdt.hf.groups import TrainerGroup, resolve_group
from fpdt.hf.patches import Patches
from fpdt.hf.padding import check_right_padding, whole_window_mask
from fpdt.hf.trainer import TRAINER_ATTN_NAME, contiguous_to_fpdt_layout
from fpdt.layout.documents import DocumentError, sequence_parallel_doc_ids
from fpdt.model.checkpointing import checkpointed, checkpointed_residual
from fpdt.model.config import uses_sliding_window
from fpdt.model.layer_checkpoints import LayerCheckpoints
from fpdt.model.inputs import prepare_inputs as _prepare_inputs
from fpdt.model.inputs import shift_labels as _shift_labels
from fpdt.model.loss import (IGNORE_INDEX, default_loss_chunks, sequence_parallel_lm_loss,
                             sum_gradient_over_group, sum_over_group, valid_token_scale)
from fpdt.model.mlp import default_mlp_chunks, swiglu_of_linears
from fpdt.model.rmsnorm import rms_norm
from fpdt.options import FPDTOptions, OptionsError

SWIGLU_ACTIVATIONS = ("silu", "swish")
RECOMPUTED_ROPE_TYPES = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the largest position of the forward (Transformers'
``dynamic_rope_update``): under SP each rank must see the window's (:func:`_global_rope_forward`)."""


def _lean_rmsnorm_classes() -> tuple[type, ...]:
    """Transformers RMSNorm classes whose forward is exactly :func:`fpdt.model.rmsnorm.rms_norm`'s
    (fp32 normalisation, cast to the input dtype, then the weight multiply); matched by class."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm


@dataclass(frozen=True)
class HFSettings:
    """What :func:`apply_fpdt` set on a model (``model.fpdt``): the options and what it resolved."""

    attn_implementation: str
    """The name fpdt's attention is registered under (the model's own, except under the Trainer)."""
    options: FPDTOptions
    """The FPDT options (``group`` may be a :class:`fpdt.hf.groups.TrainerGroup`)."""
    mlp_chunks: int
    """The MLP's token chunks (``options.mlp_chunks``, or its default for this model)."""
    loss_chunks: int
    """The loss's token chunks (``options.loss_chunks``, or its default for this model)."""
    chunked_qkv: bool = True
    lean_norms: bool = True

    def __deepcopy__(self, memo) -> "HFSettings":
        return self     # immutable, and a copied model stays in the same process group

    def rank_size(self) -> tuple[int, int]:
        """``(rank, size)`` in the sequence-parallel group."""
        return _rank_size(self.options.group, self.options.mesh)

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        mesh = self.options.mesh
        return mesh.sp_group if mesh is not None else resolve_group(self.options.group)

    @property
    def under_trainer(self) -> bool:
        """Set up for the Hugging Face Trainer's sequence parallelism (:mod:`fpdt.hf.trainer`)."""
        return isinstance(self.options.group, TrainerGroup)


def _rank_size(group: dist.ProcessGroup | TrainerGroup | None, mesh: SequenceMesh | None) -> tuple[int, int]:
    if mesh is not None:
        return mesh.sp_rank, mesh.sp
    group = resolve_group(group)
    return group_rank(group), group_size(group)


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a PEFT model (``PeftModel`` -> ``LoraModel`` -> it), or ``model``."""
    peft_model = sys.modules.get("peft.peft_model")
    if peft_model is not None and isinstance(model, peft_model.PeftModel):
        return model.get_base_model()
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise FPDTHFError(f"{type(model).__name__} is not a decoder-only causal LM with model.layers and lm_head "
                          f"(e.g. LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)")
    return list(layers)


def _check_config(model: nn.Module, layers: list[nn.Module], mlp_chunks: int, loss_chunks: int) -> None:
    cfg = model.config
    if getattr(cfg, "attention_dropout", 0.0):
        raise FPDTHFError(f"attention_dropout={cfg.attention_dropout}: fpdt attention has no dropout; set it to 0")
    if uses_sliding_window(cfg.to_dict()) or any(getattr(layer.self_attn, "sliding_window", None) for layer in layers):
        raise FPDTHFError(f"sliding-window attention (window {getattr(cfg, 'sliding_window', None)}) is not "
                          f"supported by fpdt attention, which is full causal: load the model with "
                          f"sliding_window=None (and use_sliding_window=False)")
    if loss_chunks and getattr(model.lm_head, "bias", None) is not None:
        raise FPDTHFError("an LM head with a bias is not supported by the chunked loss; use loss_chunks=0")
    if mlp_chunks:
        act = getattr(cfg, "hidden_act", None)
        if act not in SWIGLU_ACTIVATIONS or not all(
                all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) for layer in layers):
            raise FPDTHFError(f"the chunked MLP needs a SwiGLU MLP (gate_proj/up_proj/down_proj, hidden_act silu); "
                              f"this model has hidden_act={act!r}: pass mlp_chunks=0")


def _global_rope_forward(settings: "HFSettings"):
    """A forward for the model's rotary embedding whose position-dependent RoPE (``dynamic``,
    ``longrope``: frequencies picked from the largest position a forward sees) sees the
    largest position of the whole window, as one process holding it would: each SP rank
    holds other positions. One all-reduce of one integer per model forward (RoPE's tables are
    computed once per forward); the window's largest position rides along as one extra
    position, so Transformers' own update picks the frequencies (whatever its version)."""
    def forward(self, x, position_ids, *args, **kwargs):
        _, sp = settings.rank_size()
        if sp == 1:
            return type(self).forward(self, x, position_ids, *args, **kwargs)
        top = position_ids.max().reshape(1, 1).to(torch.int64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=settings.sp_group)
        top = top.to(position_ids.dtype).expand(*position_ids.shape[:-1], 1)
        cos, sin = type(self).forward(self, x, torch.cat([position_ids, top], dim=-1), *args, **kwargs)
        return cos[..., :-1, :], sin[..., :-1, :]
    return forward


def _chunked_mlp_forward(num_chunks: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = read_projections({n: getattr(self, n) for n in ("gate_proj", "up_proj", "down_proj")},
                                type(self).__name__, "apply_fpdt(..., mlp_chunks=0)")
        return swiglu_of_linears(x, *proj.bases, num_chunks, adapters=proj.adapters)
    return forward


def _lean_norm_forward(num_chunks: int):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, num_chunks)
    return forward


def _lean_norms(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The model's RMSNorms, refused (naming the fix) unless their class is a known one."""
    known = _lean_rmsnorm_classes()
    norm = getattr(layers[0], "input_layernorm", None)
    if type(norm) not in known:
        names = ", ".join(c.__name__ for c in known)
        raise FPDTHFError(f"lean_norms replaces Transformers' {names}; this model's layer norm is "
                          f"{type(norm).__module__}.{type(norm).__name__}, which may compute something else: "
                          f"apply_fpdt(..., lean_norms=False)")
    return [m for m in model.modules() if type(m) in known]


def _checkpointed_layer_forward(self, hidden_states, *args, **kwargs):
    """A decoder layer's forward under fpdt's checkpoint; bound to the layer, whose
    ``_fpdt_checkpoint`` holds ``(index, mode, the model's LayerCheckpoints)`` (copied with the model)."""
    i, mode, checkpoints = self._fpdt_checkpoint
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        raise FPDTHFError(_BOTH_CHECKPOINTS.format(mode=mode))
    if i == 0:
        checkpoints.start()                       # stash keys unique per forward call
    keys = checkpoints.arguments(i, hidden_states.device)
    if keys["saved"] is not None:                 # the layer's attention call records / replays its output
        kwargs = dict(kwargs, fpdt_saved=keys["saved"])
    if not args and type(self).__name__ in _PRE_NORM_LAYERS:
        return checkpointed_residual(_residual_branches(self, kwargs), hidden_states, list(self.parameters()), **keys)
    run = type(self).forward                      # Transformers' own forward (its checkpoint wrapper is off)
    # the decoder layer ends with a residual add, which saves nothing: its output may be freed
    return checkpointed(lambda x: run(self, x, *args, **kwargs), hidden_states, list(self.parameters()),
                        free_output=True, **keys)


_PRE_NORM_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
"""Transformers decoder layers whose forward is exactly ``h = x + self_attn(input_layernorm(x), **kwargs)[0]``,
then ``h + mlp(post_attention_layernorm(h))`` (one shared source in Transformers 5; the parity tests
against Transformers hold fpdt's split of it to that)."""


def _residual_branches(layer: nn.Module, kwargs: dict):
    """``layer``'s two residual branches (:func:`fpdt.model.checkpointing.checkpointed_residual`),
    called with the keyword arguments the model passed to the layer, as its forward calls them."""
    def attention(x):
        return layer.self_attn(hidden_states=layer.input_layernorm(x), **kwargs)[0]

    def mlp(h):
        return layer.mlp(layer.post_attention_layernorm(h))
    return attention, mlp


_BOTH_CHECKPOINTS = ("apply_fpdt(checkpointing={mode!r}) checkpoints the decoder layers itself: call "
                     "model.activation_checkpointing_disable() (gradient_checkpointing_disable(), its older "
                     "name), or apply_fpdt with checkpointing='off' to keep Transformers' checkpointing")


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, shift_labels=None,
                       num_items_in_batch=None, **kwargs):
    """The causal LM's forward after :func:`apply_fpdt` (bound to the model)."""
    settings: HFSettings = self.fpdt
    original = type(self).forward               # Transformers' forward, called with this (maybe copied) model
    rank, sp = settings.rank_size()
    trainer = settings.under_trainer
    if trainer:
        if labels is not None and labels is shift_labels:   # the Trainer's SP loss passes shift_labels as labels
            labels = None
            if sp == 1 and dist.is_initialized() and dist.get_world_size() > 1:
                raise FPDTHFError("these inputs are DeepSpeed's sequence-parallel slices (the Trainer's SP loss), "
                                  "but no DeepSpeed sequence-parallel group exists: train through the Trainer "
                                  "with parallelism_config=fpdt.hf.trainer_parallelism_config(sp_size)")
        if sp > 1 and not self.training:
            raise FPDTHFError(f"evaluation under the Trainer's sequence parallelism (sp={sp}): the Trainer gives "
                              f"every rank whole windows of its own, which fpdt cannot split; evaluate with "
                              f"TrainingArguments(eval_strategy='no') or a model without apply_fpdt")
    mode = settings.options.checkpointing
    if mode != "off" and self.training and getattr(self.model, "gradient_checkpointing", False):
        raise FPDTHFError(_BOTH_CHECKPOINTS.format(mode=mode))
    ref = input_ids if input_ids is not None else inputs_embeds
    if ref is not None and torch.is_autocast_enabled(ref.device.type):
        raise FPDTHFError("apply_fpdt's chunked functions do not run under torch.autocast: cast the model to the "
                          "training dtype instead (model.to(torch.bfloat16), or DeepSpeed's bf16 mode) and call it "
                          "outside autocast")
    if use_cache or past_key_values is not None:
        raise FPDTHFError("fpdt attention keeps no KV cache: call the model with use_cache=False and no "
                          "past_key_values (generate with a model that has not been through apply_fpdt)")
    if labels is not None:
        if shift_labels is not None:
            raise FPDTHFError("pass labels= or shift_labels=, not both")
        if sp > 1 and trainer:
            raise FPDTHFError(f"labels= without shift_labels= under the Trainer's sequence parallelism (sp={sp}): "
                              f"DeepSpeed's data adapter gives shift_labels; whole windows with labels (the "
                              f"Trainer's evaluation) cannot be split by fpdt: use TrainingArguments("
                              f"eval_strategy='no') or a model without apply_fpdt")
        if sp > 1:
            raise FPDTHFError(f"labels= would be shifted inside this rank's slice of the sequence (sp={sp}); "
                              f"pass the global-shifted shift_labels= from fpdt.hf.prepare_inputs")
        shift_labels = _shift_labels(labels)      # one rank holds the whole sequence in order
    explicit_docs, cu_seqlens = pop_explicit_documents(kwargs)     # packed documents: fpdt.hf.documents
    doc_ids = None
    if sp == 1:
        refusal = None
        try:
            if ref is not None:
                doc_ids = window_doc_ids(ref.shape[:2], ref.device, position_ids=position_ids, doc_ids=explicit_docs,
                                         cu_seqlens=cu_seqlens)
        except FPDTHFError as e:
            refusal = e
        attention_mask = whole_window_mask(attention_mask, ref, shift_labels, trainer and self.training, refusal)
    if position_ids is None and sp > 1:
        raise FPDTHFError(f"position_ids are required with sequence parallelism (sp={sp}): this rank's tokens "
                          f"are not contiguous; use fpdt.hf.prepare_inputs")
    if trainer and sp > 1:                      # DeepSpeed's data adapter slices the window contiguously
        if input_ids is None:
            raise FPDTHFError("under the Trainer's sequence parallelism pass input_ids, not inputs_embeds (the "
                              "tokens are moved into fpdt's chunk layout by id)")
        if explicit_docs is not None or cu_seqlens is not None:
            raise FPDTHFError("under the Trainer's sequence parallelism packed documents are marked by position_ids "
                              "that restart at 0 (DataCollatorWithFlattening's default), not by doc_ids or "
                              "cu_seq_lens_q/k, which DeepSpeed's data adapter cannot slice")
        input_ids, position_ids, shift_labels, doc_ids = contiguous_to_fpdt_layout(   # every rank of the job agrees
            input_ids, position_ids, shift_labels, attention_mask, group=settings.sp_group, job_group=None, sp=sp,
            rank=rank, num_chunks=settings.options.num_chunks)
        attention_mask = None                    # all ones over the window, or refused above
    elif sp > 1:
        if cu_seqlens is not None:
            raise FPDTHFError(f"cu_seq_lens_q/k with sequence parallelism (sp={sp}): pass the window's cu_seqlens "
                              f"to fpdt.hf.prepare_inputs, whose doc_ids the model then takes")
        B, S_local = ref.shape[:2]
        try:
            doc_ids = window_doc_ids((B, S_local * sp), ref.device, doc_ids=explicit_docs) \
                if explicit_docs is not None else \
                sequence_parallel_doc_ids(position_ids, settings.options.num_chunks,
                                          group=resolve_group(settings.options.group),
                                          mesh=settings.options.mesh)        # one all-gather of the positions
        except DocumentError as e:
            raise FPDTHFError(str(e)) from e
    if doc_ids is not None:
        kwargs["doc_ids"] = doc_ids              # [B, S] global: to every attention call (recompute included)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    with _attention_implementation(self.config, settings.attn_implementation) if trainer else contextlib.nullcontext():
        out = _decoder_and_loss(self, original, settings, sp, input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids, inputs_embeds=inputs_embeds, shift_labels=shift_labels,
                                logits_to_keep=logits_to_keep, num_items_in_batch=num_items_in_batch, kwargs=kwargs)
    if trainer and out.loss is not None:
        out.loss = sum_gradient_over_group(out.loss, group=settings.sp_group, sp=sp)
    return out if return_dict else out.to_tuple()


@contextlib.contextmanager
def _attention_implementation(config, name: str):
    """The model runs fpdt's attention and mask functions (``name``) while keeping the implementation
    name the Trainer's sequence-parallel setup checked (``sdpa``, ...) outside its forward."""
    kept = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = kept


def _decoder_and_loss(self, original, settings: HFSettings, sp: int, *, input_ids, attention_mask, position_ids,
                      inputs_embeds, shift_labels, logits_to_keep, num_items_in_batch, kwargs):
    """The decoder and the loss (chunked, or from full logits) of :func:`_causal_lm_forward`."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if shift_labels is None or settings.loss_chunks == 0:
        out = original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       inputs_embeds=inputs_embeds, use_cache=False, logits_to_keep=logits_to_keep,
                       return_dict=True, **kwargs)
        if shift_labels is not None:   # full logits (loss_chunks=0), the same reduction as the chunked loss
            loss = _full_logits_loss(out.logits, shift_labels, settings, sp, num_items_in_batch)
            out = CausalLMOutputWithPast(loss=loss, logits=out.logits, hidden_states=out.hidden_states,
                                         attentions=out.attentions)
    else:
        if not plain_linears(self.lm_head):
            raise FPDTHFError(f"the chunked loss reads lm_head.weight directly, and lm_head is "
                              f"{type(self.lm_head).__module__}.{type(self.lm_head).__name__} (an adapter or "
                              f"quantised layer), whose extra "
                              f"computation it would skip: apply_fpdt(..., loss_chunks=0)")
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=False, return_dict=True, **kwargs)
        loss = sequence_parallel_lm_loss(outputs.last_hidden_state, self.lm_head.weight, shift_labels,
                                         group=settings.sp_group, sp=sp, num_chunks=settings.loss_chunks,
                                         wgrad=settings.options.lm_head_wgrad, num_valid_tokens=num_items_in_batch)
        out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions)
    return out


def _full_logits_loss(logits, shift_labels, settings: HFSettings, sp: int, num_items_in_batch):
    """What :func:`sequence_parallel_lm_loss` gives, from materialised logits (``loss_chunks=0``)."""
    group = settings.sp_group
    scale = valid_token_scale(shift_labels, group=group, sp=sp, num_valid_tokens=num_items_in_batch)
    local = F.cross_entropy(logits.float().flatten(0, -2), shift_labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum") * scale.to(logits.device)
    return sum_over_group(local, group=group, sp=sp)


def _register_zero3_params(model: nn.Module, layers: list[nn.Module], mlp_chunked: bool, loss_chunked: bool,
                           qkv_chunked: bool, patches: Patches) -> None:
    try:
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
    except ImportError:        # no DeepSpeed, no ZeRO-3
        return

    def external(owner: nn.Module, p: torch.nn.Parameter) -> None:
        if "_external_params" not in patches.changed(owner):   # what DeepSpeed's registry adds to the module
            for name in ("_external_params", "ds_external_parameters", "all_parameters"):
                patches.remember(owner, name)
        register_external_parameter(owner, p)

    def register(owner: nn.Module, names: tuple[str, ...]) -> None:
        for sub in filter(None, (getattr(owner, n, None) for n in names)):
            for p in read_parameters(sub):          # with PEFT: the base layer's and the adapters'
                external(owner, p)

    for layer in layers:
        if qkv_chunked:
            register(layer.self_attn, ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"))   # q/k norms: Qwen3
            if lean_lora(layer.self_attn.o_proj, "") is not None:   # read directly too (a PEFT LoRA o_proj)
                register(layer.self_attn, ("o_proj",))
        if mlp_chunked:
            register(layer.mlp, ("gate_proj", "up_proj", "down_proj"))
    if loss_chunked:
        external(model, model.lm_head.weight)


def _apply_attention(model: nn.Module, layers: list[nn.Module], options: FPDTOptions, trainer: bool,
                     chunked_qkv: bool, patches: Patches) -> str:
    """Register fpdt attention under a new name and make it the model's; with ``chunked_qkv``, each
    attention module runs its projections inside it. Returns the registered name."""
    name = register_settings(options)
    if trainer:
        # The name the Trainer's SP setup checks; the chunked attention modules never call the function
        # behind it, and the forward switches to `name` (fpdt's mask function) while it runs.
        model.set_attn_implementation(TRAINER_ATTN_NAME)
    else:
        model.set_attn_implementation(name)
    if not trainer and model.config._attn_implementation != name:
        raise FPDTHFError(f"{type(model).__name__} did not take attention implementation {name!r}; it does not "
                          f"use Transformers' AttentionInterface")
    if chunked_qkv:
        forward = chunked_qkv_attention_forward(options, name)
        for layer in layers:
            patches.bind(layer.self_attn, "forward", forward)
    return name


def _apply_lean_norms(norms: list[nn.Module], num_chunks: int, patches: Patches) -> None:
    norm_forward = _lean_norm_forward(2 * num_chunks)   # fp32 temporaries within the chunk budget
    for norm in norms:
        patches.bind(norm, "forward", norm_forward)


def _apply_chunked_mlp(layers: list[nn.Module], mlp_chunks: int, patches: Patches) -> None:
    if mlp_chunks:
        mlp_forward = _chunked_mlp_forward(mlp_chunks)
        for layer in layers:
            patches.bind(layer.mlp, "forward", mlp_forward)


def _apply_checkpointing(layers: list[nn.Module], options: FPDTOptions, patches: Patches) -> None:
    if options.checkpointing == "off":
        return
    checkpoints = LayerCheckpoints(options, len(layers))   # the loop fpdt.model's decoder runs too
    for i, layer in enumerate(layers):
        patches.set(layer, "_fpdt_checkpoint", (i, options.checkpointing, checkpoints))
        patches.bind(layer, "forward", _checkpointed_layer_forward)


def _apply_forward(model: nn.Module, settings: HFSettings, patches: Patches) -> None:
    """The causal LM's forward (sequence-parallel inputs, the chunked loss) and, for RoPE types
    that depend on the largest position, a rotary embedding that sees the whole window's."""
    patches.bind(model, "forward", _causal_lm_forward)
    patches.set(model, "fpdt", settings)
    rotary = getattr(model.model, "rotary_emb", None)
    rope_types = getattr(rotary, "rope_type", "default")          # per layer type in some models
    if set(rope_types.values() if isinstance(rope_types, dict) else [rope_types]) & set(RECOMPUTED_ROPE_TYPES):
        patches.bind(rotary, "forward", _global_rope_forward(settings))


def remove_fpdt(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_fpdt` on ``model`` (the object it changed, not a copy): every patched
    forward and attribute is restored, and the model's attention implementation is the one it had.
    Returns ``model``."""
    outer, model = model, _causal_lm(model)
    if getattr(model, "fpdt", None) is None:
        raise FPDTHFError("remove_fpdt: apply_fpdt was not applied to this model")
    patches, original_attention = model.__dict__.get("_fpdt_undo", (None, None))
    if patches is None or not len(patches):
        raise FPDTHFError("remove_fpdt: this model is a copy of the one apply_fpdt changed; undo it on the "
                          "original, or build the model again")
    patches.undo()
    model.set_attn_implementation(original_attention)
    return outer


def apply_fpdt(model: nn.Module, options: FPDTOptions | None = None, *, chunked_qkv: bool = True,
               lean_norms: bool = True, **fields) -> nn.Module:
    """Make a Transformers causal LM sequence-parallel and chunked with FPDT; returns ``model``.

    Args:
        options / **fields: :class:`fpdt.options.FPDTOptions`, or its fields as keywords (both: the
            fields change the object), with the same defaults as :func:`fpdt.model.from_config`.
            The ones worth a word here follow.
        model: a ``*ForCausalLM`` whose attention uses Transformers' ``AttentionInterface``
            (Llama, Qwen2, Mistral, ...), built normally or under ``deepspeed.zero.Init``, or
            a PEFT model around one (returned as given); call this before
            ``deepspeed.initialize`` and after ``peft.get_peft_model`` (so that ZeRO-3 gathers
            the adapters where the chunked functions read them). PEFT's plain LoRA layers on
            the q/k/v and MLP projections run inside the chunked functions
            (:mod:`fpdt.hf.adapters`; dropout masks are fpdt's); other adapters (DoRA, ...)
            or quantised layers there need ``chunked_qkv=False`` / ``mlp_chunks=0``, and any
            adapter on the LM head ``loss_chunks=0`` (each refused with its fix).
        group / mesh: the sequence-parallel group (None: the default group, or no
            parallelism without torch.distributed), or a 2D :class:`fpdt.comm.SequenceMesh`.
            ``group="trainer"``: for Hugging Face's ``Trainer`` with sequence parallelism
            (:mod:`fpdt.hf.trainer`; the group is the one DeepSpeed creates when the Trainer
            prepares the model, the inputs arrive in its contiguous slices and the loss follows
            its convention; needs ``chunked_qkv``; build ``TrainingArguments(parallelism_config=``
            :func:`fpdt.hf.trainer_parallelism_config` ``(sp_size))``).
        num_chunks: attention chunks per rank ``u``; inputs must be sharded with the same
            ``u`` (:func:`prepare_inputs`).
        offload: keep finished attention chunks in pinned host memory (needs CUDA, or
            ``runtime="sim"`` on the CPU).
        runtime: device runtime of the offload copies (:attr:`fpdt.options.FPDTOptions.runtime`);
            None: automatic (``"cuda"`` on a CUDA device, ``"sync"`` elsewhere).
        backend: attention kernel (:mod:`fpdt.attention.kernels`); None = automatic.
        mlp_chunks: token chunks of each layer's SwiGLU MLP; default
            ``ceil(2 u I / hidden)`` (as :class:`fpdt.model.FPDTForCausalLM`); 0 leaves it.
        loss_chunks: token chunks of the LM head + loss; default ``ceil(2 u V / hidden)``;
            0 computes full logits (and the same sequence-parallel loss from them).
        lm_head_wgrad: ``"recompute"`` or ``"accumulate"`` (:mod:`fpdt.model.loss`).
        checkpointing: ``"off"`` leaves activation checkpointing to Transformers
            (``model.activation_checkpointing_enable()``, formerly ``gradient_checkpointing_enable()``,
            works with everything above); ``"on"``
            checkpoints each decoder layer with fpdt's own checkpoint
            (:mod:`fpdt.model.checkpointing`: the layer input is kept, the layer recomputed in
            backward); ``"offload"`` keeps the layer inputs in (pinned) host memory instead,
            fetched one layer ahead in backward, as FPDT does. Not together with Transformers'.
        attention_checkpoint: ``"recompute"`` (the checkpoint's recompute runs the attention
            forward again) or ``"save"``: each checkpointed layer keeps its attention output and
            lse from the first forward (on the host under ``"offload"``, else on the device) and
            its recompute runs no attention kernel (:mod:`fpdt.attention.saved_attention`);
            only with fpdt's checkpoint (``checkpointing`` ``"on"`` or ``"offload"``; with
            ``"off"`` there is no recompute and it changes nothing).
        save_attention_layers: with ``"save"``, only the first this many decoder layers save
            (None: every layer).
        chunked_qkv: run each layer's q/k/v projections and RoPE chunk by chunk inside the
            FPDT attention, as :class:`fpdt.model.FPDTForCausalLM` does, so the layer's
            full-length local q/k/v never exist (Llama, Mistral, Qwen2, Qwen3 attention, with
            plain or PEFT LoRA projections; other adapters, quantised q/k/v projections and other
            attention classes need ``chunked_qkv=False``, which keeps Transformers' projections
            and calls FPDT attention on their output).
        lean_norms: run the RMSNorms (Llama, Mistral, Qwen2, Qwen3 classes) with fpdt's
            RMSNorm (:mod:`fpdt.model.rmsnorm`), which saves the input and an fp32 scale per
            token instead of Transformers' fp32 copies, over ``2 u`` token chunks; same
            numerics. Other norm classes need ``lean_norms=False``.

    After this, call ``model(input_ids=..., position_ids=..., shift_labels=...)`` with this
    rank's inputs from :func:`prepare_inputs`: ``.loss`` is the global token-mean
    cross-entropy (the same on every SP rank; ``num_items_in_batch=`` overrides its
    denominator with a count over the SP group, e.g. of a gradient-accumulation window),
    ``.logits`` is None. Without labels the model returns logits of this rank's tokens.
    Without sequence parallelism ``labels=`` (unshifted, as in Transformers) works too.
    """
    outer, model = model, _causal_lm(model)
    if getattr(model, "fpdt", None) is not None:
        raise FPDTHFError("apply_fpdt was already applied to this model")
    group = fields.get("group", options.group if options is not None else None)
    mesh = fields.get("mesh", options.mesh if options is not None else None)
    if group == "trainer":
        fields["group"] = group = TrainerGroup()
    elif isinstance(group, str):
        raise FPDTHFError(f"group={group!r}: pass a torch.distributed process group, None, or 'trainer'")
    trainer = isinstance(group, TrainerGroup)
    if trainer and (mesh is not None or not chunked_qkv):
        raise FPDTHFError("group='trainer' runs Ulysses over the Trainer's group with fpdt's chunked q/k/v "
                          "projections: the model keeps 'sdpa' as its attention name, which DeepSpeed replaces "
                          "with its own Ulysses all-to-all, and Transformers' attention forward would reach it "
                          "when a checkpointed layer is recomputed in backward; pass no mesh and keep "
                          "chunked_qkv=True")
    try:
        options = FPDTOptions.build(options, **fields)
    except OptionsError as e:
        raise FPDTHFError(str(e)) from None
    layers = _decoder_layers(model)
    cfg = model.config
    num_chunks = options.num_chunks
    mlp_chunks = default_mlp_chunks(cfg.hidden_size, cfg.intermediate_size, num_chunks) \
        if options.mlp_chunks is None else options.mlp_chunks
    loss_chunks = default_loss_chunks(cfg.vocab_size, cfg.hidden_size, num_chunks) \
        if options.loss_chunks is None else options.loss_chunks
    if options.checkpoint_device_layers:
        raise FPDTHFError(f"checkpoint_device_layers={options.checkpoint_device_layers}: fpdt.hf keeps every "
                          f"checkpointed layer input in one tier; use checkpointing='on' (device) or 'offload' "
                          f"(host), or fpdt.model, which tiers them")
    try:
        options.check_layers(len(layers))
    except OptionsError as e:
        raise FPDTHFError(str(e)) from None
    _check_config(model, layers, mlp_chunks, loss_chunks)
    if chunked_qkv:
        for layer in layers:
            check_chunked_qkv(layer.self_attn)
    norms = _lean_norms(model, layers) if lean_norms else []
    # The steps, in this order: attention (the registered name and, with chunked_qkv, each attention
    # module's forward), lean norms, chunked MLP, layer checkpointing, the model's forward with the
    # chunked loss (and the global-position RoPE). Every module change goes through `patches`, so
    # that remove_fpdt can undo it.
    patches = Patches()
    original_attention = model.config._attn_implementation
    name = _apply_attention(model, layers, options, trainer, chunked_qkv, patches)
    _apply_lean_norms(norms, num_chunks, patches)
    _apply_chunked_mlp(layers, mlp_chunks, patches)
    _apply_checkpointing(layers, options, patches)
    settings = HFSettings(attn_implementation=name, options=options, mlp_chunks=mlp_chunks,
                          loss_chunks=loss_chunks, chunked_qkv=bool(chunked_qkv), lean_norms=bool(lean_norms))
    _apply_forward(model, settings, patches)
    patches.set(model, "_fpdt_undo", (patches, original_attention))
    _register_zero3_params(model, layers, bool(mlp_chunks), bool(loss_chunks), bool(chunked_qkv), patches)
    return outer


def prepare_inputs(model: nn.Module, input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   doc_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """This rank's ``input_ids``, ``position_ids`` and ``shift_labels`` ``[B, S / P]``.

    ``input_ids`` ``[B, S]`` is the global window (the same on every SP rank); ``labels``
    (default ``input_ids``) are unshifted, as in Transformers, and are shifted on the
    *global* sequence before sharding; ``position_ids`` default to ``arange(S)``. The
    layout is the one ``model`` was set up with by :func:`apply_fpdt`. ``attention_mask``
    ``[B, S]`` (the window's) may be right padding whose labels are -100, which the model
    computes exactly without a mask (:mod:`fpdt.hf.padding`); it is checked here and not
    returned. Anything else is refused.

    Packed documents (:mod:`fpdt.layout.documents`, as ``DataCollatorWithFlattening`` makes them):
    ``position_ids`` that restart at 0 at each document, or ``doc_ids`` ``[B, S]`` / ``cu_seqlens``
    ``[n + 1]`` naming them (positions then default to restarting at each). No token attends to
    another document's, and each document's last token gets the target -100. With ``doc_ids`` or
    ``cu_seqlens`` the result also holds ``doc_ids`` ``[B, S]`` of the whole window, for the model.
    """
    settings: HFSettings | None = getattr(model, "fpdt", None)
    if settings is None:
        raise FPDTHFError("call fpdt.hf.apply_fpdt(model, ...) before fpdt.hf.prepare_inputs")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise FPDTHFError(f"attention_mask {tuple(attention_mask.shape)} is not the window's mask "
                              f"{tuple(input_ids.shape)}: pass the whole window's, the same on every rank")
        check_right_padding(attention_mask, _shift_labels(labels if labels is not None else input_ids))
    rank, sp = settings.rank_size()
    try:
        inputs = _prepare_inputs(input_ids, sp_size=sp, rank=rank, num_chunks=settings.options.num_chunks, labels=labels,
                                 position_ids=position_ids, mesh=settings.options.mesh, doc_ids=doc_ids, cu_seqlens=cu_seqlens)
    except DocumentError as e:
        raise FPDTHFError(str(e)) from e
    out = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"], "shift_labels": inputs["labels"]}
    if "doc_ids" in inputs:
        out["doc_ids"] = inputs["doc_ids"]
    return out

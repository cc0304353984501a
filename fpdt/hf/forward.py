"""The forwards :func:`fpdt.hf.apply_fpdt` binds to the causal LM and its rotary embedding.

:func:`causal_lm_forward` takes this rank's sequence-parallel inputs (or, under the Trainer,
DeepSpeed's contiguous slices), finds the window's packed documents, runs the decoder and the
loss: chunked (:func:`fpdt.model.loss.sequence_parallel_lm_loss`) or from full logits, the same
reduction. :func:`global_rope_forward` lets position-dependent RoPE see the whole window.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fpdt.hf.attention import FPDTHFError, plain_linears
from fpdt.hf.collator import check_window_length
from fpdt.hf.documents import pop_explicit_documents, window_doc_ids
from fpdt.hf.groups import resolve_group
from fpdt.hf.padding import whole_window_mask
from fpdt.hf.settings import HFSettings, layer_checkpoints_of
from fpdt.hf.trainer import contiguous_to_fpdt_layout
from fpdt.layout.documents import DocumentError, sequence_parallel_doc_ids
from fpdt.model.inputs import require_position_ids, shift_labels as _shift_labels
from fpdt.model.moe import ChunkedMoE, RouterStatistics, balancing_loss
from fpdt.model.streaming import StreamedModel, streamed_loss
from fpdt.ops.projections import ProjectionError
from fpdt.model.loss import (IGNORE_INDEX, floored_loss_chunks, sequence_parallel_lm_loss, sum_gradient_over_group,
                             sum_over_group, valid_token_scale)

RECOMPUTED_ROPE_TYPES = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the largest position of the forward (Transformers'
``dynamic_rope_update``): under SP each rank must see the window's (:func:`global_rope_forward`)."""

BOTH_CHECKPOINTS = ("apply_fpdt(checkpointing={mode!r}) checkpoints the decoder layers itself: call "
                    "model.activation_checkpointing_disable() (gradient_checkpointing_disable(), its older "
                    "name), or apply_fpdt with checkpointing='off' to keep Transformers' checkpointing")


def global_rope_forward(settings: HFSettings):
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


def causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, shift_labels=None,
                      num_items_in_batch=None, **kwargs):
    """The causal LM's forward after :func:`fpdt.hf.apply_fpdt` (bound to the model)."""
    settings: HFSettings = self.fpdt
    original = type(self).forward               # Transformers' forward, called with this (maybe copied) model
    rank, sp = settings.rank_size()
    trainer = settings.under_trainer
    ref = input_ids if input_ids is not None else inputs_embeds
    labels = _checked_labels(self, settings, sp, ref, labels, shift_labels, use_cache, past_key_values)
    if labels is not None:
        shift_labels = _shift_labels(labels)      # one rank holds the whole sequence in order
    input_ids, position_ids, shift_labels, attention_mask = _fpdt_inputs(
        self, settings, rank, sp, ref, input_ids, position_ids, shift_labels, attention_mask, kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if settings.options.stream_layers:
        with _as_hf_error():
            out = _streamed(self, settings, sp, input_ids, position_ids, shift_labels, attention_mask, inputs_embeds,
                            num_items_in_batch, kwargs)
    else:
        with _attention_implementation(self.config, settings.attn_implementation) if trainer \
                else contextlib.nullcontext(), _as_hf_error():
            out = _decoder_and_loss(self, original, settings, sp, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, inputs_embeds=inputs_embeds, shift_labels=shift_labels,
                                    logits_to_keep=logits_to_keep, num_items_in_batch=num_items_in_batch,
                                    kwargs=kwargs)
    if trainer and out.loss is not None:
        out.loss = sum_gradient_over_group(out.loss, group=settings.sp_group, sp=sp)
    return out if return_dict else out.to_tuple()


def _checked_labels(model, settings: HFSettings, sp: int, ref, labels, shift_labels, use_cache, past_key_values):
    """Refuse what the forward cannot run (each naming the fix); return the unshifted ``labels``
    to shift on this rank (None when there are none, or when they are the Trainer's shift_labels)."""
    if settings.under_trainer:
        if labels is not None and labels is shift_labels:   # the Trainer's SP loss passes shift_labels as labels
            labels = None
            if sp == 1 and dist.is_initialized() and dist.get_world_size() > 1:
                raise FPDTHFError("these inputs are DeepSpeed's sequence-parallel slices (the Trainer's SP loss), "
                                  "but no DeepSpeed sequence-parallel group exists: train through the Trainer "
                                  "with parallelism_config=fpdt.hf.trainer_parallelism_config(sp_size)")
        if sp > 1 and not model.training:
            raise FPDTHFError(f"evaluation under the Trainer's sequence parallelism (sp={sp}): the Trainer gives "
                              f"every rank whole windows of its own, which fpdt cannot split; evaluate with "
                              f"TrainingArguments(eval_strategy='no') or a model without apply_fpdt")
    mode = settings.options.checkpointing
    if mode != "off" and model.training and getattr(model.model, "gradient_checkpointing", False):
        raise FPDTHFError(BOTH_CHECKPOINTS.format(mode=mode))
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
        if sp > 1 and settings.under_trainer:
            raise FPDTHFError(f"labels= without shift_labels= under the Trainer's sequence parallelism (sp={sp}): "
                              f"DeepSpeed's data adapter gives shift_labels; whole windows with labels (the "
                              f"Trainer's evaluation) cannot be split by fpdt: use TrainingArguments("
                              f"eval_strategy='no') or a model without apply_fpdt")
        if sp > 1:
            raise FPDTHFError(f"labels= would be shifted inside this rank's slice of the sequence (sp={sp}); "
                              f"pass the global-shifted shift_labels= from fpdt.hf.prepare_inputs")
    return labels


def _fpdt_inputs(model, settings: HFSettings, rank: int, sp: int, ref, input_ids, position_ids, shift_labels,
                 attention_mask, kwargs: dict):
    """``(input_ids, position_ids, shift_labels, attention_mask)`` as the decoder takes them, with
    the packed documents' ``doc_ids`` ``[B, S]`` (global) put into ``kwargs`` for every attention
    call (recompute included)."""
    trainer = settings.under_trainer
    explicit_docs, cu_seqlens = pop_explicit_documents(kwargs)     # packed documents: fpdt.hf.documents
    doc_ids = None
    if sp == 1:
        refusal = None
        try:
            if ref is not None:
                doc_ids = window_doc_ids(ref.shape[:2], ref.device, position_ids=position_ids, doc_ids=explicit_docs,
                                         cu_seqlens=cu_seqlens)
                check_window_length(ref.shape[1], 1, settings.options.num_chunks)
        except FPDTHFError as e:
            refusal = e
        attention_mask = whole_window_mask(attention_mask, ref, shift_labels, trainer and model.training, refusal)
    try:
        require_position_ids(position_ids, sp, "fpdt.hf.prepare_inputs")
    except ValueError as e:
        raise FPDTHFError(str(e)) from None
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
        doc_ids = _sequence_parallel_doc_ids(settings, sp, ref, position_ids, explicit_docs, cu_seqlens)
    if doc_ids is not None:
        kwargs["doc_ids"] = doc_ids              # [B, S] global: to every attention call (recompute included)
    return input_ids, position_ids, shift_labels, attention_mask


def _sequence_parallel_doc_ids(settings: HFSettings, sp: int, ref, position_ids, explicit_docs, cu_seqlens):
    """The window's ``doc_ids`` ``[B, S]`` from this rank's slice under fpdt's own sequence parallelism."""
    if cu_seqlens is not None:
        raise FPDTHFError(f"cu_seq_lens_q/k with sequence parallelism (sp={sp}): pass the window's cu_seqlens "
                          f"to fpdt.hf.prepare_inputs, whose doc_ids the model then takes")
    B, S_local = ref.shape[:2]
    try:
        return window_doc_ids((B, S_local * sp), ref.device, doc_ids=explicit_docs) \
            if explicit_docs is not None else \
            sequence_parallel_doc_ids(position_ids, settings.options.num_chunks,
                                      group=resolve_group(settings.options.group),
                                      mesh=settings.options.mesh)        # one all-gather of the positions
    except DocumentError as e:
        raise FPDTHFError(str(e)) from e


@contextlib.contextmanager
def _as_hf_error():
    """A projection fpdt's modules refuse (:mod:`fpdt.ops.projections`) as ``fpdt.hf``'s error."""
    try:
        yield
    except ProjectionError as e:
        raise FPDTHFError(str(e)) from None


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


def _loss_chunks(settings: HFSettings, tokens: int) -> int:
    """``settings.loss_chunks``; the default count floored for ``tokens`` (:func:`fpdt.model.loss.floored_loss_chunks`)."""
    if settings.options.loss_chunks is not None:
        return settings.loss_chunks
    return floored_loss_chunks(settings.loss_chunks, tokens)


def _decoder_and_loss(self, original, settings: HFSettings, sp: int, *, input_ids, attention_mask, position_ids,
                      inputs_embeds, shift_labels, logits_to_keep, num_items_in_batch, kwargs):
    """The decoder and the loss (chunked, or from full logits) of :func:`causal_lm_forward`."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if shift_labels is None or settings.loss_chunks == 0:
        stats = _router_statistics(self, settings)
        if stats is not None and shift_labels is not None and kwargs.get("output_router_logits",
                                                                         getattr(self.config, "output_router_logits", False)):
            raise FPDTHFError("the balancing loss of a mixture-of-experts model is added to the chunked loss only: "
                              "keep loss_chunks >= 1 (or output_router_logits=False)")
        kwargs.pop("output_router_logits", None)
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
        aux_wanted = kwargs.pop("output_router_logits", None)
        stats = _router_statistics(self, settings)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=False, return_dict=True, **kwargs)
        h, aux = outputs.last_hidden_state, None
        if stats is not None and (getattr(self.config, "output_router_logits", False) if aux_wanted is None
                                  else aux_wanted):
            h, aux = balancing_loss(h, stats)        # its backward runs before the layers'
        loss = sequence_parallel_lm_loss(h, self.lm_head.weight, shift_labels,
                                         group=settings.sp_group, sp=sp,
                                         num_chunks=_loss_chunks(settings, h.shape[0] * h.shape[1]),
                                         wgrad=settings.options.lm_head_wgrad, num_valid_tokens=num_items_in_batch)
        if aux is not None:
            loss = loss + self.config.router_aux_loss_coef * aux
        out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions)
    return out


def _router_statistics(model, settings: HFSettings) -> RouterStatistics | None:
    """A fresh :class:`RouterStatistics` set as every MoE MLP's ``call_stats`` (kept until the next
    call: a checkpoint's recompute reads it in backward), or None for a model without experts."""
    moes = [m for m in model.modules() if isinstance(m, ChunkedMoE)]
    if not moes:
        return None
    if model.training and getattr(model.model, "gradient_checkpointing", False) and torch.is_grad_enabled():
        raise FPDTHFError("Transformers' gradient checkpointing would record the experts' statistics twice: use "
                          "apply_fpdt(..., checkpointing='on' or 'offload') and gradient_checkpointing_disable()")
    stats = RouterStatistics(moes[0].num_experts, moes[0].top_k, group=settings.sp_group)
    for m in moes:
        m.call_stats = stats
    model.router_stats = stats
    return stats


def _streamed(self, settings: HFSettings, sp: int, input_ids, position_ids, shift_labels, attention_mask,
              inputs_embeds, num_items_in_batch, kwargs):
    """The loss with ``stream_layers`` (:func:`fpdt.model.streaming.streamed_loss`, the run
    :class:`fpdt.model.FPDTForCausalLM` makes): no logits, RoPE from the model's rotary embedding a
    chunk of positions at a time."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if shift_labels is None or input_ids is None or inputs_embeds is not None or attention_mask is not None:
        raise FPDTHFError("stream_layers computes the loss from input_ids and labels (or shift_labels) only, with no "
                          "attention_mask, inputs_embeds or logits: pass them so, or apply_fpdt with "
                          "stream_layers=False")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    rotary, dtype = self.model.rotary_emb, self.model.embed_tokens.weight.dtype

    def rope(positions: torch.Tensor, want: torch.dtype):
        cos, sin = rotary(torch.empty(0, dtype=dtype, device=positions.device), positions)
        return cos.to(want), sin.to(want)

    aux_wanted = kwargs.pop("output_router_logits", None)
    stats = _router_statistics(self, settings)
    with_aux = stats is not None and (getattr(self.config, "output_router_logits", False) if aux_wanted is None
                                      else aux_wanted)
    spec = StreamedModel(settings.options, settings.loss_chunks, rope, layer_checkpoints_of(self.model.layers),
                         stats, self.config.router_aux_loss_coef if with_aux else None)
    loss = streamed_loss(self, spec, input_ids, shift_labels, position_ids, kwargs.get("doc_ids"),
                         num_items_in_batch, sp, settings.sp_group)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def _full_logits_loss(logits, shift_labels, settings: HFSettings, sp: int, num_items_in_batch):
    """What :func:`sequence_parallel_lm_loss` gives, from materialised logits (``loss_chunks=0``)."""
    group = settings.sp_group
    scale = valid_token_scale(shift_labels, group=group, sp=sp, num_valid_tokens=num_items_in_batch)
    local = F.cross_entropy(logits.float().flatten(0, -2), shift_labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum") * scale.to(logits.device)
    return sum_over_group(local, group=group, sp=sp)


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
  chunked functions (:mod:`fpdt.ops.projections`, :mod:`fpdt.ops.lora`); the frozen base weights
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

* **o_proj** (``offload=True`` without a layer checkpoint: ``checkpointing="off"`` and not
  Transformers' own on that layer; ``chunked_qkv``): the output projection keeps no copy of its
  input, the full-length attention output; its backward reads it back a chunk at a time from the
  attention's host stash (:mod:`fpdt.attention.output_projection`, as
  :class:`fpdt.model.FPDTForCausalLM` under ``checkpointing="off"``).

What stays Transformers': embeddings, RoPE's tables (``(cos, sin)`` of every local token,
``2 D / hidden`` of a hidden-state tensor, which :class:`fpdt.model.FPDTForCausalLM` does not
hold) and the output projection under a layer checkpoint or without offload (and the q/k/v
projections with ``chunked_qkv=False``).

Gradient convention, as :class:`fpdt.model.FPDTForCausalLM`: the loss value is the same on
every SP rank; parameter gradients **summed** over the SP group are those of the global
mean. DeepSpeed averages over all ranks, so back-propagate ``loss * sp``. Not so with
``group="trainer"`` (:mod:`fpdt.hf.trainer`): there the backward already sums the Trainer's
per-rank loss weights over the group.

How: the steps of :mod:`fpdt.model.apply` (the ones :class:`fpdt.model.FPDTForCausalLM` runs), in
their order, through :class:`fpdt.hf.apply_steps.TransformersAdapter`, which binds the forwards
(:mod:`fpdt.hf.forward` for the model's) through :class:`fpdt.hf.patches.Patches`; then the ZeRO-3
registration. :func:`remove_fpdt` undoes every one.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from fpdt.hf.apply_steps import TransformersAdapter
from fpdt.hf.attention import FPDTHFError, check_chunked_qkv
from fpdt.hf.forward import RECOMPUTED_ROPE_TYPES
from fpdt.hf.groups import TrainerGroup
from fpdt.hf.padding import check_right_padding
from fpdt.hf.patches import Patches
from fpdt.hf.settings import HFSettings
from fpdt.layout.documents import DocumentError
from fpdt.model.apply import apply_all, loss_chunks_for, mlp_chunks_for
from fpdt.model.config import uses_sliding_window
from fpdt.model.external_params import directly_read
from fpdt.model.inputs import prepare_inputs as _prepare_inputs
from fpdt.model.inputs import shift_labels as _shift_labels
from fpdt.options import FPDTOptions, OptionsError

__all__ = ["HFSettings", "apply_fpdt", "prepare_inputs", "remove_fpdt"]

SWIGLU_ACTIVATIONS = ("silu", "swish")


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


def _check_streaming(model: nn.Module, chunked_qkv: bool) -> None:
    """Refuse, naming the fix, what ``stream_layers`` cannot run on this model."""
    if not chunked_qkv:
        raise FPDTHFError("stream_layers runs fpdt's own attention a chunk at a time: keep chunked_qkv=True")
    rope_types = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    if set(rope_types.values() if isinstance(rope_types, dict) else [rope_types]) & set(RECOMPUTED_ROPE_TYPES):
        raise FPDTHFError(f"stream_layers computes RoPE a chunk at a time, and {rope_types!r} RoPE picks its "
                          f"frequencies from the largest position of the whole forward: use stream_layers=False")


def _register_zero3_params(model: nn.Module, loss_chunked: bool, streamed: bool, layers: list[nn.Module],
                           patches: Patches) -> None:
    """ZeRO-3's external parameters (:mod:`fpdt.model.external_params`, as ``fpdt-train``), and with
    ``streamed`` the decoder layers as ZeRO-3 leaf modules (a streamed layer runs its submodules inside
    its own Functions: ZeRO-3 gathers the whole layer around it); recorded in ``patches``."""
    try:
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
        from deepspeed.utils import set_z3_leaf_modules
    except ImportError:        # no DeepSpeed, no ZeRO-3
        return
    if streamed:
        for layer in layers:
            patches.remember(layer, "_z3_leaf")
        set_z3_leaf_modules(model, [type(layers[0])])
    for owner, p in directly_read(model, lm_head=loss_chunked, streamed=streamed):
        if "_external_params" not in patches.changed(owner):   # what DeepSpeed's registry adds to the module
            for name in ("_external_params", "ds_external_parameters", "all_parameters"):
                patches.remember(owner, name)
        register_external_parameter(owner, p)


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
            (:mod:`fpdt.ops.projections`; dropout masks are fpdt's); other adapters (DoRA, ...)
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
            only with fpdt's checkpoint (``checkpointing`` ``"on"`` or ``"offload"``; refused
            with ``"off"``, which has no recompute to skip).
        save_attention_layers: with ``"save"`` (refused with ``"recompute"``), only the first
            this many decoder layers save (None: every layer).
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
    mlp_chunks, loss_chunks = mlp_chunks_for(options, model.config), loss_chunks_for(options, model.config)
    if options.stream_layers:
        _check_streaming(model, chunked_qkv)
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
    # The steps of fpdt.model.apply, in their order (attention, lean norms, chunked MLP, layer
    # checkpointing, the chunked loss with the model's forward), as fpdt.model runs them; every module
    # change goes through `patches` (fpdt.hf.apply_steps), so that remove_fpdt can undo it.
    patches = Patches()
    original_attention = model.config._attn_implementation
    adapter = TransformersAdapter(model, layers, patches, trainer=trainer, chunked_qkv=chunked_qkv,
                                  lean_norms=lean_norms)     # refuses unknown norm classes, before any change
    apply_all(adapter, options)
    patches.set(model, "_fpdt_undo", (patches, original_attention))
    _register_zero3_params(model, bool(loss_chunks), options.stream_layers, layers, patches)
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

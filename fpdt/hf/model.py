"""Put FPDT into an existing Transformers causal LM, in place: :func:`apply_fpdt` and :func:`remove_fpdt`.

The model's decoder layers get ``fpdt.model``'s own modules holding its parameters under their
names (attention, MLP, RMSNorms), its layers run under fpdt's layer checkpoint or streamed, and its
forward computes the sequence-parallel chunked loss; the class, ``state_dict`` and
``save_pretrained`` stay Transformers'. What each option does and what is refused: ``docs/hf.md``.

Gradient convention, as :class:`fpdt.model.FPDTForCausalLM`: the loss is the same on every SP
rank, and parameter gradients **summed** over the SP group are those of the global mean (under
DeepSpeed, back-propagate ``loss * sp``; not with ``group="trainer"``, :mod:`fpdt.hf.trainer`).
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
from fpdt.model.apply import apply_all, has_attention, loss_chunks_for, mlp_chunks_for
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
    if any(hasattr(layer.mlp, "experts") for layer in layers) and not mlp_chunks:
        raise FPDTHFError(f"{type(model).__name__} has mixture-of-experts MLPs, which run chunked only (fpdt's "
                          f"forward computes their balancing loss): keep mlp_chunks at its default or >= 1")
    if getattr(cfg, "attention_dropout", 0.0):
        raise FPDTHFError(f"attention_dropout={cfg.attention_dropout}: fpdt attention has no dropout; set it to 0")
    if uses_sliding_window(cfg.to_dict()) or any(getattr(getattr(layer, "self_attn", None), "sliding_window", None)
                                                 for layer in layers):
        raise FPDTHFError(f"sliding-window attention (window {getattr(cfg, 'sliding_window', None)}) is not "
                          f"supported by fpdt attention, which is full causal: load the model with "
                          f"sliding_window=None (and use_sliding_window=False)")
    if loss_chunks and getattr(model.lm_head, "bias", None) is not None:
        raise FPDTHFError("an LM head with a bias is not supported by the chunked loss; use loss_chunks=0")
    if mlp_chunks:
        act = getattr(cfg, "hidden_act", None)
        if act not in SWIGLU_ACTIVATIONS or not all(
                all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) for layer in layers
                if not hasattr(layer.mlp, "experts")):
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


def _check_gated_deltanet(layers: list[nn.Module], options: FPDTOptions) -> None:
    """Refuse, naming the fix, what a model with Gated DeltaNet layers (Qwen3.5) cannot run."""
    if all(has_attention(layer) for layer in layers):
        return
    if options.mesh is not None and options.mesh.cp > 1:
        raise FPDTHFError(f"a context-parallel ring (cp={options.mesh.cp}) is not implemented for Gated DeltaNet "
                          f"layers: use Ulysses only (cp=1)")


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

    ``model``: a ``*ForCausalLM`` using Transformers' ``AttentionInterface`` (Llama, Qwen2,
    Mistral, Qwen3, ...), or a PEFT model around one; call this after ``peft.get_peft_model`` and
    before ``deepspeed.initialize``. ``options`` / ``**fields``: :class:`fpdt.options.FPDTOptions`
    or its fields (both: the fields change the object); ``group="trainer"`` for Hugging Face's
    Trainer (:mod:`fpdt.hf.trainer`). ``chunked_qkv``: put :class:`fpdt.hf.attention.TransformersAttention`
    in place of each attention module (False keeps Transformers' projections and calls FPDT
    attention on their output, for other attention classes). ``lean_norms``: put fpdt's RMSNorm in
    place of the Llama / Mistral / Qwen2 / Qwen3 RMSNorms.

    Then call ``model(**prepare_inputs(model, window))``: ``.loss`` is the global token-mean
    cross-entropy, ``.logits`` None (logits without labels, or with ``loss_chunks=0``). Everything
    it cannot honour is refused with :class:`FPDTHFError` naming the fix (``docs/hf.md``).
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
    _check_gated_deltanet(layers, options)
    if chunked_qkv:
        for layer in layers:
            if has_attention(layer):
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

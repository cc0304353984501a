"""Llama-family causal LM on FPDT layers.

* :func:`from_pretrained` / :func:`from_config` build a :class:`FPDTForCausalLM` from a
  Hugging Face checkpoint or config (Llama 2/3/3.1/3.2, Qwen2/2.5, Mistral; Qwen3.5's Gated DeltaNet
  hybrids, ``docs/models.md``);
  :func:`save_pretrained` writes one ``transformers`` loads.
* :func:`add_lora` attaches LoRA adapters (:class:`LoraSpec`) and freezes the rest;
  :func:`save_adapter` / :func:`load_adapter` use PEFT's adapter format.
* :func:`prepare_inputs` turns a global token window into one rank's inputs.
* :class:`FPDTOptions` lists the memory / parallelism options.
"""

from fpdt.model.config import ModelConfig, UnsupportedConfigError
from fpdt.model.inputs import prepare_inputs, shift_labels
from fpdt.model.llama import FPDTForCausalLM
from fpdt.options import FPDTOptions
from fpdt.model.lora import LoraSpec, adapter_state_dict, add_lora, load_adapter, save_adapter
from fpdt.model.loss import chunked_lm_loss, default_loss_chunks
from fpdt.model.mlp import ChunkedSwiGLU
from fpdt.model.build import construct, from_config, from_pretrained
from fpdt.model.weights import load_hf_state_dict, save_pretrained

__all__ = [
    "ChunkedSwiGLU", "FPDTForCausalLM", "FPDTOptions", "LoraSpec", "ModelConfig", "UnsupportedConfigError",
    "adapter_state_dict", "add_lora", "chunked_lm_loss", "construct", "default_loss_chunks", "from_config", "from_pretrained",
    "load_adapter", "load_hf_state_dict", "prepare_inputs", "save_adapter", "save_pretrained", "shift_labels",
]

"""FPDT inside an existing Transformers model: sequence-parallel, chunked, offloaded.

For users who keep their ``transformers`` model class (and its checkpoints, PEFT adapters,
training loop) rather than rebuild it as :class:`fpdt.model.FPDTForCausalLM`:

* :func:`apply_fpdt` -- FPDT attention (Ulysses or 2D mesh, chunked, host offload), the
  chunked SwiGLU MLP and the chunked sequence-parallel loss, applied to a ``*ForCausalLM``
  in place (:mod:`fpdt.hf.model`);
* :func:`prepare_inputs` -- one rank's ``input_ids``, ``position_ids`` and ``shift_labels``;
* :func:`trainer_parallelism_config` -- with ``apply_fpdt(model, group="trainer")``, training
  under Hugging Face's ``Trainer`` and its sequence parallelism (:mod:`fpdt.hf.trainer`);
* :class:`FlatteningCollator` -- Transformers' ``DataCollatorWithFlattening`` (packed documents),
  its batches padded by one padding document to a length fpdt's layout cuts (:mod:`fpdt.hf.collator`).

PEFT LoRA models go through :func:`apply_fpdt` as they are (after ``get_peft_model``): their
LoRA layers run inside the chunked functions (:mod:`fpdt.ops.projections`).
"""

from fpdt.hf.attention import FPDTHFError
from fpdt.hf.collator import FlatteningCollator
from fpdt.hf.model import HFSettings, apply_fpdt, prepare_inputs, remove_fpdt
from fpdt.hf.trainer import trainer_parallelism_config

__all__ = ["FPDTHFError", "FlatteningCollator", "HFSettings", "apply_fpdt", "prepare_inputs", "remove_fpdt",
           "trainer_parallelism_config"]

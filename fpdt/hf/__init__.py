"""FPDT inside an existing Transformers model (and its checkpoints, PEFT adapters, training loop):
:func:`apply_fpdt` (attention, MLP and loss chunked, sequence-parallel, offloaded; in place),
:func:`prepare_inputs` (one rank's inputs), :func:`trainer_parallelism_config` (under Hugging
Face's ``Trainer``) and :class:`FlatteningCollator` (packed documents). Usage: ``docs/hf.md``.
"""

from fpdt.hf.attention import FPDTHFError
from fpdt.hf.collator import FlatteningCollator
from fpdt.hf.model import HFSettings, apply_fpdt, prepare_inputs, remove_fpdt
from fpdt.hf.trainer import trainer_parallelism_config

__all__ = ["FPDTHFError", "FlatteningCollator", "HFSettings", "apply_fpdt", "prepare_inputs", "remove_fpdt",
           "trainer_parallelism_config"]

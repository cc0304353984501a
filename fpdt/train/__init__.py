"""The FPDT trainer: ``fpdt-train`` on DeepSpeed ZeRO, and ``fpdt-export``.

Modules (the planner reads :mod:`~fpdt.train.config`, :mod:`~fpdt.train.metrics` and
:mod:`~fpdt.train.preflight`; only ``fpdt.train``, ``fpdt.hf`` and ``fpdt.cli`` import DeepSpeed):

* :mod:`~fpdt.train.config`     -- the trainer's FPDT options, the DeepSpeed JSON, up-front validation
* :mod:`~fpdt.train.zero_load`  -- a checkpoint streamed into a ZeRO-3 model one tensor at a time
* :mod:`~fpdt.train.preflight`  -- checks of files and checkpoints before anything starts
* :mod:`~fpdt.train.errors`     -- one error line per failure, exit codes, --debug
* :mod:`~fpdt.train.data`       -- token sources, windows, FPDT-layout sharding
* :mod:`~fpdt.train.parallel`   -- process group, SP / DP groups, device
* :mod:`~fpdt.train.zero`       -- DeepSpeed engine and ZeRO-3 external parameters
* :mod:`~fpdt.train.loop`       -- the optimizer-step loop and its loss scaling
* :mod:`~fpdt.train.metrics`    -- FLOPs, MFU, TGS
* :mod:`~fpdt.train.progress`   -- tqdm bar and JSON-lines log
* :mod:`~fpdt.train.lora`       -- LoRA fine-tuning: flags, checks, adapters, what checkpoints record
* :mod:`~fpdt.train.saving`     -- save / resume
* :mod:`~fpdt.train.export`     -- training checkpoint -> Hugging Face checkpoint (PEFT adapter for LoRA)
* ``fpdt-train`` itself is :mod:`fpdt.cli.train` (above the planner it uses; ``python -m fpdt.cli`` runs it)
"""

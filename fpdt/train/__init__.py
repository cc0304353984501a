"""The FPDT trainer: ``fpdt-train`` on DeepSpeed ZeRO, and ``fpdt-export``.

Reading order: :mod:`~fpdt.train.config` (options, DeepSpeed JSON, validation),
:mod:`~fpdt.train.preflight` and :mod:`~fpdt.train.errors` (checks and one-line failures),
:mod:`~fpdt.train.data` (windows, sharding), :mod:`~fpdt.train.parallel` (groups, device),
:mod:`~fpdt.train.zero_load` and :mod:`~fpdt.train.zero` (ZeRO-3 loading and engine),
:mod:`~fpdt.train.loop` (steps, loss scaling), :mod:`~fpdt.train.metrics` and
:mod:`~fpdt.train.progress` (MFU, bar, JSON log), :mod:`~fpdt.train.lora`,
:mod:`~fpdt.train.saving` and :mod:`~fpdt.train.export`. The command line itself is
:mod:`fpdt.cli.train`.
"""

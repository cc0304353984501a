"""The FPDT trainer: ``fpdt-train`` on DeepSpeed ZeRO (command line in :mod:`fpdt.cli.train`),
and ``fpdt-export``. Reading order: CONTRIBUTING.md.
"""

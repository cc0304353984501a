"""The FPDT trainer: ``fpdt-train`` on DeepSpeed ZeRO (command line in :mod:`fpdt.cli.train`),
and ``fpdt-export``. Reading order: CONTRIBUTING.md.

Public here: :func:`load_tokens`, ``--data`` read as ``fpdt-train`` reads it (for your own loops).
"""

from fpdt.train.data import DataError, load_tokens

__all__ = ["DataError", "load_tokens"]

"""Measurement helpers used by tests, profiling scripts and the trainer (device-memory accountant)."""

from fpdt.profiling.memory import MemoryAccountant, PhaseMemory, chunk_unit, sequence_unit

__all__ = ["MemoryAccountant", "PhaseMemory", "chunk_unit", "sequence_unit"]

"""Measurement helpers used by tests, profiling scripts and the trainer (device-memory accountant)."""

from fpdt.profiling.memory import (MemoryAccountant, MemoryPeaks, PhaseMemory, RegionMemory, SimulatedOutOfMemoryError,
                                  chunk_unit, sequence_unit)

__all__ = ["MemoryAccountant", "MemoryPeaks", "PhaseMemory", "RegionMemory", "SimulatedOutOfMemoryError", "chunk_unit",
           "sequence_unit"]

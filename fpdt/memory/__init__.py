"""Device-memory accounting used by the trainer, the tests and the profiling scripts
(:mod:`fpdt.memory.accountant`)."""

from fpdt.memory.accountant import (MemoryAccountant, MemoryPeaks, PhaseMemory, RegionMemory,
                                    SimulatedOutOfMemoryError, chunk_unit, sequence_unit)

__all__ = ["MemoryAccountant", "MemoryPeaks", "PhaseMemory", "RegionMemory", "SimulatedOutOfMemoryError", "chunk_unit",
           "sequence_unit"]

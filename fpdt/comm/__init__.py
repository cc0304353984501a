"""Communication for sequence parallelism: Ulysses all-to-all and head bookkeeping.

Every function that communicates takes its process group as an argument.
"""

from fpdt.comm import release  # noqa: F401 (the module: fpdt.comm.release)
from fpdt.comm.heads import kv_replication_factor, replicate_kv, sum_kv_replicas
from fpdt.comm.mesh import PLACEMENTS, SequenceMesh, sp_group_of, sp_rank_size
from fpdt.comm.ring import P2PStats, RingComm, RingSchedule
from fpdt.comm.ulysses import (HeadsToSeq, PendingAllToAll, SeqToHeads, group_rank, group_size, heads_to_seq,
                               heads_to_seq_packed, seq_to_heads, seq_to_heads_packed, start_seq_to_heads_packed)

__all__ = [
    "PLACEMENTS", "P2PStats", "RingComm", "RingSchedule", "SequenceMesh",
    "HeadsToSeq", "PendingAllToAll", "SeqToHeads", "group_rank", "group_size", "heads_to_seq", "heads_to_seq_packed",
    "kv_replication_factor", "replicate_kv", "seq_to_heads", "seq_to_heads_packed", "start_seq_to_heads_packed",
    "sp_group_of", "sp_rank_size", "sum_kv_replicas",
]

"""Saved attention outputs for the layer checkpoint's recompute (Selective Checkpoint++,
arXiv 2406.18485, §5.2; LightSeq, arXiv 2310.03294, §3.3).

A :class:`SavedAttention` keeps one checkpointed layer's ``o_i`` ``[B, C, H/P, D]`` (input dtype)
and ``lse_i`` ``[B, H/P, C]`` (fp32) per chunk, in the pipeline's head layout, under keys
``("attn out", i)`` / ``("attn lse", i)``: recorded in the first (no-grad) forward, replayed in the
recompute, which then runs no attention-kernel forward. Host bytes per saving layer and rank:
:func:`fpdt.attention.offload_volume.saved_attention_bytes`. One attention call per layer.
Mechanics: ``docs/attention.md``, "Saved attention outputs"."""

from __future__ import annotations

import torch

from fpdt.comm import heads_to_seq, replicate_kv, start_seq_to_heads_packed
from fpdt.offload import HostStash, Runtime

OUT, LSE = "attn out", "attn lse"

class SavedAttention:
    """One checkpointed layer's attention outputs and lse between its two forwards.

    Args:
        device: the compute device; on_host: pinned host memory (else device references).
        label: names the layer in errors, e.g. ``"layer 2"``.
        runtime: the attention's device runtime, so that host buffers can be handed over.
        stash: keep them there instead (the NVMe tier's ``NVMeStash``; ``on_host`` unused); its
            :meth:`begin_backward` also reads back the chunks of :attr:`ahead`, set by the caller."""

    def __init__(self, device: torch.device | str, on_host: bool, label: str | None = None,
                 runtime: Runtime | str | None = None, stash: HostStash | None = None):
        self.stash = stash if stash is not None else HostStash(device, enabled=on_host, label=label, runtime=runtime)
        self.ahead: SavedAttention | None = None
        self.label = label
        self.signature: tuple | None = None     # set by the recording call, checked by the replay
        self.replayed = False

    @property
    def recorded(self) -> bool:
        return self.signature is not None

    def begin_backward(self) -> None:
        """The layer's backward starts (before its recompute): fetch chunk 0 ahead (from disk:
        read this layer's chunks and the next layer's back)."""
        for saved in (self, self.ahead):
            if saved is not None and hasattr(saved.stash, "read_all"):
                saved.stash.read_all()
        self.ahead = None
        if self.recorded and (OUT, 0) in self.stash:
            self.stash.prefetch((OUT, 0))   # overlaps the recompute's norm and chunk 0's projections

    def end_backward(self) -> None:
        """The layer's backward is over: drop whatever was not handed over."""
        self.stash.clear()

    def claim(self, for_backward: bool, signature: tuple) -> tuple[str, SavedAttention] | None:
        """``("record", self)`` (first forward), ``("replay", self)`` (recompute) or None (run as usual).
        ``signature`` identifies the call's shapes and chunking; a mismatched replay or a second
        recording call is refused."""
        if not for_backward:
            if self.recorded:
                raise RuntimeError(f"attention_checkpoint='save' keeps one attention call per checkpointed layer, "
                                   f"and {self.label or 'a layer'} made a second: use attention_checkpoint='recompute'")
            self.signature = signature
            return "record", self
        if self.recorded and not self.replayed:
            if signature != self.signature:
                raise RuntimeError(f"the recompute of {self.label or 'a layer'} calls its attention with {signature}, "
                                   f"its first forward with {self.signature}: the saved outputs do not apply")
            self.replayed = True
            return "replay", self
        return None

    def keep(self, i: int, o_h: torch.Tensor, lse: torch.Tensor) -> None:
        """Record chunk ``i``'s final output (head layout, not modified afterwards) and lse."""
        self.stash.put((OUT, i), o_h)
        self.stash.put((LSE, i), lse)

    def take(self, i: int, num_chunks: int, dest: HostStash) -> torch.Tensor:
        """Chunk ``i``'s output on the device; its output and lse move into ``dest`` as
        ``("o", i)``, ``("lse", i)`` (host buffers handed over when both stashes offload)."""
        o = self.stash.get((OUT, i))
        if i + 1 < num_chunks:
            self.stash.prefetch((OUT, i + 1))
        self.stash.hand_over((OUT, i), dest, ("o", i))
        self.stash.hand_over((LSE, i), dest, ("lse", i))
        return o


def replay_forward(spec, produce, emit, stash: HostStash, saved: SavedAttention) -> None:
    """The recompute's forward of :func:`fpdt.attention.mesh_pipeline.run_forward` without the
    attention: leaves in ``stash`` what that forward leaves for backward (``k``, ``v``, ``q`` chunks,
    or ``q`` and packed ``kv`` for a mesh spec, plus ``o``, ``lse`` from ``saved``) and emits each
    saved output chunk in sequence layout, with the same collectives in the same order."""
    mesh = hasattr(spec, "hp_group")                       # a mesh_pipeline.MeshSpec (which imports this)
    group = spec.hp_group if mesh else spec.group
    u = spec.num_chunks

    def start(i):
        q, k, v = produce(i)
        return start_seq_to_heads_packed((q, replicate_kv(k, spec.kv_factor), replicate_kv(v, spec.kv_factor)), group)

    overlap = mesh or spec.overlap_all_to_all      # as each pipeline's forward does
    pending = None
    for i in range(u):
        if pending is None:
            pending = start(i)
        q_h, k_h, v_h = pending.wait()
        pending = start(i + 1) if i + 1 < u and overlap else None
        if mesh:
            stash.put(("q", i), q_h)
            stash.put(("kv", i), torch.stack((k_h, v_h)))
        else:
            stash.put(("k", i), k_h)
            stash.put(("v", i), v_h)
            stash.put(("q", i), q_h)
        del q_h, k_h, v_h
        o = saved.take(i, u, stash)
        emit(i, heads_to_seq(o, group))
        del o

"""The decoder-layer checkpoint of a whole model, written once for ``fpdt.model`` and ``fpdt.hf``.

:class:`LayerCheckpoints` holds what one model's layer checkpoints share (:mod:`fpdt.model.checkpointing`
does one layer): the host stash of the offloaded layer inputs, keys unique per forward call,
which layers keep their input on the device (the last ``checkpoint_device_layers``), and
which layers keep their attention output for the recompute (the attention layers among the first
``save_attention_layers`` under ``attention_checkpoint="save"``), and which offloaded layers keep
both on disk instead (the first ``nvme_layers`` under ``nvme_path``, ``docs/nvme.md``). Both
models' decoder loops run each layer through :meth:`checkpointed_layer`.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from fpdt.attention.offload_volume import saved_attention_bytes
from fpdt.attention.saved_attention import SavedAttention
from fpdt.offload import HostStash
from fpdt.offload.nvme import ALIGN, NVMeTier, aligned
from fpdt.offload.nvme_stash import NVMeStash
from fpdt.options import FPDTOptions


class LayerCheckpoints:
    """One model's layer-checkpoint state for ``options`` and ``num_layers`` decoder layers;
    ``attention[i]`` False: layer ``i`` mixes tokens by a Gated DeltaNet. ``previous``: the model's
    checkpoints before a ``configure``, whose NVMe tier (with its open store) carries over when ``options`` name none."""

    def __init__(self, options: FPDTOptions, num_layers: int, attention: list[bool] | None = None,
                 previous: "LayerCheckpoints | None" = None):
        self.mode = options.checkpointing
        self.attention = [True] * num_layers if attention is None else list(attention)  # False: Gated DeltaNet
        self.runtime = options.runtime
        self.nvme_path = options.nvme_path
        self.tier = options.nvme_tier or (previous.tier if previous is not None else None) or NVMeTier()
        self.num_layers = num_layers
        self.on_host = num_layers - options.checkpoint_device_layers   # layers [on_host, n) keep x on the device
        self.saving = saving_layers(options, num_layers)
        self.on_nvme = nvme_layer_count(options, num_layers)            # layers [0, on_nvme) go to disk
        self._recent: list = []      # weak references to the last three layers' NVMe SavedAttention
        self._stash: HostStash | None = None
        self._ids = itertools.count()
        self._forward = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def start(self) -> None:
        """A new forward call: fresh stash keys (an earlier call's entries may still be held)."""
        self._forward = next(self._ids)
        self._recent = []

    def arguments(self, i: int, device: torch.device) -> dict:
        """The keyword arguments of layer ``i``'s checkpoint in the current forward call."""
        stash = self._stash_for(device) if self.mode == "offload" else None
        fid = self._forward
        saved = None
        if i < self.saving and self.attention[i] and torch.is_grad_enabled():   # no backward, no recompute to serve
            on_disk = stash is not None and i < self.on_nvme
            saved = SavedAttention(device, on_host=stash is not None and i < self.on_host, label=f"layer {i}",
                                   runtime=self.runtime, stash=self._saved_stash(device, i) if on_disk else None)
        if stash is not None and self.on_nvme and torch.is_grad_enabled():
            self._chain(saved)
        return dict(stash=stash, key=("layer input", i, fid),
                    prev_key=("layer input", i - 1, fid) if i > 0 else None,
                    on_device=i >= self.on_host, saved=saved)

    def checkpointed_layer(self, i: int, h: torch.Tensor, branches, params: list) -> torch.Tensor:
        """Decoder layer ``i`` of the current forward call under its checkpoint (layer 0 starts the
        call): ``h + attn(h)``, then ``+ mlp``, by
        :func:`fpdt.model.checkpointing.checkpointed_residual` with ``branches(saved)``, the layer's two
        residual branches given its saved attention outputs (None: not saving)."""
        from fpdt.model.checkpointing import checkpointed_residual

        if i == 0:
            self.start()
        args = self.arguments(i, h.device)
        return checkpointed_residual(branches(args["saved"]), h, params, **args)

    def _saved_stash(self, device: torch.device, i: int) -> NVMeStash:
        """Layer ``i``'s saved attention outputs on disk: each chunk's write starts two puts later."""
        return NVMeStash(device, self.nvme_store(), runtime=self.runtime, label=f"layer {i}")

    def _chain(self, saved: SavedAttention | None) -> None:
        """Called for every layer ``i``: saved outputs on disk go there as they come (two chunks
        staged, two writes in flight); here the last chunks of layer ``i - 2`` (whose copies have
        long landed) start their writes and layer ``i - 3`` waits for its own, so that host memory
        holds a few chunks of the last three layers, whatever the depth. Backward reads the
        previous layer's outputs ahead (:attr:`SavedAttention.ahead`)."""
        live = [ref() if ref is not None else None for ref in self._recent]
        if saved is not None and live and live[-1] is not None:
            saved.ahead = live[-1]
        for back, finish in ((2, False), (3, True)):
            earlier = live[-back] if len(live) >= back else None
            if earlier is not None and isinstance(earlier.stash, NVMeStash):
                earlier.stash.flush() if finish else earlier.stash.start_flush()
        self._recent = self._recent[-2:] + [weakref.ref(saved) if saved is not None else None]

    def nvme_store(self):
        """This rank's store of the NVMe tier (opened on first use)."""
        return self.tier.store(self.nvme_path, global_rank())

    @property
    def stash(self) -> HostStash | None:
        """The host stash of the offloaded layer inputs (None until an offloading forward made it)."""
        return self._stash

    def _stash_for(self, device: torch.device) -> HostStash:
        if self._stash is None or self._stash.device != torch.device(device):
            if self.nvme_path is not None:      # the NVMe tier: the inputs go on to files (docs/nvme.md)
                self._stash = NVMeStash(device, self.nvme_store(), runtime=self.runtime,
                                        read_ahead=_previous_layer_input,
                                        to_disk=lambda key, n=self.on_nvme: key[1] < n)
            else:
                self._stash = HostStash(device, enabled=True, runtime=self.runtime)
        return self._stash

    def __deepcopy__(self, memo) -> "LayerCheckpoints":
        copy = LayerCheckpoints.__new__(LayerCheckpoints)   # a copied model gets a stash of its own
        copy.__dict__.update(self.__dict__, _stash=None, _ids=itertools.count(), _recent=[])
        return copy


def _previous_layer_input(key):
    """The stash key backward fetches after ``key`` (``("layer input", i, fid)``): layer ``i - 1``'s."""
    kind, i, fid = key
    return (kind, i - 1, fid) if i > 0 else None


def global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def saving_layers(options: FPDTOptions, num_layers: int) -> int:
    """How many decoder layers (the first ones) keep their attention output for the recompute:
    0 with ``attention_checkpoint="recompute"`` or without layer checkpointing."""
    if options.attention_checkpoint != "save" or options.checkpointing == "off":
        return 0
    return num_layers if options.save_attention_layers is None else min(options.save_attention_layers, num_layers)


def nvme_layer_count(options: FPDTOptions, num_layers: int) -> int:
    """How many decoder layers (the first ones) keep their checkpoints on disk: ``nvme_layers``
    (None: every offloaded layer) of the layers whose input is offloaded; 0 without ``nvme_path``."""
    if options.nvme_path is None or options.checkpointing != "offload":
        return 0
    offloaded = num_layers - options.checkpoint_device_layers
    return offloaded if options.nvme_layers is None else min(options.nvme_layers, offloaded)


def nvme_layers_on_disk(options: FPDTOptions, num_layers: int) -> int:
    """:func:`nvme_layer_count`, less the last layer when streamed (read first, it stays on the host)."""
    n = nvme_layer_count(options, num_layers)
    return min(n, num_layers - 1) if options.stream_layers else n


@dataclass(frozen=True)
class NVMeBytes:
    """What the NVMe tier writes per rank in one micro-batch and holds until its backward."""

    layers: int
    per_layer: int
    saving: int
    per_saved: int

    @property
    def total(self) -> int:
        return self.layers * self.per_layer + self.saving * self.per_saved

    def words(self) -> str:
        saved = f" + {self.saving} saved attention outputs x {self.per_saved:,} bytes" if self.saving else ""
        return f"{self.layers} layers x {self.per_layer:,} bytes{saved}"


def nvme_bytes(options: FPDTOptions, num_layers: int, tokens: int, hidden: int, num_heads: int, head_dim: int,
               dtype: torch.dtype) -> NVMeBytes:
    """The one count of the NVMe tier's bytes (the planner, the free-space preflight, the start-up
    line): ``tokens`` = micro-batch x ``S / P`` per rank; the :func:`nvme_layers_on_disk` layers'
    inputs (one file, streamed one per chunk) and of those the saving layers' outputs and lse (two
    files per chunk), every file padded to the store's alignment (an upper bound)."""
    n = nvme_layers_on_disk(options, num_layers)
    files = options.num_chunks if options.stream_layers else 1
    per_layer = files * aligned(tokens * hidden * dtype.itemsize // files)
    saving = min(n, saving_layers(options, num_layers))
    per_saved = saved_attention_bytes(batch=1, seq_local=tokens, num_heads=num_heads, head_dim=head_dim,
                                      dtype=dtype) + 2 * options.num_chunks * ALIGN
    return NVMeBytes(n, per_layer, saving, per_saved if saving else 0)

"""``fpdt.plan.plan``: will it fit, how fast, which settings, and the longest length.

Choices the caller leaves open (:class:`Choice`: coordinates left ``None``, model options
not fixed) are searched: global chunk sizes 8K..256K
(powers of two dividing ``S``) and ``fpdt-train``'s default chunk for each mesh, every ``hp x cp = sp`` with
``hp`` dividing the query heads, both placements when ``cp > 1``, both LM-head weight
gradient modes (:mod:`fpdt.model.loss`), and for checkpointed setups whether (and how many)
layers save their attention output instead of recomputing it (:func:`_with_saved_attention`).
Among the candidates that fit, the fastest wins (less device memory breaks ties). ``recommended`` searches the
checkpoint mode as well; the headline figures keep the caller's mode (the trainer's
default, ``offload``, unless told otherwise).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from fpdt.attention.kernels import expands_gqa_on_gpu
from fpdt.model.config import ModelConfig
from fpdt.options import (CHECKPOINT_MODES, LM_HEAD_WGRAD_MODES, FPDTOptions, LayoutOptions, attention_checkpoint_given,
                          device_defaults)
from fpdt.plan.documents import effective_length
from fpdt.plan.hardware import Cluster
from fpdt.plan.memory_model import (FRAGMENTATION, estimate_memory, mlp_chunks, moe_chunks, nvme_layers_on_disk,
                                    saved_attention_bytes)
from fpdt.plan.models import load_model_config, model_spec
from fpdt.plan.models import train_flops_per_token as kind_train_flops
from fpdt.comm import PLACEMENTS
from fpdt.plan.setup import (GPU_OPTIONS, RunSettings, Setup,
                             chunk_count_problems, doc_len_problems, option_problems, split_options)
from fpdt.plan.time_model import estimate_time, nvme_io
from fpdt.layout import chunk_split, hidden_bytes
from fpdt.train.config import PRECISIONS, default_chunk_size
from fpdt.train.metrics import ModelShape, layer_matmul_flops, step_rates, train_flops_per_token


CHUNK_CANDIDATES = tuple(2 ** k for k in range(13, 19))    # 8K .. 256K global tokens
MAX_SEARCH_LEN = 2 ** 31
DEFAULT_GRANULE = 2 ** 16


@dataclass(frozen=True)
class Choice(LayoutOptions, RunSettings):
    """What the caller fixed and what the planner chooses. Build one with :meth:`fix`, which
    takes the layout (:class:`~fpdt.options.LayoutOptions`), the cluster settings and
    :class:`~fpdt.options.FPDTOptions` fields alike:
    ``Choice().fix(chunk_size=65536, lm_head_wgrad="accumulate")``.

    Layout fields left None are chosen (``sp``: every GPU). Of the model options, those not in :attr:`fixed`
    are ``fpdt-train``'s on a GPU (:data:`fpdt.plan.setup.GPU_OPTIONS`), except those the
    planner chooses: attention ``offload`` (``fpdt-train``'s default, on when the sequence
    has more than one chunk: :func:`fpdt.options.device_defaults`), ``lm_head_wgrad``
    (the faster mode that fits), ``checkpoint_device_layers`` (0, or where the host memory
    is what does not fit, the fewest that bring the host peak within it while the GPU still
    fits: :func:`_with_device_layers`) and the saved attention (``attention_checkpoint`` /
    ``save_attention_layers``: ``"save"`` for as many layers as fit, as ``fpdt-train``'s
    default does; a fixed ``"save"`` without a layer count chooses the count, fixed
    ``"recompute"`` saves none). ``checkpointing`` is ``"offload"`` unless fixed; the
    ``recommended`` answer searches it too. ``backend`` (the kernel; None: automatic) sets
    the KV heads the memory model counts (:func:`fpdt.attention.kernels.expands_gqa_on_gpu`)
    and the attention rate."""

    fixed: Mapping[str, Any] = field(default_factory=dict)
    """The :class:`~fpdt.options.FPDTOptions` fields the caller fixed, by name (never
    ``num_chunks``, ``group`` or ``mesh``: :data:`fpdt.plan.setup.DERIVED_OPTIONS`)."""

    def fix(self, **changes: Any) -> Choice:
        """A copy with ``changes`` to the coordinates and the fixed options (by their
        :class:`FPDTOptions` names). An option given as None is left to the planner again (as
        ``fpdt-train`` reads a flag not given); an unknown name is a ``TypeError``."""
        own, opts = split_options(changes, _OWN_FIELDS, "Choice")
        fixed = {**self.fixed, **opts}
        return replace(self, fixed={k: v for k, v in fixed.items() if v is not None}, **own)

    @property
    def options(self) -> FPDTOptions:
        """:data:`fpdt.plan.setup.GPU_OPTIONS` with the fixed options: the base of every setup
        the planner tries (the fields it chooses replaced there)."""
        fixed = dict(self.fixed)
        fixed["attention_checkpoint"] = attention_checkpoint_given(fixed.get("attention_checkpoint"),
                                                                   fixed.get("save_attention_layers"))
        return replace(GPU_OPTIONS, **fixed)

    def chooses(self, name: str) -> bool:
        """Whether the option ``name`` is left to the planner (not fixed)."""
        return name not in self.fixed

    @property
    def fixed_save_layers(self) -> int | None:
        """The saving-layer count the caller fixed: theirs, 0 for ``"recompute"``, else None."""
        if self.fixed.get("attention_checkpoint") == "recompute":
            return 0
        return self.fixed.get("save_attention_layers")


_OWN_FIELDS = {f.name for f in fields(Choice)} - {"fixed"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: ModelConfig, seq_len: int, choice: Choice, world: int,
               checkpoints: tuple[str, ...] | None = None) -> list[Setup]:
    """Every setup consistent with ``choice`` that can run at all at ``seq_len``.

    Without a fixed ``sp`` the sequence spans every GPU; only when no mesh of that size
    can run does it fall back to the largest smaller SP group (the rest data-parallel).
    """
    if choice.sp:
        return _candidates(cfg, seq_len, choice, world, choice.sp, checkpoints)
    for sp in sorted(_divisors(world), reverse=True):
        found = _candidates(cfg, seq_len, choice, world, sp, checkpoints)
        if found:
            return found
    return []


def _candidates(cfg, seq_len, choice, world, sp, checkpoints):
    meshes = _meshes(choice, sp)
    out = []
    base = choice.options
    expands = expands_gqa_on_gpu(base.backend, PRECISIONS[choice.dtype], cfg.head_dim)
    # a frozen LM head (LoRA) forms no weight gradient: both modes are one run (apply_fpdt's default)
    wgrads = ((base.lm_head_wgrad,) if not choice.chooses("lm_head_wgrad")
              else ("recompute",) if choice.lora_rank else LM_HEAD_WGRAD_MODES)
    saving = choice.fixed_save_layers
    combos = [(mesh, chunk) for mesh in meshes for chunk in _chunk_candidates(seq_len, choice, *mesh)]
    # streamed layers: tried beside the unstreamed setups unless fixed (_best prefers unstreamed when both fit)
    streams = (base.stream_layers,) if not choice.chooses("stream_layers") else (False, True)
    for ((hp, cp), chunk), ckpt, wgrad, stream in itertools.product(combos, checkpoints or (base.checkpointing,),
                                                                     wgrads, streams):
        if stream and (ckpt != "offload" or choice.fixed.get("offload") is False
                       or base.checkpoint_device_layers):
            continue
        offload, _ = device_defaults("cuda", seq_len // chunk, choice.fixed.get("offload"), stream_layers=stream)
        saves = bool(saving) and ckpt != "off"        # a layer count saves nothing without checkpointing
        tier = ckpt == "offload"           # the NVMe tier holds offloaded checkpoints only
        options = replace(base, checkpointing=ckpt, offload=offload, lm_head_wgrad=wgrad, stream_layers=stream,
                          nvme_path=base.nvme_path if tier else None, nvme_layers=base.nvme_layers if tier else None,
                          checkpoint_device_layers=base.checkpoint_device_layers if ckpt == "offload" else 0,
                          attention_checkpoint="save" if saves else "recompute",
                          save_attention_layers=saving if saves else None)
        placements = [choice.placement] if choice.placement else (list(PLACEMENTS) if cp > 1 else ["head_first"])
        for placement in placements:
            s = Setup(seq_len=seq_len, chunk_size=chunk, hp=hp, cp=cp, placement=placement,
                      inner_ring=choice.inner_ring, options=options, kernel_expands_gqa=expands,
                      **choice.run_settings())
            if not s.problems(cfg, world):
                out.append(s)
    return out


def _meshes(choice: Choice, sp: int) -> list[tuple[int, int]]:
    """The ``(hp, cp)`` meshes of ``sp`` ranks to try: the caller's degrees read by :meth:`LayoutOptions.degrees`
    (as ``fpdt-train`` reads them), or every ``hp`` dividing ``sp``; kept when ``hp * cp`` is ``sp``."""
    given = [LayoutOptions(sp=sp, hp=choice.hp, cp=choice.cp)] if choice.hp or choice.cp else \
        [LayoutOptions(sp=sp, hp=hp) for hp in _divisors(sp)]
    return [mesh.degrees() for mesh in given if not mesh.layout_problems()]


def _chunk_candidates(seq_len: int, choice: Choice, hp: int, cp: int) -> list[int]:
    """The caller's chunk, else the powers of two in :data:`CHUNK_CANDIDATES` dividing ``S``
    plus ``fpdt-train``'s own default for this mesh (:func:`fpdt.train.config.default_chunk_size`,
    which also serves meshes that no power of two splits, e.g. 6 ranks)."""
    if choice.chunk_size:
        return [choice.chunk_size]
    chunks = [c for c in CHUNK_CANDIDATES if c <= seq_len and seq_len % c == 0]
    default = default_chunk_size(seq_len, chunk_split(hp * cp, zigzag=cp > 1))
    return sorted(set(chunks) | {default})


def evaluate(cfg: ModelConfig, s: Setup, cluster: Cluster) -> dict:
    """Memory, time and MFU of one setup (the planner's output fields, without the search)."""
    mem = estimate_memory(cfg, s, cluster.world, cluster.gpus_per_node)
    times = estimate_time(cfg, s, cluster)
    dp = cluster.world // s.sp
    tokens = s.seq_len * s.batch * dp
    shape = ModelShape.from_config(cfg)
    attended = effective_length(s.seq_len, s.doc_len)     # MFU counts the attention work the mask needs
    rates = step_rates(shape, attended, tokens, times["total"], cluster.world,
                       cluster.gpu.bf16_flops, recompute=s.options.checkpointing != "off")
    spec = model_spec(cfg)
    if not spec.plain:   # attention in the full-attention layers only, k of E experts (fpdt.plan.models)
        denom = rates.tokens_per_s / (cluster.world * cluster.gpu.bf16_flops)
        rates = dataclasses.replace(rates, mfu=kind_train_flops(cfg, spec, attended, True) * denom,
                                    mfu_full=kind_train_flops(cfg, spec, attended, False) * denom)
    if s.lora_rank:   # the FLOPs a LoRA step needs: no weight gradients of the frozen linears and head
        rates = dataclasses.replace(rates, mfu=rates.mfu * _lora_flops_fraction(shape, attended, True),
                                    mfu_full=rates.mfu_full * _lora_flops_fraction(shape, attended, False))
    fits_device = mem.device_peak_bytes <= cluster.gpu.mem_bytes
    fits_host = mem.host_peak_bytes <= cluster.host_mem_bytes
    fits_nvme = cluster.nvme is None or mem.nvme_bytes <= cluster.nvme.capacity_bytes
    limited = [name for name, ok in (("device", fits_device), ("host", fits_host), ("nvme", fits_nvme)) if not ok]
    out = {
        "fits": not limited,
        "limited_by": limited[0] if limited else None,
        "seq_len": s.seq_len,
        "device_peak_bytes": mem.device_peak_bytes,
        "activation_peak_bytes": mem.activation_peak_bytes,
        "host_peak_bytes": mem.host_peak_bytes,
        "device_capacity_bytes": cluster.gpu.mem_bytes,
        "host_capacity_bytes": cluster.host_mem_bytes,
        "breakdown": mem.breakdown,
        "working_sets": mem.working_sets,
        "step_time_s": times["total"],
        "step_time_split_s": {k: v for k, v in times.items() if k != "total"},
        "tokens_per_s": rates.tokens_per_s,
        "tgs": rates.tgs,
        "mfu": rates.mfu,
        "mfu_full": rates.mfu_full,
        "setup": s.as_dict(),
        # the count the model runs (setup's mlp_chunks: None = its default); a MoE model's experts' chunks
        "mlp_chunks": moe_chunks(cfg, spec, s) if spec.moe_layers else mlp_chunks(cfg, s),
    }
    if mem.nvme_bytes:
        recompute = s.options.checkpointing != "off"
        io = nvme_io(cfg, s, cluster, times["gemms"] + times["attention"] + times.get("gdn_core", 0.0),
                     4 if recompute else 3)
        out["nvme"] = {"layers": nvme_layers_on_disk(cfg, s), "bytes_per_node": mem.nvme_bytes,
                       "capacity_bytes": cluster.nvme.capacity_bytes if cluster.nvme else None, **io}
    return out


def _lora_flops_fraction(m: ModelShape, seq_len: int, causal: bool) -> float:
    """A LoRA step's FLOPs over full training's (the trainer's ``3 x forward`` formula): the
    linears' and the head's weight-gradient GEMMs are not run (the adapters' are negligible)."""
    full = train_flops_per_token(m, seq_len, causal)
    return (full - m.num_layers * layer_matmul_flops(m) - 2 * m.hidden_size * m.vocab_size) / full


def _with_device_layers(cfg: ModelConfig, s: Setup, r: dict, cluster: Cluster) -> tuple[Setup, dict] | None:
    """Setup ``s`` (``r`` its evaluation) with the fewest more of its last layers' inputs
    kept on the device that bring its host peak within the host memory, and its evaluation;
    None when ``s`` is not an offloaded-checkpoint setup over on the host only, or no such
    count fits the GPU too.
    Each layer kept moves one layer input per rank from host to device (``checkpoints_host``
    over the offloaded layers)."""
    kept = s.options.checkpoint_device_layers
    offloaded = cfg.num_layers - kept
    if r["fits"] or r["limited_by"] != "host" or s.options.checkpointing != "offload" or offloaded == 0:
        return None
    per_layer = r["breakdown"]["checkpoints_host"] / offloaded          # bytes per node
    k = kept + math.ceil((r["host_peak_bytes"] - r["host_capacity_bytes"]) / per_layer)
    while k <= cfg.num_layers:      # (one more if rounding left the host a few bytes over)
        tiered = s.updated(checkpoint_device_layers=k)
        out = evaluate(cfg, tiered, cluster)
        if out["limited_by"] != "host":
            return (tiered, out) if out["fits"] else None   # more on the GPU cannot make it fit there
        k += 1
    return None


def _with_nvme_layers(cfg: ModelConfig, s: Setup, r: dict, cluster: Cluster) -> tuple[Setup, dict] | None:
    """Setup ``s`` (``r`` its evaluation, over on the host only) with the fewest of its first
    layers' checkpoints on the NVMe tier that bring its host peak within the host memory, and its
    evaluation; None without the tier, when ``nvme_layers`` is fixed, or when no count fits (the
    drive full, or the device over). Each layer on disk frees its input and saved output but
    for the staging buffers (:func:`fpdt.plan.memory_model.nvme_tier_bytes`)."""
    o = s.options
    if r["fits"] or r["limited_by"] != "host" or o.nvme_path is None or o.nvme_layers != 0:
        return None
    offloaded = cfg.num_layers - o.checkpoint_device_layers
    lo, hi = 1, offloaded            # the smallest count whose host fits (the host peak falls with it)
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        tiered = s.updated(nvme_layers=mid)
        out = evaluate(cfg, tiered, cluster)
        if out["limited_by"] == "host":
            lo = mid + 1
        else:
            best, hi = (tiered, out), mid - 1
    return best if best is not None and best[1]["fits"] else None


def _fewest_nvme_layers(cfg: ModelConfig, s: Setup, r: dict, cluster: Cluster) -> tuple[Setup, dict]:
    """Fitting setup ``s`` (``r`` its evaluation), whose ``nvme_layers`` :func:`_with_nvme_layers`
    chose before :func:`_with_saved_attention` re-tiered it, with the fewest first layers on disk
    that still fit, and its evaluation: keeping more layer inputs on the device for the saved
    outputs frees host memory, so fewer layers may need the disk."""
    best, lo, hi = (s, r), 0, s.options.nvme_layers - 1
    while lo <= hi:                  # the host peak falls as nvme_layers grows
        mid = (lo + hi) // 2
        tiered = s.updated(nvme_layers=mid)
        out = evaluate(cfg, tiered, cluster)
        if out["fits"]:
            best, hi = (tiered, out), mid - 1
        else:
            lo = mid + 1
    return best


def most_saving_layers(cfg: ModelConfig, s: Setup, host_room: float, device_room: float | None,
                       ranks_per_node: int) -> int:
    """The most layers (the first ones) that can save their attention output in the memory a
    recompute setup ``s`` leaves: ``host_room`` bytes per node of ``ranks_per_node`` ranks and
    ``device_room`` per GPU (None: not limited). The first ``l - k`` layers' outputs go to the
    host under ``"offload"``, the rest (and all under ``"on"``) to the device, where the
    allocator's slack (:data:`FRAGMENTATION`) is counted on them. 0 without checkpointing. In a
    hybrid model the count is of layers, of which the full-attention ones save."""
    l, o = cfg.num_layers, s.options
    if o.checkpointing == "off":
        return 0
    per = saved_attention_bytes(cfg, s)
    attention = [i for i, kind in enumerate(model_spec(cfg).mixers) if kind == "attention"]   # GDN layers save nothing
    first_on_device = l - o.checkpoint_device_layers if o.checkpointing == "offload" else 0
    host = [i for i in attention if i < first_on_device]
    n_host = max(0, int(host_room // (ranks_per_node * per)))
    if n_host < len(host):
        return host[n_host]            # the layers before it: n_host attention layers, on the host
    device = [i for i in attention if i >= first_on_device]
    n_dev = len(device) if device_room is None else int(max(0.0, device_room) // (FRAGMENTATION * per))
    return device[n_dev] if n_dev < len(device) else l


def _with_saved_attention(cfg: ModelConfig, s: Setup, r: dict, cluster: Cluster,
                          tier: bool) -> tuple[Setup, dict] | None:
    """Fitting setup ``s`` (``r`` its evaluation) with the most layers saving their attention
    output that still fit, and its evaluation (None when ``s`` does not fit, does not
    checkpoint, or not one layer fits).

    The saving layers are the first ``K``; a layer's saved output goes where its input
    checkpoint is (:meth:`fpdt.plan.setup.Setup.saving_layers`), so under ``"offload"`` the
    first ``l - k`` cost host memory and the rest device memory. With ``tier`` (the caller
    left ``checkpoint_device_layers`` open) more layer inputs may move to the device, each
    freeing host memory for one more saved output: the smallest ``k`` that gives the largest
    ``K`` wins. ``K`` comes from the memory ``r`` leaves (both grow linearly in ``K``: on the
    host by the ranks' saved bytes, on the device by those times the allocator's slack, an
    upper bound; each kept input costs its full bytes on the device, as at the loss, where all
    ``k`` are live), then is checked by :func:`evaluate`."""
    l, checkpointing = cfg.num_layers, s.options.checkpointing
    if not r["fits"] or checkpointing == "off":
        return None
    nd = hidden_bytes(s.rank_tokens, cfg.hidden_size, s.elem_bytes)
    ranks = min(cluster.gpus_per_node, cluster.world)
    host_room = r["host_capacity_bytes"] - r["host_peak_bytes"]
    dev_room = r["device_capacity_bytes"] - r["device_peak_bytes"]
    k0 = s.options.checkpoint_device_layers
    best = (0, k0)
    for k in range(k0, l + 1) if tier and checkpointing == "offload" else [k0]:
        host_k = host_room + (k - k0) * ranks * nd
        dev_k = dev_room - FRAGMENTATION * nd * (k - k0)
        if dev_k < 0:
            break
        n = most_saving_layers(cfg, s.updated(checkpoint_device_layers=k), host_k, dev_k, ranks)
        if n > best[0]:
            best = (n, k)
    n, k = best
    while n > 0:
        saving = s.updated(attention_checkpoint="save", save_attention_layers=n, checkpoint_device_layers=k)
        out = evaluate(cfg, saving, cluster)
        if out["fits"]:
            return saving, out
        n -= 1
    return None


def _best(cfg: ModelConfig, setups: list[Setup], cluster: Cluster, tier: bool = False,
          save: bool = False) -> dict | None:
    """The fastest fitting setup's evaluation, or the least-memory one when none fits.
    ``tier``: a setup over on the host only may keep some layer inputs on the device
    (:func:`_with_device_layers`). With the NVMe tier offered, one over on the host gets the
    fewest first layers on disk that fit (:func:`_with_nvme_layers`). ``save``: each fitting
    checkpointed setup is also tried with the most layers saving their attention output
    (:func:`_with_saved_attention`), a tiered one then with the fewest layers on disk again
    (:func:`_fewest_nvme_layers`)."""
    evaluated = [(s, evaluate(cfg, s, cluster)) for s in setups]
    if tier:
        evaluated += [t for t in (_with_device_layers(cfg, s, r, cluster) for s, r in evaluated) if t is not None]
    on_disk = [t for t in (_with_nvme_layers(cfg, s, r, cluster) for s, r in evaluated) if t is not None]
    evaluated += on_disk
    if save:
        chose = {id(s) for s, _ in on_disk}
        evaluated += [t if id(s) not in chose else _fewest_nvme_layers(cfg, *t, cluster)
                      for s, t in ((s, _with_saved_attention(cfg, s, r, cluster, tier)) for s, r in evaluated)
                      if t is not None]
    results = [r for _, r in evaluated]
    if not results:
        return None
    fitting = [r for r in results if r["fits"]]
    if fitting:   # fastest; within 1% of it, the least device memory, the plain Ulysses mesh, then
        # fpdt-train's LM-head mode (recompute: measured faster on an H100 than this model says)
        fastest = min(r["step_time_s"] for r in fitting)
        close = [r for r in fitting if r["step_time_s"] <= 1.01 * fastest]
        return min(close, key=lambda r: (r["setup"]["stream_layers"], r["device_peak_bytes"], r["setup"]["cp"],
                                         r["setup"]["lm_head_wgrad"] != "recompute"))
    return min(results, key=lambda r: (r["setup"]["stream_layers"],      # streaming only when it makes a run fit
                                       r["device_peak_bytes"] / r["device_capacity_bytes"]
                                       + r["host_peak_bytes"] / r["host_capacity_bytes"]))


def _recommended(r: dict | None) -> dict | None:
    if r is None or not r["fits"]:
        return None
    s = r["setup"]
    out = {k: s[k] for k in ("chunk_size", "hp", "cp", "placement", "inner_ring", "checkpoint",
                             "checkpoint_device_layers", "offload", "lm_head_wgrad", "lora_rank",
                             "attention_checkpoint", "save_attention_layers", "stream_layers", "nvme_layers")}
    if s.get("doc_len"):    # the plan counts packed documents' work: fpdt-train packs them with this
        out["pack_documents"] = PACK_DOCUMENTS
    return out


NVME_PATH = "NVME_DIR"
"""The ``nvme_path`` a plan's setups carry when the cluster has drives (``--nvme``, ``--nvme-gib``):
``recommended`` then names ``--nvme-path NVME_DIR --nvme-layers K``."""

PACK_DOCUMENTS = "best-fit"
"""The ``--pack-documents`` mode ``recommended`` names with ``--doc-len``: whole documents filling
each window (99.8-100% in docs/train.md's figures), as the plan's documents end to end do."""


def plan_at(cfg: ModelConfig, seq_len: int, cluster: Cluster, choice: Choice) -> dict:
    """The planner's answer at one length (the caller's checkpoint mode; best other choices)."""
    tier = choice.chooses("checkpoint_device_layers")
    save = choice.fixed_save_layers is None
    best = _best(cfg, candidates(cfg, seq_len, choice, cluster.world), cluster, tier, save)
    if best is None:
        return {"fits": False, "seq_len": seq_len, "reason": _why_none(cfg, seq_len, choice, cluster.world),
                "recommended": None}
    free_ckpt = candidates(cfg, seq_len, choice, cluster.world, checkpoints=CHECKPOINT_MODES)
    best["recommended"] = _recommended(_best(cfg, free_ckpt, cluster, tier, save))
    return best


def _why_none(cfg: ModelConfig, seq_len: int, choice: Choice, world: int) -> str:
    hp, cp = LayoutOptions(sp=choice.sp or world, hp=choice.hp, cp=choice.cp).degrees()   # as _candidates tries it
    s = Setup(seq_len=seq_len, chunk_size=choice.chunk_size or seq_len, hp=hp, cp=cp,
              options=replace(choice.options, offload=choice.fixed.get("offload") is not False),
              zero_stage=choice.zero_stage, dtype=choice.dtype, lora_rank=choice.lora_rank)
    return "; ".join(s.problems(cfg, world)) or f"no chunk size / mesh divides seq_len={seq_len}"


def _fits(cfg: ModelConfig, seq_len: int, cluster: Cluster, choice: Choice) -> dict | None:
    r = _best(cfg, candidates(cfg, seq_len, choice, cluster.world), cluster, choice.chooses("checkpoint_device_layers"))
    return r if r is not None and r["fits"] else None


def max_seq_len(cfg: ModelConfig, cluster: Cluster, choice: Choice, granule: int | None = None) -> dict:
    """Longest ``S`` (a multiple of ``granule``) that fits: doubling, then bisection.

    ``granule`` defaults to the fixed chunk size, else 64K (so that the answer can use the
    paper's 64K chunks), else 8K when not even 64K fits.
    Returns :func:`plan_at`'s answer at that length plus ``max_seq_len`` (0 when not even
    one granule fits).
    """
    g = granule or choice.chunk_size or DEFAULT_GRANULE
    if not _fits(cfg, g, cluster, choice) and granule is None and choice.chunk_size is None:
        g = CHUNK_CANDIDATES[0]
    if not _fits(cfg, g, cluster, choice):
        out = plan_at(cfg, g, cluster, choice)
        return {**out, "max_seq_len": 0}
    lo = 1
    while lo * 2 * g <= MAX_SEARCH_LEN and _fits(cfg, lo * 2 * g, cluster, choice):
        lo *= 2
    hi = lo * 2                     # lo fits, hi does not (or is past the search bound)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(cfg, mid * g, cluster, choice):
            lo = mid
        else:
            hi = mid
    return {**plan_at(cfg, lo * g, cluster, choice), "max_seq_len": lo * g}


def plan(model, cluster: Cluster, seq_len: int | None = None, choice: Choice | None = None,
         search_max: bool = False) -> dict:
    """The planner's answer as one JSON-able dict.

    Args:
        model: preset name, ``config.json`` path, config dict or :class:`ModelConfig`.
        cluster: GPUs, nodes, host memory, rates.
        seq_len: global sequence length to check (required unless ``search_max``).
        choice: fixed settings; ``None`` fields are chosen.
        search_max: find the longest length that fits instead (``max_seq_len`` field).
    """
    cfg = load_model_config(model)
    choice = choice or Choice()
    if cluster.nvme is not None and choice.chooses("nvme_path"):   # the tier offered: no layer on it unless needed
        choice = choice.fix(nvme_path=NVME_PATH, nvme_layers=choice.fixed.get("nvme_layers", 0))
    options = choice.options
    cluster = cluster.for_kernel(options.backend)    # a named kernel's own calibrated rate
    bad = choice.layout_problems() + chunk_count_problems(options) + option_problems(options, cfg.num_layers)
    bad += doc_len_problems(choice.doc_len)
    if bad:
        raise ValueError("; ".join(bad))
    if search_max:
        out = max_seq_len(cfg, cluster, choice)
    else:
        if not seq_len or seq_len < 1:
            raise ValueError("give --seq-len S (> 0), or --max-seq-len to search the longest that fits")
        out = plan_at(cfg, seq_len, cluster, choice)
    out["cluster"] = {"gpu": cluster.gpu.name, "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.nodes,
                      "host_mem_bytes_per_node": cluster.host_mem_bytes, "rates": asdict(cluster.rates())}
    return out



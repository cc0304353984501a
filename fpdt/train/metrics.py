"""Model FLOPs, MFU and tokens per GPU per second.

FLOPs per token of a Llama-family decoder (GQA, SwiGLU, tied or untied LM head), multiply-add
= 2 FLOPs; attention counted causal (``c = 1/2``, MFU) and full (``c = 1``, ``mfu_full``), over
``S_att = sum n_d^2 / S`` with packed documents. Training = 3 x forward; the checkpoint's
recompute only in HFU; LoRA leaves out the frozen weights' gradient GEMMs and adds the adapters'.
``MFU = 3 * F_fwd(1/2) * tokens_per_second / (n_devices * peak_flops)``, ``TGS = tokens_per_second /
n_devices``, counting each sequence's tokens once per step. Formulas: ``docs/train.md`` (Progress
and MFU).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The sizes the FLOPs formula needs."""

    num_layers: int
    """l."""
    hidden_size: int
    """h."""
    num_heads: int
    """H (query heads)."""
    num_kv_heads: int
    """H_kv."""
    head_dim: int
    """D."""
    intermediate_size: float
    """I (SwiGLU inner width; with experts the FLOP-equivalent width, ``ModelConfig.mlp_flop_width``)."""
    vocab_size: int
    """V."""
    lora_widths: tuple[tuple[str, float], ...] = ()
    """Per LoRA target, ``in + out`` averaged over the layers that have it (0 where absent: Gated
    DeltaNet projections on attention layers, MLP ones on experts); empty: every layer Llama's."""

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        """The shape of a :class:`fpdt.model.ModelConfig` (or anything with its size fields)."""
        widths = ()
        if hasattr(cfg, "layer_type") and (cfg.has_linear_attention or cfg.moe is not None):
            widths = _lora_widths(cfg)
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   getattr(cfg, "mlp_flop_width", cfg.intermediate_size), cfg.vocab_size, widths)


@functools.lru_cache(maxsize=32)     # the planner asks once per setup it evaluates: thousands per plan
def _lora_widths(cfg) -> tuple[tuple[str, float], ...]:
    """:attr:`ModelShape.lora_widths` of a hybrid or MoE :class:`fpdt.model.ModelConfig` (frozen)."""
    from fpdt.model.lora import ALL_TARGETS, LoraSpec, target_of
    from fpdt.train.lora import adapter_shapes

    sums = dict.fromkeys(ALL_TARGETS, 0.0)
    for name, shape in adapter_shapes(cfg, LoraSpec(1, targets=ALL_TARGETS)).items():
        if ".lora_A." in name:
            sums[target_of(name)] += shape[1] / cfg.num_layers       # in
        else:
            sums[target_of(name)] += shape[0] / cfg.num_layers       # out
    return tuple(sums.items())


def layer_matmul_flops(m: ModelShape) -> float:
    """Forward FLOPs of one token in one layer, projections and MLP only (no attention)."""
    h, qd, kvd = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return 2 * h * (qd + 2 * kvd) + 2 * qd * h + 6 * h * m.intermediate_size


def attention_flops(m: ModelShape, seq_len: int, causal: bool) -> float:
    """Forward FLOPs of one token's attention in one layer (q.k^T and p.v)."""
    scale = 0.5 if causal else 1.0
    return scale * 4 * m.num_heads * m.head_dim * seq_len


def forward_flops_per_token(m: ModelShape, seq_len: int, causal: bool = True) -> float:
    """``F_fwd``: forward FLOPs of one token of a ``seq_len`` sequence."""
    layer = layer_matmul_flops(m) + attention_flops(m, seq_len, causal)
    return m.num_layers * layer + 2 * m.hidden_size * m.vocab_size


def adapter_flops(m: ModelShape, lora) -> float:
    """Forward FLOPs of one token through one layer's LoRA adapters: ``2 r (in + out)`` per
    targeted projection (``lora``: a :class:`fpdt.model.LoraSpec`, or None: 0)."""
    if lora is None:
        return 0.0
    h, qd, kvd, inter = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    widths = dict(m.lora_widths) or {"q_proj": h + qd, "k_proj": h + kvd, "v_proj": h + kvd, "o_proj": qd + h,
                                     "gate_proj": h + inter, "up_proj": h + inter, "down_proj": inter + h}
    return 2 * lora.rank * sum(widths[t] for t in lora.targets)


def train_flops_per_token(m: ModelShape, seq_len: int, causal: bool = True, recompute: bool = False,
                          lora=None) -> float:
    """FLOPs of forward + backward per token; ``recompute`` adds one layer forward (HFU);
    ``lora`` (a :class:`fpdt.model.LoraSpec`): a LoRA step's count (module docstring)."""
    flops = 3 * forward_flops_per_token(m, seq_len, causal)
    if lora is not None:
        flops += m.num_layers * (3 * adapter_flops(m, lora) - layer_matmul_flops(m)) - 2 * m.hidden_size * m.vocab_size
    if recompute:
        flops += m.num_layers * (layer_matmul_flops(m) + attention_flops(m, seq_len, causal) + adapter_flops(m, lora))
    return flops


# ----------------------------------------------------------------------------- peak FLOP/s

# Dense peak FLOP/s per device: (bf16/fp16, tf32 for fp32 training). Sparse figures excluded.
_GPU_PEAKS = (
    ("H200", 989.4e12, 494.7e12),
    ("H100", 989.4e12, 494.7e12),  # SXM; PCIe boards are lower: pass --peak-tflops
    ("H800", 989.4e12, 494.7e12),
    ("A100", 312e12, 156e12),
    ("A800", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
)


def gpu_peak_flops(device_name: str, dtype_name: str) -> float | None:
    """Datasheet dense peak for a known GPU name, or ``None``."""
    for key, half, tf32 in _GPU_PEAKS:
        if key in device_name.upper():
            return half if dtype_name in ("bf16", "fp16") else tf32
    return None


def measure_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """Measured square-matmul FLOP/s on the CPU (the MFU denominator there): the best of ``repeats`` runs."""
    gen = torch.Generator().manual_seed(0)      # not the default generator: a resumed run's RNG stays as saved
    a = torch.randn(n, n, dtype=dtype, generator=gen)
    b = torch.randn(n, n, dtype=dtype, generator=gen)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def resolve_peak_flops(device: torch.device, dtype_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    """-> (peak FLOP/s per device or None, where the figure came from)."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype_name)
        return peak, (f"datasheet {name}" if peak else f"unknown GPU {name!r}: pass --peak-tflops")
    return cpu_peak_flops(dtype_name)


PROBE_N = 256
"""Side of the small half-precision product :func:`cpu_peak_flops` times first (33 MFLOP)."""


def cpu_peak_flops(dtype_name: str) -> tuple[float, str]:
    """Measured CPU peak for a run in ``dtype_name``: the matmul rate in that dtype, and for bf16 / fp16
    at least the fp32 rate (CPU kernels without native half support compute in fp32).

    The half-precision rate is first probed on a ``PROBE_N`` product: where even that runs at under
    half the fp32 rate, the full measurement is skipped (on an AVX2-only CPU bf16 ran at 0.9 GFLOP/s
    against fp32's 147, and the 1024-square measurement took 14.5 s of every run's start).
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name, torch.float32)
    if dtype == torch.float32:
        return measure_matmul_flops(dtype), "measured CPU fp32 matmul"
    fp32 = measure_matmul_flops(torch.float32)
    slow = measure_matmul_flops(dtype, n=PROBE_N, repeats=1) < fp32 / 2
    rate = 0.0 if slow else measure_matmul_flops(dtype)
    if fp32 > rate:
        return fp32, f"measured CPU matmul: fp32, faster than {dtype_name} here"
    return rate, f"measured CPU {dtype_name} matmul"


# ----------------------------------------------------------------------------- per step

@dataclass(frozen=True)
class StepRates:
    """Throughput figures of one optimizer step."""

    tokens_per_s: float
    """Tokens trained per second, all ranks together."""
    tgs: float
    """Tokens per device per second."""
    mfu: float | None
    """Model FLOPs utilisation, causal attention halved, recompute not counted."""
    mfu_full: float | None
    """The same with full (unhalved) attention FLOPs."""
    hfu: float | None
    """Hardware FLOPs utilisation: causal, recompute counted when checkpointing is on."""


def step_rates(m: ModelShape, seq_len: int, tokens: int, seconds: float, n_devices: int,
               peak_flops: float | None, recompute: bool, lora=None) -> StepRates:
    """Rates for a step that trained ``tokens`` tokens of ``seq_len``-token sequences in
    ``seconds`` (``seq_len``: the attended length with packed documents, module docstring;
    ``lora``: a :class:`fpdt.model.LoraSpec` for a LoRA step's FLOPs)."""
    tps = tokens / seconds
    if not peak_flops:
        return StepRates(tps, tps / n_devices, None, None, None)
    denom = n_devices * peak_flops
    return StepRates(
        tokens_per_s=tps,
        tgs=tps / n_devices,
        mfu=train_flops_per_token(m, seq_len, causal=True, lora=lora) * tps / denom,
        mfu_full=train_flops_per_token(m, seq_len, causal=False, lora=lora) * tps / denom,
        hfu=train_flops_per_token(m, seq_len, causal=True, recompute=recompute, lora=lora) * tps / denom,
    )

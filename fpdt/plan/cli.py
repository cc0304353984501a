"""``fpdt-plan``: will a model train at a length on given GPUs, with which settings, how fast.

    fpdt-plan --model llama-3-8b --gpu h100-80g --gpus-per-node 8 --host-mem-gib 1024 --seq-len 4194304
    fpdt-plan --model path/to/config.json --gpu a100-80g --gpus-per-node 4 --nodes 2 --max-seq-len --json

Defaults follow ``fpdt-train``'s on a GPU (:func:`fpdt.options.device_defaults`): ZeRO-3,
``--checkpoint offload``, attention ``--offload``,
bf16. Chunk size, ``hp``/``cp``, placement and the LM-head weight-gradient mode are
chosen unless given.
"""

from __future__ import annotations

import argparse
import json
import sys

from fpdt.options import OPTION_FLAGS, add_option_flags, as_flag, flag_values, in_flag_terms
from fpdt.plan.deepspeed_config import apply_deepspeed_config
from fpdt.plan.hardware import GIB, GPU_PRESETS, NVME_PRESETS, Cluster, gpu_from_args, load_calibration, nvme_from_args
from fpdt.plan.models import PRESETS, load_model_config
from fpdt.plan.planner import Choice, plan
from fpdt.plan.setup import DTYPES


PLANNED = tuple(name for name in OPTION_FLAGS if name not in ("seq_len", "nvme_path", "runtime"))
"""The FPDT options ``fpdt-plan`` takes as flags (the NVMe tier's drive is ``--nvme``; no runtime)."""
OWN = ("zero_stage", "offload_optimizer", "offload_param", "dtype", "batch", "lora_rank", "doc_len")
"""Its flags that fix a :class:`~fpdt.plan.planner.Choice` field of the same name beside them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fpdt-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"config.json (or its directory), or a preset: {', '.join(PRESETS)}")
    length = p.add_mutually_exclusive_group(required=True)
    add_option_flags(length, ["seq_len"], "fpdt-plan")
    length.add_argument("--max-seq-len", action="store_true", help="search the longest length that fits")
    p.add_argument("--gpu", help=f"GPU preset: {', '.join(GPU_PRESETS)} (or give the three numbers below)")
    p.add_argument("--gpu-mem-gib", type=float, help="GPU memory (overrides the preset's)")
    p.add_argument("--gpu-tflops", type=float, help="dense bf16 TFLOP/s (overrides the preset's)")
    p.add_argument("--pcie-gbps", type=float, help="host link GB/s, one direction (overrides the preset's)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--host-mem-gib", type=float, default=1024.0, help="host memory per node (default 1024)")
    p.add_argument("--nvme", metavar="PRESET",
                   help=f"the node's local drives for the NVMe tier (docs/nvme.md): {', '.join(NVME_PRESETS)}; with "
                        f"any of --nvme/--nvme-gib/--nvme-gbps the plan moves the first layers' checkpoints there "
                        f"when the host does not hold them (default: no NVMe tier)")
    p.add_argument("--nvme-gib", type=float, help="NVMe capacity per node in GiB (overrides the preset's)")
    p.add_argument("--nvme-gbps", metavar="READ[,WRITE]",
                   help="NVMe sequential GB/s per node, read and write (overrides the preset's; "
                        "profiling/nvme_bandwidth.py measures them)")
    p.add_argument("--calibration", help="rates measured by profiling/op_latency.py or profiling/nvme_bandwidth.py "
                                         "(JSON)")
    p.add_argument("--deepspeed", metavar="JSON",
                   help="the DeepSpeed config the run will use: its ZeRO stage, offload, bucket sizes, precision and "
                        "\"fpdt\" section (chunk size, mesh, offload, checkpoint) are planned; flags given here win")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="default 3")
    p.add_argument("--offload-optimizer", action="store_true", default=None,
                   help="optimizer state (and grads) on the host")
    p.add_argument("--offload-param", action="store_true", default=None, help="ZeRO-3 parameters on the host")
    add_option_flags(p, PLANNED, "fpdt-plan")
    p.add_argument("--doc-len", type=int, metavar="N",
                   help="packed documents of N tokens (their mean; for a spread of lengths the token-weighted "
                        "mean sum(n^2)/sum(n)), each attending only within itself: the attention time and MFU "
                        "count the work the document mask leaves (default: one document per sequence)")
    p.add_argument("--lora-rank", type=int, metavar="R",
                   help="LoRA fine-tuning (fpdt-train --lora-rank, or fpdt.hf with PEFT): adapters of rank R on "
                        "every decoder linear, the rest frozen (default: full training)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16")
    p.add_argument("--batch", type=int, help="sequences per SP group per step (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f} GiB"


def tokens_text(n: int) -> str:
    """A token count in the FPDT paper's unit, as the docs write it: 1M = 2^20 tokens, 1K = 2^10
    (three significant figures: 4390912 is ``4.19M``, 32768 ``32K``)."""
    if n >= 2 ** 20:
        return f"{n / 2 ** 20:.3g}M"
    return f"{n / 2 ** 10:.4g}K" if n >= 2 ** 10 else str(n)


_tokens = tokens_text


def _attention_checkpoint(s: dict) -> str:
    """How the setup's checkpointed layers get their attention output back in backward."""
    if s["checkpoint"] == "off":
        return "not recomputed (no checkpointing)"
    if s["attention_checkpoint"] != "save" or s["save_attention_layers"] == 0:
        return "recomputed"
    n = s["save_attention_layers"]
    return "saved" + (f" by the first {n} layers" if n is not None else " by every layer")


def _nvme_line(n: dict) -> str:
    """The NVMe tier: what it holds, and whether its I/O hides under the compute."""
    cap = f" of {_gib(n['capacity_bytes']).strip()}" if n.get("capacity_bytes") else ""
    verdict = "hidden under compute" if n["hidden"] else f"exposed {n['exposed_s']:.1f} s"
    return (f"nvme             {_gib(n['bytes_per_node'])}{cap} per node, the first {n['layers']} layers; "
            f"writes {n['write_s']:.1f} s in forward {n['forward_s']:.1f} s, reads {n['read_s']:.1f} s in "
            f"backward {n['backward_s']:.1f} s: {verdict}")


RECOMMENDED = ("chunk_size", "hp", "cp", "placement", "checkpointing", "checkpoint_device_layers", "offload",
               "lm_head_wgrad", "attention_checkpoint")
"""The options every recommendation states, in this order (the rest only when they apply)."""


def _recommended(r: dict) -> str:
    """The recommended setup as ``fpdt-train`` flags (:func:`fpdt.options.as_flag`)."""
    flags = [as_flag(name, r[OPTION_FLAGS[name].json_key]) for name in RECOMMENDED]
    if r.get("stream_layers"):
        flags.append(as_flag("stream_layers", True))
    if r["attention_checkpoint"] == "save" and r["save_attention_layers"] is not None:
        flags.append(as_flag("save_attention_layers", r["save_attention_layers"]))
    if r.get("nvme_layers"):
        flags += [as_flag("nvme_path", "NVME_DIR"), as_flag("nvme_layers", r["nvme_layers"])]
    flags += [f"--lora-rank {r['lora_rank']}"] if r.get("lora_rank") else []
    flags += [f"--pack-documents {r['pack_documents']}"] if r.get("pack_documents") else []
    return " ".join(flags)


def render(out: dict) -> str:
    """The readable table."""
    c = out["cluster"]
    lines = [f"{c['nodes']} x {c['gpus_per_node']} x {c['gpu']}, "
             f"{c['host_mem_bytes_per_node'] / GIB:.0f} GiB host per node; rates: {c['rates']['source']}; "
             f"tokens: 1M = 2^20, 1K = 2^10"]
    if "max_seq_len" in out:
        lines.append(f"max_seq_len      {out['max_seq_len']} ({_tokens(out['max_seq_len'])})")
    if "reason" in out:
        lines.append(f"cannot run: {in_flag_terms(out['reason'])}")
        return "\n".join(lines)
    s = out["setup"]
    lines += [
        f"seq_len          {out['seq_len']} ({_tokens(out['seq_len'])})",
        f"fits             {out['fits']}" + (f" (over on {out['limited_by']})" if out["limited_by"] else ""),
        f"setup            chunk {_tokens(s['chunk_size'])}, hp {s['hp']} x cp {s['cp']} ({s['placement']}), "
        f"checkpoint {s['checkpoint']}" + (", streamed layers" if s.get('stream_layers') else "")
        + (f" (last {s['checkpoint_device_layers']} layer inputs on the GPU)" if s["checkpoint_device_layers"] else "")
        + f", attention {_attention_checkpoint(s)}"
        + f", offload {s['offload']}, MLP chunks {out.get('mlp_chunks', s['mlp_chunks'])}, "
        f"LM-head wgrad {s['lm_head_wgrad']}, "
        f"{'KV heads repeated by the kernel' if s['kernel_expands_gqa'] else 'native GQA kernel'}, "
        f"ZeRO-{s['zero_stage']}, {s['dtype']}"
        + (f", LoRA rank {s['lora_rank']} (base frozen)" if s.get("lora_rank") else "")
        + (f", packed documents of {_tokens(s['doc_len'])} tokens" if s.get("doc_len") else ""),
        f"device peak      {_gib(out['device_peak_bytes'])} of {_gib(out['device_capacity_bytes'])} per GPU",
        f"host peak        {_gib(out['host_peak_bytes'])} of {_gib(out['host_capacity_bytes'])} per node",
    ]
    if "nvme" in out:
        lines.append(_nvme_line(out["nvme"]))
    if "note" in out:
        lines.append(f"note             {out['note']}")
    lines += [
        "breakdown:",
    ]
    lines += [f"  {k:<24}{_gib(v)}" for k, v in out["breakdown"].items()]
    lines.append(f"step time        {out['step_time_s']:.3f} s   (MFU {out['mfu']:.1%}, "
                 f"full-attention MFU {out['mfu_full']:.1%}, {out['tgs']:.0f} tokens/GPU/s)")
    lines += [f"  {k:<24}{v:9.3f} s" for k, v in out["step_time_split_s"].items()]
    r = out.get("recommended")
    lines.append("recommended      " + (_recommended(r) if r else "nothing fits at this length"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        gpu = gpu_from_args(args.gpu, args.gpu_mem_gib, args.gpu_tflops, args.pcie_gbps)
        cal = load_calibration(args.calibration) if args.calibration else None
        cluster = Cluster(gpu, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
                          host_mem_bytes=args.host_mem_gib * GIB, calibration=cal,
                          nvme=nvme_from_args(args.nvme, args.nvme_gib, args.nvme_gbps))
        choice = apply_deepspeed_config(args.deepspeed, Choice(), cluster.world,
                                        hidden_size=load_model_config(args.model).hidden_size) \
            if args.deepspeed else Choice()
        given = {**flag_values(args, PLANNED), **{name: getattr(args, name) for name in OWN}}
        choice = choice.fix(**{k: v for k, v in given.items() if v is not None})   # flags win
        out = plan(args.model, cluster, seq_len=args.seq_len, choice=choice, search_max=args.max_seq_len)
    except (ValueError, OSError) as exc:
        print(f"fpdt-plan: error: {str(exc) if getattr(exc, 'worded', False) else in_flag_terms(str(exc))}",
              file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json else render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

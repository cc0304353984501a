"""Saved attention outputs against recomputed ones: step time, attention share, host bytes.

``attention_checkpoint="save"`` (:mod:`fpdt.attention.saved_attention`) keeps each
checkpointed layer's attention output and lse, so the recompute runs no attention forward:
three attention passes per step (forward, backward ~2) where ``"recompute"`` runs four
(LoongTrain, arXiv 2406.18485 §5.2). This script trains the same model with both, its steps
**interleaved** in one process (recompute, save, recompute, save, ...) so that a busy machine
weighs on both alike, and reports per mode and length: the median step time (forward +
backward; no optimizer step) with its min and max over the repeats, the time spent inside the
attention kernels (every call through :data:`fpdt.attention.kernels.BACKENDS` timed), the host
stash bytes (the peak of host stash bytes in use during the step, and the saved outputs by formula,
:func:`fpdt.attention.offload_volume.saved_attention_bytes`), and the save / recompute ratios.
Beside each wall time it records the process's CPU time (step and attention kernels): with
``--threads 1`` that is the work done, which other processes on a busy machine do not inflate,
so its ratio is the one to quote when the machine was not quiet.

Default shape: attention-dominated (hidden 256, 4 heads of 64 (MHA), 4 layers, SwiGLU 512,
vocabulary 512), fp32, ``checkpointing="offload"``, ``offload=True`` (the CPU's ``sync``
runtime copies into host buffers), 4K-token chunks. Writes ``attention_checkpoint.json`` under
``benchmarks/results/<device>/<date>/`` (or ``--out-dir``).

    python -m profiling.attention_checkpoint --lengths 16384 32768 --repeats 3
    OMP_NUM_THREADS=1 python -m profiling.attention_checkpoint --threads 1   # on a busy machine
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

import fpdt.model as fm
from fpdt.attention import kernels
from fpdt.attention.offload_volume import saved_attention_bytes
from fpdt.offload import HostPeak
from profiling.bench_common import header, results_dir, write_json

MODES = ("recompute", "save")


def config(args) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
            "hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "head_dim": args.hidden // args.heads, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "max_position_embeddings": max(args.lengths), "tie_word_embeddings": False, "rope_theta": 10000.0}


class KernelTimer:
    """Times every attention-kernel call by wrapping the backend in the kernel table."""

    def __init__(self, name: str, dtype: torch.dtype, head_dim: int):
        self.original = kernels.get_backend(name, torch.device("cpu"), dtype, head_dim)
        self.seconds, self.cpu_seconds, self.forwards, self.backwards = 0.0, 0.0, 0, 0

        def timed(fn, field):
            def call(*a, **k):
                t, c = time.perf_counter(), time.process_time()
                out = fn(*a, **k)
                self.seconds += time.perf_counter() - t
                self.cpu_seconds += time.process_time() - c
                setattr(self, field, getattr(self, field) + 1)
                return out
            return call

        kernels.BACKENDS[name] = dataclasses.replace(self.original, forward=timed(self.original.forward, "forwards"),
                                                     backward=timed(self.original.backward, "backwards"))

    def reset(self):
        self.seconds, self.cpu_seconds, self.forwards, self.backwards = 0.0, 0.0, 0, 0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--chunk-size", type=int, default=4096, help="global tokens per attention chunk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-len", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--checkpointing", default="offload", choices=["on", "offload"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tiny", action="store_true", help="a smoke run: 1K tokens, 1 repeat")
    args = p.parse_args(argv)
    if args.tiny:
        args.lengths, args.repeats, args.chunk_size = [1024], 1, 512
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32
    head_dim = args.hidden // args.heads
    timer = KernelTimer("cpu", dtype, head_dim)
    out = header("attention_checkpoint", args)
    out.update(config=config(args), torch_threads=torch.get_num_threads(), results=[])
    for S in args.lengths:
        u = max(1, S // args.chunk_size)
        models = {}
        for mode in MODES:
            torch.manual_seed(0)
            models[mode] = fm.from_config(config(args), dtype=dtype, num_chunks=u, offload=True,
                                          checkpointing=args.checkpointing, attention_checkpoint=mode,
                                          backend="cpu")
        models["save"].load_state_dict(models["recompute"].state_dict())
        def make_inputs(n):
            ids = torch.randint(0, args.vocab, (1, n + 1), generator=torch.Generator().manual_seed(n))
            return models["save"].prepare_inputs(ids[:, :-1], labels=ids[:, 1:], shift=False)

        inputs = make_inputs(S)
        warm = make_inputs(max(u, (args.warmup_len // u) * u))
        rows = {m: {"step_s": [], "attention_s": [], "step_cpu_s": [], "attention_cpu_s": [], "forwards": None,
                    "backwards": None, "loss": None} for m in MODES}
        host = {}
        for mode in MODES:                              # warm-up (kernel self-check, host pool) on a short input
            models[mode](**warm).backward()
        for rep in range(args.repeats):
            for mode in MODES:
                model = models[mode]
                model.zero_grad(set_to_none=True)
                timer.reset()
                with HostPeak() as peak:
                    t, c = time.perf_counter(), time.process_time()
                    loss = model(**inputs)
                    loss.backward()
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                if rep == 0:
                    host[mode] = peak.above_start
                    rows[mode].update(forwards=timer.forwards, backwards=timer.backwards, loss=loss.item())
                rows[mode]["step_s"].append(dt)
                rows[mode]["attention_s"].append(timer.seconds)
                rows[mode]["step_cpu_s"].append(dc)
                rows[mode]["attention_cpu_s"].append(timer.cpu_seconds)
                print(f"S={S} u={u} {mode:9s} rep {rep + 1}: step {dt:.2f} s (CPU {dc:.2f} s), attention "
                      f"{timer.seconds:.2f} s (CPU {timer.cpu_seconds:.2f} s) "
                      f"({timer.forwards} fwd / {timer.backwards} bwd kernel calls)", flush=True)
        saved = saved_attention_bytes(batch=1, seq_local=S, num_heads=args.heads, head_dim=head_dim, dtype=dtype)
        result = {"seq_len": S, "num_chunks": u}
        for mode in MODES:
            r = rows[mode]
            result[mode] = {
                "step_s_median": statistics.median(r["step_s"]), "step_s_min": min(r["step_s"]),
                "step_s_max": max(r["step_s"]), "step_s": r["step_s"],
                "attention_s_median": statistics.median(r["attention_s"]), "attention_s": r["attention_s"],
                "attention_share": statistics.median(a / s for a, s in zip(r["attention_s"], r["step_s"])),
                "step_cpu_s_median": statistics.median(r["step_cpu_s"]), "step_cpu_s": r["step_cpu_s"],
                "attention_cpu_s_median": statistics.median(r["attention_cpu_s"]),
                "attention_cpu_s": r["attention_cpu_s"],
                "attention_cpu_share": statistics.median(a / s for a, s in zip(r["attention_cpu_s"], r["step_cpu_s"])),
                "attention_forward_calls": r["forwards"], "attention_backward_calls": r["backwards"],
                "loss": r["loss"], "host_peak_bytes": host[mode],
            }
        result["saved_bytes_per_layer_formula"] = saved
        result["saved_bytes_all_layers_formula"] = saved * args.layers
        result["ratio_step_save_over_recompute"] = (result["save"]["step_s_median"]
                                                    / result["recompute"]["step_s_median"])
        result["ratio_attention_save_over_recompute"] = (result["save"]["attention_s_median"]
                                                         / result["recompute"]["attention_s_median"])
        for kind in ("step", "attention"):   # CPU seconds of the process: robust to other load with --threads 1
            result[f"ratio_{kind}_cpu_save_over_recompute"] = (result["save"][f"{kind}_cpu_s_median"]
                                                                / result["recompute"][f"{kind}_cpu_s_median"])
        print(f"S={S}: CPU time save/recompute: step {result['ratio_step_cpu_save_over_recompute']:.3f}, "
              f"attention {result['ratio_attention_cpu_save_over_recompute']:.3f}", flush=True)
        print(f"S={S}: step save/recompute {result['ratio_step_save_over_recompute']:.3f}, attention "
              f"{result['ratio_attention_save_over_recompute']:.3f}; saved {saved * args.layers / 2**20:.1f} MiB "
              f"on the host", flush=True)
        out["results"].append(result)
    path = write_json(os.path.join(results_dir(args.tiny, args.out_dir), "attention_checkpoint.json"), out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

"""Device bytes per added token: fpdt beside DeepSpeed's ALST and Hugging Face (docs/memory.md).

**Model** (:data:`MODEL`): Llama, hidden 512, 4 layers, 8 query / 2 KV heads of 64, SwiGLU
1408, vocabulary 32000, untied, fp32. Random weights (``torch.manual_seed(0)`` before each
build) and the same tokens (a generator seeded 1) for every strategy.

**Strategies** (:mod:`strategies`): ``fpdt`` (``offload=True``, ``checkpointing="offload"``,
``--chunk-size`` 1K-token attention chunks, the model's default MLP and loss chunks),
``alst`` (``TiledMLP``, ``TiledFusedLogitsLoss`` with as many shards as fpdt's loss chunks,
DeepSpeed's checkpoint offload with its host copies drawn from the host pool),
``hf`` (SDPA, gradient checkpointing, full logits) and ``fpdt-no-offload``.

**One trial** = one strategy at one length, in a fresh process: one forward + backward, no
optimizer step, counted by :class:`fpdt.memory.accountant.MemoryAccountant` on the CPU, the
same way for every strategy:

* ``device_peak_bytes``: the most bytes of live tensor storages created during the forward
  + backward. Not counted, because they exist before the accountant is entered: the
  parameters; the gradients, allocated as zeros before the step so that backward
  accumulates into them in place; the token ids and labels (``prepare``: data-loader work);
  the model's buffers (RoPE tables). Counted: everything else the step allocates --
  activations, recompute, chunk buffers, the loss, gradient temporaries before they are added
  into ``.grad``. Not seen: scratch memory inside one kernel (e.g. SDPA's CPU flash kernel).
* ``host_peak_bytes``: the most host-stash bytes in use (buffers from
  :class:`fpdt.offload.HostBufferPool`: fpdt's attention and checkpoint stash; ALST's
  checkpoint offload copies, through ``strategies.cpu_offload_hooks``). Not in the device peak.
* ``phases``: the step cut into exclusive accountant phases by forward pre-hooks on the
  decoder layers' input norms: ``fwd embed``, ``fwd layer i``, ``fwd head+loss``, then ``bwd head+loss``,
  ``bwd layer i`` (from the start of layer ``i``'s recompute to the start of layer
  ``i - 1``'s; ``bwd layer 0`` also holds the embedding backward). ``peak_phase`` is the
  phase in which the device peak was reached.

**Per added token**: ``(peak(L2) - peak(L1)) / (L2 - L1)`` bytes for the shortest and longest
length (default 8K and 16K); KB = 1000 bytes, the issue's unit.

**Other models**: ``--model-config PATH`` (a Transformers ``config.json``; e.g. the small
hybrid and MoE models of ``benchmarks/models/``) replaces :data:`MODEL`; ``--plot PNG`` draws
the device peak per 1K tokens and the step time of every strategy against the length.

    python -m profiling.bytes_per_token                                  # 8K, 16K; minutes on a CPU
    python -m profiling.bytes_per_token --strategies fpdt --reuse results.json   # re-run fpdt only
    python -m profiling.bytes_per_token --tiny --lengths 512 1024 --in-process   # smoke run
    python -m profiling.bytes_per_token --model-config benchmarks/models/qwen3_5_small.json \
        --strategies fpdt fpdt-stream hf --lengths 8192 16384 32768 --plot hybrid.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from profiling import bench_common as bc
from profiling import strategies as st

MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 512,
    "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1 << 20,
    "tie_word_embeddings": False, "rope_theta": 10000.0,
}
TINY = {**MODEL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
DEFAULT_STRATEGIES = ("fpdt", "alst", "hf", "fpdt-no-offload")
KB = 1000


class LayerPhases:
    """Cuts one forward + backward into exclusive, named phases of ``acct`` (see the module
    docstring), switched by forward pre-hooks on ``layers`` and by :meth:`start_backward`."""

    def __init__(self, acct, layers):
        self.acct, self.backward, self.order = acct, False, []
        self._open = None
        self._open_name = None
        # The layer's first submodule, not the layer: Transformers checkpoints the layer's
        # ``forward`` (not ``__call__``), so only its submodules' hooks run again in recompute.
        # fpdt's full-attention layers hand their input norm to the attention (not called as a module):
        # hook the norm and the token mixer (attention or Gated DeltaNet, whichever the layer has),
        # whichever runs first opens the layer's phase.
        def firsts(layer):
            mods = [getattr(layer, "input_layernorm", layer), getattr(layer, "self_attn", None),
                    getattr(layer, "linear_attn", None)]
            return [m for m in mods if m is not None]
        self._handles = [m.register_forward_pre_hook(self._layer_hook(i)) for i, layer in enumerate(layers)
                         for m in firsts(layer)]
        self._handles.append(layers[-1].register_forward_hook(self._after_last_layer))

    def switch(self, name: str) -> None:
        if self._open is not None and self._open_name == name:     # the layer's second hooked module
            return
        self._open_name = name
        if self._open is not None:
            self._open.__exit__(None, None, None)
        if name not in self.order:
            self.order.append(name)
        self._open = self.acct.phase(name)
        self._open.__enter__()

    def _layer_hook(self, i):
        def hook(module, args):
            self.switch(f"{'bwd' if self.backward else 'fwd'} layer {i}")
        return hook

    def _after_last_layer(self, module, args, out):
        if not self.backward:
            self.switch("fwd head+loss")

    def start_backward(self) -> None:
        self.backward = True
        self.switch("bwd head+loss")

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        for h in self._handles:
            h.remove()


def trial(strategy: str, cfg: dict, seq_len: int, chunk_size: int) -> dict:
    """One forward + backward of ``strategy`` at ``seq_len`` tokens, counted (see the module docstring)."""
    from fpdt.memory.accountant import MemoryAccountant
    device = torch.device("cpu")
    torch.manual_seed(0)
    trainee = st.build(strategy, cfg, seq_len, chunk_size, device, torch.float32)
    for p in trainee.params:                     # gradients allocated before the step: baseline
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, cfg["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
    inputs = trainee.prepare(ids.to(device))
    t0 = time.perf_counter()
    with MemoryAccountant(device) as acct:
        phases = LayerPhases(acct, trainee.layers)
        phases.switch("fwd embed")
        try:
            loss = trainee.forward_backward(inputs, on_backward=phases.start_backward)
        finally:
            phases.close()
        del loss
    seconds = time.perf_counter() - t0
    by_phase = {n: {"peak": acct.phases[n].peak, "host_peak": acct.phases[n].host_peak} for n in phases.order}
    peak_phase = max(phases.order, key=lambda n: acct.phases[n].peak)
    return {"status": "ok", "strategy": strategy, "seq_len": seq_len, "chunk_size": chunk_size,
            "device_peak_bytes": acct.device_peak, "host_peak_bytes": acct.host_peak,
            "fwd_peak_bytes": max(v["peak"] for n, v in by_phase.items() if n.startswith("fwd")),
            "bwd_peak_bytes": max(v["peak"] for n, v in by_phase.items() if n.startswith("bwd")),
            "peak_phase": peak_phase, "phases": by_phase, "seconds": seconds, "notes": trainee.notes,
            "commit": bc.git_commit()}


def per_token(trials: list[dict], strategies, lengths: list[int]) -> dict:
    """Per strategy: device and host bytes per added token between the shortest and longest length."""
    lo, hi = min(lengths), max(lengths)
    out = {}
    for s in strategies:
        got = {t["seq_len"]: t for t in trials if t["strategy"] == s and t.get("status") == "ok"}
        if lo in got and hi in got:
            out[s] = {"device": (got[hi]["device_peak_bytes"] - got[lo]["device_peak_bytes"]) / (hi - lo),
                      "host": (got[hi]["host_peak_bytes"] - got[lo]["host_peak_bytes"]) / (hi - lo)}
    return out


def markdown(result: dict) -> str:
    """The figures table, the ratios and the per-layer breakdown of :func:`measure`'s result."""
    lo, hi = min(result["lengths"]), max(result["lengths"])
    pt, trials = result["per_token"], result["trials"]
    mib = 2 ** 20
    lines = [f"Device bytes per added token, {lo} -> {hi} tokens: `(peak@{hi} - peak@{lo}) / {hi - lo}`; "
             f"KB = 1000 bytes. One forward + backward, fp32, chunk size {result['chunk_size']}.", "",
             f"| strategy | device peak @{lo} (MiB) | device peak @{hi} (MiB) | device KB / added token | "
             f"host peak @{hi} (MiB) | host KB / added token | peak phase @{hi} | measured at |",
             "|---|---|---|---|---|---|---|---|"]
    for s in result["strategies"]:
        got = {t["seq_len"]: t for t in trials if t["strategy"] == s}
        a, b = got.get(lo, {}), got.get(hi, {})
        if a.get("status") != "ok" or b.get("status") != "ok":
            why = (b if b.get("status") != "ok" else a).get("error") or (b or a).get("status", "not run")
            lines.append(f"| {s} | {why} | | | | | | |")
            continue
        lines.append(f"| {s} | {a['device_peak_bytes'] / mib:.1f} | {b['device_peak_bytes'] / mib:.1f} | "
                     f"**{pt[s]['device'] / KB:.1f}** | {b['host_peak_bytes'] / mib:.1f} | {pt[s]['host'] / KB:.1f} | "
                     f"{b['peak_phase']} | {b.get('commit') or '?'} |")
    lines.append("")
    for other in ("alst", "hf", "fpdt-no-offload"):
        if "fpdt" in pt and other in pt and pt[other]["device"]:
            lines.append(f"- fpdt / {other} device bytes per added token: **{pt['fpdt']['device'] / pt[other]['device']:.3f}**")
    names = [n for n in next((t["phases"] for t in trials if t.get("status") == "ok" and t["seq_len"] == hi), {})]
    shown = [s for s in result["strategies"] if any(t["strategy"] == s and t["seq_len"] == hi
                                                    and t.get("status") == "ok" for t in trials)]
    if names and shown:
        by = {s: next(t for t in trials if t["strategy"] == s and t["seq_len"] == hi) for s in shown}
        lines += ["", f"Per-phase device peak at {hi} tokens (MiB; `bwd layer i` runs from layer i's recompute "
                      f"to layer i-1's):", "", "| phase | " + " | ".join(shown) + " |",
                  "|---|" + "---|" * len(shown)]
        all_names = list(dict.fromkeys(n for s in shown for n in by[s]["phases"]))
        for n in all_names:
            cells = [f"{by[s]['phases'][n]['peak'] / mib:.1f}" if n in by[s]["phases"] else "-" for s in shown]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def model_config(tiny: bool = False, path: str | None = None) -> dict:
    """The measured model: ``path``'s ``config.json``, else :data:`TINY` or :data:`MODEL`."""
    if path is not None:
        with open(path) as f:
            return json.load(f)
    return dict(TINY if tiny else MODEL)


def measure(strategies=DEFAULT_STRATEGIES, lengths=(8192, 16384), chunk_size: int = 1024, tiny: bool = False,
            in_process: bool = False, timeout_s: float = 1800.0, reuse: list[dict] | None = None,
            config_path: str | None = None) -> dict:
    """Run (or reuse from ``reuse``, a previous result's ``trials``) every trial; per-token figures."""
    cfg = model_config(tiny, config_path)
    run_now = [s for s in strategies if st.missing_packages(s) is None]
    kept = [t for t in (reuse or []) if t["strategy"] not in run_now and t["seq_len"] in lengths]
    names = list(dict.fromkeys([*strategies, *(t["strategy"] for t in kept)]))
    trials = list(kept)
    for s in strategies:
        if s not in run_now:
            trials += [{"status": "skipped", "strategy": s, "seq_len": n, "error": st.missing_packages(s)}
                       for n in lengths]
            continue
        for n in lengths:
            if in_process:
                r = trial(s, cfg, n, chunk_size)
            else:
                argv = ["--strategy", s, "--seq-len", str(n), "--chunk-size", str(chunk_size)] + \
                    (["--tiny"] if tiny else []) + (["--model-config", config_path] if config_path else [])
                r = bc.run_trial("profiling.bytes_per_token", argv, timeout_s)
                r.setdefault("strategy", s)
                r.setdefault("seq_len", n)
            trials.append(r)
            print(f"  {s:<16} {n:>7}  " + (f"device {r['device_peak_bytes'] / 2**20:9.1f} MiB  host "
                                           f"{r['host_peak_bytes'] / 2**20:8.1f} MiB  peak in {r['peak_phase']:<14} "
                                           f"{r['seconds']:7.1f} s" if r.get("status") == "ok"
                                           else f"{r.get('status')} {r.get('error', '')}"[:160]), flush=True)
    return {"model": cfg, "chunk_size": chunk_size, "lengths": list(lengths), "strategies": names,
            "trials": trials, "per_token": per_token(trials, names, list(lengths))}


def plot(result: dict, path: str) -> None:
    """Two panels against the length: device peak per 1K tokens (MiB) and step time (s), per strategy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (mem, sec) = plt.subplots(1, 2, figsize=(9, 3.4))
    for s in result["strategies"]:
        ok = sorted((t["seq_len"], t) for t in result["trials"] if t["strategy"] == s and t.get("status") == "ok")
        if not ok:
            continue
        n = [k for k, _ in ok]
        mem.plot(n, [t["device_peak_bytes"] / 2 ** 20 / (k / 1024) for k, t in ok], marker="o", label=s)
        sec.plot(n, [t["seconds"] for _, t in ok], marker="o", label=s)
    for ax, label in ((mem, "device peak per 1K tokens (MiB, counted)"), (sec, "forward + backward (s, CPU)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(label)
    mem.legend()
    fig.suptitle(f"{result['model'].get('model_type')} (hidden {result['model'].get('hidden_size')}, "
                 f"{result['model'].get('num_hidden_layers')} layers), chunk {result['chunk_size']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES), choices=st.STRATEGIES)
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384], metavar="L",
                   help="sequence lengths; the per-token figures use the shortest and the longest")
    p.add_argument("--model-config", default=None, help="a Transformers config.json to measure instead of MODEL")
    p.add_argument("--plot", default=None, help="write a PNG of device peak per 1K tokens and step time vs length")
    p.add_argument("--chunk-size", type=int, default=1024, help="fpdt's attention chunk (tokens)")
    p.add_argument("--tiny", action="store_true", help="tiny model (hidden 64, vocab 512) for smoke runs")
    p.add_argument("--in-process", action="store_true", help="run trials in this process (tests)")
    p.add_argument("--trial-timeout-s", type=float, default=1800.0)
    p.add_argument("--reuse", default=None, help="a previous --json file: keep its trials of strategies not run now")
    p.add_argument("--json", default=None, help="write the result (every trial) here")
    p.add_argument("--out", default=None, help="write the markdown here")
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.trial:                                   # one trial, in a fresh process: JSON on the last line
        print(json.dumps(trial(args.strategy, model_config(args.tiny, args.model_config), args.seq_len,
                               args.chunk_size)))
        return {}
    reuse = None
    if args.reuse:
        with open(args.reuse) as f:
            reuse = json.load(f)["trials"]
    result = measure(args.strategies, args.lengths, args.chunk_size, args.tiny, args.in_process,
                     args.trial_timeout_s, reuse, args.model_config)
    text = markdown(result)
    if args.plot:
        plot(result, args.plot)
    print(text)
    for path, body in ((args.out, text), (args.json, json.dumps(result, indent=2) + "\n")):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(body)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

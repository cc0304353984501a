"""PNG plots and a generated markdown table from the measurement scripts' JSON.

Reads ``max_seqlen*.json``, ``chunk_sweep.json`` and ``op_latency.json`` in one results
directory and writes, next to them, whichever of these the files allow:

* ``chunk_sweep.png``: device memory (model states / activations) and MFU vs chunk size;
* ``op_latency.png``: attention and copy latency vs chunk size, copy bandwidth vs size;
* ``max_seqlen.png``: the longest completed length per strategy;
* ``memory_vs_length.png``: device-tier peak (and host tier) vs length per strategy.

The markdown (``results.md`` beside them, and the same text between the
``<!-- plot.py begin -->`` / ``<!-- plot.py end -->`` markers of ``--readme``, default
``benchmarks/README.md``; GPU results get a block of their own, ``<!-- plot.py begin <device> -->``)
has, per strategy: the longest length, the least-squares slope of
device bytes per 1K tokens, host bytes per 1K tokens, per-length device/host/total/step
time, fpdt's slope and step-time ratios against ``hf`` and ``alst``, and the planner's
prediction beside fpdt's measurement.

    python -m profiling.plot benchmarks/results/<device>/<date>
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from fpdt.bench.report import capacities, fit_trials, kernel_table, markdown, markers, measured, strategies, write_readme
from profiling import bench_common as bc

MIB = 2 ** 20



def _save(fig, out: str, name: str) -> str:
    """Write ``fig`` as ``out/name`` (PNG, 100 dpi), close it and return the path."""
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _load(path):
    with open(path) as f:
        return json.load(f)


def plot_chunk_sweep(data: dict, out: str) -> str:
    plt = _plt()
    rows = [r for r in measured(data["rows"]) if r["strategy"] == "fpdt"]
    xs = [r["chunk_size"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar([str(x) for x in xs], [r["model_states_bytes"] / MIB for r in rows], label="model states")
    a.bar([str(x) for x in xs], [r["activation_bytes"] / MIB for r in rows],
          bottom=[r["model_states_bytes"] / MIB for r in rows], label="activations")
    a.set(xlabel="global chunk (tokens)", ylabel="peak device memory (MiB)", title=f"S = {data['seq_len']}")
    a.legend()
    b.plot([str(x) for x in xs], [100 * (r.get("mfu") or 0) for r in rows], marker="o", label="MFU %")
    exposed = [r.get("exposed_copy_s") for r in rows]
    if any(e is not None for e in exposed):
        b2 = b.twinx()
        b2.plot([str(x) for x in xs], [e or 0 for e in exposed], color="tab:red", marker="s", label="exposed copy s")
        b2.set_ylabel("exposed copy time (s)")
    b.set(xlabel="global chunk (tokens)", ylabel="MFU (%)")
    return _save(fig, out, "chunk_sweep.png")


def plot_op_latency(data: dict, out: str) -> str:
    plt = _plt()
    rows = data["chunks"]
    xs = [r["chunk"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("diag_fwd_s", "attention fwd (diagonal)"), ("full_fwd_s", "attention fwd (full)"),
                       ("full_bwd_s", "attention bwd (full)"), ("qkv_h2d_pinned_s", "q/k/v H2D pinned"),
                       ("qkv_h2d_pageable_s", "q/k/v H2D pageable"), ("all_to_all_s", "all-to-all")):
        ys = [r.get(key) for r in rows]
        if all(y is not None for y in ys):
            a.plot(xs, [1e3 * y for y in ys], marker="o", label=label)
    for name in dict.fromkeys(n for r in rows for n in r.get("kernels", {})):   # --backends: fwd+bwd of a full block
        ys = [r.get("kernels", {}).get(name, {}) for r in rows]
        if all("full_fwd_s" in y for y in ys):
            a.plot(xs, [1e3 * (y["full_fwd_s"] + y["full_bwd_s"]) for y in ys], marker="x", linestyle="--",
                   label=f"{name} fwd+bwd (full)")
    a.set(xscale="log", yscale="log", xlabel="chunk (tokens)", ylabel="ms", title="latency per chunk")
    a.legend(fontsize=7)
    bw = data["bandwidth"]
    for key in ("h2d_pinned_bytes_s", "h2d_pageable_bytes_s", "d2h_pinned_bytes_s", "d2h_pageable_bytes_s"):
        if all(key in r for r in bw):
            b.plot([r["bytes"] / MIB for r in bw], [r[key] / 1e9 for r in bw], marker="o", label=key[:-8])
    b.set(xscale="log", xlabel="transfer (MiB)", ylabel="GB/s", title="copy bandwidth")
    b.legend(fontsize=7)
    return _save(fig, out, "op_latency.png")


def plot_max_seqlen(strats: dict, out: str) -> str | None:
    plt = _plt()
    caps = capacities(strats)
    names = [n for n, s in strats.items() if any(c["best"] for c in s["caps"].values())]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(caps))
    for i, cap in enumerate(caps):
        xs = [j + (i - (len(caps) - 1) / 2) * width for j in range(len(names))]
        ys = [strats[n]["caps"].get(cap, {"best": 0})["best"] / 1024 for n in names]
        bars = ax.bar(xs, ys, width, label="no capacity" if cap is None else f"{cap:g} GiB")
        for bar, n in zip(bars, names):
            if strats[n]["caps"].get(cap, {}).get("open_ended") and bar.get_height():
                ax.annotate(">=", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="longest length that fits (K tokens)",
           title="max sequence length per strategy (\">=\": longest tried)")
    ax.legend(fontsize=7)
    return _save(fig, out, "max_seqlen.png")


def plot_memory_vs_length(strats: dict, out: str, cap_gib: float | None = None) -> str | None:
    """Left: the steady-state step peak (and host tier) per strategy, with the simulated
    capacity; right: the forward+backward peak, where the activations show."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    drew = False
    for name, s in strats.items():
        pts = sorted({t["seq_len"]: t for t in measured(fit_trials(s["trials"]))}.values(), key=lambda t: t["seq_len"])
        if not pts:
            continue
        xs = [t["seq_len"] / 1024 for t in pts]
        line, = a.plot(xs, [t["device_peak_bytes"] / MIB for t in pts], marker="o", label=name)
        if any(t["host_peak_bytes"] for t in pts):
            a.plot(xs, [t["host_peak_bytes"] / MIB for t in pts], ls="--", color=line.get_color(),
                   label=f"{name} (host tier)")
        if all(t.get("fwd_bwd_peak_bytes") is not None for t in pts):
            b.plot(xs, [t["fwd_bwd_peak_bytes"] / MIB for t in pts], marker="o", color=line.get_color(), label=name)
        drew = True
    if not drew:
        plt.close(fig)
        return None
    if cap_gib:
        a.axhline(cap_gib * 1024, color="grey", ls=":", label=f"simulated capacity {cap_gib:g} GiB")
    a.set(xlabel="sequence length (K tokens)", ylabel="peak (MiB)", title="device-tier peak of a training step")
    b.set(xlabel="sequence length (K tokens)", ylabel="peak (MiB)", title="forward + backward peak (first step)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    return _save(fig, out, "memory_vs_length.png")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a results directory (benchmarks/results/<device>/<date>)")
    p.add_argument("--readme", default=os.path.join(bc.ROOT, "benchmarks", "README.md"),
                   help="markdown file whose generated block is replaced ('' to skip)")
    args = p.parse_args(argv)
    out, written = args.results, []
    if os.path.exists(os.path.join(out, "chunk_sweep.json")):
        written.append(plot_chunk_sweep(_load(os.path.join(out, "chunk_sweep.json")), out))
    op_latency = _load(os.path.join(out, "op_latency.json")) if os.path.exists(os.path.join(out, "op_latency.json")) \
        else None
    if op_latency:
        written.append(plot_op_latency(op_latency, out))
    files = [_load(f) for f in sorted(glob.glob(os.path.join(out, "max_seqlen*.json")))]
    md = None
    if files:
        strats = strategies(files)
        cap = next((f["device_mem_gib"] for f in files if f.get("device_mem_gib")), None)
        written += [x for x in (plot_max_seqlen(strats, out), plot_memory_vs_length(strats, out, cap)) if x]
        rel = os.path.relpath(os.path.abspath(out), bc.ROOT)
        md = markdown(strats, files, rel)
        if op_latency:
            md += "\n" + "\n".join(kernel_table(op_latency)) + "\n"
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(md)
        written.append(os.path.join(out, "results.md"))
        if args.readme:
            write_readme(args.readme, md, *markers(files))
    for w in written:
        print(f"wrote {w}")
    return {"written": written, "markdown": md}


if __name__ == "__main__":
    main()

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

from fpdt.bench.fit import extrapolate, slope_per_1k
from profiling import bench_common as bc

BEGIN, END = "<!-- plot.py begin -->", "<!-- plot.py end -->"
MIB, GIB = 2 ** 20, 2 ** 30



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


def _ok(trials):
    """Trials whose step completed (also those over a simulated device capacity)."""
    return [t for t in trials if t.get("measured")]


def plot_chunk_sweep(data: dict, out: str) -> str:
    plt = _plt()
    rows = [r for r in _ok(data["rows"]) if r["strategy"] == "fpdt"]
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


def _strategies(files: list[dict]) -> dict:
    """strategy -> {"trials": [...], "skipped": reason|None, "caps": {cap: longest}} over all files.
    A file run with ``--attention-backend K`` gives its fpdt strategies as ``"<strategy> [K]"``.

    Every trial is tagged with its file's ``mode`` (lengths / bisect) and ``cap``
    (``device_mem_gib``, None without one). ``caps[cap]`` = ``{"best": longest length that fit
    at that capacity, "open_ended": no longer length was seen to fail there}``.
    """
    merged: dict = {}
    for data in files:
        cap = data.get("device_mem_gib")
        kernel = (data.get("args") or {}).get("attention_backend")   # a named kernel: its own rows
        for name, entry in data["strategies"].items():
            if kernel and name.startswith("fpdt"):
                name = f"{name} [{kernel}]"
            m = merged.setdefault(name, {"trials": [], "skipped": None, "caps": {}})
            if entry["status"] == "skipped":
                m["skipped"] = entry["reason"]
                continue
            m["trials"] += [{**t, "mode": data.get("mode", "lengths"), "cap": cap} for t in entry["trials"]]
    for m in merged.values():
        for cap in {t["cap"] for t in m["trials"]}:
            at = [t for t in m["trials"] if t["cap"] == cap]
            ok = [t["seq_len"] for t in at if t.get("status") == "ok"]
            failed = [t["seq_len"] for t in at if t.get("status") != "ok"]
            best = max(ok) if ok else 0
            m["caps"][cap] = {"best": best, "open_ended": not failed or max(failed) < best}
    return merged


def _fit_trials(trials: list) -> list:
    """The trials slopes and plots use: the fixed-length ones when there are any (a bisection
    may run other chunk sizes), else all."""
    return [t for t in trials if t.get("mode", "lengths") == "lengths"] or trials


def _caps(strats: dict) -> list:
    return sorted({c for s in strats.values() for c in s["caps"]}, key=lambda c: (c is None, c or 0))


def _longest(s: dict, cap) -> str:
    c = s["caps"].get(cap)
    if c is None:
        return "-"
    return f">= {c['best']} (longest tried)" if c["open_ended"] else str(c["best"])


def plot_max_seqlen(strats: dict, out: str) -> str | None:
    plt = _plt()
    caps = _caps(strats)
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
        pts = sorted({t["seq_len"]: t for t in _ok(_fit_trials(s["trials"]))}.values(), key=lambda t: t["seq_len"])
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


def _slope(trials, key):
    return slope_per_1k(trials, key)


def _mib(b) -> str:
    return "" if b is None else f"{b / MIB:.1f}"


def _mfu(t: dict) -> str:
    """The trial's MFU (the trainer's formula, against its device's peak), if recorded."""
    return f"{t['mfu']:.3f}" if t.get("mfu") is not None else "-"


def markdown(strats: dict, files: list[dict], rel: str) -> str:
    first = files[0] if files else {}
    tier = ("Device tier on the CPU = live tensor bytes counted by `fpdt.memory.accountant` plus parameters"
            if first.get("device_type", "cpu") == "cpu" else
            "Device memory = the CUDA caching allocator's allocated peaks (`torch.cuda.max_memory_allocated`)")
    mfu_peak = ("a fp32 matmul rate measured in each trial's own run (so CPU rows compare loosely)"
                if first.get("device_type", "cpu") == "cpu" else "each trial's peak_flops (its peak_source names it)")
    sw = first.get("software") or {}
    stack = (f", torch {sw['torch']}, CUDA {sw['cuda']}, cuDNN {sw['cudnn']}" if sw.get("cudnn") else "")
    lines = [f"Results in `{rel}` (device `{first.get('device')}`, commit {first.get('commit')}, "
             f"{first.get('date_utc')}{stack}). {tier}; host tier = offloaded stash. *device* is the "
             f"steady-state step peak (forward+backward with the optimizer state live, or the optimizer "
             f"step if higher); *fwd+bwd* is the forward+backward peak of the first step (no optimizer "
             f"state yet), whose slope is the activation memory per token. MFU: the trainer's formula "
             f"against {mfu_peak}.", ""]
    # the capacity of the fixed-length runs (their fit is extrapolated to it), and every capacity seen
    cap = next((f["device_mem_gib"] for f in files if f.get("device_mem_gib") and f.get("mode") == "lengths"),
               next((f["device_mem_gib"] for f in files if f.get("device_mem_gib")), None))
    caps = [c for c in _caps(strats) if c is not None] or [None]
    head = " | ".join(f"longest that fits {c:g} GiB (measured)" if c else "longest length that fits" for c in caps)
    lines += [f"| strategy | {head} | fwd+bwd device KiB / 1K tokens | host KiB / 1K tokens |"
              + (f" longest at {cap:g} GiB, extrapolated from the fit |" if cap else ""),
              "|---|" + "---|" * len(caps) + "---|---|" + ("---|" if cap else "")]
    slopes = {}
    for name, s in strats.items():
        if s["skipped"]:
            lines.append(f"| {name} | skipped: {s['skipped']} |" + " |" * (len(caps) + 1 + bool(cap)))
            continue
        fit = _fit_trials(s["trials"])
        dev = _slope(fit, "fwd_bwd_peak_bytes")
        if dev is None:                                   # files without the phase split
            dev = _slope(fit, "device_peak_bytes")
        host = _slope(fit, "host_peak_bytes")
        slopes[name] = dev
        longest = " | ".join(_longest(s, c) for c in caps)
        extra = ""
        if cap:
            est = extrapolate(_fit_trials(s["trials"]), cap * GIB)
            extra = f" {est} |" if est is not None else " - |"
        lines.append(f"| {name} | {longest} | {dev / 1024:.1f} | {host / 1024:.1f} |{extra}" if dev is not None
                     else f"| {name} | {longest} | - | - |{extra}")
    # a fits column with a capacity, or wherever a completed step was still out of memory (on a
    # GPU: a steady state over the device's memory)
    fits_col = bool(cap) or any(t["status"] != "ok" for s in strats.values() for t in _ok(s["trials"]))
    lines += ["", "| strategy | length | device MiB | fwd+bwd MiB | host MiB | total MiB | step s | tokens/s "
              "| MFU | planned allocated MiB (/ measured) | planned step s (/ measured) |"
              + (f" fits ({cap:g} GiB unless noted) |" if cap else " fits |" if fits_col else ""),
              "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fits_col else "")]
    times: dict = {}
    for name, s in strats.items():
        for t in sorted(_ok(s["trials"]), key=lambda t: (t["seq_len"], t["mode"] == "bisect")):
            if t["mode"] != "bisect" or t["seq_len"] not in times or name not in times[t["seq_len"]]:
                times.setdefault(t["seq_len"], {})[name] = t["step_s"]   # ratios: the fixed-length trial
            # Allocated against allocated; files before planned_allocated_peak_bytes held that figure
            # (states + activations, no runtime reserve) in planned_device_peak_bytes.
            plan = t.get("planned_allocated_peak_bytes", t.get("planned_device_peak_bytes"))
            plan_s = t.get("planned_step_s")
            ratio = "" if plan is None else f"{_mib(plan)} ({plan / t['device_peak_bytes']:.3f})"
            # A step time planned from datasheet rates (no calibration in that run) is not this
            # machine's, so it is not set beside the measured one.
            ratio_s = ("" if plan_s is None or t.get("planned_rates") != "calibration"
                       else f"{plan_s:.2f} ({plan_s / t['step_s']:.2f})")
            length = (f"{t['seq_len']}" + (f" (bisection at {t['cap']:g} GiB)" if t["mode"] == "bisect" and t["cap"]
                                            else " (bisection)" if t["mode"] == "bisect" else ""))
            lines.append(f"| {name} | {length} | {_mib(t['device_peak_bytes'])} | "
                         f"{_mib(t.get('fwd_bwd_peak_bytes'))} | {_mib(t['host_peak_bytes'])} | "
                         f"{_mib(t['device_peak_bytes'] + t['host_peak_bytes'])} | {t['step_s']:.2f} | "
                         f"{t['seq_len'] / t['step_s']:.0f} | {_mfu(t)} | {ratio} | {ratio_s} |"
                         + ((" yes |" if t["status"] == "ok" else " no |") if fits_col else ""))
    ratios = []
    for other in ("hf", "alst"):
        if slopes.get("fpdt") is not None and slopes.get(other):
            ratios.append(f"fpdt / {other} fwd+bwd device slope: **{slopes['fpdt'] / slopes[other]:.3f}**")
        ratios += _step_time_ratio(times, "fpdt", other, f"fpdt / {other}")
    # the attention kernel each strategy ran (recorded from 2026-11-24 on): step times of
    # strategies on different kernels compare the kernels as much as the methods
    kernels = {name: sorted({t["attention_kernel"] for t in _ok(s["trials"]) if t.get("attention_kernel")})
               for name, s in strats.items() if not s["skipped"]}
    if any(kernels.values()):
        ratios.append("attention kernel: " + "; ".join(f"{n} `{'`, `'.join(k)}`" for n, k in kernels.items() if k))
    ratios += _step_time_ratio(times, "fpdt-save", "fpdt", "fpdt-save / fpdt (saved attention outputs / recompute)")
    if ratios:
        lines += [""] + [f"- {r}" for r in ratios]
    lines += profile_table(strats)
    return "\n".join(lines) + "\n"


def _step_time_ratio(times: dict, a: str, b: str, label: str) -> list[str]:
    """``["<label> step time: <length>: <a / b>, ..."]`` over the lengths where both ran, or []."""
    same = sorted(n for n, t in times.items() if a in t and b in t)
    return [f"{label} step time: " + ", ".join(f"{n}: {times[n][a] / times[n][b]:.2f}" for n in same)] if same else []


PROFILE_CLASSES = ("attention", "gemm", "copy_h2d_d2h", "copy_device", "collective", "other")


def profile_table(strats: dict) -> list[str]:
    """Markdown lines: where each traced step's time went (``max_seqlen --profile-step``): the
    traced span, the GPU's busy time within it, the summed kernel time per class
    (:func:`profiling.bench_common.kernel_class`; classes overlap in time across streams) and the
    exposed host<->device copy time, then the kernels that took longest. Empty without a trace."""
    traced = [(name, t) for name, s in strats.items() for t in _ok(s["trials"]) if t.get("profile")]
    if not traced:
        return []
    lines = ["", "Traced steps (`--profile-step`: one step after the counted one, without the memory accountant; "
             "seconds of kernel time per class, summed over streams):", "",
             "| strategy | length | traced s | GPU busy s | " + " | ".join(PROFILE_CLASSES) + " | exposed copy s |",
             "|---|---|---|---|" + "---|" * len(PROFILE_CLASSES) + "---|"]
    for name, t in traced:
        p = t["profile"]
        classes = " | ".join(f"{p['kernel_class_s'].get(c, 0.0):.2f}" for c in PROFILE_CLASSES)
        lines.append(f"| {name} | {t['seq_len']} | {p['traced_s']:.2f} | {p['gpu_busy_s']:.2f} | {classes} | "
                     f"{t.get('exposed_copy_s', 0.0):.2f} |")
    for name, t in traced:
        top = t["profile"]["kernels_by_time"][:8]
        lines += ["", f"{name} at {t['seq_len']}, kernels by time:", "", "| kernel | s | calls |", "|---|---|---|"]
        lines += [f"| `{k['name'][:100]}` | {k['s']:.3f} | {k['calls']} |" for k in top]
    return lines


def kernel_table(op_latency: dict) -> list[str]:
    """Markdown lines: forward and backward milliseconds of every attention kernel op_latency.py
    timed at its largest chunk (the automatic choice first, then ``--backends``), with the
    kernel each ran."""
    row = op_latency["chunks"][-1]
    timed = {"automatic": row, **(row.get("kernels") or {})}
    lines = [f"Attention kernels at one {row['chunk']}-token chunk ({op_latency.get('args', {}).get('heads')} query / "
             f"{op_latency.get('args', {}).get('kv_heads')} KV heads of {op_latency.get('args', {}).get('head_dim')}), "
             "milliseconds:", "",
             "| asked for | ran | causal fwd | causal bwd | full fwd | full bwd |", "|---|---|---|---|---|---|"]
    for asked, lat in timed.items():
        if "error" in lat:
            lines.append(f"| {asked} | failed: {lat['error'][:80]} | | | | |")
            continue
        lines.append(f"| {asked} | `{lat['backend']}` | " + " | ".join(
            f"{lat[k] * 1e3:.1f}" for k in ("diag_fwd_s", "diag_bwd_s", "full_fwd_s", "full_bwd_s")) + " |")
    return lines


def markers(files: list[dict]) -> tuple[str, str]:
    """The README block of a results directory's files: CPU results share the unnamed block of the
    CPU side-by-side; a GPU's results get one per device (``"device"`` of the files)."""
    first = files[0] if files else {}
    if first.get("device_type", "cpu") == "cpu":
        return BEGIN, END
    return f"<!-- plot.py begin {first['device']} -->", f"<!-- plot.py end {first['device']} -->"


def write_readme(path: str, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the block between ``begin`` and ``end`` in ``path`` with ``text`` (append it if absent)."""
    block = f"{begin}\n{text}{end}\n"
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end) + 1:]
    else:
        new = old.rstrip("\n") + "\n\n" + block
    with open(path, "w") as f:
        f.write(new)


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
        strats = _strategies(files)
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

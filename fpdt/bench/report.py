"""The results table of the measurement scripts' JSON (``results.md``, and the generated block
of ``benchmarks/README.md``): per strategy the longest length, least-squares slopes, per-length
peaks and step times, ratios against ``hf`` and ``alst``, the planner's prediction beside the
measurement, traced kernels and op latencies. ``profiling/plot.py`` writes it and the plots.
"""

from __future__ import annotations

import os

from fpdt.bench.fit import extrapolate, slope_per_1k

BEGIN, END = "<!-- plot.py begin -->", "<!-- plot.py end -->"
MIB, GIB = 2 ** 20, 2 ** 30


def measured(trials):
    """Trials whose step completed (also those over a simulated device capacity)."""
    return [t for t in trials if t.get("measured")]


def strategies(files: list[dict]) -> dict:
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


def fit_trials(trials: list) -> list:
    """The trials slopes and plots use: the fixed-length ones when there are any (a bisection
    may run other chunk sizes), else all."""
    return [t for t in trials if t.get("mode", "lengths") == "lengths"] or trials


def capacities(strats: dict) -> list:
    return sorted({c for s in strats.values() for c in s["caps"]}, key=lambda c: (c is None, c or 0))


def longest_cell(s: dict, cap) -> str:
    c = s["caps"].get(cap)
    if c is None:
        return "-"
    return f">= {c['best']} (longest tried)" if c["open_ended"] else str(c["best"])


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
    caps = [c for c in capacities(strats) if c is not None] or [None]
    head = " | ".join(f"longest that fits {c:g} GiB (measured)" if c else "longest length that fits" for c in caps)
    lines += [f"| strategy | {head} | fwd+bwd device KiB / 1K tokens | host KiB / 1K tokens |"
              + (f" longest at {cap:g} GiB, extrapolated from the fit |" if cap else ""),
              "|---|" + "---|" * len(caps) + "---|---|" + ("---|" if cap else "")]
    slopes = {}
    for name, s in strats.items():
        if s["skipped"]:
            lines.append(f"| {name} | skipped: {s['skipped']} |" + " |" * (len(caps) + 1 + bool(cap)))
            continue
        fit = fit_trials(s["trials"])
        dev = _slope(fit, "fwd_bwd_peak_bytes")
        if dev is None:                                   # files without the phase split
            dev = _slope(fit, "device_peak_bytes")
        host = _slope(fit, "host_peak_bytes")
        slopes[name] = dev
        longest = " | ".join(longest_cell(s, c) for c in caps)
        extra = ""
        if cap:
            est = extrapolate(fit_trials(s["trials"]), cap * GIB)
            extra = f" {est} |" if est is not None else " - |"
        lines.append(f"| {name} | {longest} | {dev / 1024:.1f} | {host / 1024:.1f} |{extra}" if dev is not None
                     else f"| {name} | {longest} | - | - |{extra}")
    # a fits column with a capacity, or wherever a completed step was still out of memory (on a
    # GPU: a steady state over the device's memory)
    fits_col = bool(cap) or any(t["status"] != "ok" for s in strats.values() for t in measured(s["trials"]))
    lines += ["", "| strategy | length | device MiB | fwd+bwd MiB | host MiB | total MiB | step s | tokens/s "
              "| MFU | planned allocated MiB (/ measured) | planned step s (/ measured) |"
              + (f" fits ({cap:g} GiB unless noted) |" if cap else " fits |" if fits_col else ""),
              "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fits_col else "")]
    times: dict = {}
    for name, s in strats.items():
        for t in sorted(measured(s["trials"]), key=lambda t: (t["seq_len"], t["mode"] == "bisect")):
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
    kernels = {name: sorted({t["attention_kernel"] for t in measured(s["trials"]) if t.get("attention_kernel")})
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
    (:func:`fpdt.bench.trace.kernel_class`; classes overlap in time across streams) and the
    exposed host<->device copy time, then the kernels that took longest. Empty without a trace."""
    traced = [(name, t) for name, s in strats.items() for t in measured(s["trials"]) if t.get("profile")]
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

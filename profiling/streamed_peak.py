"""Device peak of one whole training step against the sequence length, streamed and not.

The small Llama of ``tests/memory/test_model_budget.py`` (2 layers, hidden 256, bf16), or with
``--model`` a small Qwen3.5 (a Gated DeltaNet and a gated attention layer) or Qwen3-MoE, one
rank, ``offload=True``, ``checkpointing="offload"``, fixed token chunk ``--chunk`` (so ``u``
grows with ``S``); the device bytes counted exactly by :class:`fpdt.memory.MemoryAccountant`
(parameters and their pre-allocated gradients are the baseline). Prints one JSON line per
length and mode; ``--plot`` writes the figure.

    python -m profiling.streamed_peak --lengths 4096,8192,16384 --chunk 1024 --out benchmarks/results/cpu/streamed_peak.jsonl
    python -m profiling.streamed_peak --model qwen35 --lengths 1024,4096,16384 --chunk 256
"""

from __future__ import annotations

import argparse
import json
import statistics

from fpdt.bench.streamed_peak import CONFIGS, measure


def _emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def summary(rows: list[dict]) -> dict:
    """Medians of one length's interleaved steps per mode, and streamed / unstreamed ratios."""
    med = {}
    for stream in (False, True):
        mine = [r for r in rows if r["stream_layers"] is stream]
        med[stream] = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "device_peak_bytes")}
    return {"summary": True, "seq_len": rows[0]["seq_len"], "chunk": rows[0]["chunk"], "repeats": len(rows) // 2,
            "median": {"unstreamed": med[False], "streamed": med[True]},
            "ratio_streamed_over_unstreamed": {k: med[True][k] / med[False][k] for k in med[True]}}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for stream, label in ((False, "not streamed"), (True, "stream_layers")):
        pts = sorted({(r["seq_len"], r["device_peak_bytes"] / 2 ** 20) for r in rows
                      if not r.get("summary") and r["stream_layers"] is stream})
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xlabel("tokens (1K-token chunks)")
    ax.set_ylabel("device peak of a step (MiB, counted)")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--model", choices=sorted(CONFIGS), default="llama")
    p.add_argument("--out", help="append the JSON lines here too")
    p.add_argument("--plot", help="write the figure here (PNG)")
    p.add_argument("--repeats", type=int, default=1, help="steps per length and mode, interleaved; with more than "
                   "one, a last line per length gives the medians and the streamed / unstreamed ratios")
    args = p.parse_args()
    rows = []
    for seq in (int(x) for x in args.lengths.split(",")):
        for _ in range(args.repeats):
            for stream in (False, True):         # interleaved
                rows.append(measure(seq, args.chunk, stream, args.model))
                _emit(rows[-1], args.out)
        if args.repeats > 1:
            _emit(summary([r for r in rows if r["seq_len"] == seq]), args.out)
    if args.plot:   # every row of --out (earlier runs' too), else this run's
        if args.out:
            with open(args.out) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

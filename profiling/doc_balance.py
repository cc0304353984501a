"""Per-rank attention work of packed documents under the FPDT and the zigzag layouts.

Counting only (no model runs): for every window of packed documents and every layout, the
query-key pairs that each of ``P`` ranks computes under the document mask, and the imbalance
``max / mean`` over the ranks (the step waits for the slowest rank).

**Documents**: lengths drawn from a log-normal (median ``--median`` 2048 tokens, ``--sigma``
1.5, so the token-weighted mean is ~20K), clipped to ``--max-doc`` (128K), packed in order
into windows of ``S`` tokens; a document longer than what is left of a window is split and its
continuation starts the next window at position 0 (as ``fpdt-train --pack-documents`` and
Transformers' packing do). ``--windows`` windows per length, one stream per seed.

**Work**: a query at position ``q`` of its document (0-based) sees ``q + 1`` keys (causal,
itself included), so a rank's work is the sum of that over the query tokens it holds, times
the fraction of the heads it computes. This is the exact pair count the masked path runs
(the dense kernel on each shared-document segment of a block, nothing for a skipped block);
a varlen GPU kernel rounds each segment to its 128-token tiles on top.

**Layouts** (``P`` ranks, ``u`` FPDT chunks per rank, the global chunk ``S / u``;
:mod:`fpdt.layout`):

* ``ulysses`` (``hp = P``): after the all-to-all every rank attends every query of the global
  chunk for ``H / P`` heads: ``1/P`` of the total whatever the documents (balanced by
  construction; computed anyway as a check);
* ``fpdt_ring`` (``cp = P`` on the FPDT layout): rank ``r`` holds global piece ``i P + r``
  of every chunk ``i`` (rank-ordinal chunks) and computes its own queries against keys
  passed around a ring;
* ``zigzag`` (``cp = P``, :func:`fpdt.layout.mesh_token_index` with ``hp = 1``): rank ``c``
  holds pieces ``c`` and ``2P - 1 - c`` of every span, the ring's causal load balance;
* ``mesh_hpXcp`` (``hp x cp = P``, zigzag over ``cp``): a CP rank's queries' work split over its
  ``hp`` head ranks;
* ``zigzag_arranged`` (``--arrange``): the zigzag ring with each window's documents in the order
  ``fpdt-train --pack-documents`` writes them on a ring (:meth:`fpdt.train.data.PackedWindows.arrangement`).

    python -m profiling.doc_balance --out benchmarks/results/cpu-amd-epyc/2026-11-27/doc_balance.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from fpdt.bench.documents import (arranged_windows, document_stream, imbalance, keys_seen, layouts, pack_windows,
                                  rank_work)


def run(args) -> dict:
    results = []
    for seq_len in args.lengths:
        for chunk in args.chunks:
            chunks = max(1, seq_len // chunk)
            lays = layouts(seq_len, args.ranks, chunks)
            stream = document_stream(args.seed, args.median, args.sigma, args.max_doc)
            windows = pack_windows(stream, seq_len, args.windows)
            per_layout = {name: [] for name in lays}
            docs_per_window, needed, causal_full = [], [], seq_len * (seq_len + 1) / 2
            arranged = arranged_windows(windows, seq_len, args.ranks, chunks) if args.arrange else None
            if arranged is not None:
                per_layout["zigzag_arranged"] = []
            for w, docs in enumerate(windows):
                work = keys_seen(docs)
                docs_per_window.append(len(docs))
                needed.append(float(work.sum()))
                for name, layout in lays.items():
                    per_layout[name].append(imbalance(rank_work(work, layout)))
                if arranged is not None:
                    per_layout["zigzag_arranged"].append(imbalance(rank_work(arranged(w), lays["zigzag"])))
            dense = torch.arange(1, seq_len + 1, dtype=torch.int64)     # one document: the causal reference
            row = {"seq_len": seq_len, "chunk": seq_len // chunks, "num_chunks": chunks, "ranks": args.ranks,
                   "windows": len(windows), "docs_per_window_mean": statistics.fmean(docs_per_window),
                   "needed_over_causal": statistics.fmean(needed) / causal_full,
                   "imbalance": {name: {"mean": statistics.fmean(v), "median": statistics.median(v), "max": max(v),
                                        "p90": sorted(v)[int(0.9 * (len(v) - 1))]}
                                 for name, v in per_layout.items()},
                   "imbalance_one_document": {name: imbalance(rank_work(dense, layout))
                                              for name, layout in lays.items()}}
            results.append(row)
            print(f"S={seq_len:>8} chunk={row['chunk']:>6} u={chunks:>3} docs/window={row['docs_per_window_mean']:7.1f} "
                  f"needed/causal={row['needed_over_causal']:.4f}  "
                  + "  ".join(f"{k} {v['mean']:.3f}/{v['max']:.3f}" for k, v in row["imbalance"].items()),
                  flush=True)
    return {"what": "per-rank attention work (query-key pairs) of packed documents: max/mean over ranks, "
                    "mean and max over windows (profiling/doc_balance.py)",
            "documents": {"distribution": "log-normal", "median": args.median, "sigma": args.sigma,
                          "max_doc": args.max_doc, "seed": args.seed},
            "host": platform.node(), "torch": torch.__version__, "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2 ** 17, 2 ** 18, 2 ** 19, 2 ** 20])
    p.add_argument("--chunks", type=int, nargs="+", default=[2 ** 16, 2 ** 14],
                   help="global FPDT chunk lengths (u = S / chunk chunks per rank)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--median", type=int, default=2048)
    p.add_argument("--sigma", type=float, default=1.5)
    p.add_argument("--max-doc", type=int, default=2 ** 17)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arrange", action="store_true",
                   help="also the zigzag ring with each window's documents arranged as fpdt-train does on a ring "
                        "(zigzag_arranged)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    out = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

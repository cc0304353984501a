"""The NVMe tier on this machine's disk (``docs/nvme.md``): bandwidth against block size for both
backends, and a training step with and without the tier.

``bandwidth``: ``--total-mib`` of random bytes written through :class:`fpdt.offload.nvme.NVMeStore`
as tensors of each block size (one file each, ``--depth`` transfers in flight), then read back
and compared bit for bit; the disk counterpart of FPDT's PCIe sweep (arXiv:2408.16978, Fig. 10).
The portable backend is buffered, so its write time includes an ``os.sync()`` (the bytes on the
disk) and every file is evicted from the page cache (``posix_fadvise DONTNEED``) before the read;
DeepSpeed's aio opens its files ``O_DIRECT``. The largest block's rates are the calibration that
``fpdt-plan --calibration`` reads (``nvme_read_bytes_s``, ``nvme_write_bytes_s``; ``--calibration-out``).

``step``: one training step of a small Llama (``--layers`` layers, hidden 256, bf16, one rank,
``checkpointing="offload"``, ``attention_checkpoint="save"``) at ``--seq`` tokens, host-only and
with ``nvme_path``: wall and process CPU time (the I/O threads' included) and the host-stash
peak (:class:`fpdt.offload.HostPeak`). ``depth``: the same against the number of layers.

    python -m profiling.nvme_bandwidth bandwidth --dir /mnt/nvme --out benchmarks/results/cpu/nvme_bandwidth.jsonl
    python -m profiling.nvme_bandwidth step --dir /mnt/nvme --seq 16384 --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import torch

from fpdt.offload.nvme import NVMeStore, PortableBackend

BLOCKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 1 << 20,
    "tie_word_embeddings": False, "rope_theta": 10000.0,
}


def backends(names: str | None = None) -> dict:
    """``name -> factory`` of the backends that work here (aio only where libaio builds), or of
    ``names`` (comma-separated) among them."""
    from fpdt.train.nvme_aio import aio_backend, aio_unavailable
    out = {"portable": PortableBackend}
    if names is not None and "deepspeed-aio" not in names.split(","):
        return {k: v for k, v in out.items() if k in names.split(",")}
    probe = aio_backend()
    if probe is not None:
        probe.close()
        out["deepspeed-aio"] = aio_backend
    else:
        print(f"# deepspeed-aio skipped: {aio_unavailable()}")
    return out


def _evict(store: NVMeStore) -> None:
    os.sync()
    for path in store._files.values():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run(store: NVMeStore, tensors: list, out: list, depth: int, read: bool) -> None:
    pending = []
    for i, t in enumerate(tensors):
        pending.append(store.read(i, out[i]) if read else store.write(i, t))
        if len(pending) >= depth:
            pending.pop(0).wait()
    for h in pending:
        h.wait()


def bandwidth(directory: str, name: str, factory, block: int, total: int, depth: int) -> dict:
    """Write then read ``total`` bytes as ``block``-byte tensors through one store; GB/s each way."""
    n = max(1, total // block)
    g = torch.Generator().manual_seed(block)
    tensors = [torch.randint(0, 256, (block,), dtype=torch.uint8, generator=g) for _ in range(n)]
    out = [torch.empty_like(t) for t in tensors]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = NVMeStore(directory, rank=0, backend=factory())
    try:
        t0 = time.perf_counter()
        _run(store, tensors, out, depth, read=False)
        if name == "portable":
            os.sync()                   # buffered writes: count the time until they are on the disk
        write_s = time.perf_counter() - t0
        if name == "portable":
            _evict(store)               # the read must come from the disk, not the page cache
        t0 = time.perf_counter()
        _run(store, tensors, out, depth, read=True)
        read_s = time.perf_counter() - t0
        exact = all(torch.equal(a, b) for a, b in zip(tensors, out))
    finally:
        store.close()
    nbytes = n * block
    return {"what": "bandwidth", "backend": name, "block_bytes": block, "blocks": n, "bytes": nbytes, "depth": depth,
            "write_s": write_s, "read_s": read_s, "write_gb_s": nbytes / write_s / 1e9,
            "read_gb_s": nbytes / read_s / 1e9, "bit_exact": exact}


def step(directory: str | None, seq: int, chunk: int, layers: int) -> dict:
    """One step's wall time and host-stash peak, host-only (``directory`` None) or with the tier."""
    import fpdt.model as fm
    from fpdt.offload import HostPeak
    from fpdt.offload.nvme import NVMeTier
    tier = NVMeTier()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fm.from_config(CONFIG | {"num_hidden_layers": layers}, dtype=torch.bfloat16, num_chunks=seq // chunk,
                               offload=True, checkpointing="offload", attention_checkpoint="save",
                               nvme_path=directory, nvme_tier=tier if directory else None)
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(seq))
        inputs = model.prepare_inputs(ids[:, :-1], labels=ids[:, 1:], shift=False)
        model(**inputs).backward()      # the first step fills the pools
        model.zero_grad(set_to_none=True)
        before = tier.store(directory).bytes_written if directory else 0
        t0, c0 = time.perf_counter(), time.process_time()
        with HostPeak() as host:
            model(**inputs).backward()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        written = tier.store(directory).bytes_written - before if directory else 0
        tier.close()
    return {"what": "step", "seq_len": seq, "chunk": chunk, "layers": layers, "nvme": directory is not None,
            "wall_s": wall, "cpu_s": cpu, "host_peak_bytes": host.above_start, "nvme_bytes_written": written}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name in sorted({r["backend"] for r in rows if r["what"] == "bandwidth"}):
        for way, style in (("write", "-"), ("read", "--")):
            pts = sorted((r["block_bytes"] / 2 ** 20, r[f"{way}_gb_s"]) for r in rows
                         if r["what"] == "bandwidth" and r["backend"] == name)
            ax.plot(*zip(*pts), style, marker="o", label=f"{name} {way}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block (MiB, one file each)")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("bandwidth", "step", "depth"))
    p.add_argument("--dir", help="a directory on the drive to measure (default: a temporary one)")
    p.add_argument("--blocks", default=",".join(str(b) for b in BLOCKS), help="block sizes in bytes")
    p.add_argument("--total-mib", type=int, default=256, help="bytes per block size and backend")
    p.add_argument("--depth", type=int, default=8, help="transfers in flight")
    p.add_argument("--backends", help="comma-separated: portable, deepspeed-aio (default: every one that works "
                                      "here; deepspeed-aio JIT-builds on first use, minutes)")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--layers", default="4", help="decoder layers (depth: a comma-separated list)")
    p.add_argument("--out", help="append the JSON lines here too")
    p.add_argument("--plot", help="write the bandwidth figure here (PNG)")
    p.add_argument("--calibration-out", help="write the largest block's rates as an fpdt-plan calibration (JSON)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        if args.mode == "bandwidth":
            for name, factory in backends(args.backends).items():
                for block in (int(b) for b in args.blocks.split(",")):
                    rows.append(bandwidth(d, name, factory, block, args.total_mib << 20, args.depth))
                    print(json.dumps(rows[-1]), flush=True)
        else:
            depths = [int(x) for x in args.layers.split(",")]
            for layers in depths:
                for nvme in (False, True):
                    rows.append(step(d if nvme else None, args.seq, args.chunk, layers))
                    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if args.plot and args.mode == "bandwidth":
        plot(rows, args.plot)
    if args.calibration_out and args.mode == "bandwidth":
        big = max(r["block_bytes"] for r in rows)
        best = [r for r in rows if r["block_bytes"] == big]
        with open(args.calibration_out, "w") as f:
            json.dump({"device": "this machine's disk (profiling/nvme_bandwidth.py)",
                       "nvme_read_bytes_s": max(r["read_gb_s"] for r in best) * 1e9,
                       "nvme_write_bytes_s": max(r["write_gb_s"] for r in best) * 1e9}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

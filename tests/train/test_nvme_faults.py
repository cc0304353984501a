"""One rank's drive fails in the middle of a step under fpdt-train (docs/nvme.md, Safety): every
rank stops with the same one line naming that rank, its file and the errno message, before the
optimizer step and any save; the tier's files are removed and the last checkpoint is left as it was.
The faults of a standalone model still raise at ``wait()`` (tests/offload/test_nvme.py)."""

from __future__ import annotations

import errno
import hashlib
import os
import warnings
from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fpdt.offload.nvme import NVMeError, NVMeStore, PortableBackend
from tests.distributed import run_distributed
from tests.train.helpers import SGD, SGD_CLIP, TINY_CONFIG, ds_config, quiet, write_fixture, write_json

LAYERS = 4          # with two inputs staged, layers 0 and 1 are written in each forward
DIST_TIMEOUT_S = 60  # a hang fails in a minute, not torch's default half hour


class FullDrive(PortableBackend):
    """The portable backend whose writes fail with ENOSPC after the first ``after``."""

    name = "full-drive"

    def __init__(self, after: int):
        super().__init__(threads=1)
        self.after, self.writes = after, 0

    def write(self, path, view, padded):
        self.writes += 1
        if self.writes <= self.after:
            return super().write(path, view, padded)
        failed = Future()
        failed.set_exception(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return failed


def test_deferred_fault_is_recorded_not_raised(tmp_path):
    """Under the store's deferred_faults a failed write's wait() returns and the first error is
    kept for its take_fault (once); outside it the same failure raises, as before."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # tmp_path may be on tmpfs
        store = NVMeStore(tmp_path, rank=0, backend=FullDrive(after=1))
    try:
        store.write("a", torch.ones(10)).wait()
        with store.deferred_faults():
            store.write("b", torch.ones(10)).wait()         # fails: recorded
            store.write("c", torch.ones(10)).wait()         # fails too: the first is kept
            out = torch.full((10,), 7.0)
            store.read("b", out).wait()                     # no file: recorded, the buffer as it was
            assert torch.equal(out, torch.full((10,), 7.0))
        fault = store.take_fault()
        assert isinstance(fault, NVMeError) and "write of 'b'" in str(fault) and "(errno 28)" in str(fault)
        assert store.take_fault() is None
        with pytest.raises(NVMeError, match="write of 'd'.*No space left on device"):
            store.write("d", torch.ones(10)).wait()
    finally:
        store.close(raise_errors=False)        # "d" failed outside: close would raise it again
    assert os.listdir(tmp_path) == []


def _digest(root: str) -> dict[str, str]:
    out = {}
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _run(argv: list[str]):
    """fpdt-train's run(): its records, or the RunError it stopped with."""
    from fpdt.cli.train import build_parser, run
    from fpdt.train.errors import RunError

    try:
        return run(build_parser().parse_args(argv))
    except RunError as e:
        return e


def _body(rank: int, world_size: int, tmp: str) -> None:
    quiet()
    dist.destroy_process_group()            # the harness's group, remade with a short timeout
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=DIST_TIMEOUT_S))
    from fpdt.train import nvme_aio, saving
    drives = {"next": lambda: PortableBackend()}
    nvme_aio.default_backend = lambda: (drives["next"](), "NVMe backend: portable (test)")
    ck, nv = os.path.join(tmp, "ckpt"), os.path.join(tmp, "nvme")
    base = ["--model-config", os.path.join(tmp, "config.json"), "--data", os.path.join(tmp, "tokens.npy"),
            "--seq-len", "64", "--chunk-size", "32", "--sp", "2", "--deepspeed", os.path.join(tmp, "sgd.json"),
            "--runtime", "sim", "--checkpoint", "offload", "--attention-checkpoint", "recompute",
            "--nvme-path", nv, "--nvme-layers", str(LAYERS), "--save-dir", ck, "--save-every", "1"]

    records = _run([*base, "--steps", "1"])
    assert len(records) == 1, records
    dist.barrier()
    saved = _digest(os.path.join(ck, "step1"))
    assert saved and os.listdir(nv) == []           # the run's files went with it

    if rank == 1:                                   # rank 1's drive fills up after its first write
        drives["next"] = lambda: FullDrive(after=1)
    error = _run([*base, "--steps", "3", "--resume", ck])
    assert not isinstance(error, list), "the run went on past the failed drive"
    messages = [None] * world_size
    dist.all_gather_object(messages, str(error))
    assert messages[0] == messages[1], messages
    line = messages[0]
    assert error.same_on_every_rank and "\n" not in line
    assert line.startswith("step 2: the NVMe tier failed on rank 1 (rank 1: NVMe write of "), line
    assert f"to {os.path.join(nv, 'rank1')}{os.sep}" in line and "No space left on device (errno 28)" in line, line
    assert line.endswith(f"the step's update was not applied, and nothing was saved for it. Last checkpoint: {ck} "
                         f"(resume with --resume {ck})"), line
    dist.barrier()
    assert os.listdir(nv) == []                     # every rank's files removed
    assert sorted(t for t in os.listdir(ck) if t.startswith("step")) == ["step1"]
    assert saving.read_latest(ck) == "step1"
    assert _digest(os.path.join(ck, "step1")) == saved


@pytest.mark.slow
def test_one_ranks_full_drive_stops_every_rank_with_one_line(tmp_path):
    tmp = str(tmp_path)
    write_fixture(tmp)
    write_json(os.path.join(tmp, "config.json"), {**TINY_CONFIG, "num_hidden_layers": LAYERS})
    write_json(os.path.join(tmp, "sgd.json"), ds_config(SGD, SGD_CLIP))
    os.mkdir(os.path.join(tmp, "nvme"))
    run_distributed(_body, world_size=2, args=(tmp,), timeout=300)

"""NVMeStore (fpdt/offload/nvme.py): bit-exact round trips, concurrency, cleanup, the marker,
preflight, the RAM-backed warning and I/O errors, on the portable backend; the round trip on both
backends (DeepSpeed's aio: tests/offload/nvme_helpers.py)."""

import errno
import json
import os
import signal
import subprocess
import sys
import warnings
from concurrent.futures import Future

import pytest
import torch

from fpdt.offload.nvme import (ALIGN, MARKER, NVMeError, NVMeStore, PortableBackend, aligned, check_space,
                               filesystem_type, ram_backed)
from tests.offload.nvme_helpers import BACKENDS, backend_factory, tensor


@pytest.fixture
def store(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # tmp_path may be on tmpfs
        s = NVMeStore(tmp_path, rank=3)
    yield s
    s.close()


@pytest.fixture(scope="module", params=BACKENDS)
def make_backend(request):
    return request.param, backend_factory(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("n", [1, 7, 1024, 4097, 300_003])
def test_roundtrip_bit_exact(tmp_path, make_backend, dtype, n):
    """Both backends, every size (below, at and past one alignment block and aio's 1 MiB block)."""
    name, make = make_backend
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # tmp_path may be on tmpfs
        store = NVMeStore(tmp_path, rank=0, backend=make())
    assert store.backend.name == name
    with store:
        t = tensor(dtype, n)
        store.write(("x", n), t).wait()
        out = torch.empty_like(t)
        store.read(("x", n), out).wait()
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        path = store._files[("x", n)]
        assert os.path.getsize(path) == aligned(t.numel() * t.element_size()) != 0
        assert os.path.getsize(path) % ALIGN == 0
    assert os.listdir(tmp_path) == []


def test_shapes_kept_by_caller(store):
    t = tensor(torch.float32, 6 * 5 * 3).view(6, 5, 3)
    store.write("t", t).wait()
    out = torch.empty(6, 5, 3)
    store.read("t", out).wait()
    assert torch.equal(out, t)


def test_many_keys_concurrent_in_flight(store):
    ts = {("layer", i, j): tensor(torch.bfloat16, 3000 + 17 * i + j, seed=i * 10 + j) for i in range(8) for j in range(4)}
    handles = [store.write(k, t) for k, t in ts.items()]       # all in flight at once
    for h in handles:
        h.wait()
    assert len(store) == len(ts)
    outs = {k: torch.empty_like(t) for k, t in ts.items()}
    reads = [store.read(k, outs[k]) for k in reversed(list(ts))]
    for h in reads:
        h.wait()
    for k, t in ts.items():
        assert torch.equal(outs[k].view(torch.int16), t.view(torch.int16)), k
    assert store.bytes_written == sum(aligned(t.numel() * 2) for t in ts.values())
    assert store.bytes_read == store.bytes_written


def test_read_waits_for_write_in_flight(store):
    t = tensor(torch.float32, 50_000)
    store.write("k", t)                      # not waited
    out = torch.empty_like(t)
    store.read("k", out).wait()
    assert torch.equal(out, t)


def test_overwrite_and_discard(store):
    a, b = tensor(torch.float32, 100, 1), tensor(torch.float32, 100, 2)
    store.write("k", a).wait()
    store.write("k", b).wait()
    out = torch.empty(100)
    store.read("k", out).wait()
    assert torch.equal(out, b)
    path = store._files["k"]
    store.discard("k")
    assert not os.path.exists(path) and "k" not in store
    store.discard("k")                       # no-op
    with pytest.raises(KeyError, match="no key 'k'"):
        store.read("k", out)


def test_bad_tensors_refused(store):
    with pytest.raises(TypeError, match="contiguous CPU tensor"):
        store.write("k", torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="contiguous CPU tensor"):
        store.write("k", [1, 2])


def test_close_removes_everything(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = NVMeStore(tmp_path, rank=0)
    (tmp_path / "user-file").write_text("keep me")
    for i in range(5):
        s.write(i, tensor(torch.float32, 999, i))     # in flight at close
    s.close()
    assert sorted(os.listdir(tmp_path)) == ["user-file"]
    s.close()                                          # idempotent
    with pytest.raises(NVMeError, match="closed"):
        s.write(0, torch.zeros(1))


def test_exception_in_context_removes_files(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with NVMeStore(tmp_path, rank=1) as s:
                s.write("a", torch.ones(1000)).wait()
                assert os.listdir(tmp_path / "rank1")
                1 / 0
    assert os.listdir(tmp_path) == []


def _write_marker(d, pid, host=None):
    import socket
    d.mkdir()
    (d / MARKER).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "created": 0}))


def test_reclaims_marked_leftover_of_dead_process(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    _write_marker(tmp_path / "rank0", dead)
    (tmp_path / "rank0" / "0.bin").write_bytes(b"x" * 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with NVMeStore(tmp_path, rank=0) as s:
            assert sorted(os.listdir(s.dir)) == [MARKER]
            assert json.loads((tmp_path / "rank0" / MARKER).read_text())["pid"] == os.getpid()
    assert os.listdir(tmp_path) == []


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "precious.txt").write_text("data")
    with pytest.raises(NVMeError) as e:
        NVMeStore(tmp_path, rank=0)
    msg = str(e.value)
    assert str(tmp_path / "rank0") in msg and "not created by fpdt" in msg and "\n" not in msg
    assert (tmp_path / "rank0" / "precious.txt").read_text() == "data"


def test_refuses_marked_directory_with_foreign_files(tmp_path):
    _write_marker(tmp_path / "rank0", 2**22 + 12345, host="another-host")
    (tmp_path / "rank0" / "notes.txt").write_text("data")
    with pytest.raises(NVMeError, match="did not write \\(notes.txt\\)"):
        NVMeStore(tmp_path, rank=0)
    assert (tmp_path / "rank0" / "notes.txt").exists() and (tmp_path / "rank0" / MARKER).exists()


def test_refuses_directory_of_a_live_run(tmp_path):
    _write_marker(tmp_path / "rank0", os.getppid())         # our parent: alive, on this host
    with pytest.raises(NVMeError, match=f"in use by running process {os.getppid()}"):
        NVMeStore(tmp_path, rank=0)
    assert (tmp_path / "rank0" / MARKER).exists()


def test_missing_directory_refused(tmp_path):
    with pytest.raises(NVMeError, match="not an existing directory; create it"):
        NVMeStore(tmp_path / "nope")


def test_preflight_space(tmp_path):
    free = check_space(tmp_path, 1)
    assert free > 0
    with pytest.raises(NVMeError) as e:
        check_space(tmp_path, 10**18)
    msg = str(e.value)
    assert str(tmp_path) in msg and "1,000,000,000,000,000,000 bytes" in msg and " free" in msg and "\n" not in msg
    with pytest.raises(NVMeError, match="needs"):
        NVMeStore(tmp_path, need_bytes=10**18)
    assert os.listdir(tmp_path) == []


MOUNTS = """\
sysfs /sys sysfs rw 0 0
/dev/nvme0n1p2 / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid 0 0
/dev/nvme1n1 /mnt/nvme xfs rw 0 0
ramfs /mnt/nvme/ram ramfs rw 0 0
"""


def test_filesystem_type_from_mounts():
    assert filesystem_type("/dev/shm/x", MOUNTS) == "tmpfs"
    assert filesystem_type("/mnt/nvme/run1", MOUNTS) == "xfs"
    assert filesystem_type("/mnt/nvme/ram/a", MOUNTS) == "ramfs"
    assert filesystem_type("/mnt/nvmex", MOUNTS) == "ext4"          # a prefix of a name is not a mount
    assert ram_backed("/dev/shm", MOUNTS) and ram_backed("/mnt/nvme/ram", MOUNTS)
    assert not ram_backed("/mnt/nvme", MOUNTS) and not ram_backed("/home", MOUNTS)


def test_tmpfs_warning():
    if not os.path.isdir("/dev/shm") or not ram_backed("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm on this machine")
    with pytest.warns(UserWarning, match="RAM-backed: .* costs host memory"):
        s = NVMeStore("/dev/shm", rank=os.getpid())
    s.close()


class _FailingBackend(PortableBackend):
    name = "failing"

    def __init__(self, err):
        super().__init__(threads=1)
        self.err = err

    def write(self, path, view, padded):
        f = Future()
        f.set_exception(OSError(self.err, os.strerror(self.err)))
        return f


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_io_error_surfaces_from_wait(tmp_path, err):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = NVMeStore(tmp_path, rank=0, backend=_FailingBackend(err))
    h = s.write(("layer input", 4), torch.ones(10))
    with pytest.raises(NVMeError) as e:
        h.wait()
    msg = str(e.value)
    assert "write of ('layer input', 4)" in msg and str(tmp_path / "rank0") in msg
    assert os.strerror(err) in msg and f"errno {err}" in msg and "\n" not in msg
    with pytest.raises(NVMeError):          # the same error again, and at close
        h.wait()
    with pytest.raises(NVMeError, match=os.strerror(err)):
        s.close()
    assert os.listdir(tmp_path) == []


def test_real_enospc_on_a_tiny_filesystem(tmp_path):
    """A real ENOSPC would need a small mount; RLIMIT_FSIZE gives EFBIG the same way."""
    code = f"""
import resource, signal, torch, warnings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
warnings.simplefilter("ignore")
from fpdt.offload.nvme import NVMeStore, NVMeError
s = NVMeStore({str(tmp_path)!r})
try:
    s.write("big", torch.ones(100_000)).wait()
except NVMeError as e:
    print("ERR", e)
s.close(raise_errors=False)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert "ERR NVMe write of 'big'" in out.stdout and "File too large" in out.stdout, out.stdout + out.stderr
    assert os.listdir(tmp_path) == []


def test_ctrl_c_removes_files(tmp_path):
    """Ctrl-C (SIGINT, Python's KeyboardInterrupt) ends the process through the interpreter's
    exit, which closes a store left open."""
    code = f"""
import time, torch, warnings
warnings.simplefilter("ignore")
from fpdt.offload.nvme import NVMeStore
s = NVMeStore({str(tmp_path)!r})
s.write("a", torch.ones(5000)).wait()
print("ready", flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout.readline().strip() == "ready"
    assert os.listdir(tmp_path / "rank0")
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    assert p.returncode != 0
    assert os.listdir(tmp_path) == []


def test_the_library_takes_no_signal(tmp_path):
    """Importing the NVMe module and using a store (or a tier) installs no signal handler."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    import fpdt.offload.nvme as nvme
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nvme.NVMeTier() as tier:
            tier.store(tmp_path, 0).write("a", torch.ones(10)).wait()
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert os.listdir(tmp_path) == []


def test_atexit_removes_files(tmp_path):
    code = f"""
import torch, warnings
warnings.simplefilter("ignore")
from fpdt.offload.nvme import NVMeStore
s = NVMeStore({str(tmp_path)!r}, rank=2)
s.write("a", torch.ones(5000))
keep = [s]
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    assert os.listdir(tmp_path) == []


def test_second_store_on_the_same_directory_in_one_process(tmp_path):
    """A second store of the same (path, rank) in this process is refused, never reclaimed over
    the first one's files; a tier hands out the one store."""
    from fpdt.offload.nvme import NVMeTier
    tier = NVMeTier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = tier.store(tmp_path, 0)
        assert tier.store(str(tmp_path), 0) is first
        first.write("a", torch.ones(10)).wait()
        with pytest.raises(NVMeError, match="in use by another NVMeStore of this process"):
            NVMeStore(tmp_path, rank=0)
    assert "a" in first
    first.close()
    assert os.listdir(tmp_path) == []

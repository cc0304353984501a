"""fpdt-train's SIGTERM handling: the library takes no signal, the trainer turns SIGTERM into the
orderly stop of Ctrl-C, so the NVMe tier's files go with the run."""

import os
import signal
import subprocess
import sys


def test_sigterm_unwinds_and_removes_the_tier_files(tmp_path):
    code = f"""
import time, torch, warnings
warnings.simplefilter("ignore")
from fpdt.cli.train import terminate_as_interrupt
from fpdt.offload.nvme import NVMeTier
try:
    with terminate_as_interrupt(), NVMeTier() as tier:
        tier.store({str(tmp_path)!r}, 0).write("a", torch.ones(5000)).wait()
        print("ready", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    assert os.listdir(tmp_path / "rank0")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert out.strip() == "interrupted" and p.returncode == 0
    assert os.listdir(tmp_path) == []


def test_the_handler_is_restored():
    from fpdt.cli.train import terminate_as_interrupt
    before = signal.getsignal(signal.SIGTERM)
    with terminate_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before

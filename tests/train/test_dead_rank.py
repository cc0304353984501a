"""A rank that dies or stalls mid-run must not leave the others waiting: the survivor stops
with one clear line naming the step, within the process-group timeout (--dist-timeout-min).

Killed (SIGKILL): gloo sees the closed connection at once. Stalled (SIGSTOP): the peer's
socket stays open, so only the timeout ends the wait; a short one keeps the test short."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train.helpers import write_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps_logged(path: str) -> int:
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip() and json.loads(line))


@pytest.mark.slow
@pytest.mark.parametrize("signum, timeout_min", [(signal.SIGKILL, 0.5),
                                                 pytest.param(signal.SIGSTOP, 0.25, marks=pytest.mark.long)],
                         ids=["killed", "stalled"])
def test_dead_or_stalled_rank_stops_the_other_with_a_clear_message(tmp_path, signum, timeout_min):
    cfg, data = write_fixture(str(tmp_path))
    log = str(tmp_path / "log.jsonl")
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "fpdt.cli", "--model-config", cfg, "--data", data, "--seq-len", "64",
               "--steps", "100000", "--sp", "2", "--log-json", log, "--dist-timeout-min", str(timeout_min)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        deadline = time.monotonic() + 240          # start-up on a loaded machine; a hang guard, not a timing check
        while _steps_logged(log) < 2:
            assert procs[0].poll() is None and procs[1].poll() is None, procs[0].stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the 2-rank run did not reach step 2"
            time.sleep(0.2)
        procs[1].send_signal(signum)               # rank 1 dies / freezes in the middle of a later step
        try:
            _, err = procs[0].communicate(timeout=timeout_min * 60 + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still runs {timeout_min * 60 + 60:.0f} s after rank 1 stopped")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()                           # SIGKILL also ends a stopped process
            p.wait()
    assert procs[0].returncode == 1, err[-3000:]
    lines = [l for l in err.splitlines() if l.startswith("fpdt-train: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err
    assert lines[0].startswith("fpdt-train: error: rank 0: step "), lines[0]
    assert "a collective failed, so another rank died or stalled" in lines[0]
    assert "--dist-timeout-min" in lines[0]

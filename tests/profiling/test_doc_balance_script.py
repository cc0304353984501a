"""profiling/doc_balance.py run as a user runs it (``python -m``): its JSON per length; the
counting itself is tested in tests/bench/test_documents.py."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "profiling.doc_balance", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.long
@pytest.mark.slow
def test_imbalance_per_layout_and_the_trainers_arrangement(tmp_path):
    """One document is balanced by the zigzag; --arrange (fpdt-train's ring order) is never
    busier than stream order."""
    out, arranged = tmp_path / "b.json", tmp_path / "a.json"
    _run("--lengths", "4096", "--chunks", "1024", "--windows", "2", "--median", "64", "--max-doc", "1024",
         "--out", str(out))
    row = json.loads(out.read_text())["results"][0]
    assert row["num_chunks"] == 4 and row["imbalance"]["ulysses"]["max"] == pytest.approx(1.0)
    assert row["imbalance_one_document"]["zigzag"] == 1.0 and 0 < row["needed_over_causal"] < 1
    _run("--lengths", "4096", "--chunks", "1024", "--windows", "6", "--median", "64", "--max-doc", "1024",
         "--arrange", "--out", str(arranged))
    imb = json.loads(arranged.read_text())["results"][0]["imbalance"]
    assert imb["zigzag_arranged"]["mean"] <= imb["zigzag"]["mean"] and imb["zigzag_arranged"]["max"] <= imb["zigzag"]["max"]

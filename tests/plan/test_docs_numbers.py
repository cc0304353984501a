"""The planner's numbers in docs/plan.md's tables and docs/nvme.md, each beside the flags that
produce it, against what ``fpdt-plan`` prints now (lengths in its unit: 1M = 2^20 tokens)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest

from fpdt.plan.cli import main, tokens_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2 ** 30
GRANULE = 2 ** 16          # what binds: what a length this much longer runs out of


def _page(name: str) -> str:
    with open(os.path.join(ROOT, "docs", name)) as f:
        return f.read()


def _plan(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _longest(flags: list[str], stream: str) -> tuple[dict, str]:
    """The longest length's answer and what a longer one runs out of."""
    best = _plan(*flags, stream, "--max-seq-len")
    longer = _plan(*flags, stream, "--seq-len", str(best["max_seq_len"] + GRANULE))
    return best, longer["limited_by"]


def _rows(page: str, heading: str) -> list[list[str]]:
    """The cells of the table under ``heading`` whose first cell is a flag list in backticks."""
    start = page.index(heading)
    end = page.find("\n## ", start + 1)
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in page[start:end].splitlines()
            if line.startswith("| `--model")]


def _bold(a: str, b: str) -> tuple[str, str]:
    """The two lengths with the larger one in bold, as the tables mark the planner's choice."""
    return (f"**{a}**", b) if float(a[:-1]) * (2 ** 20 if a[-1] == "M" else 1) >= \
        float(b[:-1]) * (2 ** 20 if b[-1] == "M" else 1) else (a, f"**{b}**")


def test_the_unit_is_the_papers():
    assert [tokens_text(n) for n in (4390912, 2 ** 21, 32768, 1441792, 18153472, 1000)] == \
        ["4.19M", "2M", "32K", "1.38M", "17.3M", "1000"]


@pytest.mark.long
@pytest.mark.slow
def test_streamed_layers_table_is_the_planners():
    rows = _rows(_page("plan.md"), "## Streamed layers: what the planner predicts")
    assert len(rows) == 7
    for flags_cell, streamed_cell, at_length, unstreamed_cell, binds in rows:
        flags = flags_cell.strip("`").split()
        streamed, s_binds = _longest(flags, "--stream-layers")
        unstreamed, u_binds = _longest(flags, "--no-stream-layers")
        want = _bold(tokens_text(streamed["max_seq_len"]), tokens_text(unstreamed["max_seq_len"]))
        assert (streamed_cell, unstreamed_cell) == want, flags_cell
        assert at_length == (f"{streamed['device_peak_bytes'] / GIB:.1f} GiB / "
                             f"{streamed['host_peak_bytes'] / GIB:.0f} GiB"), flags_cell
        assert binds == f"{s_binds} / {u_binds}", flags_cell


@pytest.mark.long
@pytest.mark.slow
def test_nvme_table_is_the_planners():
    page = _page("plan.md")
    rows = _rows(page, "## The NVMe tier: what the planner predicts")
    assert len(rows) == 3
    for flags_cell, unstreamed_cell, streamed_cell, host_only, binds, disk in rows:
        flags = flags_cell.strip("`").split()
        streamed, s_binds = _longest(flags, "--stream-layers")
        unstreamed, u_binds = _longest(flags, "--no-stream-layers")
        want = _bold(tokens_text(unstreamed["max_seq_len"]), tokens_text(streamed["max_seq_len"]))
        assert (unstreamed_cell, streamed_cell) == want, flags_cell
        plain = [f for i, f in enumerate(flags) if not (f.startswith("--nvme") or flags[i - 1].startswith("--nvme"))]
        host = [tokens_text(_plan(*plain, s, "--max-seq-len")["max_seq_len"])
                for s in ("--no-stream-layers", "--stream-layers")]
        assert host_only == f"{host[0]} / {host[1]}", flags_cell
        assert binds == f"{s_binds} / {u_binds}", flags_cell
        chosen = max((unstreamed, "unstreamed"), (streamed, "streamed"), key=lambda a: a[0]["max_seq_len"])
        n = chosen[0]["nvme"]
        assert disk == (f"{n['bytes_per_node'] / GIB:.0f} GiB ({chosen[1]}, first {n['layers']} layers): writes "
                        f"{n['write_s']:.0f} s in a {n['forward_s']:.0f} s forward, reads {n['read_s']:.0f} s in "
                        f"{n['backward_s']:.0f} s of backward"), flags_cell
    assert "fpdt-plan --model llama-3-8b --gpu h100-80g --gpus-per-node 8 --host-mem-gib 2048 --nvme gen5-x8" in page


@pytest.mark.long
@pytest.mark.slow
def test_packed_documents_figures_are_the_planners():
    page = " ".join(_page("plan.md").split())
    node = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--host-mem-gib", "1024",
            "--seq-len", str(2 ** 21)]
    assert f"`fpdt-plan {' '.join(node)}`, then `--doc-len 8192`, `--doc-len 2048`" in page
    one, eight, two = (_plan(*node, *extra) for extra in ([], ["--doc-len", "8192"], ["--doc-len", "2048"]))
    assert (f"{one['step_time_s']:.0f} s per step as one document, {eight['step_time_s']:.1f} s with 8K-token "
            f"documents (MFU {eight['mfu']:.0%}") in page
    assert f"and {two['step_time_s']:.1f} s with 2K ones" in page


@pytest.mark.slow
def test_every_layer_saving_length_is_the_planners():
    page = " ".join(_page("plan.md").split())
    node = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--host-mem-gib", "1024"]
    assert f"fpdt-plan {' '.join(node)} --max-seq-len" in page
    longest = _plan(*node, "--save-attention-layers", "32", "--max-seq-len")["max_seq_len"]
    assert (f"every layer saves up to {tokens_text(longest)} tokens (the example's command with "
            f"`--save-attention-layers 32`)") in page


def test_nvme_page_quotes_the_worked_example():
    """docs/nvme.md's first figures are docs/plan.md's worked example's (checked against the tool
    by tests/plan/test_cli.py)."""
    nvme, plan = " ".join(_page("nvme.md").split()), " ".join(_page("plan.md").split())
    m = re.search(r"at ([\d.]+M) tokens on 8 × H100 with 1 TiB of host, (\d+) GiB of it holds layer-input", nvme)
    assert m and f"**{m.group(1)} tokens**" in plan and f"{m.group(2)} GiB are offloaded layer inputs" in plan
    assert "`fpdt-plan --model llama-3-8b --gpu h100-80g --gpus-per-node 8 --host-mem-gib 1024 --max-seq-len`" in nvme

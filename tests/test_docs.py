"""README.md, CONTRIBUTING.md and docs/: every code block runs as written, every relative link
resolves, and nothing names a document the repository does not have.

A fenced block's info string says how it runs:

- ```` ```python ````: run in a fresh process from a scratch directory that sees the repository's
  ``examples/``; ```` ```python ranks=N ````: on N gloo ranks of ``tests/distributed.py``.
- ```` ```bash ````: run as a bash script (``set -e``) from such a directory. ```` ```bash slow ```` /
  ```` ```python slow ```` marks a run of ten seconds or more whose work CI checks elsewhere (training
  runs: in shorter form in ``tests/train`` and ``tests/hf``; ``fpdt-plan`` length searches: the
  figures in ``tests/plan``), run in the ``long`` tier.
- The README's single-process blocks run in the fast set (the README's own test command checks
  its quick starts); ``ranks=N`` blocks and those of the other pages among the slow tests.
- ```` ```bash gpu ```` / ```` ```python gpu ````: needs a GPU; skipped without one. On the CPU
  the ``fpdt-train`` / ``fpdt-plan`` lines still parse with the tools' own argument parsers and
  every ``examples/`` path they name exists.
- ```` ```bash ci ````: the README's set-up lines, which ``.ci/run`` runs (``tests/train/test_readme.py``
  checks that they agree); not run here, since they install the project and run this suite.
- ```` ```text ````: output or a formula, not run.

The figures the docs quote from ``fpdt-plan`` are compared with what it prints in
``tests/plan/test_cli.py``; the README's attention quick start is checked against the float64
reference in ``tests/attention/test_readme_snippet.py``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.distributed import run_distributed
from tests.train.helpers import fresh_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", "CONTRIBUTING.md",
                *(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))])
LINKED_PAGES = PAGES + ["benchmarks/README.md"]
FENCE = re.compile(r"^( *)```([^\n`]*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
LANGS = {"python", "bash", "text"}
TAGS = {"slow", "gpu", "ci"}


def _read(rel: str) -> str:
    path = os.path.join(ROOT, rel)
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        return f.read()


def code_blocks():
    """(page, line, lang, tags, code) of every fenced block."""
    out = []
    for page in PAGES:
        text = _read(page)
        for m in FENCE.finditer(text):
            info = m.group(2).split()
            lang, tags = (info[0] if info else ""), info[1:]
            line = text.count("\n", 0, m.start()) + 1
            code = textwrap.dedent("".join(l[len(m.group(1)):] if l.startswith(m.group(1)) else l
                                           for l in m.group(3).splitlines(keepends=True)))
            out.append((page, line, lang, tags, code))
    return out


def _ranks(tags) -> int:
    for t in tags:
        if t.startswith("ranks="):
            return int(t.split("=", 1)[1])
    return 1


def _blocks(lang, *, gpu=False, multi=None):
    """The blocks of one language; the README's single-process ones are in the fast set (the
    README's test command checks its own quick starts), the rest among the slow tests."""
    params = []
    for page, line, blang, tags, code in code_blocks():
        if blang != lang or ("gpu" in tags) != gpu or "ci" in tags:
            continue
        n = _ranks(tags)
        if multi is not None and (n > 1) != multi:
            continue
        slow = not gpu and ("slow" in tags or n > 1 or page != "README.md")
        marks = [pytest.mark.slow] if slow else []
        if not gpu and "slow" in tags:    # a run checked elsewhere in CI: the long tier
            marks.append(pytest.mark.long)
        params.append(pytest.param(code, n, id=f"{page}:{line}", marks=marks))
    return params


def _scratch(tmp_path) -> str:
    """A directory that sees the repository's examples/ (blocks write runs/ there, not in the checkout)."""
    for name in ("examples", "benchmarks", "profiling"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    return str(tmp_path)


def _env() -> dict:
    env = fresh_env()
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def test_every_block_says_how_it_runs():
    blocks = code_blocks()
    assert len(blocks) >= 10
    for page, line, lang, tags, _ in blocks:
        assert lang in LANGS, f"{page}:{line}: a block needs one of {sorted(LANGS)} as its language, not {lang!r}"
        for t in tags:
            assert t in TAGS or re.fullmatch(r"ranks=\d+", t), f"{page}:{line}: unknown tag {t!r}"


@pytest.mark.parametrize("code, ranks", _blocks("python", multi=False))
def test_python_block_runs(code, ranks, tmp_path):
    proc = subprocess.run([sys.executable, "-c", code], cwd=_scratch(tmp_path), env=_env(),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _run_block(rank, world_size, code, cwd):
    """One rank of a ``ranks=N`` block, with the environment torchrun would give it."""
    os.chdir(cwd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    exec(compile(code, "docs block", "exec"), {"__name__": "__main__"})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("code, ranks", _blocks("python", multi=True))
def test_multi_rank_python_block_runs(code, ranks, tmp_path):
    run_distributed(_run_block, world_size=ranks, args=(code, _scratch(tmp_path)), timeout=280)


def _bash(code, tmp_path, timeout):
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + code], cwd=_scratch(tmp_path), env=_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert "FutureWarning" not in proc.stdout + proc.stderr     # third-party deprecations are filtered
    return proc


@pytest.mark.timeout(1200)                               # training runs of a minute each, on 2 shared cores
@pytest.mark.parametrize("code, ranks", _blocks("bash"))
def test_bash_block_runs(code, ranks, tmp_path):
    _bash(code, tmp_path, timeout=1100)
    log = tmp_path / "runs" / "tiny.jsonl"
    if "--log-json runs/tiny.jsonl" in code:          # the README's main job: "from about 7.6 to about 6.4"
        losses = [json.loads(line)["loss"] for line in open(log)]
        assert len(losses) == 60 and abs(losses[0] - 7.6) < 0.3 and abs(losses[-1] - 6.4) < 0.3, losses
    log = tmp_path / "runs" / "sp2.jsonl"
    if "--log-json runs/sp2.jsonl" in code:           # the README's 2-rank quick start: "from about 7.6 to about 6.5"
        losses = [json.loads(line)["loss"] for line in open(log)]
        assert len(losses) == 18 and abs(losses[0] - 7.6) < 0.3 and abs(losses[-1] - 6.5) < 0.3, losses


def _commands(code: str):
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", code)
    return [shlex.split(l, comments=True) for l in joined.splitlines() if shlex.split(l, comments=True)]


def _tool_argv(argv):
    """(tool, its arguments) for an fpdt-train / fpdt-plan command, however it is launched."""
    for tool in ("fpdt-train", "fpdt-plan"):
        if argv[0] == tool:
            return tool, argv[1:]
    for module, tool in (("fpdt.cli", "fpdt-train"), ("fpdt.plan", "fpdt-plan")):
        for flag in ("-m", "--module"):
            for i in range(len(argv) - 1):
                if argv[i] == flag and argv[i + 1] == module:
                    return tool, argv[i + 2:]
    return None, None


@pytest.mark.parametrize("code, ranks", _blocks("bash", gpu=True) + _blocks("python", gpu=True))
def test_gpu_block(code, ranks, tmp_path):
    if torch.cuda.is_available():
        if code.lstrip().startswith(("fpdt-", "python", "bash")) and "/path/to/" not in code:
            _bash(code, tmp_path, timeout=600)
        return
    if "import " in code:                                  # a python block: it must at least compile
        compile(code, "gpu block", "exec")
        return
    from fpdt.plan.cli import build_parser as plan_parser
    from fpdt.cli.train import build_parser as train_parser

    for argv in _commands(code):
        for arg in argv:
            if arg.startswith("examples/") or arg.startswith("profiling/"):
                assert os.path.exists(os.path.join(ROOT, arg)), arg
        for flag, module in zip(argv, argv[1:]):          # python -m profiling.NAME
            if flag == "-m" and module.startswith("profiling."):
                assert os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"), module
        tool, args = _tool_argv(argv)
        if tool:
            (train_parser if tool == "fpdt-train" else plan_parser)().parse_args(args)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    text = FENCE.sub("", text)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M)}


def test_every_relative_link_resolves():
    checked = 0
    for page in LINKED_PAGES:
        text = FENCE.sub("", _read(page))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue                                      # http(s), mailto
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
                os.path.join(ROOT, page)
            assert os.path.exists(full), f"{page}: link {target!r}: no {os.path.relpath(full, ROOT)}"
            if anchor and full.endswith(".md"):
                assert anchor in _anchors(open(full).read()), f"{page}: link {target!r}: no such heading"
            checked += 1
    assert checked >= 20


OUTSIDE_DOCUMENTS = re.compile(r"\bbrief\b|\bpitfall \d+|\bissue \d+", re.I)   # a paper's "arXiv:N §5.2" is fine


def test_nothing_names_a_document_outside_the_repository():
    """Code, tests and docs cite a paper (arXiv id and section) or a page of this repository."""
    this = os.path.relpath(__file__, ROOT)
    found = []
    for folder in ("fpdt", "tests", "profiling", "examples"):
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True) + \
                glob.glob(os.path.join(ROOT, folder, "**", "*.sh"), recursive=True):
            rel = os.path.relpath(path, ROOT)
            if rel == this:
                continue
            for n, line in enumerate(open(path, encoding="utf-8"), 1):
                if OUTSIDE_DOCUMENTS.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    for page in LINKED_PAGES:
        for n, line in enumerate(_read(page).splitlines(), 1):
            if OUTSIDE_DOCUMENTS.search(line):
                found.append(f"{page}:{n}: {line.strip()}")
    assert not found, "\n".join(found)

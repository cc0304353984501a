"""The README's attention-core snippet runs as written, on one process and on two ranks,
and computes attention: its out and q/k/v gradients match the float64 reference on the
snippet's own global tensors (fp32, 1e-5)."""

import pytest

import os
import re

import torch
import torch.distributed as dist

from fpdt.layout import unshard
from tests.attention.reference import assert_rel_close, reference_attention
from tests.distributed import run_distributed

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def readme_snippet() -> str:
    text = open(README).read()
    section = text[text.index("## The attention core"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_and_check(rank, world_size):
    ns = {}
    exec(compile(readme_snippet(), "README.md (attention core)", "exec"), ns)  # as written
    P, u = ns["P"], ns["u"]
    assert P == world_size and ns["out"].shape == (ns["B"], ns["S"] // P, ns["H"], ns["D"])

    def gathered(t):
        if P == 1:
            return t.detach()
        parts = [torch.empty_like(t) for _ in range(P)]
        dist.all_gather(parts, t.detach().contiguous())
        return unshard(parts, u)

    full = [ns[n].double().requires_grad_() for n in ("q_full", "k_full", "v_full")]
    ref = reference_attention(*full)
    ref.sum().backward()
    assert_rel_close(gathered(ns["out"]), ref, 1e-5, "out")
    for name, t in zip("qkv", full):
        assert_rel_close(gathered(ns[name].grad), t.grad, 1e-5, f"d{name}")


def test_readme_snippet_one_process():
    assert not dist.is_initialized()
    _run_and_check(0, 1)


@pytest.mark.slow
def test_readme_snippet_two_ranks():
    run_distributed(_run_and_check, world_size=2)

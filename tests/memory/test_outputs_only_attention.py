"""The ``outputs_only_attention`` fixture (tests/outputs_only.py) changes no counted byte: the
same peaks, forward and backward, as torch's CPU attention op, on the budget tests' models (fpdt's
and Transformers' after ``apply_fpdt``), GQA, several chunks, saved outputs and LoRA."""

import pytest
import torch

import fpdt.hf
from fpdt.attention.kernels import torch_cpu
from fpdt.memory.accountant import MemoryAccountant
from tests.memory import test_hf_budget as hf
from tests.memory import test_model_budget as mb
from tests.outputs_only import OUTPUTS_ONLY

pytestmark = pytest.mark.slow


def _peaks(model, inputs) -> tuple[int, int]:
    """Forward and backward peak, counted bytes."""
    with MemoryAccountant("cpu") as acct:
        with acct.phase("fwd"):
            out = model(**inputs)
            loss = out if isinstance(out, torch.Tensor) else out.loss
        with acct.phase("bwd"):
            loss.backward()
        del loss, out
    return acct.phases["fwd"].peak, acct.phases["bwd"].peak


def _both(monkeypatch, model, inputs):
    _peaks(model, inputs)        # the first forward's one-time work (the kernel's self-check) apart
    real = _peaks(model, inputs)
    monkeypatch.setattr(torch_cpu, "aten", OUTPUTS_ONLY)
    return real, _peaks(model, inputs)


@pytest.mark.parametrize("u,attention_checkpoint", [(4, "recompute"), (2, "save")])
def test_fpdt_model(monkeypatch, u, attention_checkpoint):
    model = mb._model(u, attention_checkpoint=attention_checkpoint)
    real, outputs_only = _both(monkeypatch, model, mb._inputs(model, 1024))
    assert real == outputs_only


def test_transformers_model_with_lora(monkeypatch):
    model = hf._model(4, lora_dropout=0.1)
    ids = torch.randint(0, hf.CONFIG["vocab_size"], (1, 1024), generator=torch.Generator().manual_seed(0))
    real, outputs_only = _both(monkeypatch, model, fpdt.hf.prepare_inputs(model, ids))
    assert real == outputs_only

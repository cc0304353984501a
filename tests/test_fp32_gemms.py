"""``tests/fp32_gemms.py``: bf16 matrix products on the CPU from fp32 operands, rounded once; the
accountant counts a whole step to the same byte with and without it."""

import pytest
import torch

from fpdt.memory.accountant import MemoryAccountant
from tests.fp32_gemms import Fp32Gemms


def _operands(*shapes):
    g = torch.Generator().manual_seed(len(shapes))
    return [torch.randn(*s, generator=g).to(torch.bfloat16) for s in shapes]


def test_each_product_is_the_fp32_product_rounded_once():
    a, b, c = _operands((5, 7), (7, 3), (5, 3))
    x, y, z = _operands((2, 5, 7), (2, 7, 3), (2, 5, 3))
    f = torch.Tensor.float
    want = {"mm": (f(a) @ f(b)), "addmm": torch.addmm(f(c), f(a), f(b), beta=0.5, alpha=2.0),
            "bmm": torch.bmm(f(x), f(y)), "baddbmm": torch.baddbmm(f(z), f(x), f(y), alpha=3.0)}
    with Fp32Gemms():
        got = {"mm": a @ b, "addmm": torch.addmm(c, a, b, beta=0.5, alpha=2.0), "bmm": torch.bmm(x, y),
               "baddbmm": torch.baddbmm(z, x, y, alpha=3.0)}
        inplace, out = c.clone().addmm_(a, b), torch.empty(5, 3, dtype=torch.bfloat16)
        torch.mm(a, b, out=out)
        unchanged = f(a) @ f(b)                      # fp32 operands: the op as it is
    for name, w in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], w.to(torch.bfloat16)), name
    assert torch.equal(inplace, torch.addmm(f(c), f(a), f(b)).to(torch.bfloat16))
    assert torch.equal(out, want["mm"].to(torch.bfloat16))
    assert unchanged.dtype == torch.float32 and torch.equal(unchanged, want["mm"])


@pytest.mark.slow
@pytest.mark.usefixtures("outputs_only_attention")
def test_the_accountant_counts_the_same_bytes():
    """A whole step of the memory budgets' 2-layer model (checkpoint offload, u = 4): every phase's
    peak and the storages live at the step's peak are the same; the gradients agree to bf16."""
    from tests.memory import test_model_budget as mb

    model = mb._model(4)
    inputs = mb._inputs(model, 1024)
    model(**inputs).backward()                      # first-use work (kernel self-check) apart

    def step():
        for p in model.parameters():
            p.grad.zero_()
        with MemoryAccountant("cpu", detail=True) as acct:
            with acct.phase("step"):
                loss = model(**inputs)
                loss.backward()
        return acct, loss.item(), [p.grad.float().clone() for p in model.parameters()]

    native, loss, grads = step()
    with Fp32Gemms():
        fp32, loss32, grads32 = step()
    assert (native.device_peak, native.phases["step"].peak) == (fp32.device_peak, fp32.phases["step"].peak)
    assert sorted(native.phases["step"].peak_tensors) == sorted(fp32.phases["step"].peak_tensors)
    assert abs(loss32 - loss) <= 1e-2 * abs(loss)
    for g, g32 in zip(grads, grads32):
        assert (g32 - g).norm() <= 5e-2 * g.norm() + 1e-6

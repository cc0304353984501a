"""bf16 matrix products on the CPU computed in fp32, for tests that count memory.

On a CPU without native bf16 (AVX2 only: the AMD EPYC CI machines), PyTorch's bf16 GEMM falls back
to a kernel that ran at 2 GFLOP/s where fp32 ran at 70-96 (2 cores, ``[1024, 256] @ [256, 704]``):
the matrix products were two thirds of the memory budgets' time and those budgets most of CI's.
:class:`Fp32Gemms` computes each bf16 ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` on the CPU from fp32
copies of its operands and rounds the result to bf16 once, as the bf16 kernel does after its fp32
accumulation (the values differ only in summation order).

Counting stays exact to the byte: :class:`fpdt.memory.accountant.MemoryAccountant` counts the
storages an op returns, one dispatch mode above this one, never the scratch inside an op; the fp32
copies are made below it and are scratch (``test_the_accountant_counts_the_same_bytes`` checks a
whole step). Only for tests that count memory or ops: numerics tests keep the real bf16 kernels.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
IN_PLACE = {aten.addmm_.default: aten.addmm.default, aten.baddbmm_.default: aten.baddbmm.default}
OUT = {aten.mm.out: aten.mm.default, aten.addmm.out: aten.addmm.default, aten.bmm.out: aten.bmm.default,
       aten.baddbmm.out: aten.baddbmm.default}


def _is_cpu_bf16(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def _fp32(x):
    return x.float() if _is_cpu_bf16(x) else x


class Fp32Gemms(TorchDispatchMode):
    """Push before any counting mode (it must sit below the accountant): ``with Fp32Gemms(): ...``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS and _is_cpu_bf16(args[0]):
            return self._product(func, args, kwargs)
        if func in IN_PLACE and _is_cpu_bf16(args[0]):
            return args[0].copy_(self._product(IN_PLACE[func], args, kwargs))
        if func in OUT and _is_cpu_bf16(kwargs.get("out")):
            out = kwargs.pop("out")
            return out.copy_(self._product(OUT[func], args, kwargs))
        return func(*args, **kwargs)

    @staticmethod
    def _product(func, args, kwargs):
        return func(*(_fp32(a) for a in args), **kwargs).to(torch.bfloat16)

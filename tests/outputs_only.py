"""The ``outputs_only_attention`` fixture (``tests/conftest.py``): the CPU attention op replaced by one
that allocates exactly its outputs (``out`` like ``q`` and an fp32 ``[B, H, Sq]`` lse; backward ``dq, dk, dv`` like its
inputs) and computes nothing.

The accountant counts storages an op returns, never scratch inside one op, so a per-token
budget counted with it is the same to the byte (``test_outputs_only_attention.py`` checks this
forward and backward); it spares the quadratic attention FLOPs that made the long-sequence
budgets most of CI's time. Only for tests that count memory: the values are zeros. Kernel
self-checks (``fpdt.attention.kernels.self_check``) still run the real op, so automatic selection
picks the same kernel as without the fixture.
"""

import types

import torch

import fpdt.attention.kernels as kernels
from fpdt.attention.kernels import torch_cpu


def _forward(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None):
    return torch.zeros_like(q), q.new_zeros(q.shape[:3], dtype=torch.float32)


def _backward(dout, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


OUTPUTS_ONLY = types.SimpleNamespace(_scaled_dot_product_flash_attention_for_cpu=_forward,
                                     _scaled_dot_product_flash_attention_for_cpu_backward=_backward)


def outputs_only(monkeypatch) -> None:
    """Replace the CPU attention op for the rest of the test (``monkeypatch`` undoes it)."""
    real_op, real_check = torch_cpu.aten, kernels.self_check

    def check_with_the_real_op(*args, **kwargs):
        torch_cpu.aten = real_op
        try:
            return real_check(*args, **kwargs)
        finally:
            torch_cpu.aten = OUTPUTS_ONLY

    monkeypatch.setattr(kernels, "self_check", check_with_the_real_op)
    monkeypatch.setattr(torch_cpu, "aten", OUTPUTS_ONLY)

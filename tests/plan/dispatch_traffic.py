"""Shared base of the traffic-counting dispatch modes of the time-model tests."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class AccumulatorWatch(TorchDispatchMode):
    """Runs every op and hands it to :meth:`on_op`; knows the fp32 weight-gradient
    accumulators (fp32 ``zeros`` with one of ``weight_shapes``) by storage, and keeps every
    tensor it remembers alive so that no later tensor takes its address while counting."""

    def __init__(self, weight_shapes):
        super().__init__()
        self.shapes = {tuple(s) for s in weight_shapes}
        self.accumulators: set[int] = set()
        self.casts: dict[int, int] = {}        # storage of a cast to fp32 -> bytes to charge back
        self.bytes = 0
        self._alive: list = []

    def remember(self, t: torch.Tensor) -> int:
        self._alive.append(t)
        return storage_ptr(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "zeros" and out.dtype == torch.float32 and tuple(out.shape) in self.shapes:
            self.accumulators.add(self.remember(out))
        self.on_op(name, func, args, kwargs, out)
        return out

    def on_op(self, name, func, args, kwargs, out) -> None:
        raise NotImplementedError

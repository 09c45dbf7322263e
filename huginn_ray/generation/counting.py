"""Counting what a piece of code asks of the device: ATen ops, and reads of the device by the host.

    with OpCounter() as counter:
        engine.step()
    counter.ops, counter.host_reads

`host_reads` counts the ops that hand a tensor's value to the host (`.item()`, `bool(t)`, `int(t)`: ATen's
`_local_scalar_dense`; `nonzero`, `masked_select`, `unique`, whose output shape is data-dependent) and the
Tensor methods that copy to the host without an ATen op on a CPU tensor (`tolist`, `numpy`, `cpu`). Within
`paused()` nothing is counted (the bench's engine reads its outputs there, outside the step).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"}
HOST_READ_METHODS = ("tolist", "numpy", "cpu")


class OpCounter(TorchDispatchMode):
    """ATen ops and host reads within its `with` block (module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops, self.host_reads, self.counting = 0, 0, True
        self.read_ops: list[str] = []
        self.originals = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.ops += 1
            name = func.overloadpacket.__name__
            if name in HOST_READ_OPS:
                self.host_reads += 1
                self.read_ops.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in HOST_READ_METHODS:
            original = self.originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _counted(self, name, original):
        def method(tensor, *args, **kwargs):
            if self.counting:
                self.host_reads += 1
                self.read_ops.append(name)
            return original(tensor, *args, **kwargs)
        return method

    @contextmanager
    def paused(self):
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

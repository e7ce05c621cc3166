"""Counting the ops a piece of PyTorch code dispatches, and the host syncs among them.

`OpCounter` is a `TorchDispatchMode`: inside `with OpCounter() as c:` every aten op that
reaches a kernel is counted by name (views apart: they launch nothing on a GPU). It serves
the speed benchmark (`benchmarks/bench_step.py`: eager ops per training step) and the tests
that a training step never waits for the device (`SYNC_OPS`: ops whose result the host must
read back, which on a GPU stop the CPU from queueing work ahead of it).

It sees what runs on the CPU too, so a step on a machine without a GPU shows exactly the
syncs it would make on one. A compiled graph's own kernels are not dispatched ops: under
`torch.compile` the counter sees only the kernels the graph calls out to (matmuls, SDPA).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: ops that read a device value back to the host (on CUDA: a synchronisation): `.item()`,
#: `int()`, `float()`, `bool()` of a tensor, and ops whose output size depends on the data
SYNC_OPS = frozenset(str(op) for op in (
    aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.equal, aten.masked_select,
    aten.unique_consecutive, aten._unique2, aten.unique_dim, aten.bincount,
    aten.repeat_interleave,
))


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops by name (`ops`), views excluded (`views` counts those)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Ops that launch a kernel (views excluded)."""
        return sum(self.ops.values())

    @property
    def syncs(self) -> dict[str, int]:
        """{op: count} of the host-sync ops seen."""
        return {op: n for op, n in self.ops.items() if op in SYNC_OPS}

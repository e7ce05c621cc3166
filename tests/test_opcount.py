"""pmnet.opcount: what the op counter counts and which ops it calls host syncs."""

import torch

from pmnet.opcount import SYNC_OPS, OpCounter


def test_counts_kernels_not_views_and_names_the_syncs():
    x = torch.arange(6.0)
    with OpCounter() as c:
        y = (x * 2).view(2, 3).t()  # mul is a kernel; view and t are not
        s = y.sum()
        value = float(s)  # reads the value back: a sync on a GPU
        torch.nonzero(x)  # output size depends on the data: a sync
    assert value == 30.0
    assert c.ops["aten.mul"] == 1 and c.ops["aten.sum"] == 1
    assert c.views == 2 and "aten.view" not in c.ops and "aten.t" not in c.ops
    assert c.syncs == {"aten._local_scalar_dense": 1, "aten.nonzero": 1}
    assert c.total == sum(c.ops.values())


def test_a_computation_without_readback_has_no_syncs():
    x = torch.randn(4, 5)
    with OpCounter() as c:
        torch.softmax(x @ x.t(), -1).argmax(-1)
    assert c.total >= 3 and c.syncs == {}
    assert "aten._local_scalar_dense" in SYNC_OPS

"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_thread():
    """One torch thread for the test (two threads contend badly on a busy 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Test helper: give each boundary's consolidation its own copy of the Consolidator's
parameters, so the gradient that reaches the Consolidator through each boundary can be read
separately (their sum is the gradient of the shared parameters)."""

from __future__ import annotations

import torch
from torch.func import functional_call


class PerBoundaryConsolidator(torch.nn.Module):
    """Stands in for `model.consolidator`: call k (one per block and boundary, in order) uses
    the parameter copy of boundary ``k // n_blocks``. Forward values are unchanged."""

    def __init__(self, inner: torch.nn.Module, n_boundaries: int, n_blocks: int):
        super().__init__()
        self.inner, self.n_blocks = inner, n_blocks
        self.copies = [{n: p.detach().clone().requires_grad_(True)
                        for n, p in inner.named_parameters()} for _ in range(n_boundaries)]
        self.calls = 0

    def forward(self, S):
        params = self.copies[self.calls // self.n_blocks]
        self.calls += 1
        return functional_call(self.inner, params, (S,))

    def grad_norms(self) -> list[float]:
        """Per boundary: the norm of the gradient that reached its parameter copy (0 when
        none did)."""
        out = []
        for copy in self.copies:
            sq = sum(float((p.grad ** 2).sum()) for p in copy.values() if p.grad is not None)
            out.append(sq ** 0.5)
        return out

    def summed_grads(self) -> dict[str, torch.Tensor]:
        return {n: sum(c[n].grad if c[n].grad is not None else torch.zeros_like(c[n])
                       for c in self.copies) for n in self.copies[0]}


def probe(model, n_boundaries: int) -> PerBoundaryConsolidator:
    """Replace `model.consolidator` by a per-boundary probe and return it."""
    p = PerBoundaryConsolidator(model.consolidator, n_boundaries, model.cfg.n_blocks)
    model.consolidator = p
    return p

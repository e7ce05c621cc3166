"""Beyond the paper (issue 11): each alternative consolidation operator against the
Consolidator, a family of paired comparisons of its own."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from pmnet.conditions import OPERATOR_REFERENCE
from pmnet.stats.paired import Comparison, compare_all
from pmnet.stats.vocabulary import OPERATOR_CONDITIONS


def _build_operator_comparisons() -> tuple[Comparison, ...]:
    return tuple(
        Comparison(f"{c} - Consolidator: updated_ltm", c, "updated_ltm", OPERATOR_REFERENCE,
                   "updated_ltm", "ours:operators")
        for c in OPERATOR_CONDITIONS
    )


#: Beyond the paper: each consolidation operator against the Consolidator (the learned arm,
#: ``consolidator_only``) on updated-mapping LTM recall, paired by seed. A family of its own:
#: Holm runs over these four only, so the paper's family (:data:`COMPARISONS`) is unchanged.
OPERATOR_COMPARISONS: tuple[Comparison, ...] = _build_operator_comparisons()

#: The note each operator comparison carries.
OPERATOR_REMARKS: dict[str, str] = {
    c.label: "separately trained operators from one Phase-1 checkpoint"
    for c in OPERATOR_COMPARISONS
}


def has_operator_results(df: pd.DataFrame) -> bool:
    """Whether any trial of an operator condition is in ``df``."""
    return not df.empty and bool(df["condition"].isin(OPERATOR_CONDITIONS).any())


def compare_operators(
    df: pd.DataFrame, *, expected_seeds: Iterable[int] | None = None, alpha: float = 0.05
) -> pd.DataFrame:
    """:func:`compare_all` over :data:`OPERATOR_COMPARISONS` (Holm within that family)."""
    return compare_all(df, OPERATOR_COMPARISONS, expected_seeds=expected_seeds, alpha=alpha,
                       remarks=OPERATOR_REMARKS)

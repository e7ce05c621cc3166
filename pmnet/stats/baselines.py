"""Beyond the paper (issue 23): each task-matched baseline against the Consolidator and the
GRU operator, a family of paired comparisons of its own."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from pmnet.conditions import BASELINE_REFERENCES
from pmnet.stats.paired import Comparison, compare_all
from pmnet.stats.vocabulary import BASELINE_CONDITION_NAMES

#: The baseline conditions, in their defined order.
BASELINE_CONDITIONS: tuple[str, ...] = BASELINE_CONDITION_NAMES

#: How each reference arm is named in a comparison's label.
REFERENCE_NAMES: dict[str, str] = {"consolidator_only": "Consolidator",
                                   "operator_gru": "GRU operator"}


def _build_baseline_comparisons() -> tuple[Comparison, ...]:
    return tuple(
        Comparison(f"{b} - {REFERENCE_NAMES[r]}: updated_ltm", b, "updated_ltm", r,
                   "updated_ltm", "ours:baselines")
        for b in BASELINE_CONDITIONS for r in BASELINE_REFERENCES
    )


#: Beyond the paper: each baseline minus each reference arm (the Consolidator,
#: ``consolidator_only``; the GRU operator, ``operator_gru``) on updated-mapping recall,
#: paired by seed. A family of its own: Holm runs over these eight only.
BASELINE_COMPARISONS: tuple[Comparison, ...] = _build_baseline_comparisons()

#: The note each baseline comparison carries.
BASELINE_REMARKS: dict[str, str] = {
    c.label: "separately trained from one Phase-1 checkpoint, same episodes and steps"
    for c in BASELINE_COMPARISONS
}


def has_baseline_results(df: pd.DataFrame) -> bool:
    """Whether any trial of a baseline condition is in ``df``."""
    return not df.empty and bool(df["condition"].isin(BASELINE_CONDITIONS).any())


def compare_baselines(
    df: pd.DataFrame, *, expected_seeds: Iterable[int] | None = None, alpha: float = 0.05
) -> pd.DataFrame:
    """:func:`compare_all` over :data:`BASELINE_COMPARISONS` (Holm within that family)."""
    return compare_all(df, BASELINE_COMPARISONS, expected_seeds=expected_seeds, alpha=alpha,
                       remarks=BASELINE_REMARKS)

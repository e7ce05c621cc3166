"""Beyond the paper (issue 23): each task-matched baseline against the Consolidator and the
GRU operator, a family of paired comparisons of its own."""

from __future__ import annotations

from pmnet.conditions import BASELINE_REFERENCES
from pmnet.stats.paired import Comparison, Family
from pmnet.stats.vocabulary import BASELINE_CONDITION_NAMES

#: The baseline conditions, in their defined order.
BASELINE_CONDITIONS: tuple[str, ...] = BASELINE_CONDITION_NAMES

#: How each reference arm is named in a comparison's label.
REFERENCE_NAMES: dict[str, str] = {"consolidator_only": "Consolidator",
                                   "operator_gru": "GRU operator"}

#: Beyond the paper: each baseline minus each reference arm (the Consolidator,
#: ``consolidator_only``; the GRU operator, ``operator_gru``) on updated-mapping recall,
#: paired by seed; Holm over these eight.
BASELINE_FAMILY = Family(
    conditions=BASELINE_CONDITIONS,
    comparisons=tuple(
        Comparison(f"{b} - {REFERENCE_NAMES[r]}: updated_ltm", b, "updated_ltm", r,
                   "updated_ltm", "ours:baselines")
        for b in BASELINE_CONDITIONS for r in BASELINE_REFERENCES),
    remark="separately trained from one Phase-1 checkpoint, same episodes and steps",
)
BASELINE_COMPARISONS = BASELINE_FAMILY.comparisons
has_baseline_results = BASELINE_FAMILY.present
compare_baselines = BASELINE_FAMILY.compare

"""Beyond the paper (issue 11): each alternative consolidation operator against the
Consolidator, a family of paired comparisons of its own."""

from __future__ import annotations

from pmnet.conditions import OPERATOR_REFERENCE
from pmnet.stats.paired import Comparison, Family
from pmnet.stats.vocabulary import OPERATOR_CONDITIONS

#: Beyond the paper: each consolidation operator against the Consolidator (the learned arm,
#: ``consolidator_only``) on updated-mapping LTM recall, paired by seed; Holm over these four.
OPERATOR_FAMILY = Family(
    conditions=OPERATOR_CONDITIONS,
    comparisons=tuple(
        Comparison(f"{c} - Consolidator: updated_ltm", c, "updated_ltm", OPERATOR_REFERENCE,
                   "updated_ltm", "ours:operators")
        for c in OPERATOR_CONDITIONS),
    remark="separately trained operators from one Phase-1 checkpoint",
)
OPERATOR_COMPARISONS = OPERATOR_FAMILY.comparisons
has_operator_results = OPERATOR_FAMILY.present
compare_operators = OPERATOR_FAMILY.compare

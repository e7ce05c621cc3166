"""The Phase-2 conditions of the paper (Table "Parameter-isolation conditions") and its seeds.

The one place that names them: training (`pmnet.train`), statistics (`pmnet.stats`), the
report and the grids (`tune_spaces`) all read `CONDITIONS` and `PAPER_SEEDS` from here. The
module imports nothing heavy (no torch), so light readers can use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Condition:
    name: str
    consolidation: str  # "learned" or "identity" (raw STM accumulation)
    subset: str  # a PMNet.trainable_subset name
    ltm_routing: bool  # direct LTM term of Eq. 9
    objective: str  # "updated" (Eq. 10) or "dual" (Eq. 11)
    select: str  # validation metric that selects the checkpoint
    label: str  # short name in tables and figures
    description: str


#: The six conditions, in the paper's table order.
CONDITIONS: dict[str, Condition] = {
    c.name: c
    for c in (
        Condition("learned_full", "learned", "entire_model", True, "updated", "updated_ltm",
                  "Learned full",
                  "Learned full: entire model trainable, learned consolidation"),
        Condition("identity_full", "identity", "all_but_consolidator", True, "updated",
                  "updated_ltm", "Identity full",
                  "Identity full: all but the Consolidator, raw STM accumulation"),
        Condition("consolidator_only", "learned", "consolidator_only", True, "updated",
                  "updated_ltm", "Consolidator only",
                  "Consolidator only (12.35K parameters), LTM routing on"),
        Condition("consolidator_only_routing_off", "learned", "consolidator_only", False,
                  "updated", "updated_ltm", "Consolidator only, routing off",
                  "Consolidator only, direct LTM routing term of Eq. 9 removed"),
        Condition("memory_consolidator", "learned", "memory_consolidator", True, "updated",
                  "updated_ltm", "Memory + Consolidator",
                  "Memory read/write/routing + Consolidator"),
        Condition("learned_full_dual", "learned", "entire_model", True, "dual", "dual",
                  "Learned full, dual objective",
                  "Learned full with the dual objective L_updated + L_STM (Eq. 11)"),
    )
}

#: Phase-2 seeds of the paper (Appendix "Hyperparameters and Architecture").
PAPER_SEEDS: tuple[int, ...] = (42, 43, 44, 45, 46)


def get_condition(name: str) -> Condition:
    if name not in CONDITIONS:
        raise ValueError(f"unknown condition {name!r}; known: {', '.join(CONDITIONS)}")
    return CONDITIONS[name]

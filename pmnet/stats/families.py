"""Beyond the paper (issue 52): did Phase 1 learn each rule family?

A recall metric averages the task's two rule families (ADD10, AFFINE10, `RULE_FAMILIES`).
Where the backbone never learned a family in Phase 1 (its STM recall no better than the
family's output-set baseline, the rule-free guesser), no later recall of that family can show
a consolidated rule, and a mean over both families mixes a family the backbone knows with one
it does not. So each family's Phase-1 STM is read beside its baseline, and a family that is
not learned gives no verdict (the capability gate of issue 44, applied per family;
docs/choices.md, "Per-family truth").

Phase-1 STM is read from the trials themselves: a condition that trains only the
Consolidator or an operator (`FROZEN_BACKBONE_CONDITIONS`) leaves the backbone as Phase 1
made it, so its test-stream STM recall (`seg{t}_stm_<family>`, on the auxiliary STM
trajectories that never see LTM) is the Phase-1 checkpoint's, on the same episodes as the
trial's other metrics, with the family's baseline beside it (`seg{t}_stm_<family>_baseline`,
computed from the stream by `pmnet.evaluate.summarize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from pmnet.conditions import ALL_CONDITIONS
from pmnet.stats.paired import COMPARISONS, Comparison
from pmnet.stats.vocabulary import PHASE1_SEED, RULE_FAMILIES

#: The trainable subsets that leave the backbone (every STM path) as Phase 1 made it.
FROZEN_BACKBONE_SUBSETS: tuple[str, ...] = ("consolidator_only", "operator_only")
#: The conditions whose test-stream STM recall is their Phase-1 checkpoint's.
FROZEN_BACKBONE_CONDITIONS: tuple[str, ...] = tuple(
    name for name, c in ALL_CONDITIONS.items() if c.subset in FROZEN_BACKBONE_SUBSETS)

#: The episodes of one family in a test stream the margin is sized for (the `cpu` preset's
#: and the ladder's 2,000-episode streams hold about 1,000 of each family)
MARGIN_EPISODES = 1000
#: A family is learned when its Phase-1 STM is above its output-set baseline by more than
#: this (pp): the 95% half-width of a recall over MARGIN_EPISODES queries at 50%, the widest
#: a binomial proportion gets (1.96 * sqrt(0.25 / 1000) = 3.1 pp). Within it, STM is at the
#: baseline as far as one stream can tell.
LEARNED_MARGIN_PP: float = 100 * 1.96 * math.sqrt(0.25 / MARGIN_EPISODES)


@dataclass(frozen=True)
class FamilyCheckpoint:
    """One family's Phase-1 STM recall (mean of the segments' STM queries) and its
    output-set baseline on one checkpoint's test episodes (%; means over its trials)."""

    phase1_seed: int | None
    stm: float
    baseline: float

    @property
    def margin(self) -> float:
        return self.stm - self.baseline

    @property
    def learned(self) -> bool:
        return self.margin > LEARNED_MARGIN_PP


@dataclass(frozen=True)
class FamilyLearning:
    """Did Phase 1 learn one rule family? Learned only when it is on every checkpoint the
    trials come from: a claim read across checkpoints reads all of them."""

    family: str  # "add10", "affine10"
    checkpoints: tuple[FamilyCheckpoint, ...]

    @property
    def name(self) -> str:
        return RULE_FAMILIES.get(self.family, self.family)

    @property
    def stm(self) -> float:
        return sum(c.stm for c in self.checkpoints) / len(self.checkpoints)

    @property
    def baseline(self) -> float:
        return sum(c.baseline for c in self.checkpoints) / len(self.checkpoints)

    @property
    def not_learned_on(self) -> list[int | None]:
        return [c.phase1_seed for c in self.checkpoints if not c.learned]

    @property
    def learned(self) -> bool:
        return not self.not_learned_on

    def status(self) -> str:
        """`learned`, `not learned`, or `not learned on 7 of 10 checkpoints (0, 1, 3, ...)`."""
        if self.learned:
            return "learned"
        off, k = self.not_learned_on, len(self.checkpoints)
        if k == 1 or len(off) == k:
            return "not learned"
        return (f"not learned on {len(off)} of {k} checkpoints "
                f"({', '.join(str(s) for s in off)})")

    def text(self) -> str:
        """`100.0 vs 50.0`, `37.1 vs 34.2 (not learned)`, `38.0 vs 34.4 (not learned on 7 of
        10)`: the baseline column's cell, short enough to stay in the table."""
        out = f"{self.stm:.1f} vs {self.baseline:.1f}"
        return out if self.learned else f"{out} ({self.status().split(' checkpoints')[0]})"

    def reason(self) -> str:
        """Why a claim about this family gets no verdict."""
        return (f"{self.name} not learned in Phase 1 (STM {self.stm:.1f} vs output-set "
                f"baseline {self.baseline:.1f}, {self.status()})")


def _segment_columns(df: pd.DataFrame, family: str) -> list[tuple[str, str]]:
    """(STM, baseline) columns of every segment's STM query of one family in `df`."""
    out, t = [], 1
    while f"seg{t}_stm_{family}" in df.columns:
        base = f"seg{t}_stm_{family}_baseline"
        if base in df.columns:
            out.append((f"seg{t}_stm_{family}", base))
        t += 1
    return out


def phase1_families(df: pd.DataFrame) -> dict[str, FamilyLearning]:
    """Each rule family's Phase-1 STM beside its output-set baseline, per Phase-1 checkpoint,
    from the frozen-backbone trials of `df` (a tidy frame); families without those columns,
    or without such a trial, are left out ({} for results without per-family STM)."""
    if df.empty:
        return {}
    rows = df[df["condition"].isin(FROZEN_BACKBONE_CONDITIONS)]
    out: dict[str, FamilyLearning] = {}
    for family in RULE_FAMILIES:
        cols = _segment_columns(rows, family)
        if not cols or rows.empty:
            continue
        stm = rows[[c for c, _ in cols]].apply(pd.to_numeric, errors="coerce").mean(axis=1)
        base = rows[[b for _, b in cols]].apply(pd.to_numeric, errors="coerce").mean(axis=1)
        frame = pd.DataFrame({"stm": stm, "baseline": base})
        keyed = PHASE1_SEED in rows.columns and rows[PHASE1_SEED].notna().all()
        frame["k"] = rows[PHASE1_SEED].astype("int64") if keyed else -1
        frame = frame.dropna(subset=["stm", "baseline"])
        if frame.empty:
            continue
        means = frame.groupby("k")[["stm", "baseline"]].mean()
        out[family] = FamilyLearning(family, tuple(
            FamilyCheckpoint(int(k) if k >= 0 else None, float(r.stm), float(r.baseline))
            for k, r in means.iterrows()))
    return out


def family_of(metric: str) -> str | None:
    """The rule family a per-family metric is split by (`updated_ltm_affine10` ->
    `affine10`); None for a metric over both families."""
    for family in RULE_FAMILIES:
        if metric.endswith(f"_{family}") or f"_{family}_" in metric:
            return family
    return None


def family_comparison(spec: Comparison, family: str) -> Comparison:
    """`spec` read on one family's episodes (each side's metric split by the family),
    labelled `<label>_<family>` (`routing on - off: updated_ltm_add10`)."""
    return Comparison(f"{spec.label}_{family}", spec.cond_a, f"{spec.metric_a}_{family}",
                      spec.cond_b, f"{spec.metric_b}_{family}", "ours:rule-families")


#: Every comparison of the paper's family on updated-mapping recall, read on each family's
#: episodes: the per-family rows of the headline and claims tables (not part of the family's
#: Holm correction, `COMPARISONS`, whose data files they would change; the ones it already
#: has, `routing on - off: updated_ltm_add10`, are the same comparisons).
FAMILY_COMPARISONS: tuple[Comparison, ...] = tuple(
    family_comparison(c, family) for c in COMPARISONS if c.label.endswith(": updated_ltm")
    for family in RULE_FAMILIES)

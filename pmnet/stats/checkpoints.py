"""Beyond the paper (issue 39): an effect's distribution over Phase-1 checkpoints.

The paper judges its claims within one Phase-1 checkpoint; at the `cpu` scale the routing
effect's sign is the checkpoint's, so the claim is judged at the level where it varies. For
each comparison, over K checkpoints x n Phase-2 seeds:

- one :class:`CheckpointPoint` per checkpoint: its mean paired difference with a 95% CI from
  the *pooled* within-checkpoint SD (the spread of Phase-2 seeds around their checkpoint's
  mean, pooled over every checkpoint: t with sum(n_i - 1) df). With two seeds a checkpoint's
  own paired t has 1 df (a 95% CI 12.7 SDs wide); pooling assumes the seed noise is the same
  on every checkpoint and gives each point a usable interval. The paired t of the
  checkpoint's own seeds is kept beside it (``p_paired``).
- one :class:`EffectDistribution`: the mean with the checkpoint as a random intercept
  (:func:`pmnet.stats.phase1_variance`, REML, t with K - 1 df), the between-checkpoint SD,
  the fraction of checkpoints whose effect is positive (negative) and significant by the
  pooled test, and the number of checkpoints a study needs to detect a mean effect of 5 and
  10 pp (:func:`checkpoints_needed`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import pandas as pd

from pmnet.conditions import ROUTING_PAIRS, STRICT_PAIRS
from pmnet.stats.paired import COMPARISONS, Comparison
from pmnet.stats.phase1 import Phase1Effect, phase1_variance

#: The effects the checkpoint study reads (issue 39), in report order.
CHECKPOINT_COMPARISON_LABELS: tuple[str, ...] = (
    "routing on - off: updated_ltm",
    "learned - forced identity, routing on: updated_ltm",
    "learned - forced identity, routing off: updated_ltm",
)
CHECKPOINT_COMPARISONS: tuple[Comparison, ...] = tuple(
    next(c for c in COMPARISONS if c.label == label) for label in CHECKPOINT_COMPARISON_LABELS
)
#: "Can anything use the channel?" (issue 39): routing on - off for every arm that has a
#: routing-off twin (`pmnet.conditions.ROUTING_PAIRS`), the Consolidator's first.
CHANNEL_COMPARISONS: tuple[Comparison, ...] = tuple(
    Comparison(f"routing on - off: updated_ltm ({on})" if on != "consolidator_only"
               else "routing on - off: updated_ltm", on, "updated_ltm", off, "updated_ltm", "")
    for on, off in ROUTING_PAIRS.items()
)
#: What a strict-off arm changes (issue 39): routing off - strict off, paired by seed, for
#: every routing-off arm with a strict-off twin (`pmnet.conditions.STRICT_PAIRS`): what L
#: reaching the deeper routers through u is worth when the direct term is already gone.
STRICT_COMPARISONS: tuple[Comparison, ...] = tuple(
    Comparison(f"routing off - strict off: updated_ltm ({off})", off, "updated_ltm", strict,
               "updated_ltm", "")
    for off, strict in STRICT_PAIRS.items()
)
#: The mean effects the power statement is made for (pp).
POWER_EFFECTS: tuple[float, ...] = (5.0, 10.0)
POWER = 0.8


@dataclass(frozen=True)
class CheckpointPoint:
    """One checkpoint's effect: mean paired difference, pooled-SD 95% CI and p (two-sided),
    ``verdict`` "+" / "-" (significant by the pooled test, that sign) or "0"; ``p_paired``
    the paired t of its own seeds (NaN with fewer than two distinct differences)."""

    label: str
    phase1_seed: int
    n: int
    mean_diff: float
    ci_low: float
    ci_high: float
    p: float
    df: float
    verdict: str
    p_paired: float


@dataclass(frozen=True)
class EffectDistribution:
    """One comparison over K checkpoints; see the module docstring. ``k_needed`` maps each
    effect of :data:`POWER_EFFECTS` to the checkpoints needed (None: not computable, the
    between SD was not estimated)."""

    label: str
    k: int
    n: int
    seeds_per_checkpoint: float
    estimate: float
    se: float
    ci_low: float
    ci_high: float
    p: float
    sd_between: float
    sd_within: float
    df_within: float
    icc: float
    positive: int
    positive_significant: int
    negative_significant: int
    k_needed_5: int | None
    k_needed_10: int | None
    note: str


def checkpoints_needed(effect: float, sd_between: float, sd_within: float, seeds: float, *,
                       alpha: float = 0.05, power: float = POWER,
                       k_max: int = 100_000) -> int | None:
    """The fewest Phase-1 checkpoints K (>= 2) for which a two-sided one-sample t-test on the
    K checkpoint means (``seeds`` Phase-2 seeds each) detects a mean effect ``effect`` with
    the given power: each checkpoint mean has variance sd_between^2 + sd_within^2 / seeds
    (the balanced random-intercept model, whose REML test is this t with K - 1 df). None when
    an SD is not finite, or more than ``k_max`` would be needed."""
    from statsmodels.stats.power import TTestPower

    if not all(math.isfinite(x) for x in (effect, sd_between, sd_within, seeds)) or seeds <= 0:
        return None
    tau = math.sqrt(sd_between ** 2 + sd_within ** 2 / seeds)
    if tau == 0:
        return 2
    d = abs(effect) / tau
    analysis = TTestPower()
    lo, hi = 2, 2
    while analysis.power(d, hi, alpha) < power:  # exponential search, then bisection
        lo, hi = hi, hi * 2
        if hi > k_max:
            return None
    while lo < hi:
        mid = (lo + hi) // 2
        if analysis.power(d, mid, alpha) >= power:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _pairs(df: pd.DataFrame, c: Comparison) -> pd.DataFrame:
    """(phase1_seed, seed, diff) of every paired trial of ``c``."""
    from pmnet.stats.vocabulary import PHASE1_SEED

    cols = ["seed", PHASE1_SEED]
    a = df[df["condition"] == c.cond_a][cols + [c.metric_a]].rename(columns={c.metric_a: "a"})
    b = df[df["condition"] == c.cond_b][cols + [c.metric_b]].rename(columns={c.metric_b: "b"})
    both = a.merge(b, on=cols).dropna(subset=["a", "b"])
    both["diff"] = both["a"].astype(float) - both["b"].astype(float)
    both[PHASE1_SEED] = both[PHASE1_SEED].astype(int)
    return both[[PHASE1_SEED, "seed", "diff"]]


def pooled_within_sd(pairs: pd.DataFrame) -> tuple[float, float]:
    """(SD, df) of the paired differences around their checkpoint's mean, pooled over the
    checkpoints with two or more pairs; (NaN, 0) without any."""
    from pmnet.stats.vocabulary import PHASE1_SEED

    g = pairs.groupby(PHASE1_SEED)["diff"]
    ss = float(((pairs["diff"] - g.transform("mean")) ** 2).sum())
    df = float((g.count() - 1).clip(lower=0).sum())
    return (math.sqrt(ss / df), df) if df > 0 else (math.nan, 0.0)


def checkpoint_distribution(
    df: pd.DataFrame,
    comparisons: Sequence[Comparison] | None = None,
    *,
    alpha: float = 0.05,
) -> tuple[tuple[EffectDistribution, ...], tuple[CheckpointPoint, ...]]:
    """Each comparison's distribution over the Phase-1 checkpoints of ``df`` (the tidy trial
    table with a ``phase1_seed`` column and the derived metrics; default comparisons
    :data:`CHECKPOINT_COMPARISONS`). Comparisons without paired trials are left out."""
    from scipy import stats as sps

    from pmnet.stats.vocabulary import PHASE1_SEED

    comparisons = CHECKPOINT_COMPARISONS if comparisons is None else tuple(comparisons)
    analysis = phase1_variance(df, comparisons, alpha=alpha)
    effects: dict[str, Phase1Effect] = {e.label: e for e in analysis.effects}
    dists: list[EffectDistribution] = []
    points: list[CheckpointPoint] = []
    for c in comparisons:
        pairs = _pairs(df, c)
        if pairs.empty:
            continue
        sd_w, df_w = pooled_within_sd(pairs)
        q = float(sps.t.ppf(1 - alpha / 2, df_w)) if df_w > 0 else math.nan
        own: list[CheckpointPoint] = []
        for k, g in pairs.groupby(PHASE1_SEED):
            d = g["diff"].to_numpy(dtype=float)
            m, n = float(d.mean()), int(d.size)
            se = sd_w / math.sqrt(n) if df_w > 0 else math.nan
            p = float(2 * sps.t.sf(abs(m) / se, df_w)) if se and se > 0 else math.nan
            sig = math.isfinite(p) and p < alpha
            p_paired = (float(sps.ttest_1samp(d, 0.0).pvalue)
                        if n > 1 and float(np.ptp(d)) > 0 else math.nan)
            own.append(CheckpointPoint(
                label=c.label, phase1_seed=int(k), n=n, mean_diff=m, ci_low=m - q * se,
                ci_high=m + q * se, p=p, df=df_w, verdict=("+" if m > 0 else "-") if sig
                else "0", p_paired=p_paired))
        points += own
        e = effects[c.label]
        spc = float(len(pairs)) / len(own)
        needed = {x: checkpoints_needed(x, e.sd_between if e.fitted else math.nan, sd_w, spc,
                                        alpha=alpha) for x in POWER_EFFECTS}
        dists.append(EffectDistribution(
            label=c.label, k=len(own), n=len(pairs), seeds_per_checkpoint=spc,
            estimate=e.estimate, se=e.se, ci_low=e.ci_low_t, ci_high=e.ci_high_t, p=e.p_t,
            sd_between=e.sd_between, sd_within=sd_w, df_within=df_w, icc=e.icc,
            positive=sum(pt.mean_diff > 0 for pt in own),
            positive_significant=sum(pt.verdict == "+" for pt in own),
            negative_significant=sum(pt.verdict == "-" for pt in own),
            k_needed_5=needed[5.0], k_needed_10=needed[10.0], note=e.note))
    return tuple(dists), tuple(points)


def frame(rows: Sequence[EffectDistribution] | Sequence[CheckpointPoint]) -> pd.DataFrame:
    """The rows as a DataFrame (columns in field order; empty rows give the columns of
    :class:`EffectDistribution`)."""
    cls = type(rows[0]) if rows else EffectDistribution
    return pd.DataFrame([asdict(r) for r in rows], columns=[f.name for f in fields(cls)])

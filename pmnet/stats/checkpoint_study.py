"""Beyond the paper (issue 39, in the product since issue 45): the checkpoint study's
analyses beyond each effect's distribution (:mod:`pmnet.stats.checkpoints`).

All are pure functions of the tidy trial frame (:func:`pmnet.stats.load_results`, derived
metrics added), and where the analysis reads a trained model's diagnostics, of the
diagnostics frame (:func:`diagnostics_frame`, one row per ``pmnet diagnose``-d trial):

- **whole checkpoints** (:func:`whole_checkpoints`): a checkpoint enters the channel
  comparisons only as a whole unit, every channel arm on a common Phase-2 seed; a started,
  unfinished checkpoint's channel trials are set aside (listed, not averaged in);
- **the channel interaction** (:func:`channel_analysis`): does routing's effect differ
  between the Consolidator and a capable operator or trainable router? (operator on - off) -
  (Consolidator on - off) per checkpoint, a one-sample t over the checkpoints; each arm's
  level against the Consolidator's; the routing effects' agreement across checkpoints; and
  from the diagnosed models, whether they use L's routes at all (the mechanism check);
- **the strict-off contrasts** (:func:`strict_analysis`): routing off - strict off (what L
  through u is worth) and routing on - strict off (all of L's routing influence), whether the
  strict models' routers ignore L, and whether the inference-time probe foretells the trained
  effect;
- **the pre-registered predictor** (:func:`predictor_test`): Spearman's rho between each
  checkpoint's root L route change (its Phase-1 diagnostics) and its routing effect,
  one-sided (rho < 0), on the confirmatory checkpoints the store names;
- **sensitivity** (:func:`sensitivity`): the core effects on a named subset of checkpoints,
  and with every trial at its last epoch, each beside the capability gate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pmnet.conditions import ROUTING_PAIRS, STRICT_PAIRS
from pmnet.stats.checkpoints import (
    CHANNEL_COMPARISONS,
    CHECKPOINT_COMPARISONS,
    STRICT_COMPARISONS,
    CheckpointPoint,
    EffectDistribution,
    checkpoint_distribution,
)
from pmnet.stats.checkpoints import frame as checkpoint_frame
from pmnet.stats.paired import CapabilityGate, Comparison, capability_gate
from pmnet.stats.vocabulary import LAST_PREFIX, PHASE1_SEED
from pmnet.trial_id import TrialId

#: the reference arm of the channel question, and the arms read against it (issue 39, "Can
#: anything use the channel?"), each with its routing-off twin (`ROUTING_PAIRS`)
CONSOLIDATOR = "consolidator_only"
CHANNEL_OPERATORS: tuple[str, ...] = tuple(on for on in ROUTING_PAIRS if on != CONSOLIDATOR)
#: every condition of the channel question, routing on then off per arm
CHANNEL_CONDITIONS: tuple[str, ...] = tuple(
    c for on in (CONSOLIDATOR, *CHANNEL_OPERATORS) for c in (on, ROUTING_PAIRS[on]))
#: the conditions only the channel arms train (the Consolidator's two are the core arms)
CHANNEL_ONLY: tuple[str, ...] = tuple(c for c in CHANNEL_CONDITIONS
                                      if c not in (CONSOLIDATOR, ROUTING_PAIRS[CONSOLIDATOR]))
#: how well each arm consolidates against the Consolidator, same routing: is the operator
#: more capable, i.e. is the comparison worth making?
LEVEL_COMPARISONS: tuple[Comparison, ...] = tuple(
    Comparison(f"{op} - {CONSOLIDATOR}, routing {r}: updated_ltm", op + suffix, "updated_ltm",
               CONSOLIDATOR + suffix, "updated_ltm", "")
    for op in CHANNEL_OPERATORS for r, suffix in (("on", ""), ("off", "_routing_off")))
#: the arms with a strict-off twin, by their routing-on name
STRICT_ARMS: tuple[str, ...] = tuple(on for on, off in ROUTING_PAIRS.items()
                                     if off in STRICT_PAIRS)
#: all of L's routing influence: routing on - strict off, per arm with a strict-off twin
ALL_ROUTING_COMPARISONS: tuple[Comparison, ...] = tuple(
    Comparison(f"routing on - strict off: updated_ltm ({on})", on, "updated_ltm",
               STRICT_PAIRS[ROUTING_PAIRS[on]], "updated_ltm", "")
    for on in STRICT_ARMS)
#: what the checkpoint section's distribution reads: the core effects, every other arm's
#: routing effect, and routing off - strict off
STUDY_COMPARISONS: tuple[Comparison, ...] = (
    *CHECKPOINT_COMPARISONS,
    *(c for c in (*CHANNEL_COMPARISONS, *STRICT_COMPARISONS)
      if c.label not in {x.label for x in CHECKPOINT_COMPARISONS}))
#: the secondary checkpoint features of the predictor test (two-sided, exploratory)
SECONDARY_FEATURES: tuple[str, ...] = ("random_route_cost", "root_margin", "phase1_stm_val",
                                       "on_root_l_removed_cost")


# ------------------------------------------------------------------------------------------
# the per-trial diagnostics
# ------------------------------------------------------------------------------------------


def diagnostics_row(trial: TrialId, h: Mapping[str, Any]) -> dict[str, Any]:
    """One diagnosed model (`pmnet diagnose` of a trial's model) as the columns the analyses
    read: its updated-LTM recall (a routing-off model has no "updated_ltm" entry: its recall
    is the strict-off recall plus what strict off cost it), the recall (pp) it loses with
    routing switched off at inference (the paper's off), with L out of the root's routing
    only, and under strict routing off (L out of u too), its L route change per block, and
    (diagnostics since issue 61) its last segment's path change on shared tokens per block and
    its Consolidator gradient's routing share."""
    wo = h.get("updated_without_ltm_route") or []
    strict = h.get("updated_strict_off") or {}
    own = (h.get("updated_ltm") or {}).get("recall")
    if own is None and strict.get("recall") is not None:
        own = strict["recall"] + strict["drop"]
    return {"condition": trial.condition, "seed": trial.seed, "variant": trial.variant,
            PHASE1_SEED: trial.phase1_seed, "updated_ltm": own,
            "routing_off_cost": (h.get("updated_routing_off") or {}).get("drop"),
            "root_l_removed_cost": wo[0]["drop"] if wo else None,
            "strict_off_cost": strict.get("drop"),
            "l_route_change": [float(x) for x in h.get("ltm_route_change") or []],
            # the mechanism (issue 61; absent from older diagnostics): per block, % of the
            # last segment's shared-prefix positions routed off the first segment's path, and
            # the Consolidator gradient's routing share (%)
            "seg2_path_change": [float(x) for x in
                                 (h.get("seg2_path_change") or {}).get("shared_prefix") or []],
            "routing_grad_share": (h.get("consolidator_gradient") or {}).get("routing_share")}


DIAGNOSTICS_COLUMNS: tuple[str, ...] = tuple(diagnostics_row(TrialId("x", 0), {}))


def diagnostics_frame(records: Mapping[TrialId, Mapping[str, Any]]) -> pd.DataFrame:
    """The diagnostics of each trial (:func:`diagnostics_row`), one row per trial."""
    rows = [diagnostics_row(t, h) for t, h in records.items()]
    out = pd.DataFrame(rows, columns=list(DIAGNOSTICS_COLUMNS))
    return out.sort_values(["condition", PHASE1_SEED, "seed"], na_position="first",
                           ignore_index=True) if rows else out


def load_diagnostics(directory: str | Path) -> pd.DataFrame:
    """:func:`diagnostics_frame` of every ``<trial>.json`` under ``directory`` (a store's or
    run's ``diagnostics/``); an empty frame when there is none. A file whose name is not a
    trial's raises ValueError naming it."""
    import json

    records = {}
    for path in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else ():
        try:
            records[TrialId.parse(path.stem)] = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a trial's diagnostics ({e})") from e
    return diagnostics_frame(records)


def diagnosed_model(diagnostics: pd.DataFrame, condition: str, phase1_seed: int
                    ) -> dict[str, Any] | None:
    """The diagnostics of `condition`'s diagnosed model on checkpoint `phase1_seed` (its
    smallest diagnosed Phase-2 seed: the study diagnoses seed 42's), or None."""
    if diagnostics is None or diagnostics.empty:
        return None
    rows = diagnostics[(diagnostics["condition"] == condition)
                       & (diagnostics[PHASE1_SEED] == phase1_seed)
                       & (diagnostics["variant"] == "")]
    return None if rows.empty else rows.sort_values("seed").iloc[0].to_dict()


# ------------------------------------------------------------------------------------------
# checkpoints as whole units
# ------------------------------------------------------------------------------------------


def checkpoints_with(df: pd.DataFrame, conditions: Iterable[str]) -> list[int]:
    """Phase-1 seeds where every one of `conditions` ran on at least one common Phase-2 seed."""
    need = set(conditions)
    if df.empty or PHASE1_SEED not in df.columns:
        return []
    have = df.groupby([PHASE1_SEED, "seed"])["condition"].agg(set)
    return sorted({int(k) for (k, _), got in have.items() if need <= got})


def whole_checkpoints(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(kept, set aside): the channel arms' trials of a checkpoint without every channel arm
    on a common Phase-2 seed are set aside (a started, unfinished checkpoint is listed, not
    averaged in); every other trial is kept."""
    ks = checkpoints_with(df, CHANNEL_CONDITIONS)
    if df.empty or PHASE1_SEED not in df.columns:
        return df, df.iloc[0:0]
    partial = df["condition"].isin(CHANNEL_ONLY) & ~df[PHASE1_SEED].isin(ks)
    return df[~partial], df[partial]


# ------------------------------------------------------------------------------------------
# small tests
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Correlation:
    """Spearman's rho of two series over the `n` checkpoints where both are defined; rho and
    p are None with fewer than three, or where either series is constant."""

    n: int
    rho: float | None
    p: float | None
    alternative: str


def spearman(x: pd.Series, y: pd.Series, alternative: str = "two-sided") -> Correlation:
    """Spearman's rho of `x` and `y` (aligned on their index), `alternative` as scipy's."""
    from scipy import stats as sps

    x, y = x.astype(float).align(y.astype(float), join="inner")
    ok = x.notna() & y.notna()
    if ok.sum() < 3 or x[ok].nunique() < 2 or y[ok].nunique() < 2:  # rho undefined
        return Correlation(int(ok.sum()), None, None, alternative)
    r = sps.spearmanr(x[ok], y[ok], alternative=alternative)
    return Correlation(int(ok.sum()), float(r.statistic), float(r.pvalue), alternative)


@dataclass(frozen=True)
class OneSample:
    """A one-sample t over per-checkpoint values: mean, SE, 95% CI and two-sided p (NaN
    with fewer than two checkpoints)."""

    k: int
    mean: float
    se: float
    ci_low: float
    ci_high: float
    p: float


def one_sample(values: pd.Series) -> OneSample:
    from scipy import stats as sps

    v = values.dropna().astype(float)
    if len(v) < 2:
        m = float(v.mean()) if len(v) else math.nan
        return OneSample(len(v), m, math.nan, math.nan, math.nan, math.nan)
    t = sps.ttest_1samp(v, 0.0)
    ci = t.confidence_interval(0.95)
    return OneSample(len(v), float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))),
                     float(ci.low), float(ci.high), float(t.pvalue))


# ------------------------------------------------------------------------------------------
# the channel question
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interaction:
    """(operator on - off) - (reference on - off) of updated-LTM recall: per checkpoint the
    mean over its Phase-2 seeds (paired by seed), then a one-sample t over the checkpoints
    (the checkpoint is the unit; with equal seeds per checkpoint this is the random-intercept
    estimate). > 0: the operator gains more from routing than the reference does."""

    operator: str
    reference: str
    n_pairs: int
    per_checkpoint: dict[int, float]
    test: OneSample

    @property
    def label(self) -> str:
        return f"({self.operator} on - off) - (Consolidator on - off)"


def routing_interaction(df: pd.DataFrame, operator: str, checkpoints: Sequence[int],
                        reference: str = CONSOLIDATOR) -> Interaction:
    v = df[df[PHASE1_SEED].isin(checkpoints)].pivot_table(
        index=[PHASE1_SEED, "seed"], columns="condition", values="updated_ltm")
    need = [operator, ROUTING_PAIRS[operator], reference, ROUTING_PAIRS[reference]]
    if not set(need) <= set(v.columns):
        return Interaction(operator, reference, 0, {}, one_sample(pd.Series(dtype=float)))
    v = v.dropna(subset=need)
    d = ((v[operator] - v[ROUTING_PAIRS[operator]])
         - (v[reference] - v[ROUTING_PAIRS[reference]]))
    per = d.groupby(level=PHASE1_SEED).mean()
    return Interaction(operator, reference, int(len(d)),
                       {int(k): float(x) for k, x in per.items()}, one_sample(per))


def condition_levels(df: pd.DataFrame, conditions: Sequence[str], checkpoints: Sequence[int],
                     metrics: Sequence[str]) -> pd.DataFrame:
    """Each condition's metrics, the mean over `checkpoints` of each checkpoint's mean over
    its Phase-2 seeds (a row per condition, sorted by name)."""
    sub = df[df["condition"].isin(conditions) & df[PHASE1_SEED].isin(checkpoints)]
    metrics = [m for m in metrics if m in sub.columns]
    return (sub.groupby(["condition", PHASE1_SEED])[metrics].mean()
            .groupby("condition").mean())


def _points_by(points: Sequence[CheckpointPoint], label: str) -> pd.Series:
    return pd.Series({p.phase1_seed: p.mean_diff for p in points if p.label == label},
                     dtype=float)


@dataclass(frozen=True)
class ChannelAnalysis:
    """"Can anything use the channel?" on the checkpoints with every channel arm
    (``checkpoints``): each arm's routing effect and level against the Consolidator's
    (``distributions``, ``points``), the interactions, the routing effects' agreement with
    the Consolidator's across checkpoints (two-sided), each arm's mean levels, and the
    diagnosed models' costs (``mechanism``: a row per checkpoint and condition)."""

    checkpoints: list[int]
    phase2_seeds: list[int]
    distributions: tuple[EffectDistribution, ...]
    points: tuple[CheckpointPoint, ...]
    interactions: tuple[Interaction, ...]
    agreement: dict[str, Correlation]
    levels: pd.DataFrame
    mechanism: pd.DataFrame


def channel_analysis(df: pd.DataFrame, diagnostics: pd.DataFrame | None = None
                     ) -> ChannelAnalysis | None:
    """The channel question over `df` (whole checkpoints only: :func:`whole_checkpoints`);
    None when no checkpoint has every channel arm."""
    ks = checkpoints_with(df, CHANNEL_CONDITIONS)
    if not ks:
        return None
    sub = df[df[PHASE1_SEED].isin(ks)]
    dists, points = checkpoint_distribution(sub, (*CHANNEL_COMPARISONS, *LEVEL_COMPARISONS))
    routing = {c.cond_a: c.label for c in CHANNEL_COMPARISONS}
    reference = _points_by(points, routing[CONSOLIDATOR])
    agree = {op: spearman(reference, _points_by(points, routing[op]))
             for op in CHANNEL_OPERATORS}
    mech = []
    for k in ks:
        for cond in CHANNEL_CONDITIONS:
            if (h := diagnosed_model(diagnostics, cond, k)) is not None:
                mech.append(h)
    return ChannelAnalysis(
        checkpoints=ks, phase2_seeds=sorted(int(s) for s in sub["seed"].unique()),
        distributions=dists, points=points,
        interactions=tuple(routing_interaction(df, op, ks) for op in CHANNEL_OPERATORS),
        agreement=agree,
        levels=condition_levels(df, CHANNEL_CONDITIONS, ks, ("updated_ltm", "updated_ltm_add10",
                                                             "updated_ltm_affine10",
                                                             "seg2_stm")),
        mechanism=pd.DataFrame(mech, columns=list(DIAGNOSTICS_COLUMNS)))


# ------------------------------------------------------------------------------------------
# the strict-off arms
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeVsTrained:
    """Does the inference-time probe (the diagnosed routing-off model's strict-off cost)
    foretell the trained routing off - strict off effect, checkpoint by checkpoint?"""

    arm: str
    probe: dict[int, float]
    trained: dict[int, float]
    correlation: Correlation


@dataclass(frozen=True)
class StrictAnalysis:
    """What a trained strict-off arm changes: per arm with a strict-off twin, on the
    checkpoints where its three arms ran (``checkpoints``), routing off - strict off and
    routing on - strict off; each condition's mean levels; the probe against the trained
    effect; and the diagnosed strict models (``strict_models``: strict off at inference
    costs a model whose routers ignore L nothing)."""

    checkpoints: dict[str, list[int]]
    distributions: tuple[EffectDistribution, ...]
    points: tuple[CheckpointPoint, ...]
    levels: pd.DataFrame
    probe_vs_trained: tuple[ProbeVsTrained, ...]
    strict_models: pd.DataFrame


def strict_analysis(df: pd.DataFrame, diagnostics: pd.DataFrame | None = None
                    ) -> StrictAnalysis | None:
    """None when no checkpoint has an arm's three strict-off conditions."""
    arms = {on: checkpoints_with(df, (on, ROUTING_PAIRS[on], STRICT_PAIRS[ROUTING_PAIRS[on]]))
            for on in STRICT_ARMS}
    arms = {on: ks for on, ks in arms.items() if ks}
    if not arms:
        return None
    dists: list[EffectDistribution] = []
    points: list[CheckpointPoint] = []
    probes, sanity = [], []
    for on, ks in arms.items():
        off = ROUTING_PAIRS[on]
        strict = STRICT_PAIRS[off]
        comps = [c for c in (*STRICT_COMPARISONS, *ALL_ROUTING_COMPARISONS)
                 if c.cond_a in (on, off) and c.cond_b == strict]
        d, p = checkpoint_distribution(df[df[PHASE1_SEED].isin(ks)], comps)
        dists += d
        points += p
        off_minus_strict = next(c.label for c in comps if c.cond_a == off)
        trained = {q.phase1_seed: q.mean_diff for q in p if q.label == off_minus_strict}
        probe = {}
        for k in ks:
            if (h := diagnosed_model(diagnostics, off, k)) is not None and \
                    h["strict_off_cost"] is not None:
                probe[k] = float(h["strict_off_cost"])
            if (h := diagnosed_model(diagnostics, strict, k)) is not None:
                sanity.append(h)
        both = [k for k in ks if k in probe and k in trained]
        probes.append(ProbeVsTrained(
            on, {k: probe[k] for k in both}, {k: trained[k] for k in both},
            spearman(pd.Series(probe, dtype=float), pd.Series(trained, dtype=float))))
    all_ks = sorted({k for ks in arms.values() for k in ks})
    conds = [c for on in arms for c in (on, ROUTING_PAIRS[on], STRICT_PAIRS[ROUTING_PAIRS[on]])]
    return StrictAnalysis(
        checkpoints=arms, distributions=tuple(dists), points=tuple(points),
        levels=condition_levels(df, conds, all_ks, ("updated_ltm", "updated_ltm_add10",
                                                    "seg2_stm")),
        probe_vs_trained=tuple(probes),
        strict_models=pd.DataFrame(sanity, columns=list(DIAGNOSTICS_COLUMNS)))


# ------------------------------------------------------------------------------------------
# the pre-registered predictor
# ------------------------------------------------------------------------------------------


def checkpoint_features(routes: Mapping[int, Mapping[str, Any]],
                        diagnostics: pd.DataFrame | None = None) -> pd.DataFrame:
    """A row per Phase-1 checkpoint (index: its seed) from its Phase-1 route diagnostics
    (`pmnet diagnose phase1.pt`): the pre-registered predictor `root_l_route_change` (the %
    of segment-2 root routes L changes) and the secondary ones (the random-route cost, the
    root's median margin, Phase 1's STM recall on the validation stream); and from the
    diagnosed routing-on Consolidator, the recall lost when L leaves the root's routing."""
    rows = []
    for k, g in sorted(routes.items()):
        change = g.get("ltm_route_change") or [math.nan]
        row = {PHASE1_SEED: int(k), "root_l_route_change": float(change[0]),
               "random_route_cost": (g.get("stm_random_routes") or {}).get("drop"),
               "root_margin": (g.get("margin_median") or [None])[0],
               "phase1_stm_val": (g.get("stm") or {}).get("recall"),
               "on_root_l_removed_cost": None}
        if (h := diagnosed_model(diagnostics, CONSOLIDATOR, int(k))) is not None:
            row["on_root_l_removed_cost"] = h["root_l_removed_cost"]
        rows.append(row)
    cols = [PHASE1_SEED, "root_l_route_change", *SECONDARY_FEATURES]
    return pd.DataFrame(rows, columns=cols).set_index(PHASE1_SEED).astype(float)


@dataclass(frozen=True)
class PredictorTest:
    """The pre-registered test (docs/results.md, "Pre-registration" and its amendments):
    rho(root L route change, routing effect) < 0, one-sided, p < ``alpha``, on the
    ``subset`` of checkpoints (``subset_name`` in the store); beside it, the same over every
    checkpoint (not independent of the pre-registration), the sign rule's cases (X >= 50),
    and the secondary features (two-sided, exploratory)."""

    subset_name: str
    subset: tuple[int, ...]
    alpha: float
    confirmatory: Correlation
    all_checkpoints: Correlation
    sign_rule: tuple[tuple[int, float, float], ...]  # (phase1_seed, X, routing effect)
    secondary: dict[str, Correlation] = field(default_factory=dict)

    @property
    def holds(self) -> bool:
        c = self.confirmatory
        return c.rho is not None and c.p is not None and c.rho < 0 and c.p < self.alpha


def predictor_test(features: pd.DataFrame, routing_effect: pd.Series,
                   subset: Sequence[int], *, subset_name: str = "confirmatory",
                   alpha: float = 0.05) -> PredictorTest:
    """`features`: :func:`checkpoint_features`; `routing_effect`: each checkpoint's routing
    on - off effect (index: Phase-1 seed); `subset`: the confirmatory checkpoints."""
    x = features["root_l_route_change"]
    y = routing_effect.astype(float)
    conf = [k for k in subset if k in features.index]
    sign = tuple((int(k), float(x[k]), float(y[k])) for k in features.index
                 if x[k] >= 50 and k in y.index and not math.isnan(y[k]))
    return PredictorTest(
        subset_name=subset_name, subset=tuple(subset), alpha=alpha,
        confirmatory=spearman(x.loc[conf], y, "less"),
        all_checkpoints=spearman(x, y, "less"), sign_rule=sign,
        secondary={name: spearman(features[name], y) for name in SECONDARY_FEATURES
                   if features[name].notna().any()})


# ------------------------------------------------------------------------------------------
# sensitivity: a named subset, the last epoch, the capability gate
# ------------------------------------------------------------------------------------------


def at_last_epoch(df: pd.DataFrame) -> pd.DataFrame:
    """Every trial scored at its last epoch instead of its selected one: each metric with a
    `last_` twin takes that twin's value (issue 44: a trial selected at epoch 0 says what an
    untrained Consolidator does)."""
    out = df.copy()
    for col in df.columns:
        if col.startswith(LAST_PREFIX) and col[len(LAST_PREFIX):] in df.columns:
            out[col[len(LAST_PREFIX):]] = df[col]
    return out


@dataclass(frozen=True)
class SensitivityRow:
    """One effect under one analysis, with both arms against their output-set baselines
    over the same trials (None: no baseline column)."""

    analysis: str
    distribution: EffectDistribution
    gate: CapabilityGate | None


def sensitivity(df: pd.DataFrame, subsets: Mapping[str, Sequence[int]] | None = None,
                comparisons: Sequence[Comparison] = CHECKPOINT_COMPARISONS
                ) -> tuple[SensitivityRow, ...]:
    """The core effects over every checkpoint at the selected epoch, on each named subset
    of checkpoints, and over every checkpoint at the last epoch (where the trials carry it)."""
    comparisons = [c for c in comparisons if {c.metric_a, c.metric_b} <= set(df.columns)]
    frames = {"all checkpoints, selected epoch": df}
    for name, seeds in (subsets or {}).items():
        frames[f"{name} {_seed_range(seeds)}, selected epoch"] = df[df[PHASE1_SEED].isin(seeds)]
    if any(c.startswith(LAST_PREFIX) for c in df.columns):
        frames["all checkpoints, last epoch"] = at_last_epoch(df)
    rows = []
    for analysis, part in frames.items():
        for d in checkpoint_distribution(part, comparisons)[0]:
            spec = next(c for c in comparisons if c.label == d.label)
            rows.append(SensitivityRow(analysis, d, capability_gate(part, spec)))
    return tuple(rows)


def _seed_range(seeds: Sequence[int]) -> str:
    """`3..9` for a run of consecutive seeds, else `1, 4, 7`."""
    s = sorted(seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}..{s[-1]}"
    return ", ".join(str(x) for x in s)


def sensitivity_frame(rows: Sequence[SensitivityRow]) -> pd.DataFrame:
    out = checkpoint_frame([r.distribution for r in rows])
    out.insert(0, "analysis", [r.analysis for r in rows])
    out["arms_vs_baseline"] = [r.gate.text() if r.gate else "" for r in rows]
    return out

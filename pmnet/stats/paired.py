"""Per-condition summaries and paired-by-seed comparisons (paper Section 6.3): mean ± SD,
the paired t-test with its t CI and d_z, and the paper's family of comparisons with Holm's
correction (:data:`COMPARISONS`, :func:`compare_all`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.weightstats import DescrStatsW

from pmnet.conditions import PAPER_SEEDS
from pmnet.stats.vocabulary import (
    CONDITIONS,
    EQUAL_TOL,
    IDENTITY_COLUMNS,
    NOT_METRICS,
    STRING_META,
    VARIANT_FIELDS_ATTR,
    ordered_conditions,
)


def metric_columns(df: pd.DataFrame) -> list[str]:
    """Numeric measurement columns of a tidy table (test metrics, val_*, best_epoch, time);
    not the identity, provenance or variant-field columns."""
    out = []
    skip = set(IDENTITY_COLUMNS + ("source_file",) + STRING_META)
    skip |= set(df.attrs.get(VARIANT_FIELDS_ATTR, ()))
    for name in df.columns:
        if name in NOT_METRICS or name in skip:
            continue
        if pd.api.types.is_numeric_dtype(df[name]):
            out.append(name)
    return out


def seed_values(df: pd.DataFrame, condition: str, metric: str) -> pd.Series:
    """The non-missing values of ``metric`` for ``condition``, indexed by seed."""
    if df.empty or metric not in df.columns:
        return pd.Series(dtype="float64", name=metric)
    rows = df[df["condition"] == condition]
    values = pd.to_numeric(rows[metric], errors="coerce")
    values.index = rows["seed"].astype("int64").to_numpy()
    return values.dropna().sort_index()


def summarize(df: pd.DataFrame, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Per condition and metric: n (non-missing seeds), mean and sample SD (ddof=1).

    SD is NaN when n < 2. Metrics without any value for a condition are omitted.
    """
    metrics = list(metrics) if metrics is not None else metric_columns(df)
    rows = []
    conditions = ordered_conditions(df["condition"]) if not df.empty else []
    for condition in conditions:
        for metric in metrics:
            values = seed_values(df, condition, metric)
            n = int(values.size)
            if n == 0:
                continue
            rows.append(
                {
                    "condition": condition,
                    "metric": metric,
                    "n": n,
                    "mean": float(values.mean()),
                    "sd": float(values.std(ddof=1)) if n > 1 else math.nan,
                }
            )
    return pd.DataFrame(rows, columns=["condition", "metric", "n", "mean", "sd"])


def _seed_word(seeds: Sequence[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in seeds)


def paired_comparison(
    df: pd.DataFrame,
    cond_a: str,
    metric_a: str,
    cond_b: str,
    metric_b: str,
    label: str | None = None,
    *,
    paper_table: str | None = None,
    expected_seeds: Iterable[int] | None = None,
    remark: str | None = None,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """Paired-by-seed difference ``(cond_a, metric_a) - (cond_b, metric_b)``.

    Seeds are inner-joined; every seed seen on either side (or listed in ``expected_seeds``)
    that is not paired is listed in ``missing_seeds`` and in ``note``
    (``"seed 45 missing in consolidator_only_routing_off; n=4"``).

    Returns n, paired seeds, mean and SD of each side over the paired seeds, mean and sample SD
    of the differences, the t-distribution ``1 - alpha`` CI of the mean difference, the paired
    t statistic, its two-sided p value (statsmodels ``DescrStatsW``), the effect size
    d_z = mean / SD, and ``note``. With fewer than two paired seeds, or all differences equal
    (SD = 0), t, p and the CI are NaN and the note says why.
    """
    label = label or f"{cond_a}:{metric_a} - {cond_b}:{metric_b}"
    sides = []
    for condition, metric in ((cond_a, metric_a), (cond_b, metric_b)):
        present: set[int] = set()
        if not df.empty:
            present = set(df.loc[df["condition"] == condition, "seed"].astype(int))
        sides.append((condition, metric, present, seed_values(df, condition, metric)))
    (_, _, present_a, values_a), (_, _, present_b, values_b) = sides
    paired = sorted(set(values_a.index) & set(values_b.index))
    candidates = present_a | present_b | set(expected_seeds or ())
    unpaired = sorted(candidates - set(paired))

    # why each unpaired seed is unpaired, grouped by reason (order: side a, side b)
    reasons: dict[str, list[int]] = {}
    for seed in unpaired:
        for condition, metric, present, values in sides:
            if seed not in present:
                reason = f"missing in {condition}"
            elif seed not in values.index:
                reason = f"without {metric} in {condition}"
            else:
                continue
            if seed not in reasons.setdefault(reason, []):
                reasons[reason].append(seed)
    notes = []
    for reason, seeds in reasons.items():
        condition = reason.rsplit(" in ", 1)[1]
        present = present_a if condition == cond_a else present_b
        if not present:
            notes.append(f"no results for {condition} ({_seed_word(seeds)})")
            continue
        if reason.startswith("without ") and set(seeds) == present:
            # the metric is absent from every trial of that condition: say so once
            metric = reason[len("without ") :].rsplit(" in ", 1)[0]
            notes.append(f"{metric} not reported by {condition} ({_seed_word(seeds)})")
        else:
            notes.append(f"{_seed_word(seeds)} {reason}")
    head = []
    for condition, present in ((cond_a, present_a), (cond_b, present_b)):
        said = any(n.startswith(f"no results for {condition}") for n in notes + head)
        if not present and not said:
            head.append(f"no results for {condition}")
    notes = head + notes

    n = len(paired)
    a = values_a.loc[paired].to_numpy(dtype=float) if n else np.array([])
    b = values_b.loc[paired].to_numpy(dtype=float) if n else np.array([])
    diffs = a - b
    nan = math.nan
    result: dict[str, Any] = {
        "label": label,
        "paper_table": paper_table,
        "cond_a": cond_a,
        "metric_a": metric_a,
        "cond_b": cond_b,
        "metric_b": metric_b,
        "n": n,
        "seeds": list(paired),
        "missing_seeds": list(unpaired),
        "mean_a": float(a.mean()) if n else nan,
        "sd_a": float(a.std(ddof=1)) if n > 1 else nan,
        "mean_b": float(b.mean()) if n else nan,
        "sd_b": float(b.std(ddof=1)) if n > 1 else nan,
        "mean_diff": float(diffs.mean()) if n else nan,
        "sd_diff": nan,
        "ci_low": nan,
        "ci_high": nan,
        "t": nan,
        "df": n - 1 if n > 1 else nan,
        "p": nan,
        "d_z": nan,
        "note": "",
    }
    if notes:
        notes.append(f"n={n}")
    if n == 0:
        notes.append("no paired seeds; nothing to compare")
    elif n == 1:
        notes.append("fewer than 2 paired seeds (n=1); SD, CI and t-test undefined")
    else:
        mean = float(diffs.mean())
        if float(np.ptp(diffs)) <= EQUAL_TOL * max(1.0, abs(mean)):
            result["sd_diff"] = 0.0
            notes.append(f"all paired differences equal ({mean:+.2f}); t-test undefined")
        else:
            stats = DescrStatsW(diffs)
            t_stat, p_value, _ = stats.ttest_mean(0.0)
            low, high = stats.tconfint_mean(alpha=alpha)
            sd = float(diffs.std(ddof=1))
            result.update(
                sd_diff=sd,
                ci_low=float(low),
                ci_high=float(high),
                t=float(t_stat),
                p=float(p_value),
                d_z=mean / sd,
            )
    if remark:
        notes.append(remark)
    result["note"] = "; ".join(notes)
    return result


class Comparison(NamedTuple):
    """One paired comparison of the paper's family: ``(cond_a, metric_a) - (cond_b, metric_b)``."""

    label: str
    cond_a: str
    metric_a: str
    cond_b: str
    metric_b: str
    paper_table: str


def _build_comparisons() -> tuple[Comparison, ...]:
    on, off = "consolidator_only", "consolidator_only_routing_off"
    out = [
        Comparison(f"routing on - off: {m}", on, m, off, m, table)
        for m, table in (
            ("updated_ltm", "tab:direct-ltm-routing"),
            ("updated_ltm_add10", "tab:routing-rule-family"),
            ("updated_ltm_affine10", "tab:routing-rule-family"),
            ("seg2_stm", "tab:direct-ltm-routing"),
        )
    ]
    out += [
        Comparison(
            "learned - forced identity, routing on: updated_ltm",
            on, "updated_ltm", on, "forced_identity", "tab:same-address-update",
        ),
        Comparison(
            "learned - forced identity, routing off: updated_ltm",
            off, "updated_ltm", off, "forced_identity", "tab:direct-ltm-routing",
        ),
        Comparison(
            "learned_full - identity_full: updated_ltm",
            "learned_full", "updated_ltm", "identity_full", "updated_ltm",
            "sec:core-parameter-isolation",
        ),
    ]
    out += [
        Comparison(
            f"dual - LTM only: {m}", "learned_full_dual", m, "learned_full", m,
            "tab:dual-objective-aggregate",
        )
        for m in ("updated_ltm", "mean_stm", "seg2_stm")
    ]
    for control, name in (("mismatched_ltm", "mismatched"), ("fresh_ltm", "fresh")):
        out += [
            Comparison(
                f"correct - {name} LTM: {c}", c, "updated_ltm", c, control,
                "sec:recall-requires-the-correct-latent-experience",
            )
            for c in CONDITIONS
        ]
    out += [
        Comparison(
            f"recall - output-set baseline: {c}", c, "updated_ltm", c, "updated_ltm_baseline",
            "ours:shortcut-diagnostics",
        )
        for c in CONDITIONS
    ]
    out += [
        Comparison(
            f"recall - output-set baseline, {fam}: {c}", c, f"updated_ltm_{fam}", c,
            f"updated_ltm_{fam}_baseline", "ours:shortcut-diagnostics",
        )
        for fam in ("add10", "affine10")
        for c in CONDITIONS
    ]
    return tuple(out)


#: A recall metric's output-set baseline is the column with this suffix: the rule-free
#: guesser's expected recall on the same episodes (`pmnet.task`, "Output-set shortcut").
BASELINE_SUFFIX = "_baseline"


def baseline_metric(metric: str) -> str | None:
    """The output-set baseline column of a recall metric (`updated_ltm` ->
    `updated_ltm_baseline`, `updated_ltm_add10` -> `updated_ltm_add10_baseline`); None for a
    column that is a baseline itself."""
    return None if metric.endswith(BASELINE_SUFFIX) else metric + BASELINE_SUFFIX


@dataclass(frozen=True)
class ArmCapability:
    """One arm's recall beside its output-set baseline, means over the same trials (issue 44):
    an arm at or below the baseline does not use the episode's rule, whatever it recalls."""

    condition: str
    metric: str
    recall: float
    baseline: float
    n: int  # trials with both values

    @property
    def margin(self) -> float:
        """recall - baseline, percentage points."""
        return self.recall - self.baseline

    @property
    def above(self) -> bool:
        return self.margin > 0


@dataclass(frozen=True)
class CapabilityGate:
    """The two arms of a paired comparison against their output-set baselines. A comparison
    whose arms are both at or below the baseline compares two models that do not use the
    rule: it gets no verdict about the paper's mechanism (issue 44)."""

    a: ArmCapability
    b: ArmCapability

    @property
    def both_below(self) -> bool:
        return not self.a.above and not self.b.above

    def text(self) -> str:
        """`20.1 / 18.3 vs 42.0` (one baseline when both arms share it), `(both below)`."""
        base = (f"{self.a.baseline:.1f}" if abs(self.a.baseline - self.b.baseline) < 0.05
                else f"{self.a.baseline:.1f} / {self.b.baseline:.1f}")
        out = f"{self.a.recall:.1f} / {self.b.recall:.1f} vs {base}"
        return out + (" (both below)" if self.both_below else "")


def arm_capability(df: pd.DataFrame, condition: str, metric: str) -> ArmCapability | None:
    """`condition`'s mean `metric` and mean output-set baseline over the trials that have
    both; None when the metric has no baseline column or no trial has both."""
    base = baseline_metric(metric)
    if df.empty or base is None or metric not in df.columns or base not in df.columns:
        return None
    rows = df.loc[df["condition"] == condition, [metric, base]]
    rows = rows.apply(pd.to_numeric, errors="coerce").dropna()
    if rows.empty:
        return None
    return ArmCapability(condition, metric, float(rows[metric].mean()),
                         float(rows[base].mean()), int(len(rows)))


def capability_gate(df: pd.DataFrame, spec: Comparison) -> CapabilityGate | None:
    """Both arms of `spec` against their baselines; None when either side has no baseline
    (e.g. a `recall - output-set baseline` comparison) or no trial."""
    a = arm_capability(df, spec.cond_a, spec.metric_a)
    b = arm_capability(df, spec.cond_b, spec.metric_b)
    return None if a is None or b is None else CapabilityGate(a, b)


#: The paper's family of paired comparisons (Holm correction runs over all of them).
COMPARISONS: tuple[Comparison, ...] = _build_comparisons()

#: Extra context appended to a comparison's note.
COMPARISON_REMARKS: dict[str, str] = {
    "learned_full - identity_full: updated_ltm": (
        "independently trained runs (the paper calls them unpaired); differences paired by seed"
    ),
    **{
        f"dual - LTM only: {m}": (
            "independently optimized objectives; paired by seed and data stream"
        )
        for m in ("updated_ltm", "mean_stm", "seg2_stm")
    },
    **{
        f"routing on - off: {m}": "separately trained Consolidators from one Phase-1 checkpoint"
        for m in ("updated_ltm", "updated_ltm_add10", "updated_ltm_affine10", "seg2_stm")
    },
}


def expected_seed_set(df: pd.DataFrame) -> list[int]:
    """Every seed seen in ``df`` (or the paper's seeds when ``df`` is empty)."""
    if df.empty:
        return list(PAPER_SEEDS)
    return sorted(set(df["seed"].astype(int)))


def compare_all(
    df: pd.DataFrame,
    comparisons: Sequence[Comparison] | None = None,
    *,
    expected_seeds: Iterable[int] | None = None,
    alpha: float = 0.05,
    remarks: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Every comparison of the family (default :data:`COMPARISONS`), one row each; a
    comparison's note ends with its entry in ``remarks`` (default :data:`COMPARISON_REMARKS`).

    ``expected_seeds`` defaults to every seed in ``df``, so a seed that ran for some condition
    but is absent from both sides of a comparison is still named in its note. ``p_holm`` is
    the Holm step-down adjusted p over the comparisons whose p is defined (``holm_m`` of
    them); undefined p values stay NaN and are not counted.
    """
    comparisons = COMPARISONS if comparisons is None else comparisons
    remarks = COMPARISON_REMARKS if remarks is None else remarks
    seeds = expected_seed_set(df) if expected_seeds is None else list(expected_seeds)
    rows = [
        paired_comparison(
            df,
            c.cond_a,
            c.metric_a,
            c.cond_b,
            c.metric_b,
            c.label,
            paper_table=c.paper_table,
            expected_seeds=seeds,
            remark=remarks.get(c.label),
            alpha=alpha,
        )
        for c in comparisons
    ]
    out = pd.DataFrame(rows)
    if out.empty:
        out = pd.DataFrame(columns=["label", "p", "p_holm", "holm_m"])
        return out
    p = out["p"].to_numpy(dtype=float)
    finite = np.isfinite(p)
    holm = np.full(p.shape, np.nan)
    if finite.any():
        holm[finite] = multipletests(p[finite], method="holm")[1]
    out["p_holm"] = holm
    out["holm_m"] = int(finite.sum())
    return out


@dataclass(frozen=True)
class Family:
    """A family of paired comparisons beyond the paper, with Holm's correction within it (so
    the paper's family, :data:`COMPARISONS`, is unchanged): the conditions whose trials make
    it present in a run, its comparisons, and the note each comparison carries."""

    conditions: tuple[str, ...]
    comparisons: tuple[Comparison, ...]
    remark: str

    @property
    def remarks(self) -> dict[str, str]:
        return {c.label: self.remark for c in self.comparisons}

    def present(self, df: pd.DataFrame) -> bool:
        """Whether any trial of the family's conditions is in ``df``."""
        return not df.empty and bool(df["condition"].isin(self.conditions).any())

    def compare(self, df: pd.DataFrame, *, expected_seeds: Iterable[int] | None = None,
                alpha: float = 0.05) -> pd.DataFrame:
        """:func:`compare_all` over the family's comparisons (Holm within the family)."""
        return compare_all(df, self.comparisons, expected_seeds=expected_seeds, alpha=alpha,
                           remarks=self.remarks)

"""Beyond the paper (issue 11): the Phase-1 checkpoint as a random factor. Each headline
effect over K Phase-1 checkpoints x Phase-2 seeds, a REML mixed model with a random intercept
per checkpoint beside the paper's paired test within each checkpoint."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from pmnet.stats.paired import (
    COMPARISONS,
    Comparison,
    _seed_word,
    paired_comparison,
    seed_values,
)
from pmnet.stats.vocabulary import EQUAL_TOL, PHASE1_SEED

#: The headline paired comparisons (the paired rows of the report's ``tab:headline``), in that
#: order: the effects :func:`phase1_variance` analyses across Phase-1 checkpoints by default.
PHASE1_COMPARISON_LABELS: tuple[str, ...] = (
    "routing on - off: updated_ltm",
    "learned - forced identity, routing off: updated_ltm",
    "learned - forced identity, routing on: updated_ltm",
    "learned_full - identity_full: updated_ltm",
    "dual - LTM only: mean_stm",
    "dual - LTM only: updated_ltm",
)
PHASE1_COMPARISONS: tuple[Comparison, ...] = tuple(
    next(c for c in COMPARISONS if c.label == label) for label in PHASE1_COMPARISON_LABELS
)

#: A fit whose between-checkpoint share of the variance (ICC) is below this is singular: the
#: REML estimate of the between-checkpoint variance sits on its boundary, 0.
SINGULAR_ICC = 1e-4


def _phase1_column(df: pd.DataFrame) -> pd.Series:
    """The Phase-1 seed of every row as float (NaN where missing); ValueError when the column
    is absent or holds a non-integer."""
    if PHASE1_SEED not in df.columns:
        raise ValueError(
            f"the trial table has no '{PHASE1_SEED}' column: its results come from one Phase-1 "
            "checkpoint (the result files carry no top-level phase1_seed), so there is no "
            "Phase-1 variance to analyse"
        )
    values = pd.to_numeric(df[PHASE1_SEED], errors="coerce").astype("float64")
    bad = values.notna() & (values != values.round())
    if bad.any():
        raise ValueError(f"'{PHASE1_SEED}' must hold integers, found {values[bad].iloc[0]!r}")
    return values


def phase1_seeds(df: pd.DataFrame) -> list[int]:
    """The distinct Phase-1 seeds of the trials, sorted ([] without a phase1_seed column)."""
    if PHASE1_SEED not in df.columns or df.empty:
        return []
    return sorted({int(v) for v in _phase1_column(df).dropna()})


def has_phase1_variance(df: pd.DataFrame) -> bool:
    """Whether the trials come from more than one Phase-1 checkpoint."""
    return len(phase1_seeds(df)) > 1


def reference_phase1_seed(df: pd.DataFrame) -> int | None:
    """The checkpoint the paper-layout analysis uses when there are several: the smallest
    Phase-1 seed (None without any)."""
    seeds = phase1_seeds(df)
    return seeds[0] if seeds else None


def at_phase1_seed(df: pd.DataFrame, phase1_seed: int) -> pd.DataFrame:
    """The trials that started from the Phase-1 checkpoint of ``phase1_seed`` (a copy, index
    reset, ``attrs`` kept, ``attrs["failed"]`` restricted to that checkpoint's records)."""
    out = df[(_phase1_column(df) == phase1_seed).to_numpy()].reset_index(drop=True)
    out.attrs = dict(df.attrs)
    if "failed" in df.attrs:  # failed trials of this checkpoint only
        out.attrs["failed"] = [r for r in df.attrs["failed"] if r.get(PHASE1_SEED) == phase1_seed]
    return out


@dataclass(frozen=True)
class CheckpointTest:
    """The paper's fixed-checkpoint analysis within one Phase-1 checkpoint: the paired-by-seed
    t-test of :func:`paired_comparison` over the trials of that checkpoint."""

    label: str
    phase1_seed: int
    n: int
    seeds: tuple[int, ...]
    missing_seeds: tuple[int, ...]
    mean_a: float
    mean_b: float
    mean_diff: float
    sd_diff: float
    ci_low: float
    ci_high: float
    t: float
    df: float
    p: float
    d_z: float
    note: str


@dataclass(frozen=True)
class Phase1Effect:
    """One headline effect with the Phase-1 checkpoint as a random factor.

    The model is ``diff_ij = mu + u_i + e_ij`` for the paired difference of Phase-2 seed j
    from Phase-1 checkpoint i, ``u_i ~ N(0, var_between)``, ``e_ij ~ N(0, var_residual)``,
    fitted by REML (statsmodels ``MixedLM``). ``estimate`` is mu with its ``se``; ``z`` =
    estimate / se. Two references for it: ``p_t`` / ``ci_low_t`` / ``ci_high_t`` use a t
    distribution with ``df_t`` = K - 1 degrees of freedom (exact for balanced designs; the
    report's primary numbers), ``p_wald`` / ``ci_*_wald`` the normal (statsmodels' Wald z).
    ``icc`` = var_between / (var_between + var_residual). ``mean_diff`` / ``sd_diff``
    describe all ``n`` pairs pooled (mean ± SD, as the paper prints differences).

    ``fitted`` is False when no mixed model was fitted or its fit was rejected; ``note`` then
    says why (K = 1, one pair per checkpoint, equal differences, a failed fit) and every
    model column is NaN. ``singular``: the between variance was estimated at its boundary 0.
    ``converged`` is statsmodels' flag for the kept fit (None when not fitted; a singular fit
    is kept even when the gradient optimisers call it unconverged, a non-singular one is
    not), ``optimizer`` the optimiser whose fit was kept (:func:`fit_random_intercept`);
    ``fit_warnings`` holds the warnings the fits raised (captured, never printed).
    """

    label: str
    cond_a: str
    metric_a: str
    cond_b: str
    metric_b: str
    paper_table: str
    k: int
    n: int
    phase1_seeds: tuple[int, ...]
    pairs_per_checkpoint: tuple[int, ...]
    mean_diff: float
    sd_diff: float
    estimate: float
    se: float
    z: float
    df_t: float
    p_t: float
    ci_low_t: float
    ci_high_t: float
    p_wald: float
    ci_low_wald: float
    ci_high_wald: float
    var_between: float
    var_residual: float
    sd_between: float
    sd_residual: float
    icc: float
    fitted: bool
    converged: bool | None
    singular: bool
    optimizer: str
    fit_warnings: str
    note: str


def _frame(rows: Sequence[Any], cls: type) -> pd.DataFrame:
    columns = [f.name for f in fields(cls)]
    return pd.DataFrame([asdict(r) for r in rows], columns=columns)


@dataclass(frozen=True)
class Phase1Analysis:
    """What :func:`phase1_variance` returns: one :class:`Phase1Effect` per comparison, one
    :class:`CheckpointTest` per (comparison, Phase-1 seed) in that order, and ``notes`` about
    trials left out of every comparison (rows without a Phase-1 seed)."""

    effects: tuple[Phase1Effect, ...]
    checkpoints: tuple[CheckpointTest, ...]
    notes: tuple[str, ...] = ()

    def effects_frame(self) -> pd.DataFrame:
        return _frame(self.effects, Phase1Effect)

    def checkpoints_frame(self) -> pd.DataFrame:
        return _frame(self.checkpoints, CheckpointTest)


class _MixedFit(NamedTuple):
    estimate: float
    se: float
    var_between: float
    var_residual: float
    converged: bool | None
    optimizer: str
    warnings: tuple[str, ...]
    error: str | None


#: Optimisers for a fit: statsmodels' default sequence (bfgs -> lbfgs -> cg), then, unless it
#: converged to an interior optimum, Powell and Nelder-Mead; the fit with the highest REML
#: log-likelihood is kept. Near the boundary (a small between variance) the gradient
#: methods can stop short of the optimum, unconverged; the derivative-free ones reach it.
MIXED_OPTIMIZERS: tuple[str, ...] = ("default", "powell", "nm")


def _gls_mean_and_se(
    diffs: np.ndarray, groups: np.ndarray, var_between: float, var_residual: float
) -> tuple[float, float]:
    """The GLS intercept and its SE (X' V^-1 X)^-1/2 of ``diffs ~ 1`` with a random intercept,
    given the variance components: checkpoint means weighted by n_i / (var_residual + n_i
    var_between)."""
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    means = np.bincount(inverse, weights=diffs) / counts
    weights = counts / (var_residual + counts * var_between)
    return float(np.sum(weights * means) / np.sum(weights)), float(1 / math.sqrt(weights.sum()))


def fit_random_intercept(diffs: np.ndarray, groups: np.ndarray) -> _MixedFit:
    """REML fit of ``diffs ~ 1`` with a random intercept per group (statsmodels ``MixedLM``).

    The optimisers of :data:`MIXED_OPTIMIZERS` are tried in turn until one converges to an
    interior optimum (ICC >= :data:`SINGULAR_ICC`); of the fits made, the one with the highest
    REML log-likelihood wins (among fits within 1e-6 of it, a converged one). The estimate and
    variance components are statsmodels'; the SE is the REML fixed-effect SE (X' V^-1 X)^-1/2
    at those components, which is statsmodels' ``bse_fe`` for an interior fit and stays right
    on the boundary (between variance 0), where statsmodels inverts a Hessian that is not
    positive definite. Never raises for a numerical failure: ``error`` says what failed;
    every warning of the fits is captured in ``warnings`` (deduplicated), none is printed.
    """
    from statsmodels.regression.mixed_linear_model import MixedLM

    y = np.asarray(diffs, dtype=float)
    g = np.asarray(groups)
    nan = math.nan
    found: list[tuple[float, bool, str, Any]] = []
    errors: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for optimizer in MIXED_OPTIMIZERS:
            method = None if optimizer == "default" else [optimizer]
            try:
                result = MixedLM(y, np.ones((y.size, 1)), groups=g).fit(reml=True,
                                                                        method=method)
                llf = float(result.llf)
            except (np.linalg.LinAlgError, ValueError, FloatingPointError,
                    ZeroDivisionError) as exc:
                errors.append(f"{optimizer}: {type(exc).__name__}: {exc}")
                continue
            if math.isfinite(llf):
                found.append((llf, bool(result.converged), optimizer, result))
                tau2 = float(np.asarray(result.cov_re).reshape(-1)[0])
                if result.converged and tau2 > SINGULAR_ICC * (tau2 + float(result.scale)):
                    break
    messages = tuple(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    if not found:
        error = "; ".join(errors) or "no optimiser gave a finite REML log-likelihood"
        return _MixedFit(nan, nan, nan, nan, None, "", messages, error)
    best = max(llf for llf, *_ in found)
    llf, converged, optimizer, result = max(
        (f for f in found if f[0] >= best - 1e-6), key=lambda f: (f[1], f[0]))
    var_between = max(float(np.asarray(result.cov_re).reshape(-1)[0]), 0.0)
    var_residual = float(result.scale)
    estimate = float(np.asarray(result.fe_params)[0])
    se = nan
    if var_residual > 0 and math.isfinite(var_residual + var_between):
        gls, se = _gls_mean_and_se(y, g, var_between, var_residual)
        if abs(gls - estimate) > 1e-6 * max(1.0, abs(gls)) + 1e-3 * se:
            return _MixedFit(nan, nan, nan, nan, converged, optimizer, messages,
                             f"the estimate {estimate} is not the GLS mean {gls} at the "
                             "fitted variance components")
    return _MixedFit(estimate, se, var_between, var_residual, converged, optimizer, messages,
                     None)


def _seed_list(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)


def _effect(
    comparison: Comparison,
    tests: Sequence[CheckpointTest],
    diffs: np.ndarray,
    groups: np.ndarray,
    alpha: float,
) -> Phase1Effect:
    """The mixed-model row of one comparison from its per-checkpoint pairs."""
    from scipy import stats as sps

    nan = math.nan
    used = [t for t in tests if t.n > 0]
    k, n = len(used), int(diffs.size)
    notes: list[str] = []
    unpaired = [f"phase1_seed {t.phase1_seed} ({_seed_word(t.missing_seeds)})"
                for t in tests if t.missing_seeds]
    if unpaired:
        notes.append("unpaired trials dropped: " + "; ".join(unpaired))
    empty = [t.phase1_seed for t in tests if t.n == 0]
    if empty:
        notes.append(f"no pairs from phase1_seed {_seed_list(empty)}")
    single = [t.phase1_seed for t in used if t.n == 1]
    if single and len(single) < k:
        notes.append(f"one pair from phase1_seed {_seed_list(single)} (no within-checkpoint "
                     "test there; it still informs the between-checkpoint variance)")
    values: dict[str, Any] = dict(
        estimate=nan, se=nan, z=nan, df_t=nan, p_t=nan, ci_low_t=nan, ci_high_t=nan,
        p_wald=nan, ci_low_wald=nan, ci_high_wald=nan, var_between=nan, var_residual=nan,
        sd_between=nan, sd_residual=nan, icc=nan, fitted=False, converged=None,
        singular=False, optimizer="", fit_warnings="",
    )
    mean = float(diffs.mean()) if n else nan
    why = None
    if n == 0:
        why = "no paired trials; nothing to compare"
    elif k == 1:
        why = (f"K = 1 Phase-1 checkpoint (phase1_seed {used[0].phase1_seed}): the "
               "between-checkpoint variance is not identifiable, so no mixed model; the "
               "fixed-checkpoint paired test is the analysis")
    elif n == k:
        why = ("one pair per Phase-1 checkpoint: the between-checkpoint and residual "
               "variances cannot be separated, so no mixed model")
    elif float(np.ptp(diffs)) <= EQUAL_TOL * max(1.0, abs(mean)):
        why = f"all paired differences equal ({mean:+.2f}); no variance to model"
    if why is None:
        fit = fit_random_intercept(diffs, groups)
        values["fit_warnings"] = "; ".join(fit.warnings)
        values["converged"] = fit.converged
        values["optimizer"] = fit.optimizer
        tau2, sigma2 = fit.var_between, fit.var_residual
        finite = all(math.isfinite(x) for x in (fit.estimate, fit.se, tau2, sigma2))
        if fit.error is not None:
            why = f"mixed model fit failed ({fit.error}); no estimate"
        elif not finite or fit.se <= 0 or sigma2 <= 0:
            why = "mixed model fit gave non-finite or zero estimates; no estimate"
        else:
            icc = tau2 / (tau2 + sigma2)
            singular = icc < SINGULAR_ICC
            if not singular and not fit.converged:
                why = "mixed model fit did not converge; rejected, no estimate"
            else:
                df_t = k - 1
                z = fit.estimate / fit.se
                q_t = float(sps.t.ppf(1 - alpha / 2, df_t))
                q_z = float(sps.norm.ppf(1 - alpha / 2))
                values.update(
                    estimate=fit.estimate, se=fit.se, z=z, df_t=float(df_t),
                    p_t=float(2 * sps.t.sf(abs(z), df_t)),
                    ci_low_t=fit.estimate - q_t * fit.se, ci_high_t=fit.estimate + q_t * fit.se,
                    p_wald=float(2 * sps.norm.sf(abs(z))),
                    ci_low_wald=fit.estimate - q_z * fit.se,
                    ci_high_wald=fit.estimate + q_z * fit.se,
                    var_between=tau2, var_residual=sigma2, sd_between=math.sqrt(tau2),
                    sd_residual=math.sqrt(sigma2), icc=icc, fitted=True, singular=singular,
                )
                if singular:
                    notes.append("singular fit: between-checkpoint variance estimated 0 "
                                 "(boundary); the estimate is the pooled paired mean")
    if why is not None:
        notes.insert(0, why)
    return Phase1Effect(
        label=comparison.label,
        cond_a=comparison.cond_a,
        metric_a=comparison.metric_a,
        cond_b=comparison.cond_b,
        metric_b=comparison.metric_b,
        paper_table=comparison.paper_table,
        k=k,
        n=n,
        phase1_seeds=tuple(t.phase1_seed for t in used),
        pairs_per_checkpoint=tuple(t.n for t in used),
        mean_diff=mean,
        sd_diff=float(diffs.std(ddof=1)) if n > 1 else nan,
        note="; ".join(notes),
        **values,
    )


def phase1_variance(
    df: pd.DataFrame,
    comparisons: Sequence[Comparison] | None = None,
    *,
    alpha: float = 0.05,
) -> Phase1Analysis:
    """Each headline effect across K Phase-1 checkpoints (issue 11, "Phase-1 variance").

    ``df`` is the tidy per-trial table of :func:`load_results` with a :data:`PHASE1_SEED`
    column (derived metrics filled as the report does: :func:`add_derived_metrics`).
    For every comparison (default :data:`PHASE1_COMPARISONS`) and every Phase-1 seed, the
    trials of that checkpoint are paired by Phase-2 seed exactly as :func:`paired_comparison`
    pairs them (the paper's fixed-checkpoint analysis: mean ± SD of the differences, t CI,
    paired t-test; one :class:`CheckpointTest` each). All pairs then go into a REML linear
    mixed model ``diff ~ 1`` with a random intercept per Phase-1 checkpoint (one
    :class:`Phase1Effect` per comparison; see there for the columns and the two p values).

    Never drops data silently: unpaired trials and trials whose metric is NaN are left out of
    the pairs and named in the notes; rows without a Phase-1 seed are left out of everything
    and counted in ``notes``. K = 1, one pair per checkpoint, equal differences or a failed
    fit give a row with ``fitted=False`` and the reason, not an exception. Raises
    ``ValueError`` for a table without a ``phase1_seed`` column, a non-integer Phase-1 seed, or
    two trials of the same (condition, seed, phase1_seed).
    """
    comparisons = PHASE1_COMPARISONS if comparisons is None else tuple(comparisons)
    column = _phase1_column(df)
    notes: list[str] = []
    missing = column.isna()
    if missing.any():
        notes.append(f"{int(missing.sum())} trial(s) without a phase1_seed left out")
    data = df[(~missing).to_numpy()].copy()
    data[PHASE1_SEED] = column[~missing].astype("int64").to_numpy()
    dup = data.duplicated(["condition", "seed", PHASE1_SEED], keep=False)
    if dup.any():
        first = data[dup].iloc[0]
        raise ValueError(
            f"two trials of condition {first['condition']!r} seed {first['seed']} "
            f"phase1_seed {first[PHASE1_SEED]}: cannot pair them"
        )
    checkpoints = sorted(set(data[PHASE1_SEED]))
    by_checkpoint = {k: data[data[PHASE1_SEED] == k] for k in checkpoints}
    effects: list[Phase1Effect] = []
    tests: list[CheckpointTest] = []
    for comparison in comparisons:
        c = comparison
        involved = data["condition"].isin({c.cond_a, c.cond_b})
        expected = sorted(set(data.loc[involved, "seed"].astype(int)))
        own: list[CheckpointTest] = []
        diffs: list[float] = []
        groups: list[int] = []
        for k in checkpoints:
            frame_k = by_checkpoint[k]
            if not frame_k["condition"].isin({c.cond_a, c.cond_b}).any():
                continue  # this checkpoint has no trial of either side
            row = paired_comparison(frame_k, c.cond_a, c.metric_a, c.cond_b, c.metric_b,
                                    c.label, expected_seeds=expected, alpha=alpha)
            own.append(CheckpointTest(
                label=c.label, phase1_seed=int(k), n=int(row["n"]), seeds=tuple(row["seeds"]),
                missing_seeds=tuple(row["missing_seeds"]), mean_a=row["mean_a"],
                mean_b=row["mean_b"], mean_diff=row["mean_diff"], sd_diff=row["sd_diff"],
                ci_low=row["ci_low"], ci_high=row["ci_high"], t=row["t"], df=float(row["df"]),
                p=row["p"], d_z=row["d_z"], note=row["note"],
            ))
            if row["n"]:
                a = seed_values(frame_k, c.cond_a, c.metric_a).loc[row["seeds"]]
                b = seed_values(frame_k, c.cond_b, c.metric_b).loc[row["seeds"]]
                diffs += list(a.to_numpy(dtype=float) - b.to_numpy(dtype=float))
                groups += [int(k)] * int(row["n"])
        tests += own
        effects.append(_effect(c, own, np.asarray(diffs, dtype=float),
                               np.asarray(groups, dtype=np.int64), alpha))
    return Phase1Analysis(tuple(effects), tuple(tests), tuple(notes))

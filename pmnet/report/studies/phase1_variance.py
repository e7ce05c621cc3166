"""The Phase-1 checkpoint as a random factor (beyond the paper; issue 11, grid
``phase1_variance`` or ``--phase1-seeds``): with trials from K Phase-1 checkpoints, each headline
effect over every checkpoint (``tab:phase1-variance``) and within each
(``tab:phase1-checkpoints``), from :func:`pmnet.stats.phase1_variance`. The paper's tables read
the reference checkpoint (:class:`pmnet.report.trials.Trials`)."""

from __future__ import annotations

from pmnet import stats
from pmnet.report.cells import NA, Cell, finite, text_cell
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials


def _phase1_labels(analysis: stats.Phase1Analysis) -> tuple[list[str], list[str]]:
    """Labels of the comparisons with paired trials, and of those without any."""
    shown = [e.label for e in analysis.effects if e.n > 0]
    absent = [e.label for e in analysis.effects if e.n == 0]
    return shown, absent


def table_phase1_variance(analysis: stats.Phase1Analysis) -> Table:
    """Beyond the paper (issue 11): each headline effect with the Phase-1 checkpoint as a
    random factor, one row per comparison with paired trials."""
    rows = []
    for e in analysis.effects:
        if e.n == 0:
            continue
        rows.append([
            text_cell(e.label),
            Cell("int", e.k),
            Cell("int", e.n),
            Cell("stat", e.mean_diff, e.sd_diff, signed=True),
            Cell("stat", e.estimate, e.se, signed=True) if e.fitted else NA,
            Cell("ci", e.ci_low_t, hi=e.ci_high_t) if e.fitted else NA,
            Cell("p", e.p_t) if e.fitted else NA,
            Cell("p", e.p_wald) if e.fitted else NA,
            Cell("num", e.sd_between) if e.fitted else NA,
            Cell("num", e.sd_residual) if e.fitted else NA,
            Cell("num", e.icc) if e.fitted else NA,
            text_cell(e.note),
        ])
    _, absent = _phase1_labels(analysis)
    notes = [
        "Model: diff_ij = mu + u_i + e_ij for Phase-2 seed j of Phase-1 checkpoint i, "
        "u_i ~ N(0, between SD^2), e_ij ~ N(0, residual SD^2), fitted by REML (statsmodels "
        "MixedLM). Estimate ± SE is mu; ICC = between / (between + residual) variance.",
        "The CI and the first p use a t distribution with K - 1 degrees of freedom (exact "
        "for balanced designs, conservative when the between variance is estimated 0); the "
        "Wald z p (statsmodels' normal reference) is shown beside it. Mean diff ± SD pools "
        "every pair, as if all came from one checkpoint. Blank = not defined (see note).",
        "With few Phase-1 checkpoints the between-checkpoint variance is poorly determined; "
        "the per-checkpoint paired tests are in tab:phase1-checkpoints.",
    ]
    if absent:
        notes.append("Not shown (no paired trials): " + "; ".join(absent) + ".")
    notes += list(analysis.notes)
    return Table(
        "tab:phase1-variance",
        "Headline effects with the Phase-1 checkpoint as a random factor (ours, not in the "
        "paper): paired differences A - B (pp) over K Phase-1 checkpoints x Phase-2 seeds, "
        "linear mixed model with a random intercept per Phase-1 seed.",
        ["Comparison", "K", "n", "Mean diff ± SD", "Estimate ± SE", "95% CI (t, K-1 df)",
         "p (t, K-1 df)", "p (Wald z)", "Between-Phase-1 SD", "Residual SD", "ICC", "Note"],
        rows,
        notes=notes,
        align=["l"] + ["r"] * 10 + ["l"],
        asides={11},
    )


def table_phase1_checkpoints(analysis: stats.Phase1Analysis) -> Table:
    """The paper's fixed-checkpoint analysis within each Phase-1 checkpoint, for every
    comparison of :func:`table_phase1_variance`."""
    shown, _ = _phase1_labels(analysis)
    rows: list[list[Cell]] = []
    rules: set[int] = set()
    idle: list[str] = []
    for label in shown:
        if rows:
            rules.add(len(rows))
        for t in analysis.checkpoints:
            if t.label != label:
                continue
            if t.n <= 0:  # issue 35: no n = 0 row (data/phase1_checkpoints.csv keeps it)
                idle.append(f"{label} at phase1_seed {t.phase1_seed}")
                continue
            rows.append([
                text_cell(label),
                text_cell(str(t.phase1_seed)),
                Cell("int", t.n),
                Cell("stat", t.mean_diff, t.sd_diff, signed=True),
                Cell("ci", t.ci_low, hi=t.ci_high) if finite(t.ci_low) else NA,
                Cell("num", t.t) if finite(t.t) else NA,
                Cell("p", t.p) if finite(t.p) else NA,
                Cell("num", t.d_z) if finite(t.d_z) else NA,
                text_cell(t.note),
            ])
    return Table(
        "tab:phase1-checkpoints",
        "The paper's fixed-checkpoint analysis within each Phase-1 checkpoint (ours, not in "
        "the paper): paired-by-seed differences A - B (pp), mean ± SD, t-distribution 95% CI, "
        "paired t-test p (unadjusted). Blank = not defined (see note).",
        ["Comparison", "Phase-1 seed", "n", "Mean diff ± SD", "95% CI", "t", "p", "d_z",
         "Note"],
        rows,
        rules_before=rules,
        notes=([f"Not run here (no paired seeds): {', '.join(idle)}."] if idle else [])
        + ["With few seeds per checkpoint the intervals and tests are descriptive (paper "
           "Sections 6.3 and 9)."],
        align=["l", "r", "r", "r", "r", "r", "r", "r", "l"],
        labels=2,
        asides={8},
    )


def _build(trials: Trials) -> Findings:
    every = stats.add_derived_metrics(trials.loaded)  # every checkpoint, the default variant
    analysis = stats.phase1_variance(stats.default_variant(every))
    reference = stats.reference_phase1_seed(every)
    failed = [r for r in trials.loaded.attrs.get("failed", [])
              if r.get(stats.PHASE1_SEED) != reference]  # the reference's are the core's
    return Findings(
        tables=([table_phase1_variance(analysis), table_phase1_checkpoints(analysis)]
                if trials.paper_part else []),
        data={"phase1_variance.csv": analysis.effects_frame(),
              "phase1_checkpoints.csv": analysis.checkpoints_frame()},
        missing=[f"failed trial (phase1_seed {r.get(stats.PHASE1_SEED, 'unknown')}): "
                 f"{r['condition']} seed {r['seed']} ({r['file']}): {r['error']}"
                 for r in failed],
    )


STUDY = Study(
    name="Phase-1 variance",
    grid="phase1_variance",
    recognise=lambda trials: stats.has_phase1_variance(trials.loaded),
    build=_build,
)

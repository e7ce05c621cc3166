"""The Phase-1 checkpoints (beyond the paper; issues 11, 39, 45): one section for every run
with trials from K >= 2 Phase-1 checkpoints (grid ``phase1_variance``, ``checkpoints``,
``checkpoint_channel``, ``--phase1-seeds``, or a store such as issue 39's).

- Always: each headline effect with the checkpoint as a random factor
  (``tab:phase1-variance``) and within each checkpoint (``tab:phase1-checkpoints``), from
  :func:`pmnet.stats.phase1_variance`; the paper's tables read the reference checkpoint
  (:class:`pmnet.report.trials.Trials`).
- With the checkpoint study's grids, or MIN_CHECKPOINTS checkpoints or more, its analysis
  (:mod:`pmnet.stats.checkpoints`, :mod:`pmnet.stats.checkpoint_study`): each effect as one
  point per checkpoint with its CI (``fig-checkpoints``, ``tab:checkpoint-effects``, with the
  checkpoint's Phase-1 route diagnostics beside it) and over the checkpoints
  (``tab:checkpoint-distribution``), each with the capability gate; the core effects on the
  store's named subsets and at the last epoch (``tab:checkpoint-sensitivity``); the
  pre-registered predictor (``tab:checkpoint-predictor``); the channel interaction and the
  diagnosed models (``tab:checkpoint-channel``, ``tab:checkpoint-channel-levels``,
  ``tab:checkpoint-mechanism``); the strict-off contrasts (``tab:checkpoint-strict``,
  ``tab:checkpoint-strict-models``).

A checkpoint enters the channel comparisons only as a whole unit (every channel arm on a
common Phase-2 seed, :func:`pmnet.stats.whole_checkpoints`); the trials of a started,
unfinished one are named under the distribution table, not averaged in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from pmnet import stats
from pmnet.report.cells import NA, Cell, finite, text_cell
from pmnet.report.figures import FigureResult, new_figure
from pmnet.report.paper_tables import BASELINE_COLUMN, BELOW_BASELINE_VERDICT
from pmnet.report.studies.routes import _routes_by_checkpoint
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials

GRID = "checkpoints"
#: every grid whose trials get the checkpoint study's analysis (`checkpoint_channel` adds
#: the GRU operator's and `memory_consolidator`'s routing arms and the strict-off twins to
#: five of the checkpoints)
GRIDS: tuple[str, ...] = (GRID, "checkpoint_channel")
#: Trials from this many Phase-1 checkpoints or more get the study's analysis whatever the
#: grid (with fewer, `tab:phase1-variance` says what there is to say).
MIN_CHECKPOINTS = 5
#: the store's subset the pre-registered predictor is tested on (`store.json` "subsets")
CONFIRMATORY = "confirmatory"
ROUTING = "routing on - off: updated_ltm"


def _grid_name(meta: Mapping[str, Any]) -> str:
    space = meta.get("space")
    return str(space.get("name", "")) if isinstance(space, Mapping) else ""


def recognise(trials: Trials) -> bool:
    """Whether the trials get the checkpoint study's analysis (beyond the Phase-1 variance
    tables every K >= 2 run gets)."""
    if not stats.has_phase1_variance(trials.loaded):
        return False
    return (_grid_name(trials.meta) in GRIDS
            or len(stats.phase1_seeds(trials.loaded)) >= MIN_CHECKPOINTS)


def subsets(meta: Mapping[str, Any]) -> dict[str, list[int]]:
    """The store's named subsets of Phase-1 seeds (`main_report` puts the store's record,
    `store.json`, in meta["store"])."""
    store = meta.get("store")
    got = store.get("subsets") if isinstance(store, Mapping) else None
    return ({str(k): [int(s) for s in v] for k, v in got.items()}
            if isinstance(got, Mapping) else {})


# ------------------------------------------------------------------------------------------
# the Phase-1 variance tables (issue 11)
# ------------------------------------------------------------------------------------------


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


def table_phase1_families(families: Mapping[str, stats.FamilyLearning]) -> Table:
    """Beyond the paper (issue 52): each checkpoint's Phase-1 STM per rule family beside the
    family's output-set baseline, and whether it learned the family."""
    seeds = sorted({c.phase1_seed for f in families.values() for c in f.checkpoints},
                   key=lambda k: -1 if k is None else k)
    by = {(f.family, c.phase1_seed): c for f in families.values() for c in f.checkpoints}
    rows = []
    for k in seeds:
        row = [text_cell(str(k))]
        for fam in families.values():
            c = by.get((fam.family, k))
            row += ([Cell("num", c.stm), Cell("num", c.baseline),
                     text_cell("learned" if c.learned else "not learned")] if c else [NA] * 3)
        rows.append(row)
    return Table(
        "tab:phase1-families",
        "Did each Phase-1 checkpoint learn each rule family? (ours, issue 52) Phase-1 STM "
        "recall (%, test stream, mean of the segments' STM queries of its frozen-backbone "
        "trials) beside the family's output-set baseline on the same episodes; 'not "
        f"learned': not above it by more than {stats.LEARNED_MARGIN_PP:.1f} pp (the 95% "
        "half-width of a 1,000-episode stream). A claim on a family reads it only where every "
        "checkpoint learned it (tab:claims).",
        ["Phase-1 seed", *[f"{f.name} {what}" for f in families.values()
                           for what in ("STM", "baseline", "learned?")]],
        rows,
        notes=["Over the checkpoints: " + "; ".join(
            f"{f.name} {f.text()}" for f in families.values()) + "."],
        align=["l"] + ["r", "r", "l"] * len(families),
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


# ------------------------------------------------------------------------------------------
# the checkpoint study's analysis (issues 39, 45)
# ------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = "+.2f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _verdict(d: stats.EffectDistribution, gate: stats.CapabilityGate | None,
             alpha: float = 0.05) -> Cell:
    """The mean's verdict, or none where both arms are at or below their output-set
    baselines (the capability gate, docs/choices.md)."""
    if gate is not None and gate.both_below:
        return text_cell(BELOW_BASELINE_VERDICT)
    if not finite(d.p):
        return NA
    if d.p >= alpha:
        return text_cell(f"no sign (p ≥ {alpha:g})")
    return text_cell("> 0" if d.estimate > 0 else "< 0")


def _distribution_row(d: stats.EffectDistribution, gate: stats.CapabilityGate | None,
                      power: bool) -> list[Cell]:
    row = [
        text_cell(_short(d.label)),
        Cell("int", d.k),
        Cell("int", d.n),
        Cell("stat", d.estimate, d.se, signed=True),
        Cell("ci", d.ci_low, hi=d.ci_high),
        Cell("p", d.p),
        Cell("num", d.sd_between),
        Cell("num", d.sd_within),
        text_cell(f"{d.positive} / {d.k}"),
        text_cell(f"{d.positive_significant} / {d.negative_significant}"),
    ]
    if power:
        row += [Cell("int", d.k_needed_5) if d.k_needed_5 is not None else NA,
                Cell("int", d.k_needed_10) if d.k_needed_10 is not None else NA]
    return row + [text_cell(gate.text()) if gate else NA, _verdict(d, gate)]


DISTRIBUTION_COLUMNS = ["Effect (pp)", "K", "n", "Mean ± SE", "95% CI", "p", "Between SD",
                        "Within SD", "Positive", "Signif. + / -"]
GATE_COLUMNS = [BASELINE_COLUMN, "Verdict"]
GATE_NOTE = ("Verdict: the mean's sign where p < 0.05; none where both arms recall at or below "
             "their output-set baselines over these trials (the capability gate: such a "
             "comparison is between models that do not use the rule).")


def _gates(df: pd.DataFrame, dists: Sequence[stats.EffectDistribution],
           comparisons: Sequence[stats.Comparison]) -> list[stats.CapabilityGate | None]:
    by = {c.label: c for c in comparisons}
    return [stats.capability_gate(df, by[d.label]) if d.label in by else None for d in dists]


def table_distribution(dists: Sequence[stats.EffectDistribution],
                       gates: Sequence[stats.CapabilityGate | None] | None = None,
                       set_aside: pd.DataFrame | None = None) -> Table:
    gates = list(gates) if gates is not None else [None] * len(dists)
    notes = ["A checkpoint is the unit of analysis: a claim about the method holds when "
             "the mean over checkpoints is away from 0, not when one checkpoint's seeds "
             "agree. More Phase-2 seeds per checkpoint shrink only the within part.", GATE_NOTE]
    if set_aside is not None and len(set_aside):
        notes.append("Set aside, not averaged in (a checkpoint enters the channel comparisons "
                     "only with every channel arm; updated LTM, %): " + ", ".join(
                         f"{r.condition} p{r.phase1_seed} s{r.seed} {r.updated_ltm:.2f}"
                         for r in set_aside.itertuples()) + ".")
    return Table(
        "tab:checkpoint-distribution",
        "Each effect over the Phase-1 checkpoints (ours, not in the paper): the mean with the "
        "checkpoint as a random intercept (REML; CI and p from a t with K - 1 df), the SD "
        "between checkpoints and within one (Phase-2 seeds, pooled), how many checkpoints "
        "show a positive effect, how many a significant positive / negative one (pooled "
        "within-checkpoint test, p < 0.05), and the checkpoints a study needs to detect a "
        "mean effect of 5 and of 10 pp (two-sided alpha 0.05, power 0.8, at these SDs and "
        "seeds per checkpoint).",
        [*DISTRIBUTION_COLUMNS, "K for 5 pp", "K for 10 pp", *GATE_COLUMNS],
        [_distribution_row(d, g, power=True) for d, g in zip(dists, gates)],
        notes=notes,
        align=["l"] + ["r"] * 12 + ["l"],
        asides={13},
    )


def table_effects(points: Sequence[stats.CheckpointPoint], meta: Mapping[str, Any],
                  features: pd.DataFrame | None = None) -> Table:
    """One row per checkpoint: each effect with its pooled CI and verdict, and beside it the
    checkpoint's Phase-1 route diagnostics where recorded (the root's L route change; with
    the study's features, the random-route cost, the root margin and Phase 1's STM)."""
    labels = list(dict.fromkeys(p.label for p in points))
    by = {(p.label, p.phase1_seed): p for p in points}
    routes = dict(_routes_by_checkpoint(meta))
    extra = ([] if features is None or features.empty else
             [("random_route_cost", "Random-route cost (pp)", True),
              ("root_margin", "Root margin", False), ("phase1_stm_val", "Phase-1 STM (val, %)",
                                                      False)])
    rows = []
    for k in sorted({p.phase1_seed for p in points}):
        row = [text_cell(str(k))]
        for label in labels:
            p = by.get((label, k))
            row.append(text_cell(f"{p.mean_diff:+.2f} [{p.ci_low:+.1f}, {p.ci_high:+.1f}] "
                                 f"{p.verdict}") if p is not None and math.isfinite(p.ci_low)
                       else (Cell("num", p.mean_diff, signed=True) if p is not None else NA))
        change = (routes.get(str(k)) or {}).get("ltm_route_change")
        row.append(Cell("num", change[0]) if change else NA)
        for col, _, signed in extra:
            value = features[col].get(k) if k in features.index else None
            row.append(NA if value is None or not finite(value)
                       else Cell("num", float(value), signed=signed))
        rows.append(row)
    return Table(
        "tab:checkpoint-effects",
        "Each Phase-1 checkpoint's effects (ours, not in the paper): mean paired difference "
        "over its Phase-2 seeds (pp, test stream) with a 95% CI from the pooled "
        "within-checkpoint SD, then + / - (significant, that sign) or 0; and the % of "
        "segment-2 root routes that L changes (Stage-1 route diagnostics, identity L).",
        ["Phase-1 seed", *[_short(x) for x in labels], "L changes root routes (%)",
         *[name for _, name, _ in extra]],
        rows,
        align=["l"] + ["r"] * (len(labels) + 1 + len(extra)),
    )


def table_sensitivity(rows: Sequence[stats.SensitivityRow]) -> Table:
    """The core effects over every checkpoint, on each named subset of the store and at the
    last epoch, each beside the capability gate (issue 44)."""
    body, rules = [], set()
    for i, r in enumerate(rows):
        if i and r.analysis != rows[i - 1].analysis:
            rules.add(i)
        body.append([text_cell(r.analysis), *_distribution_row(r.distribution, r.gate,
                                                              power=False)])
    return Table(
        "tab:checkpoint-sensitivity",
        "Sensitivity of the core effects (ours, issue 44): over every checkpoint, on the "
        "store's named subsets of checkpoints (a confirmatory subset is the one the "
        "pre-registration named), and with every trial scored at its last epoch instead of "
        "its selected one; each arm beside its output-set baseline over the same trials.",
        ["Analysis", *DISTRIBUTION_COLUMNS, *GATE_COLUMNS],
        body,
        rules_before=rules,
        notes=[GATE_NOTE],
        align=["l", "l"] + ["r"] * 10 + ["l"],
        labels=2,
        asides={12},
    )


def _rho_cells(c: stats.Correlation) -> list[Cell]:
    return [Cell("int", c.n), Cell("num", c.rho, signed=True) if c.rho is not None else NA,
            Cell("p", c.p) if c.p is not None else NA, text_cell(c.alternative)]


def table_predictor(test: stats.PredictorTest) -> Table:
    """The pre-registered predictor's test, then the same over every checkpoint and the
    exploratory features."""
    subset = ", ".join(str(k) for k in test.subset)
    rows = [[text_cell(f"root L route change, {test.subset_name} checkpoints ({subset}): "
                       "pre-registered"), *_rho_cells(test.confirmatory),
             text_cell("holds" if test.holds else "fails")],
            [text_cell("root L route change, every checkpoint (not independent)"),
             *_rho_cells(test.all_checkpoints), NA]]
    rows += [[text_cell(f"{name.replace('_', ' ')} (exploratory)"), *_rho_cells(c), NA]
             for name, c in test.secondary.items()]
    sign = "; ".join(f"checkpoint {k}: X = {x:.1f}%, routing effect {y:+.2f} pp"
                     for k, x, y in test.sign_rule) or "none"
    return Table(
        "tab:checkpoint-predictor",
        "The pre-registered predictor (ours; docs/results.md, \"Pre-registration\" and its "
        "amendments): Spearman's rho between each checkpoint's root L route change (its "
        "Phase-1 route diagnostics) and its routing on - off effect, one-sided (rho < 0), "
        f"p < {test.alpha:g}, on the store's {test.subset_name} checkpoints; beside it the "
        "same over every checkpoint and the exploratory features (two-sided).",
        ["Predictor of the routing effect", "n", "Spearman rho", "p", "Alternative",
         "Pre-registered test"],
        rows,
        notes=[f"The sign rule (X >= 50% -> a negative routing effect) has these cases: {sign}."],
        align=["l", "r", "r", "r", "l", "l"],
    )


def table_channel(ch: stats.ChannelAnalysis, df: pd.DataFrame) -> Table:
    """Can anything use the channel? Each arm's routing effect and level against the
    Consolidator's over the checkpoints with every channel arm, then the interactions."""
    sub = df[df[stats.PHASE1_SEED].isin(ch.checkpoints)]
    comps = (*stats.CHANNEL_COMPARISONS, *stats.LEVEL_COMPARISONS)
    rows = [_distribution_row(d, g, power=False) for d, g in
            zip(ch.distributions, _gates(sub, ch.distributions, comps))]
    for x in ch.interactions:
        t = x.test
        rows.append([text_cell(x.label), Cell("int", t.k), Cell("int", x.n_pairs),
                     Cell("stat", t.mean, t.se, signed=True), Cell("ci", t.ci_low, hi=t.ci_high),
                     Cell("p", t.p), NA, NA, NA, NA, NA, NA])
    agree = [f"{op}: rho = {_fmt(c.rho)} (n = {c.n}, p = {_fmt(c.p, '.3f')})"
             for op, c in ch.agreement.items()]
    return Table(
        "tab:checkpoint-channel",
        f"Can anything use the channel? (ours, issue 39) On the checkpoints with every channel "
        f"arm ({', '.join(map(str, ch.checkpoints))}; Phase-2 seeds "
        f"{', '.join(map(str, ch.phase2_seeds))}): each arm's routing on - off effect, each "
        "stronger arm's level against the Consolidator's (same routing), and the interaction "
        "(operator on - off) - (Consolidator on - off), per checkpoint the mean over its "
        "seeds, then a one-sample t over the checkpoints (> 0: the operator gains more from "
        "routing than the Consolidator).",
        [*DISTRIBUTION_COLUMNS, *GATE_COLUMNS],
        rows,
        notes=[GATE_NOTE, "Each arm's routing effect against the Consolidator's across the "
               "checkpoints (Spearman, two-sided): " + "; ".join(agree) + "."],
        align=["l"] + ["r"] * 10 + ["l"],
        asides={11},
    )


def table_levels(levels: pd.DataFrame, tid: str, what: str) -> Table:
    names = {"updated_ltm": "Updated LTM", "updated_ltm_add10": "ADD10",
             "updated_ltm_affine10": "AFFINE10", "seg2_stm": "Segment-2 STM"}
    cols = [c for c in names if c in levels.columns]
    return Table(
        tid,
        f"Each arm's mean recall (%, test stream) over {what}: per checkpoint the mean over "
        "its Phase-2 seeds, then the mean over the checkpoints (ours, issue 39).",
        ["Arm", *[names[c] for c in cols]],
        [[text_cell(cond), *[Cell("num", float(r[c])) for c in cols]]
         for cond, r in levels.iterrows()],
    )


def _cost(x: Any) -> Cell:
    return NA if x is None or not finite(x) else Cell("num", float(x), signed=True)


def _share(x: Any) -> Cell:
    return NA if x is None or not finite(x) else Cell("num", float(x))


def _route_change(values: Any) -> Cell:
    return text_cell(" / ".join(f"{v:.1f}" for v in values)) if values else NA


def table_mechanism(mech: pd.DataFrame) -> Table:
    """Do the trained models use L's routes? Each diagnosed model's costs (issue 39)."""
    rows = [[text_cell(str(r.phase1_seed)), text_cell(r.condition), _cost(r.updated_ltm),
             _cost(r.routing_off_cost), _cost(r.root_l_removed_cost),
             _cost(r.strict_off_cost), _route_change(r.l_route_change),
             _route_change(getattr(r, "seg2_path_change", None)),
             _share(getattr(r, "routing_grad_share", None))]
            for r in mech.itertuples()]
    return Table(
        "tab:checkpoint-mechanism",
        "Is the mechanism at work? (ours, issue 39) `pmnet diagnose` of each diagnosed "
        "channel-arm model (validation stream): its updated-LTM recall (%), the recall (pp) "
        "it loses with routing switched off at inference (the paper's off), with L out of "
        "the root's routing only, and under strict routing off (L out of u too), and the % "
        "of routes L changes per block; then the % of the last segment's tokens whose prefix "
        "is the first segment's (the shared address) but not their path, per block, and the "
        "share (%) of the Consolidator's single-kind gradient that comes through L's "
        "routing term (issue 61; '-' for diagnostics made before).",
        ["Phase-1 seed", "Model", "Updated LTM", "Cost: routing off", "Cost: L out of the "
         "root's routing", "Cost: strict off", "L route change per block (%)",
         "Segment 2 off segment 1's path (%)", "Gradient via routing (%)"],
        rows,
        labels=2,
        align=["l", "l", "r", "r", "r", "r", "l", "l", "r"],
    )


def table_strict(st: stats.StrictAnalysis, df: pd.DataFrame) -> Table:
    """Routing off - strict off and routing on - strict off per arm with a strict-off twin."""
    comps = (*stats.STRICT_COMPARISONS, *stats.ALL_ROUTING_COMPARISONS)
    ks = sorted({k for v in st.checkpoints.values() for k in v})
    rows = [_distribution_row(d, g, power=False) for d, g in
            zip(st.distributions, _gates(df[df[stats.PHASE1_SEED].isin(ks)],
                                         st.distributions, comps))]
    probe = [f"{p.arm}: rho = {_fmt(p.correlation.rho)} (n = {p.correlation.n}, p = "
             f"{_fmt(p.correlation.p, '.3f')})" for p in st.probe_vs_trained]
    where = "; ".join(f"{on}: {', '.join(map(str, ks))}" for on, ks in st.checkpoints.items())
    return Table(
        "tab:checkpoint-strict",
        "What a trained strict-off arm changes (ours, issue 39): per arm with a strict-off "
        "twin (no router sees L, directly or through u), on the checkpoints where its three "
        f"arms ran ({where}), routing off - strict off (what L through u is worth) and "
        "routing on - strict off (all of L's routing influence).",
        [*DISTRIBUTION_COLUMNS, *GATE_COLUMNS],
        rows,
        notes=[GATE_NOTE, "Does the inference-time probe (the diagnosed routing-off model's "
               "strict-off cost) foretell the trained routing off - strict off effect? "
               "Spearman, two-sided: " + "; ".join(probe) + "."],
        align=["l"] + ["r"] * 10 + ["l"],
        asides={11},
    )


def table_strict_models(models: pd.DataFrame) -> Table:
    return Table(
        "tab:checkpoint-strict-models",
        "Do the strict-off models' routers ignore L? (ours, issue 39) Each diagnosed strict "
        "model's updated-LTM recall lost under strict off at inference (0: its routers never "
        "see L, as built), and the % of routes the direct term would change per block if it "
        "were switched on.",
        ["Phase-1 seed", "Model", "Cost: strict off", "L route change per block (%)"],
        [[text_cell(str(r.phase1_seed)), text_cell(r.condition), _cost(r.strict_off_cost),
          _route_change(r.l_route_change)] for r in models.itertuples()],
        labels=2,
        align=["l", "l", "r", "l"],
    )


def _short(label: str) -> str:
    return label.replace(": updated_ltm", "")


def figure_checkpoints(dists: Sequence[stats.EffectDistribution],
                       points: Sequence[stats.CheckpointPoint]) -> FigureResult:
    fid = "fig-checkpoints"
    title = "Effects per Phase-1 checkpoint"
    caption = ("One point per Phase-1 checkpoint (sorted by its effect) with its 95% CI from "
               "the pooled within-checkpoint SD; the band is the mean over checkpoints with "
               "its 95% CI (checkpoint as a random factor); the dashed line is 0.")
    shown = [d for d in dists if d.k >= 2]
    if not shown:
        return FigureResult(fid, title, caption, skipped="fewer than two checkpoints")
    fig, axes = new_figure(len(shown), ncols=min(3, len(shown)), size=(3.8, 3.0))
    for ax, d in zip(axes, shown):
        own = sorted((p for p in points if p.label == d.label), key=lambda p: p.mean_diff)
        xs = range(len(own))
        ys = [p.mean_diff for p in own]
        lo = [p.mean_diff - p.ci_low if math.isfinite(p.ci_low) else 0.0 for p in own]
        hi = [p.ci_high - p.mean_diff if math.isfinite(p.ci_high) else 0.0 for p in own]
        colors = ["tab:green" if p.verdict == "+" else "tab:red" if p.verdict == "-"
                  else "tab:gray" for p in own]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor="0.6", lw=1)
        ax.scatter(xs, ys, c=colors, s=18, zorder=3)
        ax.axhline(0.0, ls="--", lw=0.8, color="k")
        if math.isfinite(d.estimate):
            ax.axhline(d.estimate, lw=1, color="tab:blue")
            if math.isfinite(d.ci_low):
                ax.axhspan(d.ci_low, d.ci_high, color="tab:blue", alpha=0.12)
        ax.set_xticks(list(xs), [str(p.phase1_seed) for p in own], fontsize=7)
        ax.set_xlabel("Phase-1 seed", fontsize=8)
        ax.set_ylabel("difference (pp)", fontsize=8)
        ax.set_title(_short(d.label), fontsize=8)
    fig.suptitle(title, fontsize=10)
    return FigureResult(fid, title, caption, figure=fig)




# ------------------------------------------------------------------------------------------
# the section
# ------------------------------------------------------------------------------------------


def _phase1_findings(trials: Trials) -> Findings:
    every = stats.add_derived_metrics(trials.loaded)  # every checkpoint, the default variant
    analysis = stats.phase1_variance(stats.default_variant(every))
    reference = stats.reference_phase1_seed(every)
    failed = [r for r in trials.loaded.attrs.get("failed", [])
              if r.get(stats.PHASE1_SEED) != reference]  # the reference's are the core's
    families = stats.phase1_families(stats.default_variant(every))
    return Findings(
        tables=([table_phase1_variance(analysis), table_phase1_checkpoints(analysis)]
                if trials.paper_part else [])
        + ([table_phase1_families(families)] if families else []),
        data={"phase1_variance.csv": analysis.effects_frame(),
              "phase1_checkpoints.csv": analysis.checkpoints_frame()},
        missing=[f"failed trial (phase1_seed {r.get(stats.PHASE1_SEED, 'unknown')}): "
                 f"{r['condition']} seed {r['seed']} ({r['file']}): {r['error']}"
                 for r in failed],
    )


def _study_findings(trials: Trials) -> Findings:
    """The checkpoint study's analysis (see the module docstring)."""
    every = stats.default_variant(stats.add_derived_metrics(trials.loaded))
    df, set_aside = stats.whole_checkpoints(every)
    dists, points = stats.checkpoint_distribution(df, stats.STUDY_COMPARISONS)
    if not dists:
        return Findings()
    diagnostics = trials.diagnostics
    routes = {int(k): r for k, r in _routes_by_checkpoint(trials.meta) if str(k).isdigit()}
    features = stats.checkpoint_features(routes, diagnostics) if routes else None
    named = subsets(trials.meta)
    sensitivity = stats.sensitivity(df, named)
    tables = [table_distribution(dists, _gates(df, dists, stats.STUDY_COMPARISONS), set_aside),
              table_effects(points, trials.meta, features), table_sensitivity(sensitivity)]
    data = {"checkpoint_distribution.csv": stats.checkpoint_frame(dists),
            "checkpoint_effects.csv": stats.checkpoint_frame(points),
            "checkpoint_sensitivity.csv": stats.sensitivity_frame(sensitivity)}
    routing = pd.Series({p.phase1_seed: p.mean_diff for p in points if p.label == ROUTING},
                        dtype=float)
    if features is not None and len(routing):
        subset = named.get(CONFIRMATORY)
        test = stats.predictor_test(
            features, routing, subset if subset is not None else list(features.index),
            subset_name=CONFIRMATORY if subset is not None else "all (no confirmatory "
                                                                 "subset named)")
        tables.append(table_predictor(test))
        data["checkpoint_features.csv"] = features.assign(routing_effect=routing).reset_index()
    if (ch := stats.channel_analysis(df, diagnostics)) is not None:
        tables += [table_channel(ch, df),
                   table_levels(ch.levels, "tab:checkpoint-channel-levels",
                                f"the channel checkpoints ({', '.join(map(str, ch.checkpoints))})")]
        if len(ch.mechanism):
            tables.append(table_mechanism(ch.mechanism))
        data["checkpoint_channel.csv"] = stats.checkpoint_frame(ch.distributions)
        data["checkpoint_channel_effects.csv"] = stats.checkpoint_frame(ch.points)
        data["checkpoint_channel_interaction.csv"] = pd.DataFrame(
            [{"label": x.label, "n_pairs": x.n_pairs, **vars(x.test),
              "per_checkpoint": " ".join(f"{k}:{v:.4f}" for k, v in x.per_checkpoint.items())}
             for x in ch.interactions])
    if (st := stats.strict_analysis(df, diagnostics)) is not None:
        ks = sorted({k for v in st.checkpoints.values() for k in v})
        tables += [table_strict(st, df),
                   table_levels(st.levels, "tab:checkpoint-strict-levels",
                                f"the strict-off checkpoints ({', '.join(map(str, ks))})")]
        if len(st.strict_models):
            tables.append(table_strict_models(st.strict_models))
        data["checkpoint_strict.csv"] = stats.checkpoint_frame(st.distributions)
        data["checkpoint_strict_effects.csv"] = stats.checkpoint_frame(st.points)
    return Findings(tables=tables, figures=[figure_checkpoints(dists, points)], data=data)


def _build(trials: Trials) -> Findings:
    found = _phase1_findings(trials)
    if recognise(trials):
        study = _study_findings(trials)
        found.tables += study.tables
        found.figures += study.figures
        found.data.update(study.data)
    return found


STUDY = Study(name="Phase-1 checkpoints", grid=GRID,
              recognise=lambda trials: stats.has_phase1_variance(trials.loaded), build=_build)

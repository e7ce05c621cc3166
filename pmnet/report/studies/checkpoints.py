"""The effects' distribution over Phase-1 checkpoints (beyond the paper; issue 39, grids
``checkpoints`` and ``checkpoint_channel``): with trials from many checkpoints, each effect
as one point per checkpoint with its CI (``fig-checkpoints``, ``tab:checkpoint-effects``),
and its mean with the checkpoint as a random factor, the between-checkpoint SD, the share of
checkpoints where it is significant either way, and the checkpoints a study needs
(``tab:checkpoint-distribution``), from :func:`pmnet.stats.checkpoint_distribution`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pmnet import stats
from pmnet.report.cells import NA, Cell, text_cell
from pmnet.report.figures import FigureResult, new_figure
from pmnet.report.studies.routes import _routes_by_checkpoint
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials

GRID = "checkpoints"
#: every grid whose trials get the section (`checkpoint_channel` adds the GRU operator's and
#: `memory_consolidator`'s routing arms to five of the checkpoints)
GRIDS: tuple[str, ...] = (GRID, "checkpoint_channel")
#: Trials from this many Phase-1 checkpoints or more get the section whatever the grid (with
#: fewer, `tab:phase1-variance` says what there is to say).
MIN_CHECKPOINTS = 5


def _grid_name(meta: Mapping[str, Any]) -> str:
    space = meta.get("space")
    return str(space.get("name", "")) if isinstance(space, Mapping) else ""


def recognise(trials: Trials) -> bool:
    if not stats.has_phase1_variance(trials.loaded):
        return False
    return (_grid_name(trials.meta) in GRIDS
            or len(stats.phase1_seeds(trials.loaded)) >= MIN_CHECKPOINTS)


def _comparisons() -> tuple[stats.Comparison, ...]:
    extra = [c for c in (*stats.CHANNEL_COMPARISONS, *stats.STRICT_COMPARISONS)
             if c.label not in {x.label for x in stats.CHECKPOINT_COMPARISONS}]
    return (*stats.CHECKPOINT_COMPARISONS, *extra)


def _short(label: str) -> str:
    return label.replace(": updated_ltm", "")


def table_distribution(dists: Sequence[stats.EffectDistribution]) -> Table:
    rows = []
    for d in dists:
        rows.append([
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
            Cell("int", d.k_needed_5) if d.k_needed_5 is not None else NA,
            Cell("int", d.k_needed_10) if d.k_needed_10 is not None else NA,
        ])
    return Table(
        "tab:checkpoint-distribution",
        "Each effect over the Phase-1 checkpoints (ours, not in the paper): the mean with the "
        "checkpoint as a random intercept (REML; CI and p from a t with K - 1 df), the SD "
        "between checkpoints and within one (Phase-2 seeds, pooled), how many checkpoints "
        "show a positive effect, how many a significant positive / negative one (pooled "
        "within-checkpoint test, p < 0.05), and the checkpoints a study needs to detect a "
        "mean effect of 5 and of 10 pp (two-sided alpha 0.05, power 0.8, at these SDs and "
        "seeds per checkpoint).",
        ["Effect (pp)", "K", "n", "Mean ± SE", "95% CI", "p", "Between SD", "Within SD",
         "Positive", "Signif. + / -", "K for 5 pp", "K for 10 pp"],
        rows,
        notes=["A checkpoint is the unit of analysis: a claim about the method holds when "
               "the mean over checkpoints is away from 0, not when one checkpoint's seeds "
               "agree. More Phase-2 seeds per checkpoint shrink only the within part."],
        align=["l"] + ["r"] * 11,
    )


def table_effects(points: Sequence[stats.CheckpointPoint],
                  meta: Mapping[str, Any]) -> Table:
    """One row per checkpoint: each effect with its pooled CI and verdict, and the root's
    L route change of its Stage-1 route diagnostics where recorded."""
    labels = list(dict.fromkeys(p.label for p in points))
    by = {(p.label, p.phase1_seed): p for p in points}
    routes = dict(_routes_by_checkpoint(meta))
    seeds = sorted({p.phase1_seed for p in points})
    rows = []
    for k in seeds:
        row = [text_cell(str(k))]
        for label in labels:
            p = by.get((label, k))
            row.append(text_cell(f"{p.mean_diff:+.2f} [{p.ci_low:+.1f}, {p.ci_high:+.1f}] "
                                 f"{p.verdict}") if p is not None and math.isfinite(p.ci_low)
                       else (Cell("num", p.mean_diff, signed=True) if p is not None else NA))
        change = (routes.get(str(k)) or {}).get("ltm_route_change")
        row.append(Cell("num", change[0]) if change else NA)
        rows.append(row)
    return Table(
        "tab:checkpoint-effects",
        "Each Phase-1 checkpoint's effects (ours, not in the paper): mean paired difference "
        "over its Phase-2 seeds (pp, test stream) with a 95% CI from the pooled "
        "within-checkpoint SD, then + / - (significant, that sign) or 0; and the % of "
        "segment-2 root routes that L changes (Stage-1 route diagnostics, identity L).",
        ["Phase-1 seed", *[_short(x) for x in labels], "L changes root routes (%)"],
        rows,
        align=["l"] + ["r"] * (len(labels) + 1),
    )


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


def _build(trials: Trials) -> Findings:
    df = stats.default_variant(stats.add_derived_metrics(trials.loaded))
    dists, points = stats.checkpoint_distribution(df, _comparisons())
    if not dists:
        return Findings()
    return Findings(
        tables=[table_distribution(dists), table_effects(points, trials.meta)],
        figures=[figure_checkpoints(dists, points)],
        data={"checkpoint_distribution.csv": stats.checkpoint_frame(dists),
              "checkpoint_effects.csv": stats.checkpoint_frame(points)},
    )


STUDY = Study(name="checkpoint distribution", grid=GRID, recognise=recognise, build=_build)


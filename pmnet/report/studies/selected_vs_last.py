"""The validation-selected epoch beside the last epoch (beyond the paper; issue 21): any
results that recorded the last epoch's test metrics (``test_last`` in result.json)."""

from __future__ import annotations

import pandas as pd

from pmnet import stats
from pmnet.report.cells import MISSING, na_cell, text_cell
from pmnet.report.context import Context, Missing, finish
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials
from pmnet.stats import condition_label

#: What a baseline (issue 23) shows for forced identity: it has no consolidation to replace.
NOT_COMPARABLE = "n/a"


def has_last_epoch(df: pd.DataFrame) -> bool:
    """Whether the results recorded the last epoch's test metrics (issue 21)."""
    return f"{stats.LAST_PREFIX}updated_ltm" in df.columns


def table_selected_vs_last(ctx: Context) -> Table:
    """The validation-selected epoch's test recall beside the last epoch's, per condition
    (ours, issue 21): a selection that often picks an early epoch shows here."""
    miss = Missing(ctx)
    conditions = stats.ordered_conditions(ctx.df["condition"]) if not ctx.df.empty else []
    rows = []
    for c in conditions:
        epochs = ctx.df.loc[ctx.df["condition"] == c, "best_epoch"].dropna()
        last = ctx.df.loc[ctx.df["condition"] == c, "last_epoch"].dropna()
        row = [condition_label(c),
               text_cell(" ".join(str(int(e)) for e in epochs) if len(epochs) else MISSING),
               text_cell(str(int(last.max())) if len(last) else MISSING)]
        for metric in ("updated_ltm", "forced_identity"):
            if metric == "forced_identity" and c in stats.BASELINE_CONDITIONS:
                row += [na_cell(NOT_COMPARABLE)] * 3  # a baseline has nothing to force
                continue
            label = f"last - selected epoch: {c} {metric}"
            row += [ctx.stat(miss, c, metric, paper=False),
                    ctx.stat(miss, c, f"{stats.LAST_PREFIX}{metric}", paper=False),
                    ctx.paired(miss, label, spec=stats.Comparison(
                        label, c, f"{stats.LAST_PREFIX}{metric}", c, metric,
                        "ours:selected-vs-last"), paper=False)]
        rows.append(row)
    table = Table(
        "tab:selected-vs-last",
        "The validation-selected epoch beside the last epoch (ours, not in the paper): the "
        "selected epoch of each seed, the last epoch, and test recall (%) of the updated "
        "mapping and of forced identity at each, mean ± SD, with the paired difference last - "
        "selected (pp).",
        ["Condition", "Selected epochs (by seed)", "Last epoch", "Updated LTM (selected)",
         "Updated LTM (last)", "Last - selected", "Forced identity (selected)",
         "Forced identity (last)", "Last - selected"],
        rows,
        notes=["Every other table reads the selected epoch, as the paper does."],
        align=["l", "l"] + ["r"] * 7,
    )
    return finish(ctx, table, miss)


def _build(trials: Trials) -> Findings:
    return Findings(tables=[table_selected_vs_last(trials.ctx)])


STUDY = Study(
    name="selected vs last epoch",
    grid="",
    recognise=lambda trials: trials.paper_part and has_last_epoch(trials.base),
    build=_build,
)

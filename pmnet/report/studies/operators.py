"""Alternative consolidation operators (beyond the paper; issue 11, grid ``operators``): the
Consolidator and each operator trained alone from the same Phase-1 checkpoint
(``tab:operators``), and each operator minus the Consolidator, a family of its own
(``tab:operator-comparisons``, ``data/operator_comparisons.csv``)."""

from __future__ import annotations

import pandas as pd

from pmnet import stats
from pmnet.report.cells import Cell, text_cell
from pmnet.report.context import Context, Missing, finish
from pmnet.report.paper_tables import family_comparison_table
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials
from pmnet.stats import condition_label

#: Metrics of the operators table (beyond the paper), in column order.
OPERATOR_METRICS = ("updated_ltm", "forced_identity", "initial_ltm", "fresh_ltm",
                    "mismatched_ltm")


def operators_run(df: pd.DataFrame) -> tuple[str, ...]:
    """The operator conditions with any trial in ``df``, in their defined order."""
    present = set(df["condition"]) if not df.empty else set()
    return tuple(c for c in stats.OPERATOR_CONDITIONS if c in present)


def _not_run_note(ran: tuple[str, ...]) -> list[str]:
    left = [condition_label(c) for c in stats.OPERATOR_CONDITIONS if c not in ran]
    return [f"Not run by this grid: {', '.join(left)} (grid `operators` runs every "
            "operator)."] if left else []


def table_operators(ctx: Context, operators: tuple[str, ...] | None = None) -> Table:
    """Beyond the paper: the Consolidator (``consolidator_only``) and each alternative
    consolidation operator, each trained alone from the same Phase-1 checkpoint (only
    ``operators`` when given: those the grid ran)."""
    ran = stats.OPERATOR_CONDITIONS if operators is None else operators
    miss = Missing(ctx)
    rows = []
    for c in (stats.OPERATOR_REFERENCE, *ran):
        miss.check(c, "trainable_params")
        params = ctx.values(c, "trainable_params")
        label = "Consolidator (learned)" if c == stats.OPERATOR_REFERENCE else condition_label(c)
        rows.append(
            [text_cell(label)]
            + [ctx.stat(miss, c, m) for m in OPERATOR_METRICS]
            + [Cell("int", float(params.median())) if params.size else Cell("missing")]
        )
    table = Table(
        "tab:operators",
        "Consolidation operators (ours, not in the paper): each operator replaces C_psi at "
        "both boundaries of Eq. 8 and is trained alone (LTM routing on) from the same Phase-1 "
        "checkpoint, starting at exact identity consolidation. Percent accuracy, mean ± SD "
        "over seeds; forced identity evaluates the same checkpoint with L + S.",
        ["Operator", "Updated LTM", "Forced identity", "Initial LTM", "Fresh", "Mismatched",
         "Trainable parameters"],
        rows,
        rules_before={1},
        notes=_not_run_note(tuple(ran)),
    )
    return finish(ctx, table, miss)


def table_operator_comparisons(ctx: Context, comparisons: pd.DataFrame) -> Table:
    """Each operator minus the Consolidator on updated-mapping LTM recall, paired by seed."""
    return family_comparison_table(
        ctx, comparisons, "tab:operator-comparisons",
        lambda m: ("Each consolidation operator minus the Consolidator (consolidator_only) on "
                   "updated-mapping LTM recall, paired by seed (pp). Holm p adjusts over the "
                   f"{m} operator comparisons with a defined p (a family of its own). "
                   "Blank = not defined (see note)."),
        lambda r: f"{condition_label(r['cond_a'])} - Consolidator")


def _build(trials: Trials) -> Findings:
    ran = operators_run(trials.base)  # a grid that ran some operators shows only those
    comparisons = stats.compare_operators(trials.base, expected_seeds=trials.seeds)
    comparisons = comparisons[comparisons["cond_a"].isin(ran)].reset_index(drop=True)
    return Findings(
        tables=[table_operators(trials.ctx, ran),
                table_operator_comparisons(trials.ctx, comparisons)],
        comparisons={"operator_comparisons.csv": comparisons},
    )


STUDY = Study(
    name="consolidation operators",
    grid="operators",
    recognise=lambda trials: trials.paper_part and stats.has_operator_results(trials.base),
    build=_build,
)

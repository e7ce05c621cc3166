"""Task-matched baselines (beyond the paper; issue 23, grid ``baselines``): the Consolidator,
the GRU operator and the four baselines of :mod:`pmnet.baselines`, each trained from the same
Phase-1 checkpoint on the same episodes and steps (``tab:baselines``: the paper's metrics;
``tab:baseline-families``: per rule family against the output-set baseline), each baseline
minus each reference arm, a family of its own (``tab:baseline-comparisons``,
``data/baseline_comparisons.csv``), and ``fig-baselines``."""

from __future__ import annotations

from pmnet import stats
from pmnet.report.cells import Cell, na_cell, text_cell
from pmnet.report.context import PAPER_NOTE, Context, Missing, finish
from pmnet.report.figures import FigureResult, paired_figure
from pmnet.report.paper_tables import family_comparison_table
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials
from pmnet.stats import condition_label

#: What crosses a context boundary in each arm (`pmnet.baselines`, the module docstring).
CROSSES: dict[str, str] = {
    "consolidator_only": "LTM: L + C_psi(S)",
    "operator_gru": "LTM: GRU operator f(S, L)",
    "baseline_no_reset": "KV cache and STM (nothing cleared)",
    "baseline_memory_tokens": "M memory embeddings",
    "baseline_recurrent_state": "a GRU state",
    "baseline_no_memory": "nothing",
}

#: The paper's metrics of ``tab:baselines``, in column order, and what a baseline shows for
#: the one it has no counterpart of (forced identity needs a consolidation to replace).
BASELINE_METRICS = ("updated_ltm", "initial_ltm", "fresh_ltm", "mismatched_ltm",
                    "forced_identity")
NOT_COMPARABLE = "n/a: no consolidation"

#: ``tab:baseline-families``: recall per rule family beside the output-set baseline.
FAMILY_METRICS = ("updated_ltm_add10", "updated_ltm_add10_baseline", "updated_ltm_affine10",
                  "updated_ltm_affine10_baseline", "mismatched_donor_follow",
                  "updated_ltm_in_unshown")


SEEDS_NOTE = "[n=k] marks cells over fewer seeds than expected."


def _finish(ctx: Context, table: Table, miss: Missing) -> Table:
    """`finish`, without the note on the paper's values: the paper has no baselines."""
    table = finish(ctx, table, miss)
    table.notes = [SEEDS_NOTE if n == PAPER_NOTE else n for n in table.notes]
    return table


def arms() -> tuple[str, ...]:
    """The reference arms, then the baselines."""
    return (*stats.BASELINE_REFERENCES, *stats.BASELINE_CONDITIONS)


def _label(c: str) -> str:
    return "Consolidator (learned)" if c == "consolidator_only" else condition_label(c)


def table_baselines(ctx: Context) -> Table:
    """Each arm's paper metrics (mean ± SD over seeds) and its trainable parameters."""
    miss = Missing(ctx)
    rows = []
    for c in arms():
        miss.check(c, "trainable_params")
        params = ctx.values(c, "trainable_params")
        cells = []
        for m in BASELINE_METRICS:
            if m == "forced_identity" and c in stats.BASELINE_CONDITIONS:
                cells.append(na_cell(NOT_COMPARABLE))
            else:
                cells.append(ctx.stat(miss, c, m, paper=False))
        rows.append([text_cell(_label(c)), text_cell(CROSSES[c])] + cells
                    + [Cell("int", float(params.median())) if params.size else Cell("missing")])
    table = Table(
        "tab:baselines",
        "Task-matched baselines (ours, not in the paper), each trained from the same Phase-1 "
        "checkpoint on the same episodes and steps. The carried memories and the two "
        "references train only their own parameters (backbone frozen); no reset and no "
        "memory, which have none, train the entire model. Percent accuracy on the test "
        "stream, mean ± SD over seeds; chance is 10%.",
        ["Arm", "Crosses the boundary", "Updated LTM", "Initial LTM", "Fresh", "Mismatched",
         "Forced identity", "Trainable parameters"],
        rows,
        rules_before={2},
        labels=2,
    )
    return _finish(ctx, table, miss)


def table_baseline_families(ctx: Context) -> Table:
    """Updated-mapping recall per rule family beside the output-set baseline of the same
    episodes, the donor-follow rate and the in-unshown rate."""
    miss = Missing(ctx)
    rows = [[text_cell(_label(c))] + [ctx.stat(miss, c, m, paper=False) for m in FAMILY_METRICS]
            for c in arms()]
    table = Table(
        "tab:baseline-families",
        "Updated-mapping recall per rule family beside the output-set baseline (a rule-free "
        "guesser that knows which outputs the demonstrations showed; ~50% on ADD10): recall "
        "near it is not rule use. Donor follow: mismatched answers that follow the donor's "
        "rule; in-unshown: answers among the outputs no demonstration showed.",
        ["Arm", "ADD10", "ADD10 baseline", "AFFINE10", "AFFINE10 baseline", "Donor follow",
         "In unshown"],
        rows,
        rules_before={1},
    )
    return _finish(ctx, table, miss)


def table_baseline_comparisons(ctx: Context, comparisons) -> Table:
    """Each baseline minus the Consolidator and minus the GRU operator, paired by seed."""
    return family_comparison_table(
        ctx, comparisons, "tab:baseline-comparisons",
        lambda m: ("Each baseline minus the Consolidator (consolidator_only) and minus the GRU "
                   "operator (operator_gru) on updated-mapping recall, paired by seed (pp). "
                   f"Holm p adjusts over the {m} baseline comparisons with a defined p (a "
                   "family of its own). Blank = not defined (see note)."),
        lambda r: f"{condition_label(r['cond_a'])} - {condition_label(r['cond_b'])}")


def figure_baselines(df) -> FigureResult:
    """Each seed's updated-mapping and fresh recall across the arms (paired by seed)."""
    ticks = {"consolidator_only": "Cons.", "operator_gru": "GRU op", "baseline_no_reset":
             "no reset", "baseline_memory_tokens": "mem tok", "baseline_recurrent_state":
             "rec state", "baseline_no_memory": "no mem"}
    result = paired_figure(
        df, "fig-baselines", "Baselines beside the Consolidator",
        "Updated-mapping recall (left) and fresh-LTM recall (right) of each arm; a line joins "
        "one Phase-2 seed's trials, the bar marks the mean, the dotted line is chance (10%).",
        [("Updated LTM", [(c, "updated_ltm", ticks[c]) for c in arms()]),
         ("Fresh (no experience)", [(c, "fresh_ltm", ticks[c]) for c in arms()])],
        require=[("consolidator_only", "updated_ltm")], ncols=2)
    if result.figure is not None:
        for ax in result.figure.axes:
            ax.axhline(10.0, ls=":", lw=1, color="gray")
            ax.tick_params(axis="x", labelsize=7)
    return result


def _build(trials: Trials) -> Findings:
    comparisons = stats.compare_baselines(trials.base, expected_seeds=trials.seeds)
    ctx = trials.ctx
    return Findings(
        tables=[table_baselines(ctx), table_baseline_families(ctx),
                table_baseline_comparisons(ctx, comparisons)],
        figures=[figure_baselines(trials.base)],
        comparisons={"baseline_comparisons.csv": comparisons},
    )


STUDY = Study(
    name="task-matched baselines",
    grid="baselines",
    recognise=lambda trials: trials.paper_part and stats.has_baseline_results(trials.base),
    build=_build,
)

"""Episodes of T segments (beyond the paper; issue 11, grid ``segments``): the variants that
set ``segments`` and ``ltm_graph`` (:func:`pmnet.stats.segment_arms`). Recall against T by
gradient mode (``tab:segments``, ``fig-segments``), full - truncated at each T
(``tab:segment-comparisons``) and learned - forced identity at each T and mode
(``tab:segment-identity``), each family with its own Holm correction."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from pmnet import stats
from pmnet.report.cells import NA, Cell, text_cell
from pmnet.report.context import Context, Missing, only_ran
from pmnet.report.figures import FigureResult, new_figure
from pmnet.report.paper_tables import family_comparison_table
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials
from pmnet.stats import condition_label

CHANCE = 10.0  # recall of a uniform guess among the 10 digits (pmnet.evaluate.CHANCE)


#: the segments table's per-position recall columns (header, position: 1 = the first
#: segment, -1 = the second-to-last), from ``final_ltm_seg{t}``
SEGMENT_POSITIONS: tuple[tuple[str, int], ...] = (("Segment 1", 1), ("Segment T−1", -1))


def _position_cell(ctx: Context, miss: Missing, arm: stats.SegmentArm, position: int
                   ) -> Cell:
    """Recall of segment t's mapping after the last consolidation (``final_ltm_seg{t}``); NA
    where the position is segment T itself or repeats an earlier column (T = 2: segment T−1
    is segment 1), or where two-segment trials did not compute it."""
    t = position if position > 0 else arm.segments + position
    if t >= arm.segments or (position < 0 and t == 1):
        return NA
    metric = f"final_ltm_seg{t}"
    if arm.segments == 2 and ctx.values(arm.arm, metric).size == 0:
        return NA
    return ctx.stat(miss, arm.arm, metric, paper=False)


def table_segments(ctx: Context, arms: Sequence[stats.SegmentArm]) -> Table:
    """Beyond the paper (issue 11): recall after the last consolidation against the episode
    length T, for each gradient mode across boundaries. ``ctx`` holds the arm frame
    (:func:`stats.by_arm`)."""
    miss = Missing(ctx)
    several = len({a.condition for a in arms}) > 1
    rows: list[list[Cell]] = []
    rules: set[int] = set()
    previous = None
    for a in arms:
        if previous is not None and (a.condition, a.segments) != previous:
            rules.add(len(rows))
        previous = (a.condition, a.segments)
        n = ctx.values(a.arm, "updated_ltm").size
        rows.append(
            ([text_cell(condition_label(a.condition))] if several else [])
            + [text_cell(str(a.segments)), text_cell(a.ltm_graph),
               ctx.stat(miss, a.arm, "updated_ltm", paper=False)]
            + [_position_cell(ctx, miss, a, pos) for _, pos in SEGMENT_POSITIONS]
            + [ctx.stat(miss, a.arm, "forced_identity", paper=False),
               ctx.stat(miss, a.arm, "fresh_ltm", paper=False), Cell("int", n)]
        )
    notes = [
        "Updated LTM: the last mapping (segment T's rule on segment T's query, updated_ltm). "
        "Segment t: final_ltm_seg{t}, segment t's own query asked of the final LTM and "
        "scored against segment t's rule, which later segments replaced. Forced identity: "
        "the same checkpoint with identity consolidation; Fresh: the final query with no "
        "experience (chance 10%).",
        "T = 2 with the full graph is the paper's setting. Both modes of one T share its test "
        "episodes and each seed's training stream; each T has streams of its own.",
    ]
    if any(a.segments == 2 for a in arms):
        notes.append("Blank at T = 2: segment T−1 is segment 1, and two-segment trials keep "
                     "the paper's metric set (no final_ltm_seg{t}) unless they computed it.")
    table = Table(
        "tab:segments",
        "Recall against T (ours, not in the paper): memory episodes of T segments at one "
        "address, each segment updating the mapping, queried after the last consolidation. "
        "Gradient: full = the graph across every boundary (the paper's setting); truncated = "
        "LTM detached after every boundary but the last (truncated BPTT). Percent accuracy, "
        "mean ± SD over seeds.",
        (["Condition"] if several else [])
        + ["T", "Gradient", "Updated LTM", *(h for h, _ in SEGMENT_POSITIONS),
           "Forced identity", "Fresh", "Seeds"],
        rows,
        notes=notes,
        rules_before=rules,
        align=(["l"] if several else []) + ["r", "l"] + ["r"] * 6,
        labels=3 if several else 2,
    )
    return only_ran(table, miss)


def table_segment_comparisons(ctx: Context, comparisons: pd.DataFrame) -> Table:
    """Full graph minus truncated BPTT at each T on updated-mapping recall, paired by seed."""
    return family_comparison_table(
        ctx, comparisons, "tab:segment-comparisons",
        lambda m: ("Full graph minus truncated BPTT on updated-mapping LTM recall at each T, "
                   f"paired by seed (pp). Holm p adjusts over the {m} values of T with a "
                   "defined p (a family of its own). Blank = not defined (see note)."),
        lambda r: r["label"].rsplit(": ", 1)[0])


def table_segment_identity(ctx: Context, comparisons: pd.DataFrame) -> Table:
    """Learned consolidation minus forced identity at each T and gradient mode, paired by
    seed: does the trained operator still beat leaving LTM as the first boundary wrote it."""
    return family_comparison_table(
        ctx, comparisons, "tab:segment-identity",
        lambda m: ("Learned consolidation minus forced identity (the same checkpoint with "
                   "identity consolidation at every boundary, on the same T-segment test "
                   "episodes) on updated-mapping LTM recall at each T and gradient mode, "
                   f"paired by seed (pp): the paper's test at T = 2, full. Holm p adjusts "
                   f"over the {m} comparisons with a defined p (a family of its own). "
                   "Blank = not defined (see note)."),
        lambda r: r["label"].rsplit(": ", 1)[0])


def build_segment_tables(
    df: pd.DataFrame,
    expected_seeds: Sequence[int] | None = None,
    comparisons: pd.DataFrame | None = None,
    identity: pd.DataFrame | None = None,
) -> list[Table]:
    """The segments tables from a tidy frame with variant rows (:func:`stats.segment_arms`);
    [] when no variant sets ``segments`` and ``ltm_graph``. The full - truncated table only
    when some T has both a full and a truncated arm; the learned - forced identity table
    when some arm learns its consolidation."""
    arms = stats.segment_arms(df)
    if not arms:
        return []
    seeds = list(expected_seeds) if expected_seeds is not None else stats.expected_seed_set(df)
    if comparisons is None:
        comparisons = stats.compare_segments(df, expected_seeds=seeds)
    if identity is None:
        identity = stats.compare_segments_identity(df, expected_seeds=seeds)
    ctx = Context(stats.by_arm(df), None, comparisons, seeds)
    tables = [table_segments(ctx, arms)]
    if len(comparisons):
        tables.append(table_segment_comparisons(ctx, comparisons))
    if len(identity):
        tables.append(table_segment_identity(ctx, identity))
    return tables


def figure_segments(df: pd.DataFrame) -> FigureResult:
    """Beyond the paper (issue 11): recall against T, one line per gradient mode (mean ± SD
    over seeds, each seed a faint dot): (a) the last mapping (updated LTM), (b) the first
    segment's mapping (``final_ltm_seg1``), both after the last consolidation."""
    fig_id, title = "fig-segments", "Recall against the number of segments T"
    caption = ("Mean ± SD over seeds (error bars; dots: single seeds) of recall after the "
               "last consolidation, for the full graph across boundaries (the paper's "
               "setting) and truncated BPTT. (a) the last mapping (updated LTM); (b) the "
               "first segment's mapping (final_ltm_seg1), which later segments replaced.")
    arms = stats.segment_arms(df)
    if not arms:
        return FigureResult(fig_id, title, caption,
                            skipped="no variant sets segments and ltm_graph")
    arm_df = stats.by_arm(df)
    several = len({a.condition for a in arms}) > 1
    series: dict[tuple[str, str], list[stats.SegmentArm]] = {}
    for a in arms:
        series.setdefault((a.condition, a.ltm_graph), []).append(a)
    ts = sorted({a.segments for a in arms})
    fig, axes = new_figure(2, size=(4.2, 3.3))
    result = FigureResult(fig_id, title, caption, figure=fig)
    panels = (("(a) last mapping (updated LTM)", "updated_ltm"),
              ("(b) first mapping (segment 1)", "final_ltm_seg1"))
    width = 0.06 * (max(ts) - min(ts) or 1)
    for ax, (panel, metric) in zip(axes, panels):
        drawn = False
        for i, ((condition, graph), group) in enumerate(series.items()):
            offset = (i - (len(series) - 1) / 2) * width
            xs, means, sds = [], [], []
            for a in sorted(group, key=lambda a: a.segments):
                values = stats.seed_values(arm_df, a.arm, metric)
                if not values.size:
                    continue
                xs.append(a.segments + offset)
                means.append(float(values.mean()))
                sds.append(float(values.std(ddof=1)) if values.size > 1 else 0.0)
                ax.plot([a.segments + offset] * values.size, values.to_numpy(), "o", ms=3,
                        alpha=0.3, color=f"C{i}")
            if not xs:
                continue
            drawn = True
            label = f"{condition_label(condition)}, {graph}" if several else graph
            ax.errorbar(xs, means, yerr=sds, marker="o", ms=5, capsize=3, lw=1.4,
                        color=f"C{i}", label=label)
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
            result.notes.append(f"panel '{panel}': no data")
        ax.axhline(CHANCE, ls=":", lw=0.8, color="gray")
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.set_xlabel("segments per episode T")
        ax.set_ylim(-2, 102)
        ax.set_ylabel("recall (%)")
        ax.set_title(panel, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if 2 in ts and not stats.seed_values(arm_df, next(a.arm for a in arms if a.segments == 2),
                                         "final_ltm_seg1").size:
        result.notes.append("(b) has no point at T = 2: two-segment trials do not compute "
                            "final_ltm_seg1")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(handles, labels, fontsize=8, frameon=False, title="gradient",
                       title_fontsize=8)
    fig.suptitle(title, fontsize=11)
    return result


def _build(trials: Trials) -> Findings:
    df, seeds = trials.derived, trials.seeds
    full_truncated = stats.compare_segments(df, expected_seeds=seeds)
    identity = stats.compare_segments_identity(df, expected_seeds=seeds)
    return Findings(
        tables=build_segment_tables(df, seeds, full_truncated, identity),
        figures=[figure_segments(df)],
        comparisons={"segment_comparisons.csv": full_truncated,
                     "segment_identity_comparisons.csv": identity},
    )


STUDY = Study(
    name="segments",
    grid="segments",
    recognise=lambda trials: bool(stats.segment_arms(trials.derived)),
    build=_build,
)

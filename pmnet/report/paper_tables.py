"""The paper's tables in the paper's layout (same rows, columns and labels, e.g.
``tab:direct-ltm-routing``), the headline and claims tables in front of them, the shortcut
diagnostics, and every paired comparison of the paper's family (:func:`paper_tables`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from pmnet import stats
from pmnet.report.cells import NA, Cell, finite, format_p, text_cell
from pmnet.report.context import (
    Context,
    Missing,
    comparison_spec,
    finish,
    grids_phrase,
    not_run_line,
    only_ran,
    per_checkpoint_text,
    row_names,
)
from pmnet.report.table import Table
from pmnet.stats import CONDITIONS, condition_label

ON, OFF = "consolidator_only", "consolidator_only_routing_off"


#: The headline's rows: (quantity, condition, metric) for a condition's mean, or (quantity,
#: None, label) for a paired comparison of the paper's family.
HEADLINE_ROWS: tuple[tuple[str, str | None, str], ...] = (
    ("Consolidator only, updated-mapping LTM recall (%)", ON, "updated_ltm"),
    ("Routing off, updated-mapping LTM recall (%)", OFF, "updated_ltm"),
    ("Direct routing on - off, updated LTM (pp)", None, "routing on - off: updated_ltm"),
    ("Learned - forced identity, routing off (pp)", None,
     "learned - forced identity, routing off: updated_ltm"),
    ("Learned - forced identity, routing on (pp)", None,
     "learned - forced identity, routing on: updated_ltm"),
    ("Learned full, updated LTM (%)", "learned_full", "updated_ltm"),
    ("Identity full, updated LTM (%)", "identity_full", "updated_ltm"),
    ("Memory + Consolidator, updated LTM (%)", "memory_consolidator", "updated_ltm"),
    ("Learned full - identity full (pp)", None, "learned_full - identity_full: updated_ltm"),
    ("Dual objective, updated LTM (%)", "learned_full_dual", "updated_ltm"),
    ("Dual objective, mean STM (%)", "learned_full_dual", "mean_stm"),
    ("Dual - LTM only, mean STM (pp)", None, "dual - LTM only: mean_stm"),
    ("Dual - LTM only, updated LTM (pp)", None, "dual - LTM only: updated_ltm"),
)


FAMILIES = stats.RULE_FAMILIES


def _in_family(text: str, name: str) -> str:
    """A row's text read on one rule family: `Routing off, updated LTM (%)` ->
    `Routing off, updated LTM, ADD10 (%)`."""
    for unit in (" (%)", " (pp)", ", pp)"):  # a claim: `(updated LTM, ADD10, pp)`
        if text.endswith(unit):
            return text[:-len(unit)] + f", {name}{unit}"
    return f"{text}, {name}"


def _family_key(key: str, family: str) -> str:
    """A row's metric or comparison label on one family (`..._add10`)."""
    return f"{key}_{family}"


def _by_family(rows):
    """Each row on updated-mapping recall followed by its two rule families' rows (issue 52:
    every recall per family, beside that family's output-set baseline); each row with the
    family it reads (None: both)."""
    out = []
    for text, condition, key in rows:
        out.append((text, condition, key, None))
        if key == "updated_ltm" or key.endswith(": updated_ltm"):
            out += [(_in_family(text, name), condition, _family_key(key, fam), fam)
                    for fam, name in FAMILIES.items()]
    return tuple(out)


#: The headline's rows with their rule families: (quantity, condition, metric or comparison
#: label, family or None); the Phase-1 STM rows of each family come before them.
HEADLINE_FAMILY_ROWS = _by_family(HEADLINE_ROWS)

#: The paper's paired claims of the claims table: (claim, comparison label).
PAPER_CLAIMS: tuple[tuple[str, str], ...] = (
    ("Learned > forced identity, routing on (updated LTM, pp)",
     "learned - forced identity, routing on: updated_ltm"),
    ("Routing on > off (updated LTM, pp)", "routing on - off: updated_ltm"),
    ("Learned > forced identity, routing off (updated LTM, pp)",
     "learned - forced identity, routing off: updated_ltm"),
)
#: The paired claims of the claims table: (claim, comparison label, family or None): each of
#: the paper's claims, then on each rule family, then the routing-on arm above its baseline.
CLAIM_ROWS: tuple[tuple[str, str, str | None], ...] = (
    *((t, label, fam) for t, _, label, fam in _by_family(
        [(text, None, label) for text, label in PAPER_CLAIMS])),
    *((f"Routing on: updated LTM above the output-set baseline, {name} (pp)",
       f"recall - output-set baseline, {fam}: {ON}", fam) for fam, name in FAMILIES.items()),
)
#: Every paired effect the headline and claims read across K >= 2 checkpoints (issue 35).
UNIT_LABELS: tuple[str, ...] = tuple(dict.fromkeys(
    [key for _, condition, key, _ in HEADLINE_FAMILY_ROWS if condition is None]
    + [label for _, label, _ in CLAIM_ROWS]))


def _unit_cells(ctx: Context, label: str) -> tuple[Cell, Cell, Cell, Cell]:
    """Across checkpoints: estimate ± SE (random intercept), its t CI and p, and each
    checkpoint's own mean difference."""
    view = ctx.checkpoints
    e = view.effects.get(label)
    per = text_cell(per_checkpoint_text(view.per_checkpoint.get(label, [])))
    if e is None or not e.fitted:
        return NA, NA, NA, per
    return (Cell("stat", e.estimate, e.se, n=e.k, signed=True),
            Cell("ci", e.ci_low_t, hi=e.ci_high_t), Cell("p", e.p_t), per)


def _unit_condition_cells(ctx: Context, condition: str, metric: str) -> tuple[Cell, Cell]:
    """Across checkpoints: mean ± SD over every trial, and each checkpoint's mean."""
    view = ctx.checkpoints
    values = view.condition_values(condition, metric)
    n = int(values.size)
    cell = Cell("stat", float(values.mean()) if n else math.nan,
                float(values.std(ddof=1)) if n > 1 else math.nan)
    return cell, text_cell(per_checkpoint_text(view.condition_means(condition, metric),
                                               signed=False))


def _gate_frame(ctx: Context) -> pd.DataFrame:
    """The trials an arm's recall and baseline are averaged over: every checkpoint's with
    K >= 2 checkpoints, else the run's."""
    return ctx.checkpoints.every if ctx.checkpoints is not None else ctx.df


def _gate(ctx: Context, label: str) -> stats.CapabilityGate | None:
    """Both arms of a paired comparison beside their output-set baselines (issue 44)."""
    spec = comparison_spec(label)
    return None if spec is None else stats.capability_gate(_gate_frame(ctx), spec)


def _families(ctx: Context) -> dict[str, stats.FamilyLearning]:
    """Did Phase 1 learn each rule family? Over the trials the gates read (issue 52)."""
    return stats.phase1_families(_gate_frame(ctx))


def _unlearned(families: Mapping[str, stats.FamilyLearning], family: str | None
               ) -> list[stats.FamilyLearning]:
    """The families a row reads that Phase 1 did not learn (its own, or for a row over both
    families, each)."""
    read = families.values() if family is None else [families[family]] \
        if family in families else []
    return [f for f in read if not f.learned]


def _marked(text: str, unlearned: Sequence[stats.FamilyLearning], family: str | None) -> str:
    """`text` with the mark of the families Phase 1 did not learn: `(not learned)` on a row
    of that family, `(mixes AFFINE10)` on a row over both (short: the cell stays in the
    table, tab:claims says the rest)."""
    if not unlearned:
        return text
    mark = ("not learned" if family is not None
            else "mixes " + " and ".join(f.name for f in unlearned))
    if text.endswith(")"):  # `(both below)` -> `(both below; not learned)`
        return f"{text[:-1]}; {mark})"
    return f"{text} ({mark})"


def _gate_cell(gate: stats.CapabilityGate | None, unlearned=(),
               family: str | None = None) -> Cell:
    return NA if gate is None else text_cell(_marked(gate.text(), unlearned, family))


def _arm_cell(ctx: Context, condition: str, metric: str, unlearned=(),
              family: str | None = None) -> Cell:
    """`20.1 vs 42.0 (below)`: a condition's recall beside its output-set baseline, and the
    families it reads that Phase 1 did not learn."""
    arm = stats.arm_capability(_gate_frame(ctx), condition, metric)
    if arm is None:
        return NA
    return text_cell(_marked(f"{arm.recall:.1f} vs {arm.baseline:.1f}"
                             + ("" if arm.above else " (below)"), unlearned, family))


def _phase1_rows(ctx: Context, unit: bool) -> list[list[Cell]]:
    """The headline's first rows: each rule family's Phase-1 STM beside its output-set
    baseline, marked "not learned" where it is at or within noise of it (issue 52)."""
    rows = []
    for fam in _families(ctx).values():
        values = [c.stm for c in fam.checkpoints]
        sd = float(pd.Series(values).std(ddof=1)) if len(values) > 1 else math.nan
        cell = Cell("stat", fam.stm, sd, n=len(values))
        text = text_cell(f"Phase-1 STM recall, {fam.name} (%)")
        base = text_cell(fam.text())
        if unit:
            per = text_cell(per_checkpoint_text(
                [(c.phase1_seed, c.stm) for c in fam.checkpoints], signed=False))
            rows.append([text, cell, NA, NA, per, base, NA])
        else:
            rows.append([text, cell, NA, NA, base, NA])
    return rows


#: The verdict of a paired claim whose two arms are both at or below the output-set baseline
BELOW_BASELINE_VERDICT = ("no verdict: both arms at or below the output-set baseline (neither "
                          "uses the rule)")
BASELINE_COLUMN = "Recall vs output-set baseline (%)"


def _unit_note(ctx: Context) -> str:
    view = ctx.checkpoints
    return (f"Over K = {view.k} Phase-1 checkpoints (phase1_seed "
            f"{', '.join(str(k) for k in view.phase1_seeds)}), the unit of analysis: a paired "
            "row is the mean with the checkpoint as a random intercept (estimate ± SE, REML; "
            "95% CI and p from a t with K - 1 df, tab:phase1-variance), a condition row the "
            "mean ± SD over every trial; 'Per checkpoint' gives each checkpoint's own mean "
            "over its seeds, in Phase-1 seed order. The paper-layout tables below are one "
            "checkpoint's view.")


def table_headline(ctx: Context) -> Table:
    """The paper's headline quantities that this run's trials cover: a row whose condition (or
    either side of whose comparison) has no trial at all is left out, and one note names
    those conditions. With K >= 2 Phase-1 checkpoints every row is read across them (the
    unit of analysis) with each checkpoint's value beside it."""
    miss = Missing(ctx)
    ran = {c for c, _ in ctx.present}
    unit = ctx.checkpoints is not None
    families = _families(ctx)
    rows, absent = _phase1_rows(ctx, unit), []
    for text, condition, key, family in HEADLINE_FAMILY_ROWS:
        if condition is not None:
            needs = [condition]
        else:
            needs = [ctx.comparison(key)["cond_a"], ctx.comparison(key)["cond_b"]]
        if not set(needs) <= ran:
            absent += [c for c in needs if c not in ran and c not in absent]
            continue
        unlearned = _unlearned(families, family)
        if condition is not None:
            paper = ctx.paper_stat(condition, key) or NA
            base = _arm_cell(ctx, condition, key, unlearned, family)
            if unit:
                cell, per = _unit_condition_cells(ctx, condition, key)
                rows.append([text_cell(text), cell, NA, NA, per, base, paper])
                continue
            cell = ctx.stat(miss, condition, key, paper=False)
            rows.append([text_cell(text), cell, NA, NA, base, paper])
            continue
        gate = _gate_cell(_gate(ctx, key), unlearned, family)
        if unit:
            est, ci, p, per = _unit_cells(ctx, key)
            rows.append([text_cell(text), est, ci, p, per, gate, ctx.paper_cmp(key) or NA])
            continue
        row = ctx.comparison(key)
        rows.append([
            text_cell(text),
            ctx.paired(miss, key, "stat", paper=False),
            Cell("ci", row["ci_low"], hi=row["ci_high"], paper=ctx.paper_cmp(key, "ci")),
            Cell("p", row["p"], paper=ctx.paper_cmp(key, "p")),
            gate,
            ctx.paper_cmp(key) or NA,
        ])
    if unit:
        table = Table(
            "tab:headline",
            f"Headline numbers over {ctx.checkpoints.k} Phase-1 checkpoints: ours beside the "
            "paper's (the paper's are from one checkpoint and five seeds).",
            ["Quantity", "Ours", "95% CI", "p", "Per checkpoint", BASELINE_COLUMN, "Paper"],
            rows,
            notes=[_unit_note(ctx)],
            align=["l", "r", "r", "r", "p{2.5cm}", "r", "r"],
            asides={6},
        )
    else:
        table = Table(
            "tab:headline",
            "Headline numbers: ours beside the paper's (mean ± SD over seeds; paired "
            "differences in percentage points with t-distribution 95% CI and paired t-test "
            "p).",
            ["Quantity", "Ours", "95% CI", "p", BASELINE_COLUMN, "Paper"],
            rows,
            asides={5},
        )
    if absent:
        left_out = len(HEADLINE_ROWS) - sum(r[0].text in _BASE_TEXTS for r in rows)
        absent = stats.ordered_conditions(absent)
        table.notes.append(
            f"Not run here: {', '.join(absent)} ({grids_phrase(absent)}); the paper's "
            f"{left_out} headline row{'s' if left_out != 1 else ''} about "
            f"{'them' if len(absent) > 1 else 'it'} {'are' if left_out != 1 else 'is'} left "
            "out.")
        table.absent = list(absent)
    empty = table.prune()  # a condition that ran without the metric
    if empty:
        table.notes.append(not_run_line(row_names(table, empty), []))
    if ctx.paper is not None and not unit:
        table.notes.append("Parenthesised CI and p values are the paper's where it prints them.")
    _baseline_column(table)
    if families:
        table.notes.append(_families_note(families))
    table.missing = miss.lines()
    return table


_BASE_TEXTS = frozenset(text for text, _, _ in HEADLINE_ROWS)


def _families_note(families: Mapping[str, stats.FamilyLearning]) -> str:
    """What the per-family rows and the "not learned" mark mean (issue 52)."""
    return (
        "Rule families (issue 52): each recall on updated mappings is also read on each "
        "family's test episodes beside that family's output-set baseline (50% on ADD10, "
        "about 34% on AFFINE10); '(not learned)' marks a row of a family Phase 1 did not "
        "learn, '(mixes AFFINE10)' a row over both families that averages it in. Phase-1 "
        "STM recall is the mean of the segments' STM queries "
        "of the trials whose backbone Phase 2 leaves frozen (the Phase-1 checkpoint's own); a "
        "family is 'not learned' when its Phase-1 STM is not above its baseline by more than "
        f"{stats.LEARNED_MARGIN_PP:.1f} pp (the 95% half-width of a 1,000-episode stream) on "
        "every checkpoint, and no claim is read off it (tab:claims). Here: "
        + "; ".join(f"{f.name} {f.status()}" for f in families.values()) + ".")


#: recall a control must stay under to count as "near chance" (10%) in the claims table
NEAR_CHANCE_MAX = 15.0


CLAIM_ALPHA = 0.05


def _verdict_paired(row: Mapping[str, Any]) -> str:
    """'reproduces' when the paired mean difference is > 0 with p < CLAIM_ALPHA."""
    if row["n"] < 2 or not finite(row["p"]):
        return "not tested (fewer than two paired seeds)"
    if row["mean_diff"] > 0 and row["p"] < CLAIM_ALPHA:
        return "reproduces"
    if row["mean_diff"] > 0:
        return f"does not reproduce (> 0 but p = {format_p(row['p'])} >= {CLAIM_ALPHA})"
    return "does not reproduce (difference <= 0)"


def _verdict_unit(e: stats.Phase1Effect | None) -> str:
    """'reproduces' when the mean over checkpoints (random intercept) is > 0 with p <
    CLAIM_ALPHA."""
    if e is None or e.n == 0:
        return "not tested (no paired trials)"
    if not e.fitted:
        return f"not tested ({e.note.split(';')[0]})"
    if e.estimate > 0 and e.p_t < CLAIM_ALPHA:
        return f"reproduces over {e.k} checkpoints"
    if e.estimate > 0:
        return (f"does not reproduce over {e.k} checkpoints (> 0 but p = {format_p(e.p_t)} "
                f">= {CLAIM_ALPHA})")
    return f"does not reproduce over {e.k} checkpoints (mean <= 0)"


def family_verdict(unlearned: Sequence[stats.FamilyLearning], mixed: bool) -> str:
    """The verdict of a claim that reads a rule family Phase 1 did not learn (issue 52);
    `mixed`: the claim's recall averages both families."""
    reasons = "; ".join(f.reason() for f in unlearned)
    if mixed:
        return f"no verdict: it averages in {reasons}"
    return f"no verdict: {reasons}"


def _baseline_column(table: Table) -> None:
    """Explain the baseline column, or drop it when the input has no baseline (the paper's
    own per-seed numbers)."""
    if not table.drop_empty_column(BASELINE_COLUMN):
        table.notes.append(_baseline_note())


def _baseline_note() -> str:
    return (f"{BASELINE_COLUMN}: each arm's mean recall (for a paired row: arm a / arm b) "
            "beside the mean output-set baseline of the same trials' test episodes, the "
            "rule-free guesser's recall (about 42% overall, 50% on ADD10); '(below)': at or "
            "under it, so the arm does not use the episode's rule.")


def table_claims(ctx: Context) -> Table:
    """Which of the paper's claims this run reproduces, each with the test that decides it."""
    miss = Missing(ctx)
    rows = []
    unit = ctx.checkpoints is not None
    families = _families(ctx)

    def gated_verdict(gate: stats.CapabilityGate | None, unlearned, verdict: str,
                      family: str | None) -> str:
        if gate is not None and gate.both_below:
            return BELOW_BASELINE_VERDICT
        if unlearned:  # issue 52: the capability gate per rule family
            return family_verdict(unlearned, mixed=family is None)
        return verdict

    def paired_row(claim: str, label: str, family: str | None) -> None:
        gate = _gate(ctx, label)
        unlearned = _unlearned(families, family)
        base = _gate_cell(gate, unlearned, family)
        if unit:
            est, ci, p, per = _unit_cells(ctx, label)
            e = ctx.checkpoints.effects.get(label)
            verdict = gated_verdict(gate, unlearned, _verdict_unit(e), family)
            rows.append([text_cell(claim), est, ci, p, per, base, ctx.paper_cmp(label) or NA,
                         text_cell(verdict)])
            return
        row = ctx.comparison(label)
        rows.append([
            text_cell(claim),
            ctx.paired(miss, label, "stat", paper=False),
            Cell("ci", row["ci_low"], hi=row["ci_high"]),
            Cell("p", row["p"]),
            base,
            ctx.paper_cmp(label) or NA,
            text_cell(gated_verdict(gate, unlearned, _verdict_paired(row), family)),
        ])

    for fam in families.values():  # issue 52: the gate of every claim below
        margins = [c.margin for c in fam.checkpoints]
        sd = float(pd.Series(margins).std(ddof=1)) if len(margins) > 1 else math.nan
        per = ([text_cell(per_checkpoint_text([(c.phase1_seed, c.margin)
                                               for c in fam.checkpoints]))] if unit else [])
        verdict = ("learned" if fam.learned else fam.status()) + \
            f" (the gate of the claims on {fam.name}; margin {stats.LEARNED_MARGIN_PP:.1f} pp)"
        rows.append([text_cell(f"Phase 1 learned {fam.name}: STM above its output-set "
                               "baseline (pp)"),
                     Cell("stat", fam.stm - fam.baseline, sd, n=len(margins), signed=True),
                     NA, NA, *per, text_cell(fam.text()), NA, text_cell(verdict)])

    def mean_cells(metric: str) -> tuple[Cell, list[Cell]]:
        if unit:
            cell, per = _unit_condition_cells(ctx, ON, metric)
            n = int(ctx.checkpoints.condition_values(ON, metric).size)
            return Cell("stat", cell.value, cell.sd, n=n), [per]
        return ctx.stat(miss, ON, metric, paper=False), []

    for claim, label, family in CLAIM_ROWS:
        paired_row(claim, label, family)
    for metric, name in (("fresh_ltm", "Fresh LTM"), ("mismatched_ltm", "Mismatched LTM")):
        cell, per = mean_cells(metric)
        ok = cell.n and finite(cell.value) and cell.value <= NEAR_CHANCE_MAX
        verdict = ("reproduces" if ok else
                   "not tested (no results)" if not cell.n else
                   f"does not reproduce (mean above {NEAR_CHANCE_MAX:g}%)")
        rows.append([text_cell(f"{name} near chance (10%), routing on (%)"), cell, NA, NA,
                     *per, NA, ctx.paper_stat(ON, metric) or NA, text_cell(verdict)])
    follow, per = mean_cells("mismatched_donor_follow")
    rows.append([text_cell("Mismatched LTM: answers that follow the donor's rule (%)"), follow,
                 NA, NA, *per, NA, NA, text_cell("reported (not a claim of the paper)")])
    how = ("over the Phase-1 checkpoints (the mean with the checkpoint as a random "
           "intercept, t with K - 1 df) is > 0 with p" if unit
           else "over seeds is > 0 with paired t-test p")
    table = Table(
        "tab:claims",
        "Which of the paper's claims this run reproduces. A paired claim reproduces when the "
        f"paired mean difference {how} < {CLAIM_ALPHA:g}; a "
        f"control is near chance when its mean recall is at most {NEAR_CHANCE_MAX:g}%. "
        "Above-baseline rows pair each seed's recall with the output-set baseline on the same "
        "test episodes of that family. A paired claim whose two arms both recall at or below "
        "their output-set baseline gets no verdict: it compares two models that do not use "
        "the rule (issue 44). Nor does a claim on a rule family that Phase 1 did not learn, "
        "or a claim over both families when either is not learned (issue 52).",
        ["Claim", "Ours", "95% CI", "p", *(["Per checkpoint"] if unit else []),
         BASELINE_COLUMN, "Paper", "Verdict"],
        rows,
        notes=[_unit_note(ctx)] if unit else [],
        # the text wraps: fits the page
        align=["p{5cm}", "r", "r", "r", *(["p{2.5cm}"] if unit else []), "r", "r", "p{4.5cm}"],
        asides={6, 7} if unit else {5, 6},
    )
    _baseline_column(table)
    return only_ran(table, miss)


def table_same_address_update(ctx: Context) -> Table:
    miss = Missing(ctx)
    rows = [
        [
            "Initial mapping after first consolidation",
            ctx.stat(miss, ON, "initial_ltm"),
            ctx.stat(miss, ON, "forced_identity_initial"),
        ],
        [
            "Updated mapping after second consolidation",
            ctx.stat(miss, ON, "updated_ltm"),
            ctx.stat(miss, ON, "forced_identity"),
        ],
    ]
    table = Table(
        "tab:same-address-update",
        "Same-address update under the Consolidator-only intervention. Both columns evaluate "
        "the same trained checkpoint.",
        ["State queried after consolidation", "Learned Consolidator", "Forced identity"],
        rows,
        notes=[
            ctx.paired_sentence(
                "learned - forced identity, routing on: updated_ltm",
                "Same-checkpoint learned - forced identity (updated mapping)",
            )
        ],
    )
    return finish(ctx, table, miss)


def table_direct_ltm_routing(ctx: Context) -> Table:
    miss = Missing(ctx)
    rows = []
    for name, condition, on_off in (("Off", OFF, "off"), ("On", ON, "on")):
        rows.append(
            [
                name,
                ctx.stat(miss, condition, "updated_ltm"),
                ctx.stat(miss, condition, "forced_identity"),
                ctx.paired(miss, f"learned - forced identity, routing {on_off}: updated_ltm"),
                ctx.stat(miss, condition, "seg2_stm"),
                ctx.stat(miss, condition, "mismatched_ltm"),
                ctx.stat(miss, condition, "fresh_ltm"),
            ]
        )
    table = Table(
        "tab:direct-ltm-routing",
        "Direct LTM-conditioned routing in the Consolidator-only setting. On and off runs "
        "share one STM-pretraining initialization and paired consolidation-training seeds.",
        ["Direct LTM routing", "Learned LTM", "Identity LTM", "Learned - identity",
         "Segment-2 STM", "Mismatched LTM", "Fresh LTM"],
        rows,
        notes=[
            ctx.paired_sentence("routing on - off: updated_ltm", "Paired On - Off, learned LTM"),
            ctx.paired_sentence("routing on - off: seg2_stm", "Paired On - Off, segment-2 STM"),
        ],
    )
    return finish(ctx, table, miss)


def table_routing_per_seed(ctx: Context) -> Table:
    miss = Missing(ctx)
    columns = ["Seed", "Off learned LTM", "Off identity LTM", "Learned - identity",
               "Segment-2 STM", "Mismatched LTM", "Fresh LTM", "On - Off"]
    rows = []
    for seed in ctx.seeds:
        rows.append(
            [
                str(seed),
                ctx.seed(miss, OFF, seed, "updated_ltm"),
                ctx.seed(miss, OFF, seed, "forced_identity"),
                ctx.seed_diff(miss, (OFF, "updated_ltm"), (OFF, "forced_identity"), seed),
                ctx.seed(miss, OFF, seed, "seg2_stm"),
                ctx.seed(miss, OFF, seed, "mismatched_ltm"),
                ctx.seed(miss, OFF, seed, "fresh_ltm"),
                ctx.seed_diff(miss, (ON, "updated_ltm"), (OFF, "updated_ltm"), seed),
            ]
        )
    for part, name in (("mean", "Mean"), ("sd", "SD")):
        rows.append(
            [
                name,
                ctx.stat_part(miss, OFF, "updated_ltm", part),
                ctx.stat_part(miss, OFF, "forced_identity", part),
                ctx.paired(miss, "learned - forced identity, routing off: updated_ltm", part),
                ctx.stat_part(miss, OFF, "seg2_stm", part),
                ctx.stat_part(miss, OFF, "mismatched_ltm", part),
                ctx.stat_part(miss, OFF, "fresh_ltm", part),
                ctx.paired(miss, "routing on - off: updated_ltm", part),
            ]
        )
    table = Table(
        "tab:routing-per-seed",
        "Per-seed direct LTM-routing ablation in the Consolidator-only setting (routing-off "
        "condition; On - Off pairs learned-LTM recall of the routing-on and routing-off runs "
        "of the same seed).",
        columns,
        rows,
        rules_before={len(ctx.seeds)},
        notes=["Mean and SD of the difference columns are over paired seeds only."],
    )
    return finish(ctx, table, miss)


def table_routing_rule_family(ctx: Context) -> Table:
    miss = Missing(ctx)
    rows = []
    for family, metric in (("ADD10", "updated_ltm_add10"), ("AFFINE10", "updated_ltm_affine10")):
        rows.append(
            [
                family,
                ctx.stat(miss, OFF, metric),
                ctx.stat(miss, ON, metric),
                ctx.paired(miss, f"routing on - off: {metric}"),
            ]
        )
    table = Table(
        "tab:routing-rule-family",
        "Direct LTM-routing ablation by rule family: updated-mapping LTM recall, mean ± SD over "
        "seeds; On - Off differences are computed within each seed before aggregation.",
        ["Rule family", "Routing off", "Routing on", "Paired On - Off"],
        rows,
    )
    return finish(ctx, table, miss)


CORE_CONDITIONS = ("learned_full", "identity_full", "consolidator_only", "memory_consolidator")


def table_core_parameter_isolation(ctx: Context) -> Table:
    miss = Missing(ctx)
    rows = [
        [condition_label(c)]
        + [ctx.stat(miss, c, m) for m in ("updated_ltm", "fresh_ltm", "mismatched_ltm",
                                          "seg2_stm")]
        for c in CORE_CONDITIONS
    ]
    table = Table(
        "tab:core-parameter-isolation",
        "Core parameter-isolation ablations. Percent accuracy, mean ± SD over seeds; LTM recall "
        "follows the final reset.",
        ["Condition", "Updated LTM", "Fresh", "Mismatched", "Segment-2 STM"],
        rows,
        notes=[
            ctx.paired_sentence(
                "learned_full - identity_full: updated_ltm", "Learned full - identity full"
            )
        ],
    )
    return finish(ctx, table, miss)


def table_core_results_per_seed(ctx: Context) -> Table:
    miss = Missing(ctx)
    rows = []
    for condition in CORE_CONDITIONS:
        for seed in ctx.seeds:
            rows.append(
                [condition_label(condition), str(seed)]
                + [
                    ctx.seed(miss, condition, seed, m)
                    for m in ("updated_ltm", "alternative_mode", "fresh_ltm", "seg2_stm",
                              "mismatched_ltm")
                ]
            )
    table = Table(
        "tab:core-results-per-seed",
        "Fixed-test-stream results for all core runs. Alternative mode is the same-checkpoint "
        "evaluation with the other consolidation operator (forced identity for learned "
        "conditions; the frozen identity-initialized path for identity full).",
        ["Condition", "Seed", "Primary recall", "Alternative mode", "Fresh", "Segment-2 STM",
         "Mismatched"],
        rows,
        labels=2,
    )
    return finish(ctx, table, miss)


DUAL_METRICS = ("updated_ltm", "mean_stm", "seg2_stm", "mismatched_ltm", "fresh_ltm")


def table_dual_objective_aggregate(ctx: Context) -> Table:
    miss = Missing(ctx)
    paired = DUAL_METRICS[:3]
    rows = [
        ["Updated LTM only"] + [ctx.stat(miss, "learned_full", m) for m in DUAL_METRICS],
        ["Updated LTM + STM"] + [ctx.stat(miss, "learned_full_dual", m) for m in DUAL_METRICS],
    ]
    for name, part in (("Paired change", "stat"), ("95% CI", "ci"), ("Paired p", "p")):
        rows.append(
            [name]
            + [ctx.paired(miss, f"dual - LTM only: {m}", part) for m in paired]
            + [NA] * (len(DUAL_METRICS) - len(paired))
        )
    table = Table(
        "tab:dual-objective-aggregate",
        "Aggregate dual-objective experiment. Paired runs share seeds and STM-pretraining "
        "provenance; the consolidation-training objective and validation monitor differ.",
        ["Training objective", "Updated LTM", "Mean STM", "Segment-2 STM", "Mismatched",
         "Fresh"],
        rows,
        rules_before={2},
    )
    return finish(ctx, table, miss)


def table_dual_objective_per_seed(ctx: Context) -> Table:
    miss = Missing(ctx)
    dual = "learned_full_dual"
    rows = [
        [
            str(seed),
            ctx.seed(miss, dual, seed, "best_epoch", kind="int"),
            ctx.seed(miss, dual, seed, "val_dual"),
            ctx.seed(miss, dual, seed, "dual"),
            ctx.seed(miss, dual, seed, "updated_ltm"),
            ctx.seed(miss, dual, seed, "mean_stm"),
            ctx.seed(miss, dual, seed, "forced_identity"),
        ]
        for seed in ctx.seeds
    ]
    table = Table(
        "tab:dual-objective-per-seed",
        "Per-seed dual-objective results. Validation/Test dual = mean of updated-mapping LTM "
        "recall and mean immediate-STM recall on that split.",
        ["Seed", "Best epoch", "Validation dual", "Test dual", "Updated LTM", "Mean STM",
         "Forced identity"],
        rows,
    )
    return finish(ctx, table, miss)


def table_shortcut_diagnostics(ctx: Context) -> Table:
    miss = Missing(ctx)
    conditions = stats.ordered_conditions(ctx.df["condition"]) if not ctx.df.empty else []
    conditions = conditions or list(CONDITIONS)
    rows = [
        [
            condition_label(c),
            ctx.stat(miss, c, "updated_ltm", paper=False),
            ctx.stat(miss, c, "updated_ltm_baseline", paper=False),
            ctx.paired(
                miss,
                f"recall - output-set baseline: {c}",
                spec=stats.Comparison(f"recall - output-set baseline: {c}", c, "updated_ltm", c,
                                      "updated_ltm_baseline", "ours:shortcut-diagnostics"),
                paper=False,
            ),
            ctx.stat(miss, c, "updated_ltm_bijective", paper=False),
            ctx.stat(miss, c, "updated_ltm_nonbijective", paper=False),
            ctx.stat(miss, c, "updated_ltm_in_unshown", paper=False),
            ctx.stat(miss, c, "mismatched_donor_follow", paper=False),
        ]
        for c in conditions
    ]
    table = Table(
        "tab:shortcut-diagnostics",
        "Shortcut diagnostics (ours, not in the paper): updated-mapping LTM recall beside the "
        "output-set baseline (the recall a guess among the unshown outputs would get), recall on "
        "bijective and non-bijective rules, the fraction of answers inside the unshown outputs, "
        "and how often a mismatched (donor) memory makes the model answer with the donor's rule.",
        ["Condition", "Updated LTM", "Output-set baseline", "Recall - baseline", "Bijective",
         "Non-bijective", "In unshown", "Donor-follow"],
        rows,
    )
    return finish(ctx, table, miss)


def comparison_cells(r: Mapping[str, Any]) -> list[Cell]:
    """n, mean diff ± SD, CI, t, p, Holm p and d_z of one row of :func:`stats.compare_all`."""
    return [
        Cell("int", r["n"]),
        Cell("stat", r["mean_diff"], r["sd_diff"], signed=True) if r["n"] > 0
        else Cell("missing"),
        Cell("ci", r["ci_low"], hi=r["ci_high"]) if finite(r["ci_low"]) else NA,
        Cell("num", r["t"]) if finite(r["t"]) else NA,
        Cell("p", r["p"]) if finite(r["p"]) else NA,
        Cell("p", r["p_holm"]) if finite(r["p_holm"]) else NA,
        Cell("num", r["d_z"]) if finite(r["d_z"]) else NA,
    ]


def comparisons_run(ctx: Context, comparisons: pd.DataFrame,
                    name: Callable[[Mapping[str, Any]], str] = lambda r: r["label"],
                    ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The comparisons of a family with paired seeds (n > 0), the one line naming those
    without (issue 35: no n = 0 row on the page; data/ keeps every row: the conditions
    with no trial and the grids that run them, or "no seed with both sides"), and those
    conditions."""
    records = comparisons.to_dict("records")
    run = [r for r in records if r["n"] > 0]
    idle = [r for r in records if r["n"] <= 0]
    if not idle:
        return run, [], []
    ran = {c for c, _ in ctx.present}
    unrun = [r for r in idle if not {r["cond_a"], r["cond_b"]} <= ran]
    absent = stats.ordered_conditions({c for r in unrun for c in (r["cond_a"], r["cond_b"])
                                       if c not in ran})
    parts = []
    if unrun:
        parts.append(f"{', '.join(name(r) for r in unrun)} (no trial of {', '.join(absent)}; "
                     f"{grids_phrase(absent)})")
    lacking = [r for r in idle if r not in unrun]
    if lacking:
        parts.append(f"{', '.join(name(r) for r in lacking)} (no seed has both values)")
    return run, [f"Not run here: {'; '.join(parts)}."], absent


def table_paired_comparisons(ctx: Context, comparisons: pd.DataFrame) -> Table:
    rows = []
    m = int(comparisons["holm_m"].iloc[0]) if len(comparisons) else 0
    run, idle, absent = comparisons_run(ctx, comparisons)
    for r in run:
        paper = ctx.paper.comparison(r["label"]) if ctx.paper is not None else None
        paper_cell: Cell = NA
        if paper is not None:
            paper_cell = Cell("stat", paper["mean"], paper.get("sd", math.nan), signed=True)
        rows.append([text_cell(r["label"]), *comparison_cells(r), paper_cell,
                     text_cell(r["note"])])
    table = Table(
        "tab:paired-comparisons",
        f"Every paired comparison of the family (A - B, paired by seed). Holm p adjusts over the "
        f"{m} comparisons with a defined p. Blank = not defined (see note).",
        ["Comparison", "n", "Mean diff ± SD", "95% CI", "t", "p", "Holm p", "d_z", "Paper",
         "Note"],
        rows,
        notes=[*idle, "With n = 5 seeds the intervals and tests are descriptive (paper "
               "Sections 6.3 and 9)."],
        align=["l"] + ["r"] * 8 + ["l"],
        asides={8, 9},
        absent=absent,
    )
    return table


def family_comparison_table(ctx: Context, comparisons: pd.DataFrame, table_id: str,
                             caption: Callable[[int], str],
                             label: Callable[[Mapping[str, Any]], str]) -> Table:
    """A family of paired comparisons with its own Holm adjustment (operators, segments):
    one row per comparison, `label(row)` naming it; `caption(m)` gets the Holm family size."""
    miss = Missing(ctx)
    m = int(comparisons["holm_m"].iloc[0]) if len(comparisons) else 0
    rows = []
    run, idle, absent = comparisons_run(ctx, comparisons, label)
    for r in run:
        miss.check(r["cond_a"], r["metric_a"])
        miss.check(r["cond_b"], r["metric_b"])
        rows.append([text_cell(label(r)), *comparison_cells(r), text_cell(r["note"])])
    table = Table(
        table_id, caption(m),
        ["Comparison", "n", "Mean diff ± SD", "95% CI", "t", "p", "Holm p", "d_z", "Note"],
        rows,
        notes=[*idle, "With few seeds the intervals and tests are descriptive (paper "
               "Sections 6.3 and 9)."],
        align=["l"] + ["r"] * 7 + ["l"],
        asides={8},
        absent=absent,
    )
    table.missing = miss.lines()
    return table


def paper_tables(ctx: Context, comparisons: pd.DataFrame) -> list[Table]:
    """The paper's tables (and the shortcut diagnostics) over ``ctx``'s trials, headline and
    claims first, every paired comparison of the family (``comparisons``) last."""
    return [
        table_headline(ctx),
        table_claims(ctx),
        table_same_address_update(ctx),
        table_direct_ltm_routing(ctx),
        table_routing_per_seed(ctx),
        table_routing_rule_family(ctx),
        table_core_parameter_isolation(ctx),
        table_core_results_per_seed(ctx),
        table_dual_objective_aggregate(ctx),
        table_dual_objective_per_seed(ctx),
        table_shortcut_diagnostics(ctx),
        table_paired_comparisons(ctx, comparisons),
    ]

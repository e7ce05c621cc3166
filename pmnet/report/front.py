"""What a person reads first (issue 64): one figure of our updated-mapping recall beside the
paper's and the output-set baseline (:func:`figure_recall`), then a verdict in three
sentences (:func:`verdict`), both from what the report's tables already read: the trials of
the headline (every Phase-1 checkpoint's when there are several), the paper's numbers, the
claims table and Phase 1's rule families."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pmnet import stats
from pmnet.report.figures import FigureResult
from pmnet.report.paper_tables import BELOW_BASELINE_VERDICT, ON
from pmnet.report.table import Table
from pmnet.report.trials import Trials
from pmnet.stats import condition_label

FIGURE_ID = "fig-recall"
#: the figure's panels: updated-mapping recall over both rule families, then on each
PANELS: tuple[tuple[str, str], ...] = (
    ("updated_ltm", "both rule families"),
    *((f"updated_ltm_{fam}", name) for fam, name in stats.RULE_FAMILIES.items()),
)
CHANCE = 10.0  # %: one of ten outputs


@dataclass(frozen=True)
class Arm:
    """One condition's recall on one panel: mean (and SD) over its trials, the mean output-set
    baseline of the trials that have both (None: not recorded) and the paper's mean."""

    condition: str
    metric: str
    mean: float
    sd: float
    n: int
    baseline: float | None
    paper: float | None


def front_frame(trials: Trials) -> pd.DataFrame:
    """The trials the headline reads: every Phase-1 checkpoint's (default variant) when there
    are several, else the paper's scoped trials."""
    return trials.checkpoints.every if trials.checkpoints is not None else trials.base


def arms(df: pd.DataFrame, paper: stats.PaperReference | None, metric: str) -> list[Arm]:
    """Every condition of ``df`` with a value of ``metric``, in the report's order."""
    if df.empty or metric not in df.columns:
        return []
    out = []
    for c in stats.ordered_conditions(df["condition"]):
        values = pd.to_numeric(df.loc[df["condition"] == c, metric], errors="coerce").dropna()
        if values.empty:
            continue
        gate = stats.arm_capability(df, c, metric)
        ref = paper.condition(c, metric) if paper is not None else None
        out.append(Arm(c, metric, float(values.mean()),
                       float(values.std(ddof=1)) if values.size > 1 else math.nan,
                       int(values.size), gate.baseline if gate is not None else None,
                       float(ref["mean"]) if ref is not None else None))
    return out


def _scope(trials: Trials) -> str:
    if trials.checkpoints is not None:
        return (f"over every trial of the {trials.checkpoints.k} Phase-1 checkpoints (as the "
                "headline)")
    return "over every trial of the report's Phase-1 checkpoint"


def figure_recall(trials: Trials) -> FigureResult:
    """Horizontal bars, one group per condition: our mean updated-mapping LTM recall (± SD
    over trials), the paper's where it prints one, and a tick at the output-set baseline of
    the same trials' episodes; one panel over both rule families and one per family that the
    trials report."""
    title = "Updated-mapping LTM recall: ours, the paper's, the output-set baseline"
    df = front_frame(trials)
    caption = (
        "Each condition's updated-mapping LTM recall, " + _scope(trials) + ": blue, ours "
        "(mean, whisker ± SD over trials); grey, the paper's where it prints one; black tick, "
        "the output-set baseline of the same trials' test episodes (the recall of a guess "
        "among the outputs the episode did not show; at or under it an arm does not use the "
        f"rule); dotted, chance ({CHANCE:g}%). Panels: both rule families, then each family "
        "the trials report.")
    panels = [(name, found) for metric, name in PANELS
              if (found := arms(df, trials.paper, metric))]
    if not panels:
        return FigureResult(FIGURE_ID, title, caption,
                            skipped="no trial reports updated-mapping LTM recall")
    conditions = list(dict.fromkeys(a.condition for _, found in panels for a in found))
    n = len(conditions)
    fig = Figure(figsize=(10.9, 1.5 + 0.42 * n), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False).ravel()
    y = {c: i for i, c in enumerate(conditions)}
    for ax, (name, found) in zip(axes, panels):
        for a in found:
            i = y[a.condition]
            ax.barh(i - 0.2, a.mean, height=0.38, color="#4878a8",
                    xerr=a.sd if math.isfinite(a.sd) else None,
                    error_kw={"elinewidth": 0.8, "capsize": 2}, label="ours")
            end = a.mean + (a.sd if math.isfinite(a.sd) else 0.0)
            ax.text(min(end, 100.0) + 1.5, i - 0.2, f"{a.mean:.1f}", va="center", fontsize=7)
            if a.paper is not None:
                ax.barh(i + 0.2, a.paper, height=0.38, color="#bbbbbb", label="paper")
                ax.text(min(a.paper, 100.0) + 1.5, i + 0.2, f"{a.paper:.1f}", va="center",
                        fontsize=7, color="#555555")
            if a.baseline is not None:
                ax.plot([a.baseline, a.baseline], [i - 0.45, i + 0.45], color="black", lw=2,
                        solid_capstyle="butt", label="output-set baseline")
        ax.axvline(CHANCE, color="gray", ls=":", lw=1, label=f"chance ({CHANCE:g}%)")
        ax.set_xlim(0, 112)
        ax.set_xticks([0, 20, 40, 60, 80, 100])
        ax.set_xlabel("recall (%)")
        ax.set_title(name, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(np.arange(n), [condition_label(c) for c in conditions], fontsize=8)
    axes[0].invert_yaxis()
    handles: dict[str, object] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    order = [k for k in ("ours", "paper", "output-set baseline") if k in handles]
    order += [k for k in handles if k not in order]
    fig.legend([handles[k] for k in order], order, loc="outside lower center",
               ncol=len(order), fontsize=8, frameon=False)
    return FigureResult(FIGURE_ID, title, caption, figure=fig)


# the verdict -------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{x:.1f}%"


def _capability_sentence(trials: Trials) -> str:
    df = front_frame(trials)
    found = arms(df, trials.paper, "updated_ltm")
    if not found:
        return ("No trial here reports updated-mapping LTM recall, so this report cannot say "
                "whether the Consolidator turns STM into LTM.")
    arm = next((a for a in found if a.condition == ON), None) or max(found,
                                                                       key=lambda a: a.mean)
    trials_word = f"{arm.n} trial{'s' if arm.n != 1 else ''}"
    if trials.checkpoints is not None:
        trials_word += f" on {trials.checkpoints.k} Phase-1 checkpoints"
    text = (f"{condition_label(arm.condition)}, the paper's capability arm," if arm.condition == ON
            else f"{condition_label(arm.condition)}, the best arm here (Consolidator only "
                 "did not run),")
    text += f" recalls {_pct(arm.mean)} of updated mappings over {trials_word}"
    text += (f" against the paper's {arm.paper:.2f}%" if arm.paper is not None else "")
    if arm.baseline is not None:
        margin = arm.mean - arm.baseline
        text += (f", {abs(margin):.1f} pp {'above' if margin > 0 else 'below'} the "
                 f"{_pct(arm.baseline)} a rule-free guess among the unshown outputs gets")
    families = []
    for metric, name in PANELS[1:]:
        fam = next((a for a in arms(df, trials.paper, metric)
                    if a.condition == arm.condition), None)
        if fam is not None:
            families.append(f"{name} {_pct(fam.mean)}" + (
                f" vs {_pct(fam.baseline)}" if fam.baseline is not None else ""))
    if families:
        text += f" ({', '.join(families)})"
    return text + "."


def _claims_sentence(tables: Sequence[Table]) -> str:
    claims = next((t for t in tables if t.id == "tab:claims"), None)
    verdicts = []
    if claims is not None:
        col = claims.columns.index("Verdict")
        verdicts = [row[col].text for row in claims.rows]
    counts = {"reproduce": 0, "do not": 0, "baseline": 0, "family": 0, "untested": 0}
    for v in verdicts:
        if v.startswith("reproduces"):
            counts["reproduce"] += 1
        elif v.startswith("does not reproduce"):
            counts["do not"] += 1
        elif v == BELOW_BASELINE_VERDICT:
            counts["baseline"] += 1
        elif v.startswith("no verdict"):
            counts["family"] += 1
        elif v.startswith("not tested"):
            counts["untested"] += 1
    total = sum(counts.values())
    if not total:
        return "No claim of the paper is tested here: tab:claims has no row of ours."
    parts = []
    if counts["reproduce"]:
        parts.append(f"{counts['reproduce']} reproduce{'s' if counts['reproduce'] == 1 else ''}")
    if counts["do not"]:
        parts.append(f"{counts['do not']} do{'es' if counts['do not'] == 1 else ''} not")
    none = counts["baseline"] + counts["family"]
    below = "both arms recall at or below the output-set baseline"
    unlearned = "they read a rule family Phase 1 did not learn"
    if none:
        gets = f"{none} get{'s' if none == 1 else ''} no verdict"
        if counts["baseline"] and counts["family"]:
            parts.append(f"{gets} ({counts['baseline']} because {below}, "
                         f"{counts['family']} because {unlearned})")
        else:
            parts.append(f"{gets} because {below if counts['baseline'] else unlearned}")
    if counts["untested"]:
        parts.append(f"{counts['untested']} cannot be tested here")
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"Of the {total} claims in tab:claims, {listed}."


def _families_sentence(trials: Trials) -> str:
    families = stats.phase1_families(front_frame(trials))
    if families:
        def stm(f: stats.FamilyLearning) -> str:
            return f"STM {_pct(f.stm)} against its {_pct(f.baseline)} output-set baseline"

        learned = [f for f in families.values() if f.learned]
        unlearned = [f for f in families.values() if not f.learned]
        known = " and ".join(f"{f.name} ({stm(f)})" for f in learned)
        if not unlearned:
            return f"Phase 1 learned every rule family: {known}."
        missed = " and ".join(f"{f.name} ({stm(f)}) is {f.status()}" for f in unlearned)
        head = f"Phase 1 learned {known}, but {missed}" if learned else (
            f"Phase 1 learned no rule family: {missed}")
        return head + ", so no claim is read off a family it did not learn."
    found = [a for a in arms(front_frame(trials), trials.paper, "updated_ltm")
             if a.baseline is not None]
    if found:
        above = [a for a in found if a.mean > a.baseline]
        return (f"{len(above)} of the {len(found)} arms in the figure recall above their "
                "output-set baseline; the trials record no Phase-1 recall per rule family.")
    return ("The trials record neither an output-set baseline nor Phase-1 recall per rule "
            "family, so no recall here is checked against the rule-free guess.")


def verdict(trials: Trials, tables: Sequence[Table]) -> list[str]:
    """Three sentences: the capability arm's recall against the paper's and the output-set
    baseline; how many of the claims table's claims reproduce, do not, or get no verdict; and
    which rule families Phase 1 learned (or, without them, how many arms beat their
    baseline)."""
    return [_capability_sentence(trials), _claims_sentence(tables), _families_sentence(trials)]


def front_matter(trials: Trials, tables: Sequence[Table]
                 ) -> tuple[FigureResult, list[str]]:
    """The figure and the verdict a report opens with."""
    return figure_recall(trials), verdict(trials, tables)

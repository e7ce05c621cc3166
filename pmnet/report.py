"""Tables, figures and the HTML/Markdown report built from Phase-2 trial results.

Tables follow the paper's layout (same rows, columns and labels, e.g.
``tab:direct-ltm-routing``); each aggregate cell is "mean ± SD" from our trials, followed in
parentheses by the paper's value where the paper has one (printed in paper-aggregates.csv, or
derived from paper-per-seed.csv with the same statistics). A missing trial or metric renders
as "—" and the table's footnote names it; a cell over fewer seeds than expected carries
"[n=k]".

Figures use matplotlib's object-oriented API on the Agg canvas (no pyplot, no display), and
a figure whose data is missing is skipped with a note instead of failing.

:func:`build_report` writes one self-contained HTML page (inline CSS, figures as base64 PNG)
and a Markdown twin (figures linked as files) plus the tables (.md/.tex), the figures
(.png/.pdf) and the tidy data (.csv/.parquet); :func:`main_report` does it for a pipeline run
directory (``RUN_DIR/results/*.json`` -> ``RUN_DIR/report/``).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pmnet import stats
from pmnet.io import atomic_write_bytes, atomic_write_text
from pmnet.stats import CONDITIONS, condition_label
from pmnet.trial_id import TrialId, grid_size

MISSING = "—"
TARGETS = ("md", "tex", "html")
CHANCE = 10.0  # recall of a uniform guess among the 10 digits (pmnet.evaluate.CHANCE)

# ------------------------------------------------------------------------------------------
# cells
# ------------------------------------------------------------------------------------------


def _finite(value: Any) -> bool:
    if value is None:
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Cell:
    """One table cell. ``kind``: stat (mean ± SD), num, int, p, ci, text, na, missing.

    ``paper`` is the paper's value for the same cell (shown in parentheses) or None.
    """

    kind: str
    value: float = math.nan
    sd: float = math.nan
    hi: float = math.nan
    n: int | None = None
    n_expected: int | None = None
    signed: bool = False
    paper: Cell | None = None
    text: str = ""

    @property
    def is_missing(self) -> bool:
        if self.kind == "missing":
            return True
        if self.kind in ("stat", "num", "int", "p"):
            return not _finite(self.value) or (self.kind == "stat" and self.n == 0)
        if self.kind == "ci":
            return not (_finite(self.value) and _finite(self.hi))
        return False


def text_cell(text: str) -> Cell:
    return Cell("text", text=str(text))


NA = Cell("na")


def _number(value: float, signed: bool = False, decimals: int = 2) -> str:
    value = float(value)
    if round(value, decimals) == 0:
        value = 0.0  # never print "-0.00"
    return f"{value:+.{decimals}f}" if signed else f"{value:.{decimals}f}"


def format_p(p: float, target: str = "md") -> str:
    """p to 3 significant digits; below 0.001 in scientific notation (1.07e-7 / ×10^); a p
    that underflowed to 0 as "< 1e-300"."""
    if not _finite(p):
        return MISSING if target != "tex" else "---"
    if p == 0:
        return {"tex": r"\(<10^{-300}\)", "html": "&lt; 10<sup>-300</sup>"}.get(target, "< 1e-300")
    if p >= 1e-3:
        return f"{p:.3g}"
    mantissa, exponent = f"{p:.2e}".split("e")
    exp = int(exponent)
    if target == "tex":
        return rf"\({mantissa}\times10^{{{exp}}}\)"
    if target == "html":
        return f"{mantissa}×10<sup>{exp}</sup>"
    return f"{mantissa}e{exp}"


_TEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"\(\pm\)",
    "—": "---",
    "–": "--",
    "−": "-",
    "→": r"\(\rightarrow\)",
    "×": r"\(\times\)",
}


def tex_escape(text: str) -> str:
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in str(text))


def _escape(text: str, target: str) -> str:
    if target == "tex":
        return tex_escape(text)
    if target == "html":
        return html.escape(str(text))
    return str(text).replace("|", "\\|").replace("\n", " ")


def _core(cell: Cell, target: str) -> str:
    missing = "---" if target == "tex" else MISSING
    pm = r" \(\pm\) " if target == "tex" else " ± "
    if cell.kind == "na":
        return ""
    if cell.kind == "text":
        return _escape(cell.text, target)
    if cell.is_missing:
        return missing
    if cell.kind == "int":
        return str(int(round(float(cell.value))))
    if cell.kind == "num":
        return _number(cell.value, cell.signed)
    if cell.kind == "p":
        return format_p(cell.value, target)
    if cell.kind == "ci":
        lo, hi = _number(cell.value, True), _number(cell.hi, True)
        return f"{{[}}{lo}, {hi}{{]}}" if target == "tex" else f"[{lo}, {hi}]"
    if cell.kind == "stat":
        out = _number(cell.value, cell.signed)
        if _finite(cell.sd):
            out += pm + _number(cell.sd)
        if cell.n is not None and cell.n_expected is not None and cell.n < cell.n_expected:
            out += f" [n={cell.n}]"
        return out
    raise ValueError(f"unknown cell kind {cell.kind!r}")


def format_cell(cell: Cell | str, target: str = "md") -> str:
    """A cell as Markdown (``md``), LaTeX (``tex``) or HTML (``html``) markup."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(cell, Cell):
        cell = text_cell(cell)
    out = _core(cell, target)
    if cell.paper is not None and not cell.paper.is_missing:
        paper = _core(cell.paper, target)
        if target == "html":
            out += f' <span class="paper">({paper})</span>'
        else:
            out += f" ({paper})"
    return out


# ------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------


@dataclass
class Table:
    """A rendered-on-demand table: ``id`` is the paper's label (``tab:...``)."""

    id: str
    caption: str
    columns: list[str]
    rows: list[list[Cell]]
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    rules_before: set[int] = field(default_factory=set)
    #: LaTeX column specs (``l``, ``r``, ``p{4cm}``); Markdown alignment follows them.
    align: list[str] | None = None

    def __post_init__(self) -> None:
        self.rows = [[c if isinstance(c, Cell) else text_cell(c) for c in row] for row in self.rows]
        if self.align is None:
            self.align = ["l"] + ["r"] * (len(self.columns) - 1)
        if len(self.align) != len(self.columns):
            raise ValueError(f"table {self.id}: {len(self.align)} alignments for "
                             f"{len(self.columns)} columns")
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.id}: row has {len(row)} cells for {len(self.columns)} columns"
                )

    def footnotes(self) -> list[str]:
        out = list(self.notes)
        if self.missing:
            out.append(f"{MISSING} = missing. " + "; ".join(self.missing) + ".")
        return out

    def to_markdown(self) -> str:
        lines = [f"**Table `{self.id}`.** {_escape(self.caption, 'md')}", ""]
        lines.append("| " + " | ".join(_escape(c, "md") for c in self.columns) + " |")
        aligns = [{"r": "---:", "c": ":---:"}.get(a[0], ":---") for a in self.align or []]
        lines.append("| " + " | ".join(aligns) + " |")
        for row in self.rows:
            lines.append("| " + " | ".join(format_cell(c, "md") for c in row) + " |")
        notes = self.footnotes()
        if notes:
            lines.append("")
            lines += [f"- {_escape(n, 'md')}" for n in notes]
        return "\n".join(lines) + "\n"

    def to_latex(self) -> str:
        spec = "@{}" + "".join(self.align or []) + "@{}"
        lines = [
            r"\begin{table}[htbp]",
            r"\centering",
            rf"\caption{{{tex_escape(self.caption)}}}",
            rf"\label{{{self.id}}}",
            r"\scriptsize",
            rf"\begin{{tabular}}{{{spec}}}",
            r"\toprule",
            " & ".join(tex_escape(c) for c in self.columns) + r" \\",
            r"\midrule",
        ]
        for i, row in enumerate(self.rows):
            if i in self.rules_before:
                lines.append(r"\midrule")
            lines.append(" & ".join(format_cell(c, "tex") for c in row) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}"]
        for note in self.footnotes():
            lines.append(r"\par\smallskip{\footnotesize " + tex_escape(note) + "}")
        lines.append(r"\end{table}")
        return "\n".join(lines) + "\n"

    def to_html(self) -> str:
        out = [f'<table id="{html.escape(self.id)}">']
        out.append(
            f"<caption><code>{html.escape(self.id)}</code> {html.escape(self.caption)}</caption>"
        )
        out.append(
            "<thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
            + "</tr></thead>"
        )
        out.append("<tbody>")
        for i, row in enumerate(self.rows):
            cls = ' class="rule"' if i in self.rules_before else ""
            cells = []
            for j, cell in enumerate(row):
                tag = "th" if j == 0 else "td"
                miss = ' class="missing"' if cell.is_missing and cell.kind != "na" else ""
                cells.append(f"<{tag}{miss}>{format_cell(cell, 'html')}</{tag}>")
            out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
        out.append("</tbody></table>")
        for note in self.footnotes():
            out.append(f'<p class="note">{html.escape(note)}</p>')
        return "\n".join(out) + "\n"

    def render(self, target: str) -> str:
        return {"md": self.to_markdown, "tex": self.to_latex, "html": self.to_html}[target]()


class _Missing:
    """Collects the missing trials/metrics behind one table's cells."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        self.trials: dict[str, set[int]] = {}
        self.metrics: dict[tuple[str, str], set[int]] = {}

    def check(self, condition: str, metric: str, seeds: Iterable[int] | None = None) -> None:
        seeds = self.ctx.seeds if seeds is None else list(seeds)
        values = self.ctx.values(condition, metric)
        for seed in seeds:
            if (condition, seed) not in self.ctx.present:
                self.trials.setdefault(condition, set()).add(seed)
            elif seed not in values.index:
                self.metrics.setdefault((condition, metric), set()).add(seed)

    def lines(self) -> list[str]:
        out = []
        for condition in stats.ordered_conditions(self.trials):
            seeds = sorted(self.trials[condition])
            out.append(f"{condition}: no result for {stats._seed_word(seeds)}")
        conditions = stats.ordered_conditions(c for c, _ in self.metrics)
        for condition in conditions:
            ran = sorted(s for c, s in self.ctx.present if c == condition)
            metrics = sorted(m for c, m in self.metrics if c == condition)
            everywhere = [m for m in metrics if sorted(self.metrics[(condition, m)]) == ran]
            if everywhere:
                out.append(f"{condition}: {', '.join(everywhere)} not reported by any trial")
            for metric in metrics:
                if metric not in everywhere:
                    seeds = sorted(self.metrics[(condition, metric)])
                    out.append(f"{condition}: {metric} not reported for {stats._seed_word(seeds)}")
        return out


class _Context:
    def __init__(
        self,
        df: pd.DataFrame,
        paper: stats.PaperReference | None,
        comparisons: pd.DataFrame,
        seeds: Sequence[int],
    ) -> None:
        self.df = df
        self.paper = paper
        self.seeds = list(seeds)
        self.present = (
            set(zip(df["condition"], df["seed"].astype(int))) if not df.empty else set()
        )
        self.comparisons = {r["label"]: r for r in comparisons.to_dict("records")}
        self._values: dict[tuple[str, str], pd.Series] = {}

    def values(self, condition: str, metric: str) -> pd.Series:
        """Cached :func:`stats.seed_values`."""
        key = (condition, metric)
        if key not in self._values:
            self._values[key] = stats.seed_values(self.df, condition, metric)
        return self._values[key]

    # paper cells --------------------------------------------------------------------------
    def paper_stat(self, condition: str, metric: str) -> Cell | None:
        if self.paper is None:
            return None
        ref = self.paper.condition(condition, metric)
        if ref is None:
            return None
        return Cell("stat", ref["mean"], ref.get("sd", math.nan))

    def paper_cmp(self, label: str, part: str = "stat") -> Cell | None:
        ref = self.paper.comparison(label) if self.paper is not None else None
        if ref is None:
            return None
        if part == "ci":
            return Cell("ci", ref.get("ci_low", math.nan), hi=ref.get("ci_high", math.nan))
        if part == "p":
            return Cell("p", ref.get("p", math.nan))
        if part == "mean":
            return Cell("num", ref["mean"], signed=True)
        if part == "sd":
            return Cell("num", ref.get("sd", math.nan))
        return Cell("stat", ref["mean"], ref.get("sd", math.nan), signed=True)

    def paper_seed(self, condition: str, seed: int, metric: str) -> float | None:
        if self.paper is None:
            return None
        return self.paper.seed_value(condition, seed, metric)

    # our cells ----------------------------------------------------------------------------
    def stat(self, miss: _Missing, condition: str, metric: str, paper: bool = True) -> Cell:
        miss.check(condition, metric)
        values = self.values(condition, metric)
        n = int(values.size)
        return Cell(
            "stat",
            float(values.mean()) if n else math.nan,
            float(values.std(ddof=1)) if n > 1 else math.nan,
            n=n,
            n_expected=len(self.seeds),
            paper=self.paper_stat(condition, metric) if paper else None,
        )

    def stat_part(self, miss: _Missing, condition: str, metric: str, part: str) -> Cell:
        cell = self.stat(miss, condition, metric)
        paper = cell.paper
        if part == "mean":
            return Cell("num", cell.value, paper=Cell("num", paper.value) if paper else None)
        return Cell("num", cell.sd, paper=Cell("num", paper.sd) if paper else None)

    def seed(self, miss: _Missing, condition: str, seed: int, metric: str, kind="num") -> Cell:
        miss.check(condition, metric, [seed])
        values = self.values(condition, metric)
        value = float(values.loc[seed]) if seed in values.index else math.nan
        pv = self.paper_seed(condition, seed, metric)
        return Cell(kind, value, paper=Cell(kind, pv) if pv is not None else None)

    def seed_diff(
        self, miss: _Missing, a: tuple[str, str], b: tuple[str, str], seed: int
    ) -> Cell:
        miss.check(*a, [seed])
        miss.check(*b, [seed])
        va, vb = self.values(*a), self.values(*b)
        value = math.nan
        if seed in va.index and seed in vb.index:
            value = float(va.loc[seed] - vb.loc[seed])
        paper = None
        pa, pb = self.paper_seed(a[0], seed, a[1]), self.paper_seed(b[0], seed, b[1])
        if pa is not None and pb is not None:
            paper = Cell("num", pa - pb, signed=True)
        return Cell("num", value, signed=True, paper=paper)

    def comparison(self, label: str, spec: stats.Comparison | None = None) -> dict[str, Any]:
        row = self.comparisons.get(label)
        if row is None:
            spec = spec or next((c for c in stats.COMPARISONS if c.label == label), None)
            if spec is None:
                raise KeyError(f"unknown comparison {label!r}")
            row = stats.paired_comparison(
                self.df, spec.cond_a, spec.metric_a, spec.cond_b, spec.metric_b, label,
                expected_seeds=self.seeds,
            )
            self.comparisons[label] = row
        return row

    def paired(
        self,
        miss: _Missing,
        label: str,
        part: str = "stat",
        spec: stats.Comparison | None = None,
        paper: bool = True,
    ) -> Cell:
        row = self.comparison(label, spec)
        miss.check(row["cond_a"], row["metric_a"])
        miss.check(row["cond_b"], row["metric_b"])
        paper = self.paper_cmp(label, part) if paper else None
        if part == "ci":
            return Cell("ci", row["ci_low"], hi=row["ci_high"], paper=paper)
        if part == "p":
            return Cell("p", row["p"], paper=paper)
        if part == "mean":
            return Cell("num", row["mean_diff"], signed=True, paper=paper)
        if part == "sd":
            return Cell("num", row["sd_diff"], paper=paper)
        return Cell(
            "stat",
            row["mean_diff"],
            row["sd_diff"] if row["n"] > 1 else math.nan,
            n=row["n"],
            n_expected=len(self.seeds),
            signed=True,
            paper=paper,
        )

    def paired_sentence(self, label: str, what: str) -> str:
        """A note line: our paired result with CI and p, and the paper's where known."""
        row = self.comparison(label)
        if row["n"] == 0:
            return f"{what}: not computable ({row['note']})."
        text = f"{what}: {_number(row['mean_diff'], True)}"
        if _finite(row["sd_diff"]):
            text += f" ± {_number(row['sd_diff'])} pp"
        if _finite(row["ci_low"]):
            text += (
                f", 95% CI [{_number(row['ci_low'], True)}, {_number(row['ci_high'], True)}], "
                f"p = {format_p(row['p'])}"
            )
        text += f" (n={row['n']})"
        ref = self.paper.comparison(label) if self.paper is not None else None
        if ref is not None:
            text += f"; paper {_number(ref['mean'], True)}"
            if _finite(ref.get("sd")):
                text += f" ± {_number(ref['sd'])}"
            if _finite(ref.get("ci_low")):
                text += f", CI [{_number(ref['ci_low'], True)}, {_number(ref['ci_high'], True)}]"
            if _finite(ref.get("p")):
                text += f", p = {format_p(ref['p'])}"
        if row["note"]:
            text += f". Note: {row['note']}"
        return text + "."


PAPER_NOTE = (
    "Values in parentheses are the paper's (printed in paper-aggregates.csv, or derived from "
    "paper-per-seed.csv with the same statistics); [n=k] marks cells over fewer seeds than "
    "expected."
)


def _finish(ctx: _Context, table: Table, miss: _Missing) -> Table:
    if ctx.paper is not None:
        table.notes.append(PAPER_NOTE)
    table.missing = miss.lines()
    return table


ON, OFF = "consolidator_only", "consolidator_only_routing_off"


def table_same_address_update(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


def table_direct_ltm_routing(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


def table_routing_per_seed(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


def table_routing_rule_family(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


CORE_CONDITIONS = ("learned_full", "identity_full", "consolidator_only", "memory_consolidator")


def table_core_parameter_isolation(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


def table_core_results_per_seed(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    )
    return _finish(ctx, table, miss)


DUAL_METRICS = ("updated_ltm", "mean_stm", "seg2_stm", "mismatched_ltm", "fresh_ltm")


def table_dual_objective_aggregate(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


def table_dual_objective_per_seed(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


def table_shortcut_diagnostics(ctx: _Context) -> Table:
    miss = _Missing(ctx)
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
    return _finish(ctx, table, miss)


def has_last_epoch(df: pd.DataFrame) -> bool:
    """Whether the results recorded the last epoch's test metrics (issue 21)."""
    return f"{stats.LAST_PREFIX}updated_ltm" in df.columns


def table_selected_vs_last(ctx: _Context) -> Table:
    """The validation-selected epoch's test recall beside the last epoch's, per condition
    (ours, issue 21): a selection that often picks an early epoch shows here."""
    miss = _Missing(ctx)
    conditions = stats.ordered_conditions(ctx.df["condition"]) if not ctx.df.empty else []
    rows = []
    for c in conditions:
        epochs = ctx.df.loc[ctx.df["condition"] == c, "best_epoch"].dropna()
        last = ctx.df.loc[ctx.df["condition"] == c, "last_epoch"].dropna()
        row = [condition_label(c),
               text_cell(" ".join(str(int(e)) for e in epochs) if len(epochs) else MISSING),
               text_cell(str(int(last.max())) if len(last) else MISSING)]
        for metric in ("updated_ltm", "forced_identity"):
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
    return _finish(ctx, table, miss)


def _comparison_cells(r: Mapping[str, Any]) -> list[Cell]:
    """n, mean diff ± SD, CI, t, p, Holm p and d_z of one row of :func:`stats.compare_all`."""
    return [
        Cell("int", r["n"]),
        Cell("stat", r["mean_diff"], r["sd_diff"], signed=True) if r["n"] > 0
        else Cell("missing"),
        Cell("ci", r["ci_low"], hi=r["ci_high"]) if _finite(r["ci_low"]) else NA,
        Cell("num", r["t"]) if _finite(r["t"]) else NA,
        Cell("p", r["p"]) if _finite(r["p"]) else NA,
        Cell("p", r["p_holm"]) if _finite(r["p_holm"]) else NA,
        Cell("num", r["d_z"]) if _finite(r["d_z"]) else NA,
    ]


def table_paired_comparisons(ctx: _Context, comparisons: pd.DataFrame) -> Table:
    rows = []
    m = int(comparisons["holm_m"].iloc[0]) if len(comparisons) else 0
    for r in comparisons.to_dict("records"):
        paper = ctx.paper.comparison(r["label"]) if ctx.paper is not None else None
        paper_cell: Cell = NA
        if paper is not None:
            paper_cell = Cell("stat", paper["mean"], paper.get("sd", math.nan), signed=True)
        rows.append([text_cell(r["label"]), *_comparison_cells(r), paper_cell,
                     text_cell(r["note"])])
    return Table(
        "tab:paired-comparisons",
        f"Every paired comparison of the family (A - B, paired by seed). Holm p adjusts over the "
        f"{m} comparisons with a defined p. Blank = not defined (see note).",
        ["Comparison", "n", "Mean diff ± SD", "95% CI", "t", "p", "Holm p", "d_z", "Paper",
         "Note"],
        rows,
        notes=["With n = 5 seeds the intervals and tests are descriptive (paper Sections 6.3 and "
               "9)."],
        align=["l"] + ["r"] * 8 + ["p{6cm}"],
    )


#: Metrics of the operators table (beyond the paper), in column order.
OPERATOR_METRICS = ("updated_ltm", "forced_identity", "initial_ltm", "fresh_ltm",
                    "mismatched_ltm")


def table_operators(ctx: _Context) -> Table:
    """Beyond the paper: the Consolidator (``consolidator_only``) and each alternative
    consolidation operator, each trained alone from the same Phase-1 checkpoint."""
    miss = _Missing(ctx)
    rows = []
    for c in (stats.OPERATOR_REFERENCE, *stats.OPERATOR_CONDITIONS):
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
    )
    return _finish(ctx, table, miss)


def _family_comparison_table(ctx: _Context, comparisons: pd.DataFrame, table_id: str,
                             caption: Callable[[int], str],
                             label: Callable[[Mapping[str, Any]], str]) -> Table:
    """A family of paired comparisons with its own Holm adjustment (operators, segments):
    one row per comparison, `label(row)` naming it; `caption(m)` gets the Holm family size."""
    miss = _Missing(ctx)
    m = int(comparisons["holm_m"].iloc[0]) if len(comparisons) else 0
    rows = []
    for r in comparisons.to_dict("records"):
        miss.check(r["cond_a"], r["metric_a"])
        miss.check(r["cond_b"], r["metric_b"])
        rows.append([text_cell(label(r)), *_comparison_cells(r), text_cell(r["note"])])
    table = Table(
        table_id, caption(m),
        ["Comparison", "n", "Mean diff ± SD", "95% CI", "t", "p", "Holm p", "d_z", "Note"],
        rows,
        notes=["With few seeds the intervals and tests are descriptive (paper Sections 6.3 "
               "and 9)."],
        align=["l"] + ["r"] * 7 + ["p{6cm}"],
    )
    table.missing = miss.lines()
    return table


def table_operator_comparisons(ctx: _Context, comparisons: pd.DataFrame) -> Table:
    """Each operator minus the Consolidator on updated-mapping LTM recall, paired by seed."""
    return _family_comparison_table(
        ctx, comparisons, "tab:operator-comparisons",
        lambda m: ("Each consolidation operator minus the Consolidator (consolidator_only) on "
                   "updated-mapping LTM recall, paired by seed (pp). Holm p adjusts over the "
                   f"{m} operator comparisons with a defined p (a family of its own). "
                   "Blank = not defined (see note)."),
        lambda r: f"{condition_label(r['cond_a'])} - Consolidator")


#: the segments table's per-position recall columns (header, position: 1 = the first
#: segment, -1 = the second-to-last), from ``final_ltm_seg{t}``
SEGMENT_POSITIONS: tuple[tuple[str, int], ...] = (("Segment 1", 1), ("Segment T−1", -1))


def _position_cell(ctx: _Context, miss: _Missing, arm: stats.SegmentArm, position: int
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


def table_segments(ctx: _Context, arms: Sequence[stats.SegmentArm]) -> Table:
    """Beyond the paper (issue 11): recall after the last consolidation against the episode
    length T, for each gradient mode across boundaries. ``ctx`` holds the arm frame
    (:func:`stats.by_arm`)."""
    miss = _Missing(ctx)
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
    )
    table.missing = miss.lines()
    return table


def table_segment_comparisons(ctx: _Context, comparisons: pd.DataFrame) -> Table:
    """Full graph minus truncated BPTT at each T on updated-mapping recall, paired by seed."""
    return _family_comparison_table(
        ctx, comparisons, "tab:segment-comparisons",
        lambda m: ("Full graph minus truncated BPTT on updated-mapping LTM recall at each T, "
                   f"paired by seed (pp). Holm p adjusts over the {m} values of T with a "
                   "defined p (a family of its own). Blank = not defined (see note)."),
        lambda r: r["label"].rsplit(": ", 1)[0])


def table_segment_identity(ctx: _Context, comparisons: pd.DataFrame) -> Table:
    """Learned consolidation minus forced identity at each T and gradient mode, paired by
    seed: does the trained operator still beat leaving LTM as the first boundary wrote it."""
    return _family_comparison_table(
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
    ctx = _Context(stats.by_arm(df), None, comparisons, seeds)
    tables = [table_segments(ctx, arms)]
    if len(comparisons):
        tables.append(table_segment_comparisons(ctx, comparisons))
    if len(identity):
        tables.append(table_segment_identity(ctx, identity))
    return tables


def table_headline(ctx: _Context) -> Table:
    miss = _Missing(ctx)

    def cond_row(text: str, condition: str, metric: str) -> list[Cell]:
        cell = ctx.stat(miss, condition, metric, paper=False)
        return [text_cell(text), cell, NA, NA, ctx.paper_stat(condition, metric) or NA]

    def cmp_row(text: str, label: str) -> list[Cell]:
        paper = ctx.paper_cmp(label) or NA
        return [
            text_cell(text),
            ctx.paired(miss, label, "stat", paper=False),
            Cell("ci", ctx.comparison(label)["ci_low"], hi=ctx.comparison(label)["ci_high"],
                 paper=ctx.paper_cmp(label, "ci")),
            Cell("p", ctx.comparison(label)["p"], paper=ctx.paper_cmp(label, "p")),
            paper,
        ]

    rows = [
        cond_row("Consolidator only, updated-mapping LTM recall (%)", ON, "updated_ltm"),
        cond_row("Routing off, updated-mapping LTM recall (%)", OFF, "updated_ltm"),
        cmp_row("Direct routing on - off, updated LTM (pp)", "routing on - off: updated_ltm"),
        cmp_row("Learned - forced identity, routing off (pp)",
                "learned - forced identity, routing off: updated_ltm"),
        cmp_row("Learned - forced identity, routing on (pp)",
                "learned - forced identity, routing on: updated_ltm"),
        cond_row("Consolidator only, AFFINE10 updated LTM (%)", ON, "updated_ltm_affine10"),
        cond_row("Learned full, updated LTM (%)", "learned_full", "updated_ltm"),
        cond_row("Identity full, updated LTM (%)", "identity_full", "updated_ltm"),
        cond_row("Memory + Consolidator, updated LTM (%)", "memory_consolidator", "updated_ltm"),
        cmp_row("Learned full - identity full (pp)", "learned_full - identity_full: updated_ltm"),
        cond_row("Dual objective, updated LTM (%)", "learned_full_dual", "updated_ltm"),
        cond_row("Dual objective, mean STM (%)", "learned_full_dual", "mean_stm"),
        cmp_row("Dual - LTM only, mean STM (pp)", "dual - LTM only: mean_stm"),
        cmp_row("Dual - LTM only, updated LTM (pp)", "dual - LTM only: updated_ltm"),
    ]
    table = Table(
        "tab:headline",
        "Headline numbers: ours beside the paper's (mean ± SD over seeds; paired differences "
        "in percentage points with t-distribution 95% CI and paired t-test p).",
        ["Quantity", "Ours", "95% CI", "p", "Paper"],
        rows,
    )
    if ctx.paper is not None:
        table.notes.append("Parenthesised CI and p values are the paper's where it prints them.")
    table.missing = miss.lines()
    return table


#: recall a control must stay under to count as "near chance" (10%) in the claims table
NEAR_CHANCE_MAX = 15.0
CLAIM_ALPHA = 0.05


def _verdict_paired(row: Mapping[str, Any]) -> str:
    """'reproduces' when the paired mean difference is > 0 with p < CLAIM_ALPHA."""
    if row["n"] < 2 or not _finite(row["p"]):
        return "not tested (fewer than two paired seeds)"
    if row["mean_diff"] > 0 and row["p"] < CLAIM_ALPHA:
        return "reproduces"
    if row["mean_diff"] > 0:
        return f"does not reproduce (> 0 but p = {format_p(row['p'])} >= {CLAIM_ALPHA})"
    return "does not reproduce (difference <= 0)"


def table_claims(ctx: _Context) -> Table:
    """Which of the paper's claims this run reproduces, each with the test that decides it."""
    miss = _Missing(ctx)
    rows = []

    def paired_row(claim: str, label: str) -> None:
        row = ctx.comparison(label)
        rows.append([
            text_cell(claim),
            ctx.paired(miss, label, "stat", paper=False),
            Cell("ci", row["ci_low"], hi=row["ci_high"]),
            Cell("p", row["p"]),
            ctx.paper_cmp(label) or NA,
            text_cell(_verdict_paired(row)),
        ])

    paired_row("Learned > forced identity, routing on (updated LTM, pp)",
               "learned - forced identity, routing on: updated_ltm")
    paired_row("Routing on > off (updated LTM, pp)", "routing on - off: updated_ltm")
    paired_row("Learned > forced identity, routing off (updated LTM, pp)",
               "learned - forced identity, routing off: updated_ltm")
    for fam, name in (("add10", "ADD10"), ("affine10", "AFFINE10")):
        label = f"recall - output-set baseline, {fam}: {ON}"
        paired_row(f"Routing on: updated LTM above the output-set baseline, {name} (pp)", label)
    for metric, name in (("fresh_ltm", "Fresh LTM"), ("mismatched_ltm", "Mismatched LTM")):
        cell = ctx.stat(miss, ON, metric, paper=False)
        ok = cell.n and _finite(cell.value) and cell.value <= NEAR_CHANCE_MAX
        verdict = ("reproduces" if ok else
                   "not tested (no results)" if not cell.n else
                   f"does not reproduce (mean above {NEAR_CHANCE_MAX:g}%)")
        rows.append([text_cell(f"{name} near chance (10%), routing on (%)"), cell, NA, NA,
                     ctx.paper_stat(ON, metric) or NA, text_cell(verdict)])
    follow = ctx.stat(miss, ON, "mismatched_donor_follow", paper=False)
    rows.append([text_cell("Mismatched LTM: answers that follow the donor's rule (%)"), follow,
                 NA, NA, NA, text_cell("reported (not a claim of the paper)")])
    table = Table(
        "tab:claims",
        "Which of the paper's claims this run reproduces. A paired claim reproduces when the "
        f"paired mean difference over seeds is > 0 with paired t-test p < {CLAIM_ALPHA:g}; a "
        f"control is near chance when its mean recall is at most {NEAR_CHANCE_MAX:g}%. "
        "Above-baseline rows pair each seed's recall with the output-set baseline on the same "
        "test episodes of that family.",
        ["Claim", "Ours", "95% CI", "p", "Paper", "Verdict"],
        rows,
    )
    table.missing = miss.lines()
    return table


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
        align=["l"] + ["r"] * 10 + ["p{5cm}"],
    )


def table_phase1_checkpoints(analysis: stats.Phase1Analysis) -> Table:
    """The paper's fixed-checkpoint analysis within each Phase-1 checkpoint, for every
    comparison of :func:`table_phase1_variance`."""
    shown, _ = _phase1_labels(analysis)
    rows: list[list[Cell]] = []
    rules: set[int] = set()
    for label in shown:
        if rows:
            rules.add(len(rows))
        for t in analysis.checkpoints:
            if t.label != label:
                continue
            rows.append([
                text_cell(label),
                text_cell(str(t.phase1_seed)),
                Cell("int", t.n),
                Cell("stat", t.mean_diff, t.sd_diff, signed=True) if t.n > 0
                else Cell("missing"),
                Cell("ci", t.ci_low, hi=t.ci_high) if _finite(t.ci_low) else NA,
                Cell("num", t.t) if _finite(t.t) else NA,
                Cell("p", t.p) if _finite(t.p) else NA,
                Cell("num", t.d_z) if _finite(t.d_z) else NA,
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
        notes=["With few seeds per checkpoint the intervals and tests are descriptive (paper "
               "Sections 6.3 and 9)."],
        align=["l", "r", "r", "r", "r", "r", "r", "r", "p{5cm}"],
    )


def _routes_by_checkpoint(meta: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(Phase-1 seed label, route diagnostics) of each Phase-1 checkpoint whose Stage 1
    recorded them (`stage1.json` "routes", from `pmnet.diagnose` at the end of Phase 1)."""
    out = []
    many = meta.get("phase1_checkpoints")
    if isinstance(many, Mapping):
        for key in sorted(many, key=lambda k: (len(str(k)), str(k))):
            rec = many[key]
            if isinstance(rec, Mapping) and isinstance(rec.get("routes"), Mapping):
                out.append((str(key), rec["routes"]))
    one = meta.get("phase1")
    if not out and isinstance(one, Mapping) and isinstance(one.get("routes"), Mapping):
        out.append((str(one.get("phase1_seed", 0)), one["routes"]))
    return out


def _per_block(values: Sequence[Any], fmt: str) -> Cell:
    return text_cell(" / ".join("–" if v is None else format(v, fmt) for v in values))


def table_routes(meta: Mapping[str, Any]) -> Table | None:
    """Do the hard routes of each Phase-1 checkpoint matter (issue 21, ours)? STM recall on the
    validation stream, with every top-1 route replaced by a random child, with each block's
    writes removed; how often L changes a route; the routing margins. None when no Stage 1
    recorded them."""
    checkpoints = _routes_by_checkpoint(meta)
    if not checkpoints:
        return None
    rows: list[list[Cell]] = []
    for label, d in checkpoints:
        rnd = d["stm_random_routes"]
        rows.append([
            text_cell(label),
            Cell("int", int(d["episodes"])),
            Cell("num", d["stm"]["recall"]),
            Cell("num", rnd["recall"]),
            Cell("num", rnd["drop"], signed=True),
            Cell("num", d["stm_one_path"]["drop"], signed=True) if "stm_one_path" in d else NA,
            _per_block([r["drop"] for r in d["stm_without_block"]], "+.1f"),
            _per_block(d["ltm_route_change"], ".0f"),
            _per_block(d.get("route_concentration") or [None] * int(d["n_blocks"]), ".0f"),
            _per_block(d["margin_median"], ".3f"),
        ])
    return Table(
        "tab:routes",
        "Do the routes matter? Route diagnostics of each Phase-1 checkpoint on the validation "
        "stream (ours, not in the paper; `pmnet diagnose`): immediate STM recall (%), the same "
        "with every top-1 route replaced by a uniform random child and its drop (pp), the "
        "drop with every token sent down one path (child 0 at every block: routes without "
        "content), the drop with block b's writes removed (blocks 0 / 1 / ...), the % of "
        "segment-2 routes that adding L (identity consolidation) changes, the % of a "
        "segment's tokens in its most visited group (100: every token takes one path), and "
        "the median top-1 minus top-2 routing probability per block.",
        ["Phase-1 seed", "Episodes", "STM", "Random routes", "Drop", "One path (drop)",
         "Writes removed (drop)",
         "L changes routes (%)", "Top group (%)", "Margin"],
        rows,
        notes=["A drop is paired (the same episodes); positive means the intervention hurt. "
               "Random routes leave the root group (block 0), which every token visits, as "
               "it is. Near-zero margins mean routes decided by near-ties."],
        align=["l", "r", "r", "r", "r", "r", "l", "l", "l", "l"],
    )


def routes_frame(meta: Mapping[str, Any]) -> pd.DataFrame:
    """One row per (Phase-1 checkpoint, block) of the recorded route diagnostics."""
    rows = []
    for label, d in _routes_by_checkpoint(meta):
        for b in range(int(d["n_blocks"])):
            frm = d["stm_without_blocks_from"][b]
            rows.append({
                "phase1_seed": label, "block": b, "episodes": d["episodes"],
                "stm": d["stm"]["recall"], "stm_random_routes": d["stm_random_routes"]["recall"],
                "random_route_drop": d["stm_random_routes"]["drop"],
                "one_path_drop": (d.get("stm_one_path") or {}).get("drop"),
                "margin_median": d["margin_median"][b], "top_prob_mean": d["top_prob_mean"][b],
                "writes_removed_drop": d["stm_without_block"][b]["drop"],
                "writes_removed_from_drop": None if frm is None else frm["drop"],
                "ltm_route_change": d["ltm_route_change"][b],
                "route_concentration": (d.get("route_concentration") or [None] * (b + 1))[b]})
    return pd.DataFrame(rows)


def build_tables(
    df: pd.DataFrame,
    paper: stats.PaperReference | None = None,
    comparisons: pd.DataFrame | None = None,
    expected_seeds: Sequence[int] | None = None,
    phase1: stats.Phase1Analysis | None = None,
) -> list[Table]:
    """Every report table (paper layout plus ours) from a tidy per-trial frame; the operator
    tables only when operator results are present.

    Trials from more than one Phase-1 checkpoint (a ``phase1_seed`` column with several
    values): the paper-layout tables use the reference checkpoint
    (:func:`stats.reference_phase1_seed`; ``comparisons``, if given, must be over it), and
    ``tab:phase1-variance`` / ``tab:phase1-checkpoints`` (:func:`stats.phase1_variance`) every
    checkpoint. ``phase1``: an analysis already computed (the tables are added for it)."""
    df = stats.add_derived_metrics(df) if not df.empty else df
    seeds = list(expected_seeds) if expected_seeds is not None else stats.expected_seed_set(df)
    if stats.has_phase1_variance(df):
        phase1 = phase1 or stats.phase1_variance(df)
        df = stats.at_phase1_seed(df, stats.reference_phase1_seed(df))
    if comparisons is None:
        comparisons = stats.compare_all(df, expected_seeds=seeds)
    ctx = _Context(df, paper, comparisons, seeds)
    operators: list[Table] = []
    if stats.has_operator_results(df):
        op_cmp = stats.compare_operators(df, expected_seeds=seeds)
        operators = [table_operators(ctx), table_operator_comparisons(ctx, op_cmp)]
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
        *([table_selected_vs_last(ctx)] if has_last_epoch(ctx.df) else []),
        table_paired_comparisons(ctx, comparisons),
        *operators,
        *([table_phase1_variance(phase1), table_phase1_checkpoints(phase1)]
          if phase1 is not None else []),
    ]


def render_tables(
    df: pd.DataFrame, target: str = "md", paper: stats.PaperReference | None = None
) -> dict[str, str]:
    """Every table rendered to ``target`` ("md", "tex" or "html"), keyed by table id."""
    return {t.id: t.render(target) for t in build_tables(df, paper)}


# ------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------


@dataclass
class FigureResult:
    """A built figure, or ``figure=None`` with ``skipped`` saying why."""

    id: str
    title: str
    caption: str
    figure: Figure | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)


def _new_figure(n_panels: int, ncols: int | None = None, size=(3.6, 3.1)):
    ncols = ncols or n_panels
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _seed_colors(seeds: Sequence[int]) -> dict[int, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {s: cmap(i % 10) for i, s in enumerate(seeds)}


def _paired_panel(
    ax, df: pd.DataFrame, points: Sequence[tuple[str, str, str]], title: str, colors
) -> tuple[bool, list[int]]:
    """Lines joining one seed's values across ``points`` (condition, metric, tick label).

    Returns (any data drawn, seeds that lack some point). A seed missing a point is drawn
    with its available points (the line breaks at the gap), never dropped.
    """
    series = [stats.seed_values(df, c, m) for c, m, _ in points]
    seeds = sorted(set().union(*[set(s.index) for s in series]))
    x = np.arange(len(points))
    partial = []
    for seed in seeds:
        ys = np.array([float(s.loc[seed]) if seed in s.index else np.nan for s in series])
        if np.isnan(ys).any():
            partial.append(seed)
        ax.plot(x, ys, marker="o", ms=5, lw=1.2, alpha=0.85, color=colors.get(seed),
                label=f"seed {seed}")
    if seeds:
        means = [float(s.mean()) if s.size else np.nan for s in series]
        ax.plot(x, means, marker="_", ms=22, mew=2.5, lw=0, color="black", label="mean")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    if partial:
        ax.text(0.02, 0.02, "incomplete seeds: " + ", ".join(map(str, partial)), fontsize=7,
                transform=ax.transAxes, color="firebrick")
    ax.set_xticks(x, [label for _, _, label in points])
    ax.set_xlim(-0.4, len(points) - 0.6)
    ax.set_ylim(-2, 102)
    ax.set_ylabel("recall (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return bool(seeds), partial


def _paired_figure(
    df: pd.DataFrame,
    fig_id: str,
    title: str,
    caption: str,
    panels: Sequence[tuple[str, Sequence[tuple[str, str, str]]]],
    require: Sequence[tuple[str, str]],
    ncols: int | None = None,
) -> FigureResult:
    lacking = [(c, m) for c, m in require if stats.seed_values(df, c, m).size == 0]
    if lacking:
        need = ", ".join(f"{m} of {c}" for c, m in lacking)
        return FigureResult(fig_id, title, caption, skipped=f"no data for {need}")
    seeds = stats.expected_seed_set(df)
    colors = _seed_colors(seeds)
    fig, axes = _new_figure(len(panels), ncols)
    result = FigureResult(fig_id, title, caption, figure=fig)
    for ax, (panel_title, points) in zip(axes, panels):
        drawn, partial = _paired_panel(ax, df, points, panel_title, colors)
        if not drawn:
            result.notes.append(f"panel '{panel_title}': no data")
        elif partial:
            verb = "lacks" if len(partial) == 1 else "lack"
            result.notes.append(
                f"panel '{panel_title}': {stats._seed_word(partial)} {verb} some points "
                "(drawn with gaps)"
            )
    handles, labels = axes[-1].get_legend_handles_labels()
    if handles:
        axes[-1].legend(handles, labels, fontsize=7, loc="best", frameon=False)
    fig.suptitle(title, fontsize=11)
    return result


def figure_routing(df: pd.DataFrame) -> FigureResult:
    return _paired_figure(
        df,
        "fig-ltm-routing",
        "Direct LTM-conditioned routing (paired seeds)",
        "Lines pair each seed's routing-off and routing-on runs (same Phase-1 checkpoint). "
        "(a) updated-mapping LTM recall; (b) segment-2 immediate STM recall.",
        [
            ("(a) updated-mapping LTM", [(OFF, "updated_ltm", "off"), (ON, "updated_ltm", "on")]),
            ("(b) segment-2 STM", [(OFF, "seg2_stm", "off"), (ON, "seg2_stm", "on")]),
        ],
        require=[(OFF, "updated_ltm"), (ON, "updated_ltm")],
    )


def figure_same_checkpoint(df: pd.DataFrame) -> FigureResult:
    return _paired_figure(
        df,
        "fig-consolidator-update",
        "Learned vs forced identity, same checkpoint (Consolidator only)",
        "Each line is one seed's checkpoint evaluated with the learned Consolidator and with "
        "forced identity accumulation, for the initial mapping (after the first consolidation) "
        "and the updated mapping (after the second).",
        [
            ("initial mapping", [(ON, "initial_ltm", "learned"),
                                 (ON, "forced_identity_initial", "identity")]),
            ("updated mapping", [(ON, "updated_ltm", "learned"),
                                 (ON, "forced_identity", "identity")]),
        ],
        require=[(ON, "updated_ltm"), (ON, "forced_identity")],
    )


def figure_content(df: pd.DataFrame) -> FigureResult:
    conditions = [
        c
        for c in (stats.ordered_conditions(df["condition"]) if not df.empty else [])
        if stats.seed_values(df, c, "updated_ltm").size
        and (stats.seed_values(df, c, "mismatched_ltm").size
             or stats.seed_values(df, c, "fresh_ltm").size)
    ]
    caption = (
        "Updated-mapping LTM recall of each seed's checkpoint with its own (correct) experience, "
        "a mismatched donor experience, and fresh (empty) memory."
    )
    title = "Recall requires the correct experience"
    if not conditions:
        return FigureResult("fig-consolidator-content", title, caption,
                            skipped="no condition has updated_ltm with mismatched/fresh LTM")
    panels = [
        (condition_label(c), [(c, "updated_ltm", "correct"), (c, "mismatched_ltm", "mism."),
                              (c, "fresh_ltm", "fresh")])
        for c in conditions
    ]
    return _paired_figure(
        df, "fig-consolidator-content", title, caption, panels,
        require=[(c, "updated_ltm") for c in conditions], ncols=min(3, len(panels)),
    )


def figure_dual(df: pd.DataFrame) -> FigureResult:
    full, dual = "learned_full", "learned_full_dual"
    return _paired_figure(
        df,
        "fig-dual-objective",
        "Dual objective: pre-consolidation STM and post-reset LTM",
        "Lines pair each seed's updated-LTM-only run with its dual-objective run. "
        "(a) updated-mapping LTM recall; (b) mean immediate STM recall.",
        [
            ("(a) updated-mapping LTM", [(full, "updated_ltm", "LTM only"),
                                         (dual, "updated_ltm", "LTM + STM")]),
            ("(b) mean STM", [(full, "mean_stm", "LTM only"), (dual, "mean_stm", "LTM + STM")]),
        ],
        require=[(full, "updated_ltm"), (dual, "updated_ltm")],
    )


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
    fig, axes = _new_figure(2, size=(4.2, 3.3))
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


def figure_training_curves(curves: pd.DataFrame | None) -> list[FigureResult]:
    """One figure per phase from long (phase, step/epoch, metric, value) rows.

    Each metric gets a panel; each (condition, seed[, phase1_seed]) a line when those
    columns exist. The x axis is ``step`` where the phase has steps, else ``epoch``, else the
    row order.
    """
    title = "Training curves"
    if curves is None or curves.empty or not {"metric", "value"} <= set(curves.columns):
        return [FigureResult("fig-training", title, "Training curves per phase.",
                             skipped="no training history or metrics CSV found")]
    curves = curves.copy()
    if "phase" not in curves.columns:
        curves["phase"] = "training"
    curves["value"] = pd.to_numeric(curves["value"], errors="coerce")
    curves = curves.dropna(subset=["value"])
    out = []
    for phase in sorted(curves["phase"].astype(str).unique()):
        part = curves[curves["phase"].astype(str) == phase]
        xcol = next(
            (c for c in ("step", "epoch") if c in part.columns
             and pd.to_numeric(part[c], errors="coerce").notna().any()),
            None,
        )
        metrics = sorted(part["metric"].astype(str).unique())
        safe = re.sub(r"[^A-Za-z0-9_-]+", "-", phase)
        fig, axes = _new_figure(len(metrics), min(4, len(metrics)), size=(3.3, 2.6))
        groups = [c for c in ("condition", "variant", "seed", stats.PHASE1_SEED)
                  if c in part.columns]
        for ax, metric in zip(axes, metrics):
            sub = part[part["metric"].astype(str) == metric]
            keyed = sub.groupby(groups, dropna=False, sort=True) if groups else [((), sub)]
            for key, run in keyed:
                run = run.sort_values(xcol) if xcol else run
                x = pd.to_numeric(run[xcol], errors="coerce") if xcol else np.arange(len(run))
                key = key if isinstance(key, tuple) else (key,)
                label = " ".join(str(k) for k in key
                                 if k is not None and k == k and k != "") or metric
                ax.plot(x, run["value"], lw=1.1, marker="." if len(run) < 40 else None,
                        label=label)
            ax.set_title(metric, fontsize=9)
            ax.set_xlabel(xcol or "row")
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
        handles, labels = axes[0].get_legend_handles_labels()
        if 1 < len(handles) <= 12:
            axes[0].legend(handles, labels, fontsize=6, frameon=False)
        fig.suptitle(f"{title}: {phase}", fontsize=11)
        out.append(FigureResult(f"fig-training-{safe}", f"{title}: {phase}",
                                f"Logged metrics of {phase} against {xcol or 'row order'}.",
                                figure=fig))
    return out


def make_figures(df: pd.DataFrame, curves: pd.DataFrame | None = None) -> list[FigureResult]:
    """Every report figure; missing data gives a skipped entry (with the reason)."""
    df = stats.add_derived_metrics(df) if not df.empty else df
    return [
        figure_routing(df),
        figure_same_checkpoint(df),
        figure_content(df),
        figure_dual(df),
        *figure_training_curves(curves),
    ]


def figure_bytes(fig: Figure, fmt: str = "png", dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi)
    return buf.getvalue()


def save_figure(result: FigureResult, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write a built figure as PNG and PDF (atomic); returns {"png": path, "pdf": path}."""
    if result.figure is None:
        return {}
    out = Path(out_dir)
    paths = {}
    for fmt in ("png", "pdf"):
        paths[fmt] = atomic_write_bytes(
            out / f"{result.id}.{fmt}", figure_bytes(result.figure, fmt)
        )
    return paths


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------

DESCRIPTIVE_NOTE = (
    "With n = 5 seeds (or fewer), the 95% confidence intervals and paired t-tests are "
    "descriptive, as the paper says (Sections 6.3 and 9). All main seeds share one Phase-1 "
    "checkpoint, so their spread reflects consolidation training and data streams only."
)

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:1em 0;font-size:.85em}
caption{caption-side:top;text-align:left;font-weight:600;padding:.3em 0}
th,td{border-top:1px solid #ddd;border-bottom:1px solid #ddd;padding:.25em .6em;text-align:right;
white-space:nowrap}
thead th{border-bottom:2px solid #444;text-align:center}
tbody th{text-align:left;font-weight:normal}
tr.rule{border-top:2px solid #888}
td.missing,th.missing{color:#b00}
.paper{color:#666;font-size:.9em}
.note{font-size:.85em;color:#444;margin:.2em 0}
.skipped{color:#a40;font-style:italic}
figure{margin:1.5em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85em;color:#444}
code{background:#f4f4f4;padding:0 .2em}
dl.meta dt{font-weight:600}dl.meta dd{margin:0 0 .4em 1.2em;font-family:monospace}
table.facts th{text-align:left;padding-right:1em;white-space:nowrap}
"""


def _meta_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(value)


def _grid_from_meta(meta: Mapping[str, Any]) -> tuple[list[str] | None, list[int] | None]:
    grid = meta.get("grid")
    conditions: list[str] | None = None
    seeds: list[int] | None = None
    try:
        if isinstance(grid, Mapping):
            if grid.get("conditions") is not None:
                conditions = [str(c) for c in grid["conditions"]]
            if grid.get("seeds") is not None:
                seeds = [int(s) for s in grid["seeds"]]
        elif isinstance(grid, (list, tuple)) and grid:
            pairs = []
            for item in grid:
                if isinstance(item, Mapping):
                    pairs.append((str(item["condition"]), int(item["seed"])))
                elif isinstance(item, (list, tuple)) and len(item) == 2:
                    pairs.append((str(item[0]), int(item[1])))
                elif isinstance(item, str) and re.fullmatch(r".+[:/]\d+", item):
                    name, seed = re.split(r"[:/](?=\d+$)", item)
                    pairs.append((name, int(seed)))
            if pairs:
                conditions = stats.ordered_conditions(c for c, _ in pairs)
                seeds = sorted({s for _, s in pairs})
    except (KeyError, TypeError, ValueError):
        return None, None
    return conditions, seeds


def missing_results(
    df: pd.DataFrame,
    conditions: Sequence[str],
    seeds: Sequence[int],
    comparisons: pd.DataFrame | None = None,
    key_metrics: Sequence[str] = ("updated_ltm", "forced_identity", "fresh_ltm",
                                  "mismatched_ltm", "seg2_stm", "mean_stm"),
    variants: Sequence[str] = ("",),
    expected_arms: Sequence[tuple[str, str]] | None = None,
) -> list[str]:
    """Human-readable lines: failed trials, absent trials, absent key metrics, unpaired seeds.

    The expected trials are ``conditions x variants x seeds``, or ``expected_arms x seeds``
    when ``expected_arms`` ((condition, variant) pairs) is given; a trial of a named variant
    is named by its arm (``<condition>-<variant>``, :func:`stats.by_arm`)."""
    lines = []
    failed = set()
    for rec in df.attrs.get("failed", []):
        arm = stats.arm_name(rec["condition"], rec.get("variant") or "")
        failed.add((arm, int(rec["seed"])))
        lines.append(
            f"failed trial: {arm} seed {rec['seed']} ({rec['file']}): {rec['error']}"
        )
    arms = stats.by_arm(df)
    present = set(zip(arms["condition"], arms["seed"].astype(int))) if not df.empty else set()
    expected = (expected_arms if expected_arms is not None
                else [(c, v) for c in conditions for v in variants])
    for condition, variant in expected:
        arm = stats.arm_name(condition, variant)
        absent = [s for s in seeds if (arm, s) not in present | failed]
        if absent:
            lines.append(f"no result: {arm} {stats._seed_word(absent)}")
    for arm in stats.ordered_conditions(arms["condition"]) if not df.empty else []:
        for metric in key_metrics:
            values = stats.seed_values(arms, arm, metric)
            rows = arms[arms["condition"] == arm]
            lacking = sorted(set(rows["seed"].astype(int)) - set(values.index))
            if lacking:
                lines.append(
                    f"metric missing: {arm} {metric} for {stats._seed_word(lacking)}"
                )
    if comparisons is not None and len(comparisons):
        for r in comparisons.to_dict("records"):
            if r["missing_seeds"] and r["n"] > 0:
                lines.append(f"unpaired seeds in '{r['label']}': {r['note']}")
    for warning in df.attrs.get("warnings", []):
        lines.append(f"ignored value: {warning}")
    return lines


def _minutes(seconds: Any) -> str | None:
    return f"{float(seconds) / 60:.1f} min" if isinstance(seconds, (int, float)) else None


def _variants_from_meta(meta: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{variant name: overrides} of a pipeline's grid with named variants (pipeline.json's
    ``grid.variants``, else its ``space.variants``); {} for a grid of the default variant
    only, like every pipeline recorded before variants existed."""
    grid = meta.get("grid") if isinstance(meta.get("grid"), Mapping) else {}
    found = grid.get("variants")
    if isinstance(found, Mapping):
        out = {str(k): dict(v) if isinstance(v, Mapping) else {} for k, v in found.items()}
    else:
        space = meta.get("space") if isinstance(meta.get("space"), Mapping) else {}
        records = space.get("variants") if isinstance(space.get("variants"), list) else []
        out = {str(r.get("name") or ""): dict(r.get("overrides") or {})
               for r in records if isinstance(r, Mapping)}
    return out if any(out) else {}


def _pipeline_facts(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What ran, readable: preset, grid, code, Phase-1 checkpoint, wall times, status (from
    the pipeline's records; every key that is there, none invented)."""
    facts: list[tuple[str, str]] = []
    if meta.get("status"):
        facts.append(("status", str(meta["status"])))
    if meta.get("preset"):
        why = f" ({meta['preset_reason']})" if meta.get("preset_reason") else ""
        facts.append(("preset", f"{meta['preset']}{why}"))
    space = meta.get("space") if isinstance(meta.get("space"), Mapping) else {}
    grid = meta.get("grid") if isinstance(meta.get("grid"), Mapping) else space
    variants = _variants_from_meta(meta)
    if grid.get("conditions") and grid.get("seeds"):
        n_k = len(space.get("phase1_seeds") or grid.get("phase1_seeds") or ())
        text = (f"{space.get('name', 'grid')}: "
                + grid_size(len(grid["conditions"]), len(grid["seeds"]), len(variants), n_k))
        if space:
            gpu = f" + {space['gpus_per_trial']:g} GPU" if space.get("gpus_per_trial") else ""
            text += (f"; {space.get('cpus_per_trial', 1):g} CPU{gpu} per trial, "
                     f"max_failures {space.get('max_failures', '?')}")
        facts.append(("grid", text))
    if variants:
        described = []
        for name, sets in variants.items():
            settings = ", ".join(f"{k}={v}" for k, v in sorted(sets.items()))
            described.append((name or "default") + (f" ({settings})" if settings else ""))
        facts.append(("variants", "; ".join(described)))
    if meta.get("overrides"):
        facts.append(("overrides (--set)", _meta_value(meta["overrides"])))
    if meta.get("git_commit"):
        dirty = " (with uncommitted changes)" if str(meta.get("git_dirty")) == "true" else ""
        facts.append(("code", f"git {str(meta['git_commit'])[:12]}{dirty}"))
    p1 = meta.get("phase1") if isinstance(meta.get("phase1"), Mapping) else {}
    sha = p1.get("sha256") or meta.get("phase1_sha256")
    if sha:
        text = f"sha256 {str(sha)[:12]}..."
        stm = (p1.get("metrics") or {}).get("mean_stm")
        if isinstance(stm, (int, float)):
            text += f"; test mean STM recall {stm:.2f}%"
        if _minutes(p1.get("train_time_s")):
            text += f"; trained in {_minutes(p1['train_time_s'])}"
        if p1.get("imported_from"):
            text += f"; imported from {p1['imported_from']} (`--phase1-from`), not trained here"
        facts.append(("Phase-1 checkpoint", text))
    many = meta.get("phase1_checkpoints")
    for k, info in sorted((many or {}).items(), key=lambda kv: int(kv[0])
                          if str(kv[0]).isdigit() else 0) if isinstance(many, Mapping) else ():
        if not isinstance(info, Mapping):
            continue
        text = f"sha256 {str(info.get('sha256'))[:12]}..."
        stm = (info.get("metrics") or {}).get("mean_stm")
        if isinstance(stm, (int, float)):
            text += f"; test mean STM recall {stm:.2f}%"
        if _minutes(info.get("train_time_s")):
            text += f"; trained in {_minutes(info['train_time_s'])}"
        if info.get("imported_from"):
            text += f"; imported from {info['imported_from']}"
        facts.append((f"Phase-1 checkpoint, phase1_seed {k}", text))
    timing = meta.get("timing") if isinstance(meta.get("timing"), Mapping) else {}
    p1_label = ("Phase-1 training (summed over the checkpoints trained here, which train side "
                "by side)" if isinstance(many, Mapping) and len(many) > 1 else "Phase-1 training")
    parts = [f"{label} {_minutes(timing.get(key))}" for key, label in (
        ("wall_s", "pipeline"), ("phase1_train_s", p1_label),
        ("stage2_wall_s", "Stage 2"), ("sum_trial_train_s", "summed trial training"))
        if _minutes(timing.get(key))]
    if parts:
        runs = len(timing.get("invocations") or [])
        if runs > 1:
            label = f"wall time (last of {runs} timed invocations)"
        elif timing.get("resumed"):  # an invocation that was killed wrote no timing
            label = ("wall time (this invocation, a resume: earlier ones that did not finish "
                     "are not timed; summed trial training counts them)")
        else:
            label = "wall time"
        facts.append((label, ", ".join(parts)))
    versions = meta.get("versions") if isinstance(meta.get("versions"), Mapping) else {}
    if versions:
        facts.append(("versions", ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))))
    if meta.get("tracking"):
        facts.append(("MLflow", str(meta["tracking"])))
    return facts


def _one_sha_per_phase1_seed(df: pd.DataFrame) -> bool:
    """Whether the checkpoint hashes differ only between Phase-1 seeds: every trial has a
    Phase-1 seed, and each seed's trials share one sha256 (K intended checkpoints)."""
    if not stats.has_phase1_variance(df):
        return False
    seeds = pd.to_numeric(df[stats.PHASE1_SEED], errors="coerce")
    if seeds.isna().any():
        return False
    shas = df["phase1_sha256"].astype("string").fillna("")
    return bool((shas.groupby(seeds.to_numpy()).nunique() == 1).all())


def _run_facts(df: pd.DataFrame) -> list[tuple[str, str]]:
    facts = [("trials loaded", str(len(df)))]
    if df.empty:
        return facts
    facts.append(("conditions", ", ".join(stats.ordered_conditions(df["condition"]))))
    if stats.has_variant_results(df):
        names = sorted(set(df["variant"]), key=lambda v: (v != "", v))
        facts.append(("variants (from results)",
                      ", ".join(v or "default" for v in names)))
    facts.append(("seeds", ", ".join(str(s) for s in sorted(set(df["seed"].astype(int))))))
    phase1_seeds = stats.phase1_seeds(df)
    if phase1_seeds:
        facts.append(("Phase-1 seeds (from results)",
                      ", ".join(str(s) for s in phase1_seeds)
                      + (f" ({len(phase1_seeds)} Phase-1 checkpoints)"
                         if len(phase1_seeds) > 1 else "")))
    for col in ("preset", "phase1_sha256"):
        if col not in df.columns:
            continue
        values = sorted({str(v) for v in df[col].dropna()})
        if values:
            text = ", ".join(values)
            if col == "phase1_sha256" and len(values) > 1 and not _one_sha_per_phase1_seed(df):
                text += " (WARNING: trials come from different Phase-1 checkpoints)"
            facts.append((f"{col} (from results)", text))
    if all(c in df.columns for c in stats.DEVICE_COLUMNS):  # where the trials trained
        used = df[list(stats.DEVICE_COLUMNS)].fillna("not recorded").value_counts(sort=False)
        facts.append(("trained on (from results)", "; ".join(
            f"{device}, {precision}: {n} trial{'s' if n != 1 else ''}"
            for (device, precision), n in sorted(used.items()))))
    params = []
    for condition in stats.ordered_conditions(df["condition"]):
        if "trainable_params" not in df.columns:
            break
        rows = df[df["condition"] == condition]
        tp = rows["trainable_params"].dropna()
        tf = rows.get("trainable_fraction", pd.Series(dtype=float)).dropna()
        if tp.size:
            text = f"{condition}: {int(tp.iloc[0]):,}"
            if tf.size:
                text += f" ({100 * float(tf.iloc[0]):.3f}%)"
            params.append(text)
    if params:
        facts.append(("trainable parameters", "; ".join(params)))
    total = df["train_time_s"].dropna() if "train_time_s" in df.columns else pd.Series([])
    if total.size:
        facts.append(("summed Phase-2 train time", f"{float(total.sum()) / 3600:.2f} h"))
    return facts


FRONT_TABLES = ("tab:headline", "tab:claims")


def _html_page(
    meta: Mapping[str, Any],
    facts: Sequence[tuple[str, str]],
    tables: Sequence[Table],
    figures: Sequence[FigureResult],
    figure_data: Mapping[str, bytes],
    missing: Sequence[str],
    notes: Sequence[str],
) -> str:
    esc = html.escape
    by_id = {t.id: t for t in tables}
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>PMNet Consolidator reproduction report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>PMNet Consolidator: reproduction report</h1>",
        f'<p class="note">Generated {esc(_dt.datetime.now().isoformat(timespec="seconds"))}.</p>',
    ]
    for note in notes:
        out.append(f'<p class="note">{esc(note)}</p>')
    if "tab:headline" in by_id:
        out.append('<h2 id="headline">Headline numbers</h2>')
        out.append(by_id["tab:headline"].to_html())
    out.append(f'<p class="note"><strong>Statistics.</strong> {esc(DESCRIPTIVE_NOTE)}</p>')
    if "tab:claims" in by_id:
        out.append('<h2 id="claims">Which claims reproduce</h2>')
        out.append(by_id["tab:claims"].to_html())
    out.append('<h2 id="what-ran">What ran</h2><table class="facts"><tbody>')
    for key, value in facts:
        out.append(f"<tr><th>{esc(key)}</th><td>{esc(value)}</td></tr>")
    out.append("</tbody></table>")
    out.append('<h2 id="tables">Tables</h2>')
    for table in tables:
        if table.id not in FRONT_TABLES:
            out.append(table.to_html())
    out.append('<h2 id="figures">Figures</h2>')
    for fig in figures:
        if fig.id in figure_data:
            data = base64.b64encode(figure_data[fig.id]).decode("ascii")
            out.append(f'<figure id="{esc(fig.id)}">')
            out.append(f'<img src="data:image/png;base64,{data}" alt="{esc(fig.title)}">')
            caption = fig.caption + ("" if not fig.notes else " " + "; ".join(fig.notes) + ".")
            out.append(f"<figcaption><strong>{esc(fig.title)}.</strong> {esc(caption)}"
                       "</figcaption></figure>")
        else:
            out.append(f'<p class="skipped" id="{esc(fig.id)}">Figure skipped: '
                       f"{esc(fig.title)} ({esc(fig.skipped or 'no data')}).</p>")
    out.append('<h2 id="missing-results">Missing results</h2>')
    if missing:
        out.append("<ul>" + "".join(f"<li>{esc(m)}</li>" for m in missing) + "</ul>")
    else:
        out.append("<p>None: every expected trial and key metric is present.</p>")
    out.append('<h2 id="raw-records">Raw records</h2>')
    out.append(f'<p class="note">Also in <code>data/{RAW_RECORDS}</code>.</p><dl class="meta">')
    for key, value in meta.items():
        out.append(f"<dt>{esc(str(key))}</dt><dd>{esc(_meta_value(value))}</dd>")
    out.append("</dl>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _markdown_page(
    meta: Mapping[str, Any],
    facts: Sequence[tuple[str, str]],
    tables: Sequence[Table],
    figures: Sequence[FigureResult],
    figure_files: Mapping[str, str],
    missing: Sequence[str],
    notes: Sequence[str],
) -> str:
    by_id = {t.id: t for t in tables}
    out = ["# PMNet Consolidator: reproduction report", ""] + [f"> {n}" for n in notes]
    out += [""]
    if "tab:headline" in by_id:
        out += ["## Headline numbers", "", by_id["tab:headline"].to_markdown()]
    out += [f"**Statistics.** {DESCRIPTIVE_NOTE}", ""]
    if "tab:claims" in by_id:
        out += ["## Which claims reproduce", "", by_id["tab:claims"].to_markdown()]
    out += ["## What ran", "", "| | |", "|---|---|"]
    out += [f"| {key} | {str(value).replace('|', '/')} |" for key, value in facts]
    out += ["", "## Tables", ""]
    for table in tables:
        if table.id not in FRONT_TABLES:
            out += [table.to_markdown()]
    out += ["## Figures", ""]
    for fig in figures:
        if fig.id in figure_files:
            caption = fig.caption + ("" if not fig.notes else " " + "; ".join(fig.notes) + ".")
            pdf = Path(figure_files[fig.id]).with_suffix(".pdf").as_posix()
            out += [f"![{fig.title}]({figure_files[fig.id]})", "",
                    f"*{fig.title}.* {caption} (PDF: `{pdf}`)", ""]
        else:
            out += [f"*Figure skipped: {fig.title} ({fig.skipped or 'no data'}).*", ""]
    out += ["## Missing results", ""]
    out += [f"- {m}" for m in missing] if missing else [
        "None: every expected trial and key metric is present."]
    out += ["", "## Raw records", "",
            f"The pipeline's records as they are on disk: `data/{RAW_RECORDS}`."]
    return "\n".join(out) + "\n"


def build_report(
    results_dir_or_df: str | os.PathLike[str] | pd.DataFrame,
    out_dir: str | os.PathLike[str],
    *,
    meta: Mapping[str, Any],
    curves: pd.DataFrame | None = None,
    paper: stats.PaperReference | str | None = "auto",
    expected_conditions: Sequence[str] | None = None,
    expected_seeds: Sequence[int] | None = None,
) -> dict[str, Path]:
    """Build the report under ``out_dir``; returns the written paths by name.

    ``results_dir_or_df``: a results directory/file (read with :func:`stats.load_results`;
    its ``history`` lists become the Phase-2 training curves unless ``curves`` is given) or an
    already loaded tidy frame. ``meta``: what ran (preset, grid, git commit, phase1_sha256,
    hardware, wall time, ...); every key is printed. ``meta["grid"]`` (``{"conditions": [...],
    "seeds": [...]}`` or a list of condition/seed pairs) sets the expected grid for the
    missing-results section unless ``expected_conditions``/``expected_seeds`` are given; the
    default is the paper's six conditions over every seed seen (or 42-46). ``paper="auto"``
    loads the paper's numbers from the spec directory and leaves them out (with a note) when
    it is absent; ``None`` leaves them out.

    Written (atomically): ``report.html`` (self-contained), ``report.md`` (figures linked),
    ``tables/<id>.md|.tex`` and ``tables/all_tables.tex``, ``figures/<id>.png|.pdf``,
    ``data/trials.csv|.parquet``, ``data/summary.csv``, ``data/comparisons.csv`` (and
    ``operator_comparisons.csv`` / ``segment_comparisons.csv`` /
    ``segment_identity_comparisons.csv`` for those families).

    Named variants (``variant`` column of the tidy frame; ``meta`` grid/space variants): the
    paper's tables, figures and comparisons read the trials of the default variant only (and
    are left out when there are none); variants that set ``segments`` and ``ltm_graph`` get
    ``tab:segments``, ``tab:segment-comparisons`` and ``fig-segments``
    (:func:`build_segment_tables`, :func:`figure_segments`). The expected trials of the
    missing-results section are conditions x variants x seeds. Without named variants the
    report is exactly what it was before variants existed.

    Trials from more than one Phase-1 checkpoint (``phase1_seed``): everything above but
    ``trials.*`` uses the reference checkpoint (the smallest Phase-1 seed; a note at the top
    says so), and ``tab:phase1-variance``, ``tab:phase1-checkpoints``,
    ``data/phase1_variance.csv`` and ``data/phase1_checkpoints.csv`` every checkpoint
    (:func:`stats.phase1_variance`). Otherwise the report is exactly as without them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    if isinstance(results_dir_or_df, pd.DataFrame):
        df = results_dir_or_df
    else:
        df = stats.load_results(results_dir_or_df)
        if curves is None:
            curves = stats.load_histories(results_dir_or_df)
    attrs = dict(df.attrs)
    derived = stats.add_derived_metrics(df) if not df.empty else df.copy()
    derived.attrs = attrs
    phase1: stats.Phase1Analysis | None = None
    other_failed: list[dict[str, Any]] = []
    if stats.has_phase1_variance(derived):  # K Phase-1 checkpoints: see build_tables
        phase1 = stats.phase1_variance(stats.default_variant(derived)
                                       if stats.has_variant_results(derived) else derived)
        reference = stats.reference_phase1_seed(derived)
        other_failed = [r for r in attrs.get("failed", [])
                        if r.get(stats.PHASE1_SEED) != reference]
        derived = stats.at_phase1_seed(derived, reference)
        seeds_p1 = ", ".join(str(s) for s in stats.phase1_seeds(df))
        notes.append(
            f"Trials from {len(stats.phase1_seeds(df))} Phase-1 checkpoints (phase1_seed "
            f"{seeds_p1}). The paper-layout tables, the result figures and the missing-results "
            f"list use phase1_seed {reference} (the smallest: the paper's fixed-checkpoint "
            "analysis); tab:phase1-variance, tab:phase1-checkpoints and the training curves "
            "use every checkpoint.")

    if isinstance(paper, str):
        try:
            paper = stats.load_paper_reference()
        except (stats.SpecNotFoundError, ValueError) as exc:
            notes.append(f"The paper's reference numbers are not shown: {exc}")
            paper = None
    elif paper is None:
        notes.append("The paper's reference numbers are not shown (disabled).")

    grid_conditions, grid_seeds = _grid_from_meta(meta)
    seeds = list(expected_seeds or grid_seeds or stats.expected_seed_set(df))
    # named variants (beyond the paper): the paper's tables read the default variant's trials
    # only; the variants have tables of their own. Without variants nothing changes.
    has_variants = stats.has_variant_results(derived)
    base = stats.default_variant(derived) if has_variants else derived
    paper_part = not has_variants or not base.empty
    conditions = list(expected_conditions or grid_conditions or CONDITIONS)
    variants = list(_variants_from_meta(meta)) or [""]
    expected_arms = None
    if has_variants and variants == [""]:  # no grid names the variants: those that ran
        ran = dict.fromkeys(zip(derived["condition"], derived["variant"]))
        expected_arms = [(c, "") for c in conditions] + [a for a in ran if a[1]]
    if has_variants:
        n_named = int((derived["variant"] != "").sum())
        notes.append(
            f"{n_named} trial(s) ran named variants (Phase-2 overrides; section Tables, "
            "tab:segments): the paper's tables and comparisons read only the "
            f"{len(base)} trial(s) of the default variant"
            + ("." if paper_part else ", and there are none, so they are left out."))
    comparisons = stats.compare_all(base, expected_seeds=seeds) if paper_part else None
    tables = (build_tables(base, paper, comparisons, seeds, phase1=phase1)
              if paper_part else [])
    routes = table_routes(meta)  # Phase-1 route diagnostics, where Stage 1 recorded them
    if routes is not None:
        tables.append(routes)
    figures = (make_figures(base, curves) if paper_part
               else figure_training_curves(curves))
    operator_cmp = (stats.compare_operators(base, expected_seeds=seeds)
                    if stats.has_operator_results(base) else None)
    segment_cmp = segment_identity = None
    if stats.segment_arms(derived):
        segment_cmp = stats.compare_segments(derived, expected_seeds=seeds)
        segment_identity = stats.compare_segments_identity(derived, expected_seeds=seeds)
        tables += build_segment_tables(derived, seeds, segment_cmp, segment_identity)
        first_curve = next((i for i, f in enumerate(figures)
                            if f.id.startswith("fig-training")), len(figures))
        figures.insert(first_curve, figure_segments(derived))
    families = [c for c in (comparisons, operator_cmp, segment_cmp, segment_identity)
                if c is not None and len(c)]
    missing = missing_results(
        derived, conditions, seeds,
        pd.concat(families, ignore_index=True) if len(families) > 1
        else (families[0] if families else comparisons),
        variants=variants, expected_arms=expected_arms)
    for rec in other_failed:
        missing.append(f"failed trial (phase1_seed {rec.get(stats.PHASE1_SEED, 'unknown')}): "
                       f"{rec['condition']} seed {rec['seed']} ({rec['file']}): {rec['error']}")

    paths: dict[str, Path] = {}
    fig_dir = out / "figures"
    figure_png: dict[str, bytes] = {}
    figure_files: dict[str, str] = {}
    for fig in figures:
        if fig.figure is None:
            continue
        saved = save_figure(fig, fig_dir)
        paths[f"{fig.id}.png"] = saved["png"]
        paths[f"{fig.id}.pdf"] = saved["pdf"]
        figure_png[fig.id] = saved["png"].read_bytes()
        figure_files[fig.id] = f"figures/{fig.id}.png"

    table_dir = out / "tables"
    for table in tables:
        stem = table.id.replace(":", "-")
        paths[f"{stem}.md"] = atomic_write_text(table_dir / f"{stem}.md", table.to_markdown())
        paths[f"{stem}.tex"] = atomic_write_text(table_dir / f"{stem}.tex", table.to_latex())
    paths["all_tables.tex"] = atomic_write_text(
        table_dir / "all_tables.tex",
        "% generated by pmnet.report; needs booktabs\n" + "\n".join(t.to_latex() for t in tables),
    )

    data_dir = out / "data"
    tidy = stats.write_tidy(df, data_dir)
    paths["trials.csv"], paths["trials.parquet"] = tidy["csv"], tidy["parquet"]
    paths["summary.csv"] = atomic_write_text(  # per arm: a named variant is its own row
        data_dir / "summary.csv", stats.summarize(stats.by_arm(derived)).to_csv(index=False)
    )
    # each family of comparisons has its own Holm correction, so its own file
    for name, family in (("comparisons.csv", comparisons),
                         ("operator_comparisons.csv", operator_cmp),
                         ("segment_comparisons.csv", segment_cmp),
                         ("segment_identity_comparisons.csv", segment_identity)):
        if family is None or (name != "comparisons.csv" and not len(family)):
            continue
        flat = family.copy()
        for col in ("seeds", "missing_seeds"):
            if col in flat.columns:
                flat[col] = flat[col].map(lambda v: " ".join(str(s) for s in v))
        paths[name] = atomic_write_text(data_dir / name, flat.to_csv(index=False))

    if phase1 is not None:
        for name, frame in (("phase1_variance.csv", phase1.effects_frame()),
                            ("phase1_checkpoints.csv", phase1.checkpoints_frame())):
            flat = frame.copy()
            for col in ("phase1_seeds", "pairs_per_checkpoint", "seeds", "missing_seeds"):
                if col in flat.columns:
                    flat[col] = flat[col].map(lambda v: " ".join(str(s) for s in v))
            paths[name] = atomic_write_text(data_dir / name, flat.to_csv(index=False))

    if routes is not None:
        paths["route_diagnostics.csv"] = atomic_write_text(
            data_dir / "route_diagnostics.csv", routes_frame(meta).to_csv(index=False))

    paths[RAW_RECORDS] = atomic_write_text(
        data_dir / RAW_RECORDS, json.dumps(dict(meta), indent=1, sort_keys=True, default=str))
    facts = _pipeline_facts(meta) + _run_facts(df)
    paths["markdown"] = atomic_write_text(
        out / "report.md",
        _markdown_page(meta, facts, tables, figures, figure_files, missing, notes),
    )
    paths["html"] = atomic_write_text(
        out / "report.html",
        _html_page(meta, facts, tables, figures, figure_png, missing, notes),
    )
    for fig in figures:
        if fig.figure is not None:
            fig.figure.clear()
    return paths


#: The pipeline's raw records (pipeline.json, timing, Stage 1), under the report's data/.
RAW_RECORDS = "run_records.json"

#: Run-directory JSON files whose keys go into the report's "What ran" section (first wins
#: per key), and files nested under their own key.
_META_FILES = ("pipeline.json", "meta.json", "run.json", "manifest.json")
_NESTED_META_FILES = {"timing.json": "timing", "phase1/stage1.json": "phase1"}


def _read_json_dict(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _trial_or_none(name: str) -> TrialId | None:
    try:
        return TrialId.parse(name)
    except ValueError:
        return None


def _collect_curves(run_dir: Path, results: Path, report_dir: Path) -> pd.DataFrame | None:
    """Phase-2 curves from the result histories; other phases from ``metrics*.csv`` files.

    A CSV under ``trials/<trial>/`` is a Phase-2 trial log: it is used (with the condition,
    variant and seed of the trial's name, :meth:`TrialId.parse`) only when the result files
    carry no history.
    """
    frames = []
    histories = stats.load_histories(results)
    if not histories.empty:
        frames.append(histories)
    for csv in sorted(run_dir.rglob("metrics*.csv")):
        if report_dir in csv.parents or results in csv.parents:
            continue
        parts = csv.relative_to(run_dir).parts
        trial = None
        if "trials" in parts:
            if not histories.empty:
                continue
            trial = next((t for t in map(_trial_or_none, parts) if t is not None), None)
        try:
            curves = stats.curves_from_metrics_csv(csv, "phase2" if "trials" in parts else None)
        except (OSError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError):
            continue
        if trial is not None:
            curves["condition"], curves["seed"] = trial.condition, trial.seed
            curves["variant"] = trial.variant
        frames.append(curves)
    return pd.concat(frames, ignore_index=True) if frames else None


def main_report(
    run_dir: str | os.PathLike[str], *, meta: Mapping[str, Any] | None = None
) -> dict[str, Path]:
    """Report for a pipeline run: ``RUN_DIR/results/*.json`` -> ``RUN_DIR/report/``.

    "What ran" merges ``run_dir`` with the keys of ``RUN_DIR/pipeline.json`` (and of
    ``meta.json``/``run.json``/``manifest.json`` if present), ``timing.json`` under
    ``timing`` and ``phase1/stage1.json`` under ``phase1``; ``meta`` overrides them. Training
    curves come from the result histories and any ``metrics*.csv`` under the run directory
    (phase from a ``phaseN`` path component).
    """
    run = Path(run_dir)
    results = run / "results"
    if not results.is_dir():
        raise FileNotFoundError(f"no results directory at {results} (expected RESULTS/*.json)")
    merged: dict[str, Any] = {"run_dir": str(run.resolve())}
    for name in _META_FILES:
        loaded = _read_json_dict(run / name)
        if loaded is not None:
            for key, value in loaded.items():
                merged.setdefault(key, value)
    for name, key in _NESTED_META_FILES.items():
        loaded = _read_json_dict(run / name)
        if loaded is not None and key not in merged:
            merged[key] = loaded
    checkpoints = {}  # K Phase-1 checkpoints: phase1-p1s<k>/stage1.json
    for path in sorted(run.glob("phase1-p1s*/stage1.json")):
        loaded = _read_json_dict(path)
        if loaded is not None:
            checkpoints[path.parent.name.removeprefix("phase1-p1s")] = loaded
    if checkpoints and "phase1_checkpoints" not in merged:
        merged["phase1_checkpoints"] = checkpoints
    merged.update(meta or {})
    report_dir = run / "report"
    curves = _collect_curves(run, results, report_dir)
    return build_report(results, report_dir, meta=merged, curves=curves)

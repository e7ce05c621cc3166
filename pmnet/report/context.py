"""From a tidy frame to cells: :class:`Context` builds each cell of a table (ours, with the
paper's value where it has one) and :class:`Missing` collects the trials and metrics behind
the cells that are missing, for the table's footnote."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from pmnet import stats
from pmnet.report.cells import Cell, finite, format_p, number
from pmnet.report.grid_map import GRIDS_RUNNING
from pmnet.report.table import Table


def grids_phrase(conditions: Sequence[str]) -> str:
    """Which grids run every one of ``conditions`` (in the default variant):
    "grids `paper`, `core` run them", "grid `operators` runs it", "no grid runs it"
    (:data:`pmnet.report.grid_map.GRIDS_RUNNING`, derived from ``tune_spaces.grids``)."""
    conditions = list(conditions)
    if not conditions:
        return ""
    it = "them" if len(conditions) > 1 else "it"
    common = [g for g in GRIDS_RUNNING.get(conditions[0], ())
              if all(g in GRIDS_RUNNING.get(c, ()) for c in conditions)]
    if not common:
        return f"no grid runs {it}" if len(conditions) == 1 else "no one grid runs them all"
    names = ", ".join(f"`{g}`" for g in common)
    return f"grid {names} runs {it}" if len(common) == 1 else f"grids {names} run {it}"


def not_run_line(rows: Sequence[str], absent: Sequence[str]) -> str:
    """The one line under a table that names the rows left out: with the conditions that
    have no trial and the grids that run them, or, when every condition ran, as rows
    without a value of ours."""
    names = ", ".join(rows)
    if absent:
        return (f"Not run here: {names} (no trial of {', '.join(absent)}; "
                f"{grids_phrase(absent)}).")
    return f"Not shown: {names} (no value of ours; the missing results say why)."


def row_names(table: Table, rows: Sequence[Sequence[Cell]]) -> list[str]:
    """Rows by their labels; with two label columns grouped by the first, naming the second
    only where the table keeps some of that group's rows (``Identity full``, ``Learned full
    (44)``)."""
    if table.labels < 2:
        what = table.columns[0].lower() + " " if table.columns[0].endswith("eed") else ""
        names = [table.row_name(list(r)) for r in rows]
        return [what + n if n.isdigit() else n for n in names]
    kept = {r[0].text for r in table.rows}
    groups: dict[str, list[str]] = {}
    for r in rows:
        groups.setdefault(r[0].text, []).append(" ".join(c.text for c in r[1:table.labels]))
    return [f"{k} ({', '.join(v)})" if k in kept and any(v) else k for k, v in groups.items()]


class Missing:
    """Collects the missing trials/metrics behind one table's cells."""

    def __init__(self, ctx: Context) -> None:
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

    def absent(self) -> list[str]:
        """The conditions this table reads that have no trial at all."""
        ran = {c for c, _ in self.ctx.present}
        return [c for c in stats.ordered_conditions(self.trials) if c not in ran]

    def lines(self, named: Sequence[str] = ()) -> list[str]:
        """The missing trials and metrics; a condition without any trial is "not run here"
        with the grids that run it, and left out when ``named`` already names it."""
        out = []
        absent = self.absent()
        for condition in stats.ordered_conditions(self.trials):
            if condition in named:
                continue
            if condition in absent:
                out.append(f"{condition}: not run here ({grids_phrase([condition])})")
                continue
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


@dataclass(frozen=True)
class CheckpointView:
    """The unit of analysis when trials come from K >= 2 Phase-1 checkpoints (issue 35): every
    checkpoint's default-variant trials (``every``, derived metrics filled), each paired
    effect with the checkpoint as a random intercept (``effects`` by label,
    :func:`pmnet.stats.phase1_variance`), and each checkpoint's own mean difference
    (``per_checkpoint``: label -> [(phase1_seed, mean_diff)])."""

    phase1_seeds: tuple[int, ...]
    every: pd.DataFrame
    effects: Mapping[str, stats.Phase1Effect]
    per_checkpoint: Mapping[str, list[tuple[int, float]]]

    @property
    def k(self) -> int:
        return len(self.phase1_seeds)

    @classmethod
    def build(cls, every: pd.DataFrame, labels: Sequence[str]) -> CheckpointView:
        specs = [c for c in _SPECS.values() if c.label in set(labels)]
        analysis = stats.phase1_variance(every, specs)
        per: dict[str, list[tuple[int, float]]] = {}
        for t in analysis.checkpoints:
            if t.n > 0:
                per.setdefault(t.label, []).append((t.phase1_seed, t.mean_diff))
        return cls(tuple(stats.phase1_seeds(every)), every,
                   {e.label: e for e in analysis.effects}, per)

    def condition_means(self, condition: str, metric: str) -> list[tuple[int, float]]:
        """(phase1_seed, mean over that checkpoint's seeds) of a condition's metric."""
        df = self.every
        if metric not in df.columns:
            return []
        part = df[df["condition"] == condition]
        means = part.groupby(stats.PHASE1_SEED)[metric].mean().dropna()
        return [(int(k), float(v)) for k, v in means.items()]

    def condition_values(self, condition: str, metric: str) -> pd.Series:
        df = self.every
        if metric not in df.columns:
            return pd.Series(dtype=float)
        return df.loc[df["condition"] == condition, metric].dropna().astype(float)


#: every comparison a table may name by its label: the paper's family, then each one on a
#: rule family's episodes (`stats.FAMILY_COMPARISONS`; the paper's family wins a shared label)
_SPECS: dict[str, stats.Comparison] = {
    c.label: c for c in (*stats.FAMILY_COMPARISONS, *stats.COMPARISONS)}


def comparison_spec(label: str) -> stats.Comparison | None:
    """The comparison a table names by `label` (None for an unknown one)."""
    return _SPECS.get(label)


def per_checkpoint_text(values: Sequence[tuple[int, float]], signed: bool = True) -> str:
    """`+12.1 / +0.3 / -12.9` in Phase-1 seed order (blank without values)."""
    return " / ".join(f"{v:+.1f}" if signed else f"{v:.1f}" for _, v in sorted(values))


class Context:
    """The cells of the tables over one tidy frame: ``stat`` (mean ± SD over seeds), ``seed``,
    ``seed_diff``, ``paired`` (a paired comparison of ``comparisons``, or one computed on
    demand from its spec), each with the paper's value beside ours where it has one; the
    values are cached per (condition, metric)."""

    def __init__(
        self,
        df: pd.DataFrame,
        paper: stats.PaperReference | None,
        comparisons: pd.DataFrame,
        seeds: Sequence[int],
        checkpoints: CheckpointView | None = None,
    ) -> None:
        self.df = df
        self.checkpoints = checkpoints  # the unit of analysis with K >= 2 checkpoints
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
    def stat(self, miss: Missing, condition: str, metric: str, paper: bool = True) -> Cell:
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

    def stat_part(self, miss: Missing, condition: str, metric: str, part: str) -> Cell:
        cell = self.stat(miss, condition, metric)
        paper = cell.paper
        if part == "mean":
            return Cell("num", cell.value, paper=Cell("num", paper.value) if paper else None)
        return Cell("num", cell.sd, paper=Cell("num", paper.sd) if paper else None)

    def seed(self, miss: Missing, condition: str, seed: int, metric: str, kind="num") -> Cell:
        miss.check(condition, metric, [seed])
        values = self.values(condition, metric)
        value = float(values.loc[seed]) if seed in values.index else math.nan
        pv = self.paper_seed(condition, seed, metric)
        return Cell(kind, value, paper=Cell(kind, pv) if pv is not None else None)

    def seed_diff(
        self, miss: Missing, a: tuple[str, str], b: tuple[str, str], seed: int
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
            spec = spec or _SPECS.get(label)
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
        miss: Missing,
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
        if row["n"] == 0:  # issue 35: what did not run, not the n = 0 row's notes
            ran = {c for c, _ in self.present}
            absent = [c for c in dict.fromkeys((row["cond_a"], row["cond_b"])) if c not in ran]
            if absent:
                return (f"{what}: not run here (no trial of {', '.join(absent)}; "
                        f"{grids_phrase(absent)}).")
            return f"{what}: not computable (no seed has both values)."
        text = f"{what}: {number(row['mean_diff'], True)}"
        if finite(row["sd_diff"]):
            text += f" ± {number(row['sd_diff'])} pp"
        if finite(row["ci_low"]):
            text += (
                f", 95% CI [{number(row['ci_low'], True)}, {number(row['ci_high'], True)}], "
                f"p = {format_p(row['p'])}"
            )
        text += f" (n={row['n']})"
        ref = self.paper.comparison(label) if self.paper is not None else None
        if ref is not None:
            text += f"; paper {number(ref['mean'], True)}"
            if finite(ref.get("sd")):
                text += f" ± {number(ref['sd'])}"
            if finite(ref.get("ci_low")):
                text += f", CI [{number(ref['ci_low'], True)}, {number(ref['ci_high'], True)}]"
            if finite(ref.get("p")):
                text += f", p = {format_p(ref['p'])}"
        if row["note"]:
            text += f". Note: {row['note']}"
        return text + "."


PAPER_NOTE = (
    "Values in parentheses are the paper's (printed in paper-aggregates.csv, or derived from "
    "paper-per-seed.csv with the same statistics); [n=k] marks cells over fewer seeds than "
    "expected."
)


def only_ran(table: Table, miss: Missing) -> Table:
    """Only what ran (issue 35): drop the rows without a value of ours, name them in one line
    with the conditions that have no trial and the grids that run them, and list the other
    missing trials and metrics."""
    dropped = table.prune()
    absent = miss.absent()
    if dropped:
        table.notes.append(not_run_line(row_names(table, dropped), absent))
        table.absent = absent
    table.missing = miss.lines(named=absent if dropped else ())
    return table


def finish(ctx: Context, table: Table, miss: Missing) -> Table:
    if ctx.paper is not None:
        table.notes.append(PAPER_NOTE)
    return only_ran(table, miss)

"""Assembling a report: the paper's tables and figures, then every study's findings
(:data:`pmnet.report.studies.STUDIES`), written under one directory (:func:`build_report`);
:func:`main_report` does it for a pipeline run directory (``RUN_DIR/results/*.json`` ->
``RUN_DIR/report/``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pmnet import stats
from pmnet.io import atomic_write_text
from pmnet.report.cells import Cell, finite
from pmnet.report.context import grids_phrase, not_run_line, row_names
from pmnet.report.facts import (
    _grid_from_meta,
    _pipeline_facts,
    _run_facts,
    _variants_from_meta,
    missing_results,
)
from pmnet.report.figures import (
    FigureResult,
    figure_training_curves,
    paper_figures,
    save_figure,
)
from pmnet.report.front import front_matter
from pmnet.report.page import RAW_RECORDS, html_page, markdown_page
from pmnet.report.paper_tables import paper_tables
from pmnet.report.studies import STUDIES, Findings
from pmnet.report.table import Table
from pmnet.report.trials import Trials
from pmnet.stats import CONDITIONS
from pmnet.store_layout import PHASE1_SEED_UNIT, StoreLayout, phase1_seed_of, read_store_record

#: list-valued columns of the comparison and Phase-1 frames, written to CSV as "s1 s2 ..."
LIST_COLUMNS = ("seeds", "missing_seeds", "phase1_seeds", "pairs_per_checkpoint")
#: ``data/claims.json``: the claims table (``tab:claims``) as data, one record per claim
#: (:func:`claim_records`); the pipeline logs it to its parent MLflow run
CLAIMS_FILE = "claims.json"


def claim_records(table: Table) -> list[dict[str, Any]]:
    """The rows of the claims table as data: ``claim`` (the row's text), ``estimate`` (ours:
    a paired effect in pp, or a mean recall in %), ``n`` (its seeds or checkpoints),
    ``ci_low`` / ``ci_high`` (its 95% CI), ``p`` and ``verdict``; what a row does not have
    is None."""
    col = {name: j for j, name in enumerate(table.columns)}

    def value(cell: Cell, attr: str = "value") -> float | None:
        v = getattr(cell, attr)
        return None if cell.is_missing or cell.kind in ("na", "text") or not finite(v) \
            else float(v)

    out = []
    for row in table.rows:
        ours, ci, p = row[col["Ours"]], row[col["95% CI"]], row[col["p"]]
        out.append({"claim": row[0].text, "estimate": value(ours),
                    "n": ours.n if value(ours) is not None else None,
                    "ci_low": value(ci), "ci_high": value(ci, "hi"), "p": value(p),
                    "verdict": row[col["Verdict"]].text or None})
    return out


def printed(tables: Sequence[Table]) -> tuple[list[Table], list[str]]:
    """Only what ran (issue 35): every table without its rows that hold no value of ours
    (named in a line under it), and one line naming the tables left with no row, which are
    not printed, each with the conditions that did not run and the grids that run them."""
    shown, empty = [], []
    for table in tables:
        dropped = table.prune()
        if dropped and table.rows:
            table.notes.append(not_run_line(row_names(table, dropped), []))
        (shown if table.rows else empty).append(table)
    if not empty:
        return shown, []
    groups: dict[tuple[str, ...], list[str]] = {}
    for table in empty:
        groups.setdefault(tuple(stats.ordered_conditions(table.absent)), []).append(table.id)
    parts = [f"{', '.join(ids)} (no trial of {', '.join(absent)}; {grids_phrase(absent)})"
             if absent else f"{', '.join(ids)} (no value of ours)"
             for absent, ids in groups.items()]
    return shown, [f"Not run here, so not printed: {'; '.join(parts)}."]


def study_findings(trials: Trials) -> list[Findings]:
    """The findings of every study whose results the trials hold, in registry order."""
    return [study.build(trials) for study in STUDIES if study.recognise(trials)]


def build_tables(
    df: pd.DataFrame,
    paper: stats.PaperReference | None = None,
    comparisons: pd.DataFrame | None = None,
    expected_seeds: Sequence[int] | None = None,
) -> list[Table]:
    """Every report table from a tidy per-trial frame: the paper's (over the trials
    :class:`Trials` scopes for them; ``comparisons``, if given, must be over those), then
    those of every study whose results are present (without a pipeline's records)."""
    seeds = list(expected_seeds) if expected_seeds is not None else stats.expected_seed_set(df)
    trials = Trials.build(df, seeds=seeds, paper=paper, comparisons=comparisons)
    tables = paper_tables(trials.ctx, trials.comparisons) if trials.paper_part else []
    return printed(tables + [t for found in study_findings(trials) for t in found.tables])[0]


def _resolve_paper(paper: stats.PaperReference | str | None
                   ) -> tuple[stats.PaperReference | None, str | None]:
    """The paper's numbers (``"auto"``: from the spec directory) and, when they are not
    shown, the note that says why."""
    if isinstance(paper, str):
        try:
            return stats.load_paper_reference(), None
        except (stats.SpecNotFoundError, ValueError) as exc:
            return None, f"The paper's reference numbers are not shown: {exc}"
    if paper is None:
        return None, "The paper's reference numbers are not shown (disabled)."
    return paper, None


def build_report(
    results_dir_or_df: str | os.PathLike[str] | pd.DataFrame,
    out_dir: str | os.PathLike[str],
    *,
    meta: Mapping[str, Any],
    curves: pd.DataFrame | None = None,
    paper: stats.PaperReference | str | None = "auto",
    expected_conditions: Sequence[str] | None = None,
    expected_seeds: Sequence[int] | None = None,
    diagnostics: pd.DataFrame | None = None,
) -> dict[str, Path]:
    """Build the report under ``out_dir``; returns the written paths by name.

    ``results_dir_or_df``: a results directory/file (read with :func:`stats.load_results`;
    its ``history`` lists become the Phase-2 training curves unless ``curves`` is given) or an
    already loaded tidy frame. ``meta``: what ran (preset, grid, git commit, phase1_sha256,
    hardware, wall time, ...); every key is printed. ``meta["grid"]`` (``{"conditions": [...],
    "seeds": [...]}``) sets the expected grid for the
    missing-results section unless ``expected_conditions``/``expected_seeds`` are given; the
    default is the paper's six conditions over every seed seen (or 42-46). ``paper="auto"``
    loads the paper's numbers from the spec directory and leaves them out (with a note) when
    it is absent; ``None`` leaves them out. ``diagnostics``: the trials' ``pmnet diagnose``
    records (:func:`stats.load_diagnostics`), read by the studies that use them.

    Written (atomically): ``report.html`` (self-contained; it opens with
    :func:`pmnet.report.front.figure_recall` and a three-sentence verdict, then the tables),
    ``report.md`` (figures linked),
    ``tables/<id>.md|.tex`` and ``tables/all_tables.tex``, ``figures/<id>.png|.pdf``,
    ``data/trials.csv|.parquet`` (every trial), ``data/summary.csv`` (per arm: a named variant
    is its own row), ``data/comparisons.csv`` (the paper's family), ``data/claims.json`` (the
    claims table as data, :func:`claim_records`) and each study's data files
    (``operator_comparisons.csv``, ``phase1_variance.csv``, ...).

    The paper's tables, figures and comparisons read the trials :class:`Trials` scopes for
    them (the default variant; the reference Phase-1 checkpoint when there are several; left
    out when only named variants ran); every study of
    :data:`pmnet.report.studies.STUDIES` whose results are present adds its findings. The
    expected trials of the missing-results section are conditions x variants x seeds. Without
    a study's results the report is exactly as without that study.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(results_dir_or_df, pd.DataFrame):
        df = results_dir_or_df
    else:
        df = stats.load_results(results_dir_or_df)
        if curves is None:
            curves = stats.load_histories(results_dir_or_df)
    paper, paper_note = _resolve_paper(paper)
    grid_conditions, grid_seeds = _grid_from_meta(meta)
    seeds = list(expected_seeds or grid_seeds or stats.expected_seed_set(df))
    trials = Trials.build(df, seeds=seeds, paper=paper, meta=meta, paper_note=paper_note,
                          diagnostics=diagnostics)

    tables = paper_tables(trials.ctx, trials.comparisons) if trials.paper_part else []
    figures = paper_figures(trials.base) if trials.paper_part else []
    findings = study_findings(trials)
    tables, not_printed = printed(tables + [t for found in findings for t in found.tables])
    figures += [f for found in findings for f in found.figures] + figure_training_curves(curves)
    families = {} if trials.comparisons is None else {"comparisons.csv": trials.comparisons}
    families.update({name: frame for found in findings
                     for name, frame in found.comparisons.items() if len(frame)})
    missing = _missing(trials, list(expected_conditions or grid_conditions or CONDITIONS),
                       list(families.values())) + [m for f in findings for m in f.missing]

    front, verdict = front_matter(trials, tables)  # what a person reads first (issue 64)
    paths = _write_figures([front, *figures], out / "figures")
    paths.update(_write_tables(tables, out / "tables"))
    data = {"summary.csv": stats.summarize(stats.by_arm(trials.derived)), **families}
    data.update({name: frame for found in findings for name, frame in found.data.items()})
    paths.update(_write_data(df, data, meta, out / "data"))
    claims = next((t for t in tables if t.id == "tab:claims"), None)
    if claims is not None:
        paths[CLAIMS_FILE] = atomic_write_text(out / "data" / CLAIMS_FILE, json.dumps(
            claim_records(claims), indent=1))
    else:  # an earlier build's claims are not this one's
        (out / "data" / CLAIMS_FILE).unlink(missing_ok=True)
    facts = _pipeline_facts(meta) + _run_facts(df)
    figure_files = {f.id: f"figures/{f.id}.png" for f in figures if f.figure is not None}
    figure_png = {f.id: paths[f"{f.id}.png"].read_bytes() for f in figures
                  if f.figure is not None}
    paths["markdown"] = atomic_write_text(out / "report.md", markdown_page(
        meta, facts, tables, figures, figure_files, missing, trials.notes, not_printed))
    if front.figure is not None:
        figure_png[front.id] = paths[f"{front.id}.png"].read_bytes()
    paths["html"] = atomic_write_text(out / "report.html", html_page(
        meta, facts, tables, figures, figure_png, missing, trials.notes, not_printed,
        front=front, verdict=verdict))
    for fig in [front, *figures]:
        if fig.figure is not None:
            fig.figure.clear()
    return paths


def _missing(trials: Trials, conditions: list[str], families: list[pd.DataFrame]
             ) -> list[str]:
    """The missing-results lines: the expected trials are conditions x the grid's variants x
    seeds, or, when no grid names the variants that ran, the paper's conditions and those
    variants' arms."""
    variants = list(_variants_from_meta(trials.meta)) or [""]
    expected_arms = None
    if stats.has_variant_results(trials.derived) and variants == [""]:
        ran = dict.fromkeys(zip(trials.derived["condition"], trials.derived["variant"]))
        expected_arms = [(c, "") for c in conditions] + [a for a in ran if a[1]]
    families = [f for f in families if len(f)]
    comparisons = (pd.concat(families, ignore_index=True) if len(families) > 1
                   else (families[0] if families else None))
    return missing_results(trials.derived, conditions, trials.seeds, comparisons,
                           variants=variants, expected_arms=expected_arms)


def _write_figures(figures: Sequence[FigureResult], fig_dir: Path) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    for fig in figures:
        if fig.figure is not None:
            saved = save_figure(fig, fig_dir)
            paths[f"{fig.id}.png"], paths[f"{fig.id}.pdf"] = saved["png"], saved["pdf"]
    return paths


def _write_tables(tables: Sequence[Table], table_dir: Path) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    for table in tables:
        stem = table.id.replace(":", "-")
        paths[f"{stem}.md"] = atomic_write_text(table_dir / f"{stem}.md", table.to_markdown())
        paths[f"{stem}.tex"] = atomic_write_text(table_dir / f"{stem}.tex", table.to_latex())
    paths["all_tables.tex"] = atomic_write_text(
        table_dir / "all_tables.tex",
        "% generated by pmnet.report; needs booktabs\n" + "\n".join(t.to_latex() for t in tables),
    )
    return paths


def _write_data(df: pd.DataFrame, frames: Mapping[str, pd.DataFrame], meta: Mapping[str, Any],
                data_dir: Path) -> dict[str, Path]:
    """The tidy table of every trial, each frame by its file name (list columns as "a b"),
    and the pipeline's raw records."""
    tidy = stats.write_tidy(df, data_dir)
    paths = {"trials.csv": tidy["csv"], "trials.parquet": tidy["parquet"]}
    for name, frame in frames.items():
        flat = frame.copy()
        for col in LIST_COLUMNS:
            if col in flat.columns:
                flat[col] = flat[col].map(lambda v: " ".join(str(s) for s in v))
        paths[name] = atomic_write_text(data_dir / name, flat.to_csv(index=False))
    paths[RAW_RECORDS] = atomic_write_text(
        data_dir / RAW_RECORDS, json.dumps(dict(meta), indent=1, sort_keys=True, default=str))
    return paths



#: Run-directory JSON files whose keys go into the report's "What ran" section: the
#: pipeline's record at the top level, the others each under its own key.
_META_FILE = "pipeline.json"
_NESTED_META_FILES = {"timing.json": "timing", "phase1/stage1.json": "phase1"}


def _read_json_dict(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _collect_curves(run_dir: Path, results: Path, report_dir: Path,
                    files: Sequence[Path] | None = None) -> pd.DataFrame | None:
    """Phase-2 curves from the result histories (every result file carries one; ``files``:
    those of ``results`` to read, default all); the other phases from ``metrics*.csv``
    files (Lightning's CSVLogger) outside ``trials/``, whose Phase-2 logs repeat the
    histories."""
    frames = []
    histories = stats.load_histories(results if files is None else files)
    if not histories.empty:
        frames.append(histories)
    for csv in sorted(run_dir.rglob("metrics*.csv")):
        if report_dir in csv.parents or results in csv.parents:
            continue
        if "trials" in csv.relative_to(run_dir).parts:
            continue
        try:
            frames.append(stats.curves_from_metrics_csv(csv))
        except (OSError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError):
            continue
    return pd.concat(frames, ignore_index=True) if frames else None


def main_report(
    run_dir: str | os.PathLike[str], *, meta: Mapping[str, Any] | None = None,
    units: str | os.PathLike[str] | None = None, trials: Iterable[str] | None = None,
) -> dict[str, Path]:
    """Report for a pipeline run or a durable store (`pmnet.store_layout`, laid out like a
    run): ``UNITS/results/*.json`` -> ``RUN_DIR/report/``. ``units``: the store the run's
    units landed in (default ``run_dir``, a run that is its own store); ``trials``: the
    names of the trials to read from it (default every one: a store's report).

    "What ran" merges ``run_dir`` with the keys of ``RUN_DIR/pipeline.json``, ``timing.json`` under
    ``timing``, ``phase1/stage1.json`` under ``phase1``, each ``phase1-p1s<k>/stage1.json``
    under ``phase1_checkpoints`` (with the unit's ``diagnose.json`` as its ``routes`` where the
    record has none) and a store's ``store.json`` under ``store`` (its named subsets, e.g. the
    confirmatory Phase-1 seeds, are read by the checkpoint section); ``meta`` overrides them.
    The trials' ``diagnostics/<trial>.json`` are read by the studies that use them. Training
    curves come from the result histories and any ``metrics*.csv`` under the run directory
    (phase from a ``phaseN`` path component).
    """
    run = Path(run_dir)
    store = Path(units) if units is not None else run
    results = store / "results"
    if not results.is_dir():
        raise FileNotFoundError(f"no results directory at {results} (expected RESULTS/*.json)")
    files = None  # every result of the store
    if trials is not None:
        names = set(trials)
        files = [p for p in sorted(results.glob("*.json")) if p.stem in names]
    merged: dict[str, Any] = {"run_dir": str(run.resolve())}
    for key, value in (_read_json_dict(run / _META_FILE) or {}).items():
        merged.setdefault(key, value)
    for name, key in _NESTED_META_FILES.items():
        loaded = _read_json_dict((store if name.startswith("phase1") else run) / name)
        if loaded is not None and key not in merged:
            merged[key] = loaded
    layout = StoreLayout(store)
    checkpoints = {}  # K Phase-1 checkpoints: phase1-p1s<k>/stage1.json
    for path in sorted(store.glob(f"{PHASE1_SEED_UNIT}*/stage1.json")):
        loaded = _read_json_dict(path)
        k = phase1_seed_of(path.parent.name)
        if loaded is not None and k is not None:
            if not loaded.get("routes"):
                loaded["routes"] = _read_json_dict(layout.phase1_diagnose(k))
            checkpoints[str(k)] = loaded
    if checkpoints and "phase1_checkpoints" not in merged:
        merged["phase1_checkpoints"] = checkpoints
    record = read_store_record(store)
    if record is not None and "store" not in merged:
        merged["store"] = record.to_dict()
    merged.update(meta or {})
    report_dir = run / "report"
    curves = _collect_curves(run, results, report_dir, files)
    return build_report(results if files is None else files, report_dir, meta=merged, curves=curves,
                        diagnostics=stats.load_diagnostics(layout.diagnostics_dir))

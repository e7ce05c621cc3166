"""Statistics over Phase-2 trial results (paper Section 6.3 "Metrics and statistics").

Every Phase-2 trial writes one JSON file (condition, seed, provenance, ``val``/``test`` metric
dicts, ``history``). This module turns those files into a tidy per-trial table and computes
what the paper reports from it:

* mean +- sample SD (ddof=1) over seeds per condition and metric (:func:`summarize`);
* paired-by-seed differences with a t-distribution 95% CI, a paired t-test, the effect size
  d_z and Holm-corrected p values over the paper's family of comparisons
  (:func:`paired_comparison`, :data:`COMPARISONS`, :func:`compare_all`).

A paired comparison never drops a seed silently: a seed present on only one side is named in
the ``note`` and ``missing_seeds`` columns, and degenerate cases (fewer than two paired seeds,
all differences equal) carry an explicit note instead of a silent NaN.

The paper's own numbers (``paper-aggregates.csv`` and ``paper-per-seed.csv`` in the spec
directory) can be loaded (:func:`paper_aggregates`, :func:`paper_per_seed`) and the per-seed
numbers pivoted into the same layout as :func:`load_results`
(:func:`per_seed_frame_from_paper`), so the paper's values go through the same statistics.
The spec directory is ``$PMNET_SPEC_DIR`` or ``<repo root>/../shared/spec``.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.weightstats import DescrStatsW

from pmnet.conditions import CONDITIONS as _CONDITIONS
from pmnet.conditions import OPERATOR_CONDITIONS as _OPERATOR_CONDITIONS
from pmnet.conditions import OPERATOR_REFERENCE, PAPER_SEEDS
from pmnet.io import atomic_path, atomic_write_text
from pmnet.trial_id import DEFAULT_VARIANT, TrialId, as_int

# ------------------------------------------------------------------------------------------
# vocabulary
# ------------------------------------------------------------------------------------------

#: Condition names in the paper's order, and their table labels (from pmnet.conditions).
CONDITIONS: tuple[str, ...] = tuple(_CONDITIONS)
#: The consolidation-operator conditions (beyond the paper), in their defined order.
OPERATOR_CONDITIONS: tuple[str, ...] = tuple(_OPERATOR_CONDITIONS)
CONDITION_LABELS: dict[str, str] = {
    n: c.label for n, c in {**_CONDITIONS, **_OPERATOR_CONDITIONS}.items()
}

#: Per-trial provenance columns of the tidy table, in order. ``condition``, ``seed`` and
#: ``variant`` are the trial's identity (:class:`pmnet.trial_id.TrialId`; ``variant`` is ""
#: for the default variant).
META_COLUMNS: tuple[str, ...] = (
    "condition",
    "seed",
    "variant",
    "preset",
    "phase1_sha256",
    "best_epoch",
    "trainable_params",
    "total_params",
    "trainable_fraction",
    "train_time_s",
)
_IDENTITY = ("condition", "seed", "variant")
_STRING_META = ("preset", "phase1_sha256")
#: Where each trial trained (`pmnet.train.trained_on`): columns only when a result has them
#: (results written before they were recorded keep the table as it was).
DEVICE_COLUMNS = ("device", "precision")
_NUMERIC_META = tuple(c for c in META_COLUMNS if c not in _IDENTITY + _STRING_META)
#: Numeric columns that describe the run rather than measure it (never summarised).
_NOT_METRICS = frozenset({"seed", "phase1_seed", "trainable_params", "total_params",
                          "trainable_fraction", "last_epoch"})
#: ``df.attrs`` key listing the TrainConfig fields that some trial's variant overrides (each a
#: column of the tidy table, never summarised as a metric)
VARIANT_FIELDS_ATTR = "variant_fields"

#: Optional column of the tidy table: the seed of the Phase-1 checkpoint a trial started from.
#: Present only when some result file carries a top-level ``phase1_seed`` (pipelines with K
#: Phase-1 checkpoints, issue 11); nullable integer (``Int64``), missing where a file has none.
PHASE1_SEED = "phase1_seed"

#: Prefix of the tidy columns of the last epoch's test metrics (result.json "test_last"),
#: beside the validation-selected epoch's (present only when some result has them).
LAST_PREFIX = "last_"

#: Test metrics in the order tables and CSVs show them; unknown metrics follow sorted.
KNOWN_METRICS: tuple[str, ...] = (
    "updated_ltm",
    "initial_ltm",
    "forced_identity",
    "forced_identity_initial",
    "alternative_mode",
    "fresh_ltm",
    "mismatched_ltm",
    "mismatched_donor_follow",
    "seg1_stm",
    "seg2_stm",
    "mean_stm",
    "dual",
)

_FAILED_STATUSES = frozenset({"failed", "failure", "error", "crashed", "killed", "oom"})
_EQUAL_TOL = 1e-9


def condition_label(condition: str) -> str:
    """Display name of a condition (the paper's wording), or the raw name if unknown."""
    return CONDITION_LABELS.get(condition, condition)


def ordered_conditions(names: Iterable[str]) -> list[str]:
    """The paper's condition order first, then the operator conditions, then unknown names
    sorted."""
    present = set(names)
    order = CONDITIONS + OPERATOR_CONDITIONS
    known = [c for c in order if c in present]
    return known + sorted(present - set(order))


# ------------------------------------------------------------------------------------------
# loading trial results
# ------------------------------------------------------------------------------------------


def _result_paths(paths_or_dir: str | os.PathLike[str] | Iterable[Any]) -> list[Path]:
    if isinstance(paths_or_dir, (str, os.PathLike)):
        p = Path(paths_or_dir)
        if p.is_dir():
            return sorted(p.glob("*.json"))
        if p.is_file():
            return [p]
        raise FileNotFoundError(f"no results directory or result file at {p}")
    return [Path(x) for x in paths_or_dir]


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read result file {path}: {exc}") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"malformed JSON in result file {path}: {exc.msg} "
            f"(line {exc.lineno}, column {exc.colno})"
        ) from exc
    if not isinstance(obj, dict):
        raise ValueError(
            f"result file {path}: the top level must be a JSON object, "
            f"got {type(obj).__name__}"
        )
    return obj


def _scalar(value: Any) -> float | None:
    """A JSON scalar as float (None -> NaN); None when it is not a number at all."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _flatten_metrics(
    block: Any, path: Path, section: str, warnings: list[str], prefix: str = ""
) -> dict[str, float]:
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise ValueError(
            f"result file {path}: '{section}' must be a JSON object of metrics, "
            f"got {type(block).__name__}"
        )
    out: dict[str, float] = {}
    for key, value in block.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten_metrics(value, path, section, warnings, prefix=f"{name}_"))
            continue
        num = _scalar(value)
        if num is None:
            warnings.append(
                f"{path.name}: {section}.{name} is not a number ({type(value).__name__}); ignored"
            )
            continue
        out[name] = num
    return out


def _parse_seed(value: Any, path: Path) -> int:
    try:
        return as_int(value, "'seed'")
    except ValueError as e:
        raise ValueError(f"result file {path}: {e}") from None


def _metric_order(names: Iterable[str]) -> list[str]:
    names = set(names)
    rank = {m: i for i, m in enumerate(KNOWN_METRICS)}

    def key(name: str) -> tuple[int, int, str]:
        # base metrics in the known order, each followed by its variants (_add10, ...)
        for i, base in enumerate(KNOWN_METRICS):
            if name == base:
                return (i, 0, "")
            if name.startswith(base + "_"):
                return (i, 1, name)
        if name.startswith("loss"):
            return (len(rank) + 1, 0, name)
        return (len(rank), 0, name)

    return sorted(names, key=key)


def load_results(paths_or_dir: str | os.PathLike[str] | Iterable[Any]) -> pd.DataFrame:
    """Load Phase-2 trial result JSON files into a tidy per-trial table.

    ``paths_or_dir`` is a directory (every ``*.json`` in it), one file, or an iterable of
    files. The result has one row per trial (:class:`pmnet.trial_id.TrialId`: condition,
    seed, variant) with the columns of :data:`META_COLUMNS`, ``source_file``, one column per
    TrainConfig field that a trial's variant overrides (the trial's value of that field:
    its variant's, else the one in its ``config``; listed in
    ``df.attrs["variant_fields"]``), every ``test`` metric as its own column (nested objects
    are flattened with ``_``) and every ``val`` metric as ``val_<name>``. ``variant`` is ""
    for trials of the default variant (every result file written before variants existed).

    A top-level ``phase1_seed`` (the Phase-1 checkpoint the trial started from, when a
    pipeline trains K Phase-1 checkpoints) becomes the :data:`PHASE1_SEED` column, right after
    ``seed``, as a nullable integer (missing for files without it); rows are then ordered by
    condition, Phase-1 seed, seed. When no file carries it the column is absent and the table
    is exactly as before.

    A file that is not valid JSON, not an object, or lacks a usable ``condition``/``seed``
    (or has an invalid ``variant``, or a ``phase1_seed`` that is not an integer) raises
    ``ValueError`` naming the file; so does a second file for the same trial. A file whose
    ``status`` says it failed is not a row: it is recorded in ``df.attrs["failed"]`` (file,
    condition, variant, seed, phase1_seed when present, error) for the report's
    missing-results section. Non-numeric metric values are ignored and listed in
    ``df.attrs["warnings"]``.
    """
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    warnings: list[str] = []
    seen: dict[TrialId, Path] = {}
    any_phase1 = False
    any_device = False
    test_names: set[str] = set()
    val_names: set[str] = set()
    last_names: set[str] = set()
    variant_fields: dict[str, None] = {}  # ordered set
    for path in _result_paths(paths_or_dir):
        obj = _read_json_object(path)
        condition = obj.get("condition")
        if not isinstance(condition, str) or not condition.strip():
            raise ValueError(f"result file {path}: missing or invalid 'condition' ({condition!r})")
        if "seed" not in obj:
            raise ValueError(f"result file {path}: missing 'seed'")
        seed = _parse_seed(obj["seed"], path)
        try:
            trial = TrialId.from_result({**obj, "seed": seed})
        except ValueError as exc:
            raise ValueError(f"result file {path}: {exc}") from exc
        phase1_seed = trial.phase1_seed
        any_phase1 = any_phase1 or phase1_seed is not None
        status = obj.get("status")
        if isinstance(status, str) and status.strip().lower() in _FAILED_STATUSES:
            record: dict[str, Any] = {"file": path.name, "condition": condition,
                                      "variant": trial.variant, "seed": seed}
            if phase1_seed is not None:
                record[PHASE1_SEED] = phase1_seed
            record["error"] = str(obj.get("error") or obj.get("message") or status)
            failed.append(record)
            continue
        if trial in seen:
            which = f" variant {trial.variant!r}" if trial.variant else ""
            p1 = "" if phase1_seed is None else f" phase1_seed {phase1_seed}"
            raise ValueError(
                f"duplicate result for condition {condition!r}{which} seed {seed}{p1}: "
                f"{seen[trial]} and {path}"
            )
        seen[trial] = path
        row: dict[str, Any] = {"condition": condition, "seed": seed, "variant": trial.variant,
                               "source_file": path.name, PHASE1_SEED: phase1_seed}
        for name in _STRING_META + DEVICE_COLUMNS:
            value = obj.get(name)
            row[name] = None if value is None else str(value)
        any_device = any_device or any(obj.get(n) is not None for n in DEVICE_COLUMNS)
        for name in _NUMERIC_META:
            num = _scalar(obj.get(name))
            if num is None:
                warnings.append(f"{path.name}: {name} is not a number; ignored")
                num = math.nan
            row[name] = num
        overrides = obj.get("variant_overrides") or {}
        if not isinstance(overrides, Mapping):
            raise ValueError(f"result file {path}: 'variant_overrides' must be a JSON object, "
                             f"got {type(overrides).__name__}")
        variant_fields.update(dict.fromkeys(overrides))
        row["_overrides"], row["_config"] = dict(overrides), obj.get("config") or {}
        test = _flatten_metrics(obj.get("test"), path, "test", warnings)
        val = _flatten_metrics(obj.get("val"), path, "val", warnings)
        test_names.update(test)
        val_names.update(val)
        row.update(test)
        row.update({f"val_{k}": v for k, v in val.items()})
        if obj.get("test_last") is not None:  # the last epoch's weights (issue 21)
            last = _flatten_metrics(obj.get("test_last"), path, "test_last", warnings)
            last_names.update(last)
            row.update({f"{LAST_PREFIX}{k}": v for k, v in last.items()})
            row["last_epoch"] = _scalar(obj.get("last_epoch"))
        rows.append(row)

    fields = [f for f in variant_fields if f not in META_COLUMNS]
    for row in rows:  # the trial's value of each overridden field (its variant's, else its own)
        overrides, config = row.pop("_overrides"), row.pop("_config")
        for name in fields:
            row[name] = overrides.get(name, config.get(name) if isinstance(config, Mapping)
                                      else None)
    columns = list(META_COLUMNS) + ["source_file"] + fields
    if any_device:
        columns[columns.index("phase1_sha256") + 1:columns.index("phase1_sha256") + 1] = list(
            DEVICE_COLUMNS)
    if any_phase1:
        columns.insert(columns.index("seed") + 1, PHASE1_SEED)
    columns += [m for m in _metric_order(test_names) if m not in columns]
    columns += [f"val_{m}" for m in _metric_order(val_names)]
    if last_names:  # only results that recorded the last epoch's test metrics
        columns += ["last_epoch"] + [f"{LAST_PREFIX}{m}" for m in _metric_order(last_names)]
    df = pd.DataFrame(rows, columns=columns)
    df["seed"] = df["seed"].astype("int64")
    df["variant"] = df["variant"].fillna(DEFAULT_VARIANT).astype(str)
    if any_phase1:
        df[PHASE1_SEED] = df[PHASE1_SEED].astype("Int64")
    keep = ("condition", "seed", PHASE1_SEED, "variant", "source_file") + _STRING_META \
        + DEVICE_COLUMNS + tuple(fields)
    numeric = [n for n in df.columns if n not in keep]
    df = pd.concat([df.drop(columns=numeric),  # one block per dtype, not one insert per column
                    df[numeric].apply(pd.to_numeric, errors="coerce").astype("float64")],
                   axis=1)[list(df.columns)]
    for name in fields:  # numbers stay numbers (segments), words stay words (ltm_graph)
        try:
            df[name] = pd.to_numeric(df[name])
        except (TypeError, ValueError):
            df[name] = df[name].astype(object)
    df = _sort_trials(df)
    df.attrs["failed"] = failed
    df.attrs["warnings"] = warnings
    df.attrs[VARIANT_FIELDS_ATTR] = fields
    return df


def _sort_trials(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df.reset_index(drop=True)
    order = {c: i for i, c in enumerate(ordered_conditions(df["condition"]))}
    key = df["condition"].map(order)
    by = ["_order"] + [c for c in ("variant", PHASE1_SEED) if c in df.columns] + ["seed"]
    return (
        df.assign(_order=key)
        .sort_values(by, kind="stable")
        .drop(columns="_order")
        .reset_index(drop=True)
    )


def load_histories(paths_or_dir: str | os.PathLike[str] | Iterable[Any]) -> pd.DataFrame:
    """Training curves from the ``history`` lists of result files, in long form.

    Columns: phase, condition, variant, seed, epoch, step, metric, value, and
    :data:`PHASE1_SEED` after seed when some file carries one. ``phase`` is the file's
    ``phase`` key when present, else ``"phase2"`` (result files are Phase-2 trials);
    ``variant`` is the trial's variant ("" for the default). Files that fail to parse raise
    like :func:`load_results`; non-numeric entries are skipped.
    """
    records: list[dict[str, Any]] = []
    any_phase1 = False
    for path in _result_paths(paths_or_dir):
        obj = _read_json_object(path)
        history = obj.get("history")
        if not isinstance(history, list):
            continue
        phase = str(obj.get("phase") or "phase2")
        condition = obj.get("condition")
        seed = obj.get("seed")
        phase1_seed = obj.get(PHASE1_SEED)
        any_phase1 = any_phase1 or phase1_seed is not None
        variant = str(obj.get("variant") or DEFAULT_VARIANT)
        for i, entry in enumerate(history):
            if not isinstance(entry, Mapping):
                continue
            epoch = _scalar(entry.get("epoch"))
            step = _scalar(entry.get("step"))
            for key, value in entry.items():
                if key in ("epoch", "step"):
                    continue
                num = _scalar(value)
                if num is None or math.isnan(num):
                    continue
                records.append(
                    {
                        "phase": phase,
                        "condition": condition,
                        "variant": variant,
                        "seed": seed,
                        PHASE1_SEED: phase1_seed,
                        "epoch": float(i) if epoch is None or math.isnan(epoch) else epoch,
                        "step": math.nan if step is None else step,
                        "metric": str(key),
                        "value": num,
                    }
                )
    cols = ["phase", "condition", "variant", "seed", "epoch", "step", "metric", "value"]
    if any_phase1:
        cols.insert(4, PHASE1_SEED)
    return pd.DataFrame(records, columns=cols)


def curves_from_metrics_csv(path: str | os.PathLike[str], phase: str | None = None) -> pd.DataFrame:
    """A metrics CSV as long (phase, epoch, step, metric, value) rows.

    Accepts either a long CSV (columns ``metric`` and ``value``) or a wide one with one column
    per metric (Lightning's CSVLogger layout: ``epoch``, ``step``, ``train/loss``, ...).
    """
    path = Path(path)
    raw = pd.read_csv(path)
    if phase is None:
        found = re.search(r"phase[-_]?(\d+)", str(path), flags=re.IGNORECASE)
        phase = f"phase{found.group(1)}" if found else path.stem
    if {"metric", "value"} <= set(raw.columns):
        out = raw.copy()
        if "phase" not in out.columns:
            out["phase"] = phase
    else:
        ids = [c for c in ("epoch", "step", "condition", "seed") if c in raw.columns]
        out = raw.melt(id_vars=ids, var_name="metric", value_name="value")
        out["phase"] = phase
    out["value"] = pd.to_numeric(out["value"], errors="coerce")
    return out.dropna(subset=["value"]).reset_index(drop=True)


def write_tidy(df: pd.DataFrame, out_dir: str | os.PathLike[str], stem: str = "trials") -> dict:
    """Write the tidy table as ``<stem>.csv`` and ``<stem>.parquet`` (atomic writes)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plain = pd.DataFrame(df)
    plain.attrs = {}
    csv_path = atomic_write_text(out / f"{stem}.csv", plain.to_csv(index=False))
    parquet_path = out / f"{stem}.parquet"
    with atomic_path(parquet_path) as tmp:
        plain.to_parquet(tmp, index=False)
    return {"csv": csv_path, "parquet": parquet_path}


def add_derived_metrics(df: pd.DataFrame) -> pd.DataFrame:
    """Fill metrics that are defined in terms of others, where a trial did not report them.

    * ``dual`` = mean(``updated_ltm``, ``mean_stm``) (the paper's "test dual");
    * ``alternative_mode`` = ``forced_identity`` for learned conditions (every condition but
      ``identity_full``, whose alternative mode is its frozen learned path).

    Reported values are never overwritten. Returns a copy.
    """
    out = df.copy()
    if {"updated_ltm", "mean_stm"} <= set(out.columns):
        derived = (out["updated_ltm"] + out["mean_stm"]) / 2.0
        out["dual"] = out["dual"].fillna(derived) if "dual" in out.columns else derived
    if "forced_identity" in out.columns:
        learned = out["condition"] != "identity_full"
        fill = out["forced_identity"].where(learned)
        if "alternative_mode" in out.columns:
            out["alternative_mode"] = out["alternative_mode"].fillna(fill)
        else:
            out["alternative_mode"] = fill
    return out


# ------------------------------------------------------------------------------------------
# summaries and paired comparisons
# ------------------------------------------------------------------------------------------


def metric_columns(df: pd.DataFrame) -> list[str]:
    """Numeric measurement columns of a tidy table (test metrics, val_*, best_epoch, time);
    not the identity, provenance or variant-field columns."""
    out = []
    skip = set(_IDENTITY + ("source_file",) + _STRING_META)
    skip |= set(df.attrs.get(VARIANT_FIELDS_ATTR, ()))
    for name in df.columns:
        if name in _NOT_METRICS or name in skip:
            continue
        if pd.api.types.is_numeric_dtype(df[name]):
            out.append(name)
    return out


def seed_values(df: pd.DataFrame, condition: str, metric: str) -> pd.Series:
    """The non-missing values of ``metric`` for ``condition``, indexed by seed."""
    if df.empty or metric not in df.columns:
        return pd.Series(dtype="float64", name=metric)
    rows = df[df["condition"] == condition]
    values = pd.to_numeric(rows[metric], errors="coerce")
    values.index = rows["seed"].astype("int64").to_numpy()
    return values.dropna().sort_index()


def summarize(df: pd.DataFrame, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Per condition and metric: n (non-missing seeds), mean and sample SD (ddof=1).

    SD is NaN when n < 2. Metrics without any value for a condition are omitted.
    """
    metrics = list(metrics) if metrics is not None else metric_columns(df)
    rows = []
    conditions = ordered_conditions(df["condition"]) if not df.empty else []
    for condition in conditions:
        for metric in metrics:
            values = seed_values(df, condition, metric)
            n = int(values.size)
            if n == 0:
                continue
            rows.append(
                {
                    "condition": condition,
                    "metric": metric,
                    "n": n,
                    "mean": float(values.mean()),
                    "sd": float(values.std(ddof=1)) if n > 1 else math.nan,
                }
            )
    return pd.DataFrame(rows, columns=["condition", "metric", "n", "mean", "sd"])


def _seed_word(seeds: Sequence[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in seeds)


def paired_comparison(
    df: pd.DataFrame,
    cond_a: str,
    metric_a: str,
    cond_b: str,
    metric_b: str,
    label: str | None = None,
    *,
    paper_table: str | None = None,
    expected_seeds: Iterable[int] | None = None,
    remark: str | None = None,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """Paired-by-seed difference ``(cond_a, metric_a) - (cond_b, metric_b)``.

    Seeds are inner-joined; every seed seen on either side (or listed in ``expected_seeds``)
    that is not paired is listed in ``missing_seeds`` and in ``note``
    (``"seed 45 missing in consolidator_only_routing_off; n=4"``).

    Returns n, paired seeds, mean and SD of each side over the paired seeds, mean and sample SD
    of the differences, the t-distribution ``1 - alpha`` CI of the mean difference, the paired
    t statistic, its two-sided p value (statsmodels ``DescrStatsW``), the effect size
    d_z = mean / SD, and ``note``. With fewer than two paired seeds, or all differences equal
    (SD = 0), t, p and the CI are NaN and the note says why.
    """
    label = label or f"{cond_a}:{metric_a} - {cond_b}:{metric_b}"
    sides = []
    for condition, metric in ((cond_a, metric_a), (cond_b, metric_b)):
        present: set[int] = set()
        if not df.empty:
            present = set(df.loc[df["condition"] == condition, "seed"].astype(int))
        sides.append((condition, metric, present, seed_values(df, condition, metric)))
    (_, _, present_a, values_a), (_, _, present_b, values_b) = sides
    paired = sorted(set(values_a.index) & set(values_b.index))
    candidates = present_a | present_b | set(expected_seeds or ())
    unpaired = sorted(candidates - set(paired))

    # why each unpaired seed is unpaired, grouped by reason (order: side a, side b)
    reasons: dict[str, list[int]] = {}
    for seed in unpaired:
        for condition, metric, present, values in sides:
            if seed not in present:
                reason = f"missing in {condition}"
            elif seed not in values.index:
                reason = f"without {metric} in {condition}"
            else:
                continue
            if seed not in reasons.setdefault(reason, []):
                reasons[reason].append(seed)
    notes = []
    for reason, seeds in reasons.items():
        condition = reason.rsplit(" in ", 1)[1]
        present = present_a if condition == cond_a else present_b
        if not present:
            notes.append(f"no results for {condition} ({_seed_word(seeds)})")
            continue
        if reason.startswith("without ") and set(seeds) == present:
            # the metric is absent from every trial of that condition: say so once
            metric = reason[len("without ") :].rsplit(" in ", 1)[0]
            notes.append(f"{metric} not reported by {condition} ({_seed_word(seeds)})")
        else:
            notes.append(f"{_seed_word(seeds)} {reason}")
    head = []
    for condition, present in ((cond_a, present_a), (cond_b, present_b)):
        said = any(n.startswith(f"no results for {condition}") for n in notes + head)
        if not present and not said:
            head.append(f"no results for {condition}")
    notes = head + notes

    n = len(paired)
    a = values_a.loc[paired].to_numpy(dtype=float) if n else np.array([])
    b = values_b.loc[paired].to_numpy(dtype=float) if n else np.array([])
    diffs = a - b
    nan = math.nan
    result: dict[str, Any] = {
        "label": label,
        "paper_table": paper_table,
        "cond_a": cond_a,
        "metric_a": metric_a,
        "cond_b": cond_b,
        "metric_b": metric_b,
        "n": n,
        "seeds": list(paired),
        "missing_seeds": list(unpaired),
        "mean_a": float(a.mean()) if n else nan,
        "sd_a": float(a.std(ddof=1)) if n > 1 else nan,
        "mean_b": float(b.mean()) if n else nan,
        "sd_b": float(b.std(ddof=1)) if n > 1 else nan,
        "mean_diff": float(diffs.mean()) if n else nan,
        "sd_diff": nan,
        "ci_low": nan,
        "ci_high": nan,
        "t": nan,
        "df": n - 1 if n > 1 else nan,
        "p": nan,
        "d_z": nan,
        "note": "",
    }
    if notes:
        notes.append(f"n={n}")
    if n == 0:
        notes.append("no paired seeds; nothing to compare")
    elif n == 1:
        notes.append("fewer than 2 paired seeds (n=1); SD, CI and t-test undefined")
    else:
        mean = float(diffs.mean())
        if float(np.ptp(diffs)) <= _EQUAL_TOL * max(1.0, abs(mean)):
            result["sd_diff"] = 0.0
            notes.append(f"all paired differences equal ({mean:+.2f}); t-test undefined")
        else:
            stats = DescrStatsW(diffs)
            t_stat, p_value, _ = stats.ttest_mean(0.0)
            low, high = stats.tconfint_mean(alpha=alpha)
            sd = float(diffs.std(ddof=1))
            result.update(
                sd_diff=sd,
                ci_low=float(low),
                ci_high=float(high),
                t=float(t_stat),
                p=float(p_value),
                d_z=mean / sd,
            )
    if remark:
        notes.append(remark)
    result["note"] = "; ".join(notes)
    return result


class Comparison(NamedTuple):
    """One paired comparison of the paper's family: ``(cond_a, metric_a) - (cond_b, metric_b)``."""

    label: str
    cond_a: str
    metric_a: str
    cond_b: str
    metric_b: str
    paper_table: str


def _build_comparisons() -> tuple[Comparison, ...]:
    on, off = "consolidator_only", "consolidator_only_routing_off"
    out = [
        Comparison(f"routing on - off: {m}", on, m, off, m, table)
        for m, table in (
            ("updated_ltm", "tab:direct-ltm-routing"),
            ("updated_ltm_add10", "tab:routing-rule-family"),
            ("updated_ltm_affine10", "tab:routing-rule-family"),
            ("seg2_stm", "tab:direct-ltm-routing"),
        )
    ]
    out += [
        Comparison(
            "learned - forced identity, routing on: updated_ltm",
            on, "updated_ltm", on, "forced_identity", "tab:same-address-update",
        ),
        Comparison(
            "learned - forced identity, routing off: updated_ltm",
            off, "updated_ltm", off, "forced_identity", "tab:direct-ltm-routing",
        ),
        Comparison(
            "learned_full - identity_full: updated_ltm",
            "learned_full", "updated_ltm", "identity_full", "updated_ltm",
            "sec:core-parameter-isolation",
        ),
    ]
    out += [
        Comparison(
            f"dual - LTM only: {m}", "learned_full_dual", m, "learned_full", m,
            "tab:dual-objective-aggregate",
        )
        for m in ("updated_ltm", "mean_stm", "seg2_stm")
    ]
    for control, name in (("mismatched_ltm", "mismatched"), ("fresh_ltm", "fresh")):
        out += [
            Comparison(
                f"correct - {name} LTM: {c}", c, "updated_ltm", c, control,
                "sec:recall-requires-the-correct-latent-experience",
            )
            for c in CONDITIONS
        ]
    out += [
        Comparison(
            f"recall - output-set baseline: {c}", c, "updated_ltm", c, "updated_ltm_baseline",
            "ours:shortcut-diagnostics",
        )
        for c in CONDITIONS
    ]
    out += [
        Comparison(
            f"recall - output-set baseline, {fam}: {c}", c, f"updated_ltm_{fam}", c,
            f"updated_ltm_{fam}_baseline", "ours:shortcut-diagnostics",
        )
        for fam in ("add10", "affine10")
        for c in CONDITIONS
    ]
    return tuple(out)


#: The paper's family of paired comparisons (Holm correction runs over all of them).
COMPARISONS: tuple[Comparison, ...] = _build_comparisons()

#: Extra context appended to a comparison's note.
COMPARISON_REMARKS: dict[str, str] = {
    "learned_full - identity_full: updated_ltm": (
        "independently trained runs (the paper calls them unpaired); differences paired by seed"
    ),
    **{
        f"dual - LTM only: {m}": (
            "independently optimized objectives; paired by seed and data stream"
        )
        for m in ("updated_ltm", "mean_stm", "seg2_stm")
    },
    **{
        f"routing on - off: {m}": "separately trained Consolidators from one Phase-1 checkpoint"
        for m in ("updated_ltm", "updated_ltm_add10", "updated_ltm_affine10", "seg2_stm")
    },
}


def _build_operator_comparisons() -> tuple[Comparison, ...]:
    return tuple(
        Comparison(f"{c} - Consolidator: updated_ltm", c, "updated_ltm", OPERATOR_REFERENCE,
                   "updated_ltm", "ours:operators")
        for c in OPERATOR_CONDITIONS
    )


#: Beyond the paper: each consolidation operator against the Consolidator (the learned arm,
#: ``consolidator_only``) on updated-mapping LTM recall, paired by seed. A family of its own:
#: Holm runs over these four only, so the paper's family (:data:`COMPARISONS`) is unchanged.
OPERATOR_COMPARISONS: tuple[Comparison, ...] = _build_operator_comparisons()

COMPARISON_REMARKS.update({
    c.label: "separately trained operators from one Phase-1 checkpoint"
    for c in OPERATOR_COMPARISONS
})


def has_operator_results(df: pd.DataFrame) -> bool:
    """Whether any trial of an operator condition is in ``df``."""
    return not df.empty and bool(df["condition"].isin(OPERATOR_CONDITIONS).any())


def compare_operators(
    df: pd.DataFrame, *, expected_seeds: Iterable[int] | None = None, alpha: float = 0.05
) -> pd.DataFrame:
    """:func:`compare_all` over :data:`OPERATOR_COMPARISONS` (Holm within that family)."""
    return compare_all(df, OPERATOR_COMPARISONS, expected_seeds=expected_seeds, alpha=alpha)


def expected_seed_set(df: pd.DataFrame) -> list[int]:
    """Every seed seen in ``df`` (or the paper's seeds when ``df`` is empty)."""
    if df.empty:
        return list(PAPER_SEEDS)
    return sorted(set(df["seed"].astype(int)))


def compare_all(
    df: pd.DataFrame,
    comparisons: Sequence[Comparison] | None = None,
    *,
    expected_seeds: Iterable[int] | None = None,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """Every comparison of the family (default :data:`COMPARISONS`), one row each.

    ``expected_seeds`` defaults to every seed in ``df``, so a seed that ran for some condition
    but is absent from both sides of a comparison is still named in its note. ``p_holm`` is
    the Holm step-down adjusted p over the comparisons whose p is defined (``holm_m`` of
    them); undefined p values stay NaN and are not counted.
    """
    comparisons = COMPARISONS if comparisons is None else comparisons
    seeds = expected_seed_set(df) if expected_seeds is None else list(expected_seeds)
    rows = [
        paired_comparison(
            df,
            c.cond_a,
            c.metric_a,
            c.cond_b,
            c.metric_b,
            c.label,
            paper_table=c.paper_table,
            expected_seeds=seeds,
            remark=COMPARISON_REMARKS.get(c.label),
            alpha=alpha,
        )
        for c in comparisons
    ]
    out = pd.DataFrame(rows)
    if out.empty:
        out = pd.DataFrame(columns=["label", "p", "p_holm", "holm_m"])
        return out
    p = out["p"].to_numpy(dtype=float)
    finite = np.isfinite(p)
    holm = np.full(p.shape, np.nan)
    if finite.any():
        holm[finite] = multipletests(p[finite], method="holm")[1]
    out["p_holm"] = holm
    out["holm_m"] = int(finite.sum())
    return out


# ------------------------------------------------------------------------------------------
# Phase-1 variance: the Phase-1 checkpoint as a random factor (issue 11, beyond the paper)
# ------------------------------------------------------------------------------------------

#: The headline paired comparisons (the paired rows of the report's ``tab:headline``), in that
#: order: the effects :func:`phase1_variance` analyses across Phase-1 checkpoints by default.
PHASE1_COMPARISON_LABELS: tuple[str, ...] = (
    "routing on - off: updated_ltm",
    "learned - forced identity, routing off: updated_ltm",
    "learned - forced identity, routing on: updated_ltm",
    "learned_full - identity_full: updated_ltm",
    "dual - LTM only: mean_stm",
    "dual - LTM only: updated_ltm",
)
PHASE1_COMPARISONS: tuple[Comparison, ...] = tuple(
    next(c for c in COMPARISONS if c.label == label) for label in PHASE1_COMPARISON_LABELS
)

#: A fit whose between-checkpoint share of the variance (ICC) is below this is singular: the
#: REML estimate of the between-checkpoint variance sits on its boundary, 0.
SINGULAR_ICC = 1e-4


def _phase1_column(df: pd.DataFrame) -> pd.Series:
    """The Phase-1 seed of every row as float (NaN where missing); ValueError when the column
    is absent or holds a non-integer."""
    if PHASE1_SEED not in df.columns:
        raise ValueError(
            f"the trial table has no '{PHASE1_SEED}' column: its results come from one Phase-1 "
            "checkpoint (the result files carry no top-level phase1_seed), so there is no "
            "Phase-1 variance to analyse"
        )
    values = pd.to_numeric(df[PHASE1_SEED], errors="coerce").astype("float64")
    bad = values.notna() & (values != values.round())
    if bad.any():
        raise ValueError(f"'{PHASE1_SEED}' must hold integers, found {values[bad].iloc[0]!r}")
    return values


def phase1_seeds(df: pd.DataFrame) -> list[int]:
    """The distinct Phase-1 seeds of the trials, sorted ([] without a phase1_seed column)."""
    if PHASE1_SEED not in df.columns or df.empty:
        return []
    return sorted({int(v) for v in _phase1_column(df).dropna()})


def has_phase1_variance(df: pd.DataFrame) -> bool:
    """Whether the trials come from more than one Phase-1 checkpoint."""
    return len(phase1_seeds(df)) > 1


def reference_phase1_seed(df: pd.DataFrame) -> int | None:
    """The checkpoint the paper-layout analysis uses when there are several: the smallest
    Phase-1 seed (None without any)."""
    seeds = phase1_seeds(df)
    return seeds[0] if seeds else None


def at_phase1_seed(df: pd.DataFrame, phase1_seed: int) -> pd.DataFrame:
    """The trials that started from the Phase-1 checkpoint of ``phase1_seed`` (a copy, index
    reset, ``attrs`` kept, ``attrs["failed"]`` restricted to that checkpoint's records)."""
    out = df[(_phase1_column(df) == phase1_seed).to_numpy()].reset_index(drop=True)
    out.attrs = dict(df.attrs)
    if "failed" in df.attrs:  # failed trials of this checkpoint only
        out.attrs["failed"] = [r for r in df.attrs["failed"] if r.get(PHASE1_SEED) == phase1_seed]
    return out


@dataclass(frozen=True)
class CheckpointTest:
    """The paper's fixed-checkpoint analysis within one Phase-1 checkpoint: the paired-by-seed
    t-test of :func:`paired_comparison` over the trials of that checkpoint."""

    label: str
    phase1_seed: int
    n: int
    seeds: tuple[int, ...]
    missing_seeds: tuple[int, ...]
    mean_a: float
    mean_b: float
    mean_diff: float
    sd_diff: float
    ci_low: float
    ci_high: float
    t: float
    df: float
    p: float
    d_z: float
    note: str


@dataclass(frozen=True)
class Phase1Effect:
    """One headline effect with the Phase-1 checkpoint as a random factor.

    The model is ``diff_ij = mu + u_i + e_ij`` for the paired difference of Phase-2 seed j
    from Phase-1 checkpoint i, ``u_i ~ N(0, var_between)``, ``e_ij ~ N(0, var_residual)``,
    fitted by REML (statsmodels ``MixedLM``). ``estimate`` is mu with its ``se``; ``z`` =
    estimate / se. Two references for it: ``p_t`` / ``ci_low_t`` / ``ci_high_t`` use a t
    distribution with ``df_t`` = K - 1 degrees of freedom (exact for balanced designs; the
    report's primary numbers), ``p_wald`` / ``ci_*_wald`` the normal (statsmodels' Wald z).
    ``icc`` = var_between / (var_between + var_residual). ``mean_diff`` / ``sd_diff``
    describe all ``n`` pairs pooled (mean ± SD, as the paper prints differences).

    ``fitted`` is False when no mixed model was fitted or its fit was rejected; ``note`` then
    says why (K = 1, one pair per checkpoint, equal differences, a failed fit) and every
    model column is NaN. ``singular``: the between variance was estimated at its boundary 0.
    ``converged`` is statsmodels' flag for the kept fit (None when not fitted; a singular fit
    is kept even when the gradient optimisers call it unconverged, a non-singular one is
    not), ``optimizer`` the optimiser whose fit was kept (:func:`fit_random_intercept`);
    ``fit_warnings`` holds the warnings the fits raised (captured, never printed).
    """

    label: str
    cond_a: str
    metric_a: str
    cond_b: str
    metric_b: str
    paper_table: str
    k: int
    n: int
    phase1_seeds: tuple[int, ...]
    pairs_per_checkpoint: tuple[int, ...]
    mean_diff: float
    sd_diff: float
    estimate: float
    se: float
    z: float
    df_t: float
    p_t: float
    ci_low_t: float
    ci_high_t: float
    p_wald: float
    ci_low_wald: float
    ci_high_wald: float
    var_between: float
    var_residual: float
    sd_between: float
    sd_residual: float
    icc: float
    fitted: bool
    converged: bool | None
    singular: bool
    optimizer: str
    fit_warnings: str
    note: str


def _frame(rows: Sequence[Any], cls: type) -> pd.DataFrame:
    columns = [f.name for f in fields(cls)]
    return pd.DataFrame([asdict(r) for r in rows], columns=columns)


@dataclass(frozen=True)
class Phase1Analysis:
    """What :func:`phase1_variance` returns: one :class:`Phase1Effect` per comparison, one
    :class:`CheckpointTest` per (comparison, Phase-1 seed) in that order, and ``notes`` about
    trials left out of every comparison (rows without a Phase-1 seed)."""

    effects: tuple[Phase1Effect, ...]
    checkpoints: tuple[CheckpointTest, ...]
    notes: tuple[str, ...] = ()

    def effects_frame(self) -> pd.DataFrame:
        return _frame(self.effects, Phase1Effect)

    def checkpoints_frame(self) -> pd.DataFrame:
        return _frame(self.checkpoints, CheckpointTest)


class _MixedFit(NamedTuple):
    estimate: float
    se: float
    var_between: float
    var_residual: float
    converged: bool | None
    optimizer: str
    warnings: tuple[str, ...]
    error: str | None


#: Optimisers for a fit: statsmodels' default sequence (bfgs -> lbfgs -> cg), then, unless it
#: converged to an interior optimum, Powell and Nelder-Mead; the fit with the highest REML
#: log-likelihood is kept. Near the boundary (a small between variance) the gradient
#: methods can stop short of the optimum, unconverged; the derivative-free ones reach it.
MIXED_OPTIMIZERS: tuple[str, ...] = ("default", "powell", "nm")


def _gls_mean_and_se(
    diffs: np.ndarray, groups: np.ndarray, var_between: float, var_residual: float
) -> tuple[float, float]:
    """The GLS intercept and its SE (X' V^-1 X)^-1/2 of ``diffs ~ 1`` with a random intercept,
    given the variance components: checkpoint means weighted by n_i / (var_residual + n_i
    var_between)."""
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    means = np.bincount(inverse, weights=diffs) / counts
    weights = counts / (var_residual + counts * var_between)
    return float(np.sum(weights * means) / np.sum(weights)), float(1 / math.sqrt(weights.sum()))


def fit_random_intercept(diffs: np.ndarray, groups: np.ndarray) -> _MixedFit:
    """REML fit of ``diffs ~ 1`` with a random intercept per group (statsmodels ``MixedLM``).

    The optimisers of :data:`MIXED_OPTIMIZERS` are tried in turn until one converges to an
    interior optimum (ICC >= :data:`SINGULAR_ICC`); of the fits made, the one with the highest
    REML log-likelihood wins (among fits within 1e-6 of it, a converged one). The estimate and
    variance components are statsmodels'; the SE is the REML fixed-effect SE (X' V^-1 X)^-1/2
    at those components, which is statsmodels' ``bse_fe`` for an interior fit and stays right
    on the boundary (between variance 0), where statsmodels inverts a Hessian that is not
    positive definite. Never raises for a numerical failure: ``error`` says what failed;
    every warning of the fits is captured in ``warnings`` (deduplicated), none is printed.
    """
    from statsmodels.regression.mixed_linear_model import MixedLM

    y = np.asarray(diffs, dtype=float)
    g = np.asarray(groups)
    nan = math.nan
    found: list[tuple[float, bool, str, Any]] = []
    errors: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for optimizer in MIXED_OPTIMIZERS:
            method = None if optimizer == "default" else [optimizer]
            try:
                result = MixedLM(y, np.ones((y.size, 1)), groups=g).fit(reml=True,
                                                                        method=method)
                llf = float(result.llf)
            except (np.linalg.LinAlgError, ValueError, FloatingPointError,
                    ZeroDivisionError) as exc:
                errors.append(f"{optimizer}: {type(exc).__name__}: {exc}")
                continue
            if math.isfinite(llf):
                found.append((llf, bool(result.converged), optimizer, result))
                tau2 = float(np.asarray(result.cov_re).reshape(-1)[0])
                if result.converged and tau2 > SINGULAR_ICC * (tau2 + float(result.scale)):
                    break
    messages = tuple(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    if not found:
        error = "; ".join(errors) or "no optimiser gave a finite REML log-likelihood"
        return _MixedFit(nan, nan, nan, nan, None, "", messages, error)
    best = max(llf for llf, *_ in found)
    llf, converged, optimizer, result = max(
        (f for f in found if f[0] >= best - 1e-6), key=lambda f: (f[1], f[0]))
    var_between = max(float(np.asarray(result.cov_re).reshape(-1)[0]), 0.0)
    var_residual = float(result.scale)
    estimate = float(np.asarray(result.fe_params)[0])
    se = nan
    if var_residual > 0 and math.isfinite(var_residual + var_between):
        gls, se = _gls_mean_and_se(y, g, var_between, var_residual)
        if abs(gls - estimate) > 1e-6 * max(1.0, abs(gls)) + 1e-3 * se:
            return _MixedFit(nan, nan, nan, nan, converged, optimizer, messages,
                             f"the estimate {estimate} is not the GLS mean {gls} at the "
                             "fitted variance components")
    return _MixedFit(estimate, se, var_between, var_residual, converged, optimizer, messages,
                     None)


def _seed_list(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)


def _effect(
    comparison: Comparison,
    tests: Sequence[CheckpointTest],
    diffs: np.ndarray,
    groups: np.ndarray,
    alpha: float,
) -> Phase1Effect:
    """The mixed-model row of one comparison from its per-checkpoint pairs."""
    from scipy import stats as sps

    nan = math.nan
    used = [t for t in tests if t.n > 0]
    k, n = len(used), int(diffs.size)
    notes: list[str] = []
    unpaired = [f"phase1_seed {t.phase1_seed} ({_seed_word(t.missing_seeds)})"
                for t in tests if t.missing_seeds]
    if unpaired:
        notes.append("unpaired trials dropped: " + "; ".join(unpaired))
    empty = [t.phase1_seed for t in tests if t.n == 0]
    if empty:
        notes.append(f"no pairs from phase1_seed {_seed_list(empty)}")
    single = [t.phase1_seed for t in used if t.n == 1]
    if single and len(single) < k:
        notes.append(f"one pair from phase1_seed {_seed_list(single)} (no within-checkpoint "
                     "test there; it still informs the between-checkpoint variance)")
    values: dict[str, Any] = dict(
        estimate=nan, se=nan, z=nan, df_t=nan, p_t=nan, ci_low_t=nan, ci_high_t=nan,
        p_wald=nan, ci_low_wald=nan, ci_high_wald=nan, var_between=nan, var_residual=nan,
        sd_between=nan, sd_residual=nan, icc=nan, fitted=False, converged=None,
        singular=False, optimizer="", fit_warnings="",
    )
    mean = float(diffs.mean()) if n else nan
    why = None
    if n == 0:
        why = "no paired trials; nothing to compare"
    elif k == 1:
        why = (f"K = 1 Phase-1 checkpoint (phase1_seed {used[0].phase1_seed}): the "
               "between-checkpoint variance is not identifiable, so no mixed model; the "
               "fixed-checkpoint paired test is the analysis")
    elif n == k:
        why = ("one pair per Phase-1 checkpoint: the between-checkpoint and residual "
               "variances cannot be separated, so no mixed model")
    elif float(np.ptp(diffs)) <= _EQUAL_TOL * max(1.0, abs(mean)):
        why = f"all paired differences equal ({mean:+.2f}); no variance to model"
    if why is None:
        fit = fit_random_intercept(diffs, groups)
        values["fit_warnings"] = "; ".join(fit.warnings)
        values["converged"] = fit.converged
        values["optimizer"] = fit.optimizer
        tau2, sigma2 = fit.var_between, fit.var_residual
        finite = all(math.isfinite(x) for x in (fit.estimate, fit.se, tau2, sigma2))
        if fit.error is not None:
            why = f"mixed model fit failed ({fit.error}); no estimate"
        elif not finite or fit.se <= 0 or sigma2 <= 0:
            why = "mixed model fit gave non-finite or zero estimates; no estimate"
        else:
            icc = tau2 / (tau2 + sigma2)
            singular = icc < SINGULAR_ICC
            if not singular and not fit.converged:
                why = "mixed model fit did not converge; rejected, no estimate"
            else:
                df_t = k - 1
                z = fit.estimate / fit.se
                q_t = float(sps.t.ppf(1 - alpha / 2, df_t))
                q_z = float(sps.norm.ppf(1 - alpha / 2))
                values.update(
                    estimate=fit.estimate, se=fit.se, z=z, df_t=float(df_t),
                    p_t=float(2 * sps.t.sf(abs(z), df_t)),
                    ci_low_t=fit.estimate - q_t * fit.se, ci_high_t=fit.estimate + q_t * fit.se,
                    p_wald=float(2 * sps.norm.sf(abs(z))),
                    ci_low_wald=fit.estimate - q_z * fit.se,
                    ci_high_wald=fit.estimate + q_z * fit.se,
                    var_between=tau2, var_residual=sigma2, sd_between=math.sqrt(tau2),
                    sd_residual=math.sqrt(sigma2), icc=icc, fitted=True, singular=singular,
                )
                if singular:
                    notes.append("singular fit: between-checkpoint variance estimated 0 "
                                 "(boundary); the estimate is the pooled paired mean")
    if why is not None:
        notes.insert(0, why)
    return Phase1Effect(
        label=comparison.label,
        cond_a=comparison.cond_a,
        metric_a=comparison.metric_a,
        cond_b=comparison.cond_b,
        metric_b=comparison.metric_b,
        paper_table=comparison.paper_table,
        k=k,
        n=n,
        phase1_seeds=tuple(t.phase1_seed for t in used),
        pairs_per_checkpoint=tuple(t.n for t in used),
        mean_diff=mean,
        sd_diff=float(diffs.std(ddof=1)) if n > 1 else nan,
        note="; ".join(notes),
        **values,
    )


def phase1_variance(
    df: pd.DataFrame,
    comparisons: Sequence[Comparison] | None = None,
    *,
    alpha: float = 0.05,
) -> Phase1Analysis:
    """Each headline effect across K Phase-1 checkpoints (issue 11, "Phase-1 variance").

    ``df`` is the tidy per-trial table of :func:`load_results` with a :data:`PHASE1_SEED`
    column (derived metrics filled as the report does: :func:`add_derived_metrics`).
    For every comparison (default :data:`PHASE1_COMPARISONS`) and every Phase-1 seed, the
    trials of that checkpoint are paired by Phase-2 seed exactly as :func:`paired_comparison`
    pairs them (the paper's fixed-checkpoint analysis: mean ± SD of the differences, t CI,
    paired t-test; one :class:`CheckpointTest` each). All pairs then go into a REML linear
    mixed model ``diff ~ 1`` with a random intercept per Phase-1 checkpoint (one
    :class:`Phase1Effect` per comparison; see there for the columns and the two p values).

    Never drops data silently: unpaired trials and trials whose metric is NaN are left out of
    the pairs and named in the notes; rows without a Phase-1 seed are left out of everything
    and counted in ``notes``. K = 1, one pair per checkpoint, equal differences or a failed
    fit give a row with ``fitted=False`` and the reason, not an exception. Raises
    ``ValueError`` for a table without a ``phase1_seed`` column, a non-integer Phase-1 seed, or
    two trials of the same (condition, seed, phase1_seed).
    """
    comparisons = PHASE1_COMPARISONS if comparisons is None else tuple(comparisons)
    column = _phase1_column(df)
    notes: list[str] = []
    missing = column.isna()
    if missing.any():
        notes.append(f"{int(missing.sum())} trial(s) without a phase1_seed left out")
    data = df[(~missing).to_numpy()].copy()
    data[PHASE1_SEED] = column[~missing].astype("int64").to_numpy()
    dup = data.duplicated(["condition", "seed", PHASE1_SEED], keep=False)
    if dup.any():
        first = data[dup].iloc[0]
        raise ValueError(
            f"two trials of condition {first['condition']!r} seed {first['seed']} "
            f"phase1_seed {first[PHASE1_SEED]}: cannot pair them"
        )
    checkpoints = sorted(set(data[PHASE1_SEED]))
    by_checkpoint = {k: data[data[PHASE1_SEED] == k] for k in checkpoints}
    effects: list[Phase1Effect] = []
    tests: list[CheckpointTest] = []
    for comparison in comparisons:
        c = comparison
        involved = data["condition"].isin({c.cond_a, c.cond_b})
        expected = sorted(set(data.loc[involved, "seed"].astype(int)))
        own: list[CheckpointTest] = []
        diffs: list[float] = []
        groups: list[int] = []
        for k in checkpoints:
            frame_k = by_checkpoint[k]
            if not frame_k["condition"].isin({c.cond_a, c.cond_b}).any():
                continue  # this checkpoint has no trial of either side
            row = paired_comparison(frame_k, c.cond_a, c.metric_a, c.cond_b, c.metric_b,
                                    c.label, expected_seeds=expected, alpha=alpha)
            own.append(CheckpointTest(
                label=c.label, phase1_seed=int(k), n=int(row["n"]), seeds=tuple(row["seeds"]),
                missing_seeds=tuple(row["missing_seeds"]), mean_a=row["mean_a"],
                mean_b=row["mean_b"], mean_diff=row["mean_diff"], sd_diff=row["sd_diff"],
                ci_low=row["ci_low"], ci_high=row["ci_high"], t=row["t"], df=float(row["df"]),
                p=row["p"], d_z=row["d_z"], note=row["note"],
            ))
            if row["n"]:
                a = seed_values(frame_k, c.cond_a, c.metric_a).loc[row["seeds"]]
                b = seed_values(frame_k, c.cond_b, c.metric_b).loc[row["seeds"]]
                diffs += list(a.to_numpy(dtype=float) - b.to_numpy(dtype=float))
                groups += [int(k)] * int(row["n"])
        tests += own
        effects.append(_effect(c, own, np.asarray(diffs, dtype=float),
                               np.asarray(groups, dtype=np.int64), alpha))
    return Phase1Analysis(tuple(effects), tuple(tests), tuple(notes))


# ------------------------------------------------------------------------------------------
# variants: named Phase-2 overrides of one grid (beyond the paper)
# ------------------------------------------------------------------------------------------


def _variants(df: pd.DataFrame) -> pd.Series:
    if "variant" not in df.columns:
        return pd.Series(DEFAULT_VARIANT, index=df.index, dtype=object)
    return df["variant"].fillna(DEFAULT_VARIANT).astype(str)


def has_variant_results(df: pd.DataFrame) -> bool:
    """Whether any trial in ``df`` ran a named variant (a table without a ``variant`` column,
    like every table written before variants existed, has none)."""
    return not df.empty and bool((_variants(df) != DEFAULT_VARIANT).any())


def default_variant(df: pd.DataFrame) -> pd.DataFrame:
    """The trials of the default variant: what the paper's tables and comparisons read (all
    of ``df`` when no trial has a named variant). ``df.attrs`` is kept."""
    out = df[_variants(df) == DEFAULT_VARIANT]
    out.attrs = dict(df.attrs)
    return out


def arm_name(condition: str, variant: str = DEFAULT_VARIANT) -> str:
    """The arm of a condition's trials of one variant (:attr:`TrialId.arm`): the condition
    itself for the default variant, ``<condition>-<variant>`` otherwise."""
    return TrialId(condition, 0, variant).arm if variant else str(condition)


def by_arm(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``condition`` replaced by each trial's arm (:attr:`TrialId.arm`: the
    condition for the default variant, ``<condition>-<variant>`` otherwise), so that the
    seed-wise statistics (:func:`seed_values`, :func:`summarize`, :func:`paired_comparison`)
    treat each variant as an arm of its own. Without named variants it equals ``df``."""
    out = df.copy()
    variants = _variants(df)
    named = variants != DEFAULT_VARIANT
    if named.any():
        out.loc[named, "condition"] = [arm_name(c, v) for c, v in
                                       zip(out.loc[named, "condition"], variants[named])]
    return out


#: the gradient modes across boundaries (``TrainConfig.ltm_graph``) in display order
SEGMENT_GRAPH_ORDER: tuple[str, ...] = ("full", "truncated", "detached")
#: the paired comparison of the segments grid: the paper's full graph minus truncated BPTT
SEGMENT_COMPARISON: tuple[str, str] = ("full", "truncated")


@dataclass(frozen=True)
class SegmentArm:
    """A variant that sets the episode length: its condition, variant, arm name
    (:func:`by_arm`), T (``segments``) and gradient mode (``ltm_graph``)."""

    condition: str
    variant: str
    arm: str
    segments: int
    ltm_graph: str


def segment_arms(df: pd.DataFrame) -> list[SegmentArm]:
    """The arms of ``df`` with a named variant and a ``segments`` and ``ltm_graph`` value
    (columns :func:`load_results` adds when variants override them), ordered by condition,
    T, gradient mode (:data:`SEGMENT_GRAPH_ORDER`) and variant name."""
    if not has_variant_results(df) or not {"segments", "ltm_graph"} <= set(df.columns):
        return []
    arms: dict[tuple[str, str], SegmentArm] = {}
    for condition, variant, seg, graph in zip(df["condition"], _variants(df), df["segments"],
                                              df["ltm_graph"]):
        if variant == DEFAULT_VARIANT or (condition, variant) in arms:
            continue
        try:
            t = float(seg)
        except (TypeError, ValueError):
            continue
        if not math.isfinite(t) or t != int(t) or not isinstance(graph, str):
            continue
        arms[(condition, variant)] = SegmentArm(condition, variant,
                                                arm_name(condition, variant), int(t), graph)
    rank = {c: i for i, c in enumerate(ordered_conditions(c for c, _ in arms))}
    graph_rank = {g: i for i, g in enumerate(SEGMENT_GRAPH_ORDER)}
    return sorted(arms.values(), key=lambda a: (rank[a.condition], a.segments,
                                                graph_rank.get(a.ltm_graph, len(graph_rank)),
                                                a.ltm_graph, a.variant))


def segment_comparisons(df: pd.DataFrame, metric: str = "updated_ltm"
                        ) -> tuple[Comparison, ...]:
    """For each condition and T with exactly one variant of each mode of
    :data:`SEGMENT_COMPARISON`: that pair's paired comparison on ``metric``, between the
    arms of :func:`by_arm`. The label names the condition when ``df`` has more than one."""
    arms = segment_arms(df)
    a_mode, b_mode = SEGMENT_COMPARISON
    several = len({a.condition for a in arms}) > 1
    out = []
    for key in dict.fromkeys((a.condition, a.segments) for a in arms):
        group = [a for a in arms if (a.condition, a.segments) == key]
        first = [a for a in group if a.ltm_graph == a_mode]
        second = [a for a in group if a.ltm_graph == b_mode]
        if len(first) != 1 or len(second) != 1:
            continue
        prefix = f"{key[0]}, " if several else ""
        out.append(Comparison(f"{prefix}T = {key[1]}: {a_mode} - {b_mode}: {metric}",
                              first[0].arm, metric, second[0].arm, metric, "ours:segments"))
    return tuple(out)


def segment_identity_comparisons(df: pd.DataFrame, metric: str = "updated_ltm"
                                 ) -> tuple[Comparison, ...]:
    """For each arm of :func:`segment_arms` whose condition learns its consolidation (all but
    ``identity_full``): ``metric`` minus ``forced_identity`` in the same trials (the learned
    operator against the same checkpoint with identity consolidation on the same T-segment
    test episodes), the paper's learned - forced identity test at each T and mode. The label
    names the condition when ``df`` has more than one."""
    arms = [a for a in segment_arms(df) if a.condition != "identity_full"]
    several = len({a.condition for a in arms}) > 1
    return tuple(
        Comparison(f"{f'{a.condition}, ' if several else ''}T = {a.segments}, {a.ltm_graph}: "
                   f"learned - forced identity: {metric}",
                   a.arm, metric, a.arm, "forced_identity", "ours:segments")
        for a in arms)


def compare_segments_identity(
    df: pd.DataFrame,
    metric: str = "updated_ltm",
    *,
    expected_seeds: Iterable[int] | None = None,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """:func:`compare_all` over :func:`segment_identity_comparisons` (learned - forced
    identity for every T and mode, paired by seed; Holm over these comparisons only, a family
    of their own), with ``segments`` and ``ltm_graph`` columns. Empty when ``df`` has no
    segment arm."""
    return _compare_segment_family(df, segment_identity_comparisons(df, metric),
                                   ("segments", "ltm_graph"), expected_seeds, alpha)


def compare_segments(
    df: pd.DataFrame,
    metric: str = "updated_ltm",
    *,
    expected_seeds: Iterable[int] | None = None,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """:func:`compare_all` over :func:`segment_comparisons` (full - truncated at each T, paired
    by seed; Holm over these comparisons only, a family of their own), with a ``segments``
    column. Empty when ``df`` has no such pair."""
    return _compare_segment_family(df, segment_comparisons(df, metric), ("segments",),
                                   expected_seeds, alpha)


def _compare_segment_family(df: pd.DataFrame, comparisons: Sequence[Comparison],
                            columns: Sequence[str], expected_seeds: Iterable[int] | None,
                            alpha: float) -> pd.DataFrame:
    """:func:`compare_all` over one family of segment comparisons (its own Holm), with the
    :class:`SegmentArm` fields ``columns`` of each row's first arm added as columns."""
    out = compare_all(by_arm(df), comparisons, expected_seeds=expected_seeds, alpha=alpha)
    arms = {a.arm: a for a in segment_arms(df)}
    for column in columns:
        out[column] = [getattr(arms[c], column) for c in out.get("cond_a", [])]
    return out


# ------------------------------------------------------------------------------------------
# the paper's numbers
# ------------------------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent
#: a copy of the paper's two CSVs shipped with the package, so reports show the paper's
#: numbers beside ours on any machine (tests check it equals shared/spec byte for byte)
PACKAGED_SPEC = Path(__file__).resolve().parent / "paper_data"


class SpecNotFoundError(FileNotFoundError):
    """The spec directory (paper CSVs) could not be found."""


def spec_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The spec directory: ``path``, else ``$PMNET_SPEC_DIR``, else ``<repo>/../shared/spec``,
    else the copy packaged in ``pmnet/paper_data``."""
    if path is not None:
        found, origin = Path(path), "the given path"
    elif os.environ.get("PMNET_SPEC_DIR"):
        found, origin = Path(os.environ["PMNET_SPEC_DIR"]), "$PMNET_SPEC_DIR"
    else:
        found, origin = REPO_ROOT.parent / "shared" / "spec", "the default <repo>/../shared/spec"
        if not found.is_dir():  # an installed or cloned copy without shared/: packaged CSVs
            found, origin = PACKAGED_SPEC, "the copy packaged in pmnet/paper_data"
    if not found.is_dir():
        raise SpecNotFoundError(
            f"spec directory not found at {found} ({origin}); set PMNET_SPEC_DIR to the folder "
            "holding paper-aggregates.csv and paper-per-seed.csv"
        )
    return found


def _spec_csv(name: str, spec: str | os.PathLike[str] | None, required: Sequence[str]):
    path = spec_dir(spec) / name
    if not path.is_file():
        raise SpecNotFoundError(f"{name} not found in the spec directory {path.parent}")
    frame = pd.read_csv(path)
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}")
    return frame


def paper_aggregates(spec: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """The paper's printed aggregates (``paper-aggregates.csv``), numeric columns as float."""
    frame = _spec_csv(
        "paper-aggregates.csv",
        spec,
        ["comparison_or_condition", "metric", "mean", "sd", "ci_low", "ci_high", "p",
         "paper_table"],
    )
    for name in ("mean", "sd", "ci_low", "ci_high", "p"):
        frame[name] = pd.to_numeric(frame[name], errors="coerce").astype("float64")
    return frame


def paper_per_seed(spec: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """The paper's per-seed values (``paper-per-seed.csv``) in long form."""
    frame = _spec_csv(
        "paper-per-seed.csv", spec, ["condition", "seed", "metric", "value", "paper_table"]
    )
    frame["seed"] = frame["seed"].astype("int64")
    frame["value"] = pd.to_numeric(frame["value"], errors="coerce").astype("float64")
    return frame


#: paper-per-seed.csv metric names that differ from the result-JSON names.
PAPER_METRIC_RENAMES: dict[str, str] = {"test_dual": "dual"}


def per_seed_frame_from_paper(df_long: pd.DataFrame | None = None) -> pd.DataFrame:
    """Pivot paper-per-seed rows into the wide layout of :func:`load_results`.

    One row per (condition, seed); ``test_dual`` becomes ``dual`` (the test metric) and
    ``val_dual`` stays ``val_dual``. ``preset`` is ``"paper"``. Defaults to
    :func:`paper_per_seed`.
    """
    long = paper_per_seed() if df_long is None else df_long.copy()
    long["metric"] = long["metric"].replace(PAPER_METRIC_RENAMES)
    dup = long.duplicated(["condition", "seed", "metric"], keep=False)
    if dup.any():
        first = long[dup].iloc[0]
        raise ValueError(
            f"paper per-seed table has duplicate values for "
            f"{first['condition']} seed {first['seed']} {first['metric']}"
        )
    wide = long.pivot(index=["condition", "seed"], columns="metric", values="value")
    wide.columns.name = None
    wide = wide.reset_index()
    wide["seed"] = wide["seed"].astype("int64")
    wide.insert(2, "preset", "paper")
    metrics = [c for c in wide.columns if c not in ("condition", "seed", "preset")]
    head = ["condition", "seed", "preset"] + [c for c in ("best_epoch",) if c in metrics]
    rest = [m for m in _metric_order(set(metrics) - set(head)) if not m.startswith("val_")]
    vals = sorted(m for m in metrics if m.startswith("val_"))
    return _sort_trials(wide[head + rest + vals])


def _paper_row_keys() -> dict[tuple[str, str], tuple[str, ...]]:
    keys: dict[tuple[str, str], tuple[str, ...]] = {
        ("consolidator_only routing on - off (paired)", "updated_ltm"): (
            "cmp", "routing on - off: updated_ltm"),
        ("consolidator_only_routing_off learned - identity (paired)", "updated_ltm"): (
            "cmp", "learned - forced identity, routing off: updated_ltm"),
        ("consolidator_only learned - identity (paired)", "updated_ltm"): (
            "cmp", "learned - forced identity, routing on: updated_ltm"),
        ("learned_full - identity_full (unpaired runs)", "updated_ltm"): (
            "cmp", "learned_full - identity_full: updated_ltm"),
        ("consolidator_only forced identity", "initial_ltm"): (
            "cond", "consolidator_only", "forced_identity_initial"),
        ("consolidator_only forced identity", "updated_ltm"): (
            "cond", "consolidator_only", "forced_identity"),
    }
    for m in ("updated_ltm_add10", "updated_ltm_affine10"):
        keys[("consolidator_only on - off (paired)", m)] = ("cmp", f"routing on - off: {m}")
    for m in ("initial_ltm", "updated_ltm"):
        keys[("consolidator_only learned", m)] = ("cond", "consolidator_only", m)
    for m in ("updated_ltm", "mean_stm", "seg2_stm"):
        keys[("learned_full_dual - learned_full (paired)", m)] = ("cmp", f"dual - LTM only: {m}")
    return keys


#: (row of paper-aggregates.csv, metric) -> ("cond", condition, metric) or ("cmp", label).
PAPER_AGGREGATE_KEYS = _paper_row_keys()


def paper_aggregate_key(row_name: str, metric: str) -> tuple[str, ...] | None:
    """Where a paper-aggregates.csv row belongs: a condition cell or a comparison label."""
    key = PAPER_AGGREGATE_KEYS.get((row_name, metric))
    if key is not None:
        return key
    if row_name in CONDITIONS:
        return ("cond", row_name, metric)
    return None


PRINTED = "paper-aggregates.csv"
DERIVED = "derived from paper-per-seed.csv"


@dataclass
class PaperReference:
    """The paper's numbers, keyed like our own results.

    ``conditions[(condition, metric)]`` and ``comparisons[label]`` hold dicts with mean, sd
    (and for comparisons ci_low, ci_high, p) plus ``source``: :data:`PRINTED` when the value is
    printed in paper-aggregates.csv, :data:`DERIVED` when computed from the paper's per-seed
    values with the same statistics as ours. ``per_seed`` is the wide per-seed frame.
    """

    aggregates: pd.DataFrame
    per_seed: pd.DataFrame
    conditions: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    comparisons: dict[str, dict[str, Any]] = field(default_factory=dict)
    unmapped: list[tuple[str, str]] = field(default_factory=list)
    _lookup: dict[tuple[str, int, str], float] | None = field(default=None, repr=False)

    def condition(self, condition: str, metric: str) -> dict[str, Any] | None:
        return self.conditions.get((condition, metric))

    def comparison(self, label: str) -> dict[str, Any] | None:
        return self.comparisons.get(label)

    def seed_value(self, condition: str, seed: int, metric: str) -> float | None:
        """The paper's per-seed value, or None where the paper does not list it."""
        if self._lookup is None:
            self._lookup = {}
            if not self.per_seed.empty:
                for name in metric_columns(self.per_seed):
                    for cond, s, value in zip(
                        self.per_seed["condition"], self.per_seed["seed"], self.per_seed[name]
                    ):
                        if pd.notna(value):
                            self._lookup[(cond, int(s), name)] = float(value)
        return self._lookup.get((condition, int(seed), metric))


def _finite_or_nan(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


def load_paper_reference(spec: str | os.PathLike[str] | None = None) -> PaperReference:
    """Load both paper CSVs and index them by condition/metric and comparison label."""
    aggregates = paper_aggregates(spec)
    wide = add_derived_metrics(per_seed_frame_from_paper(paper_per_seed(spec)))
    ref = PaperReference(aggregates=aggregates, per_seed=wide)
    for row in summarize(wide).itertuples(index=False):
        if row.n >= 2:
            ref.conditions[(row.condition, row.metric)] = {
                "mean": row.mean, "sd": row.sd, "n": row.n, "source": DERIVED,
            }
    for row in compare_all(wide).to_dict("records"):
        if row["n"] >= 2 and not row["missing_seeds"]:
            ref.comparisons[row["label"]] = {
                "mean": row["mean_diff"],
                "sd": row["sd_diff"],
                "ci_low": row["ci_low"],
                "ci_high": row["ci_high"],
                "p": row["p"],
                "n": row["n"],
                "source": DERIVED,
            }
    for row in aggregates.to_dict("records"):
        name, metric = str(row["comparison_or_condition"]), str(row["metric"])
        key = paper_aggregate_key(name, metric)
        if key is None:
            ref.unmapped.append((name, metric))
            continue
        entry = {
            "mean": _finite_or_nan(row["mean"]),
            "sd": _finite_or_nan(row["sd"]),
            "source": PRINTED,
            "paper_table": row["paper_table"],
        }
        if key[0] == "cond":
            ref.conditions[(key[1], key[2])] = entry
        else:
            entry.update(
                ci_low=_finite_or_nan(row["ci_low"]),
                ci_high=_finite_or_nan(row["ci_high"]),
                p=_finite_or_nan(row["p"]),
            )
            ref.comparisons[key[1]] = entry
    return ref

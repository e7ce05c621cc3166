"""Trial result files -> the tidy per-trial table (:func:`load_results`), training curves
(:func:`load_histories`, :func:`curves_from_metrics_csv`), derived metrics and the tidy CSV /
Parquet files."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from pmnet.io import atomic_path, atomic_write_text
from pmnet.stats.vocabulary import (
    DEVICE_COLUMNS,
    KNOWN_METRICS,
    LAST_PREFIX,
    META_COLUMNS,
    NUMERIC_META,
    PHASE1_SEED,
    STRING_META,
    VARIANT_FIELDS_ATTR,
    ordered_conditions,
)
from pmnet.trial_id import DEFAULT_VARIANT, TrialId, as_int

#: a result file whose ``status`` is one of these is a failed trial, not a row
_FAILED_STATUSES = frozenset({"failed", "failure", "error", "crashed", "killed", "oom"})


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
        for name in STRING_META + DEVICE_COLUMNS:
            value = obj.get(name)
            row[name] = None if value is None else str(value)
        any_device = any_device or any(obj.get(n) is not None for n in DEVICE_COLUMNS)
        for name in NUMERIC_META:
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
    keep = ("condition", "seed", PHASE1_SEED, "variant", "source_file") + STRING_META \
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

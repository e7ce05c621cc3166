"""The paper's own numbers (``paper-aggregates.csv``, ``paper-per-seed.csv`` in the spec
directory, or the copy packaged in ``pmnet/paper_data``), keyed like our results and put
through the same statistics (:class:`PaperReference`)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pmnet.stats.loading import _metric_order, _sort_trials, add_derived_metrics
from pmnet.stats.paired import compare_all, metric_columns, summarize
from pmnet.stats.vocabulary import CONDITIONS

REPO_ROOT = Path(__file__).resolve().parents[2]
#: a copy of the paper's two CSVs shipped with the package, so reports show the paper's
#: numbers beside ours on any machine (tests check it equals shared/spec byte for byte)
PACKAGED_SPEC = Path(__file__).resolve().parents[1] / "paper_data"


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

"""The unit layout: the one format a study's finished units are kept in, by a pipeline run
and by a durable store alike (issues 45, 51), read by the report.

A *unit* is one Phase-1 checkpoint or one Phase-2 trial. A run has one store: a durable
store (`--store DIR`), which holds units and nothing else, or by default the run directory,
which holds its units beside its scratch (`pipelines.layout.Layout`: logs, `trials/<trial>/`
with Lightning's files, Ray Tune's `stage2*/`). Each unit lands there once, as it finishes.
So the report reads a store exactly as it reads a run (`pmnet.report.main_report`), and
this class is the only place a unit's path is spelled:

    <store or run>/
      store.json                  StoreRecord (a store only): format version and the
                                  study's named subsets (e.g. a pre-registered
                                  confirmatory set of Phase-1 seeds)
      phase1/                     the Phase-1 checkpoint unit of a one-checkpoint grid
      phase1-p1s<k>/              the unit of Phase-1 seed k (grids over checkpoints),
                                  its files in the order they are written (`phase1_files`):
          phase1.pt  phase1.pt.sha256
          phase1_metrics.json     Phase 1's metrics, history and train_config (what a run
                                  reusing the unit checks it against,
                                  `pipelines.store.check_store_units`; a migrated unit keeps its
                                  study's file)
          provenance.json         Provenance, written when the unit starts, completed when
                                  it lands
          diagnose.json           `pmnet diagnose phase1.pt` (optional)
          stage1.json             the Stage-1 record (config hash, sha256, metrics): the
                                  unit's commit record, written last
      diagnostics/<trial>.json    `pmnet diagnose` of the trial's model, where its grid
                                  declares it (`tune_spaces.Space.diagnose`)
      provenance/<trial>.json     the trial's Provenance (started, then landed)
      results/<trial>.json        a finished trial's result: the unit's commit record,
                                  written last (`trial_files`)
      progress/<trial>/           a paused trial's progress (`pmnet.store_progress`): its
                                  last and best Lightning checkpoints and progress.json,
                                  until its unit lands (a paused Phase-1 unit's is
                                  `phase1-p1s<k>/progress/`)
      locks/<unit>.lock           the writer that holds a unit (a store: a lock per unit,
                                  never one for the store)
      report/                     the report (`main_report`): derived, rebuilt from the
                                  units, never read

A migrated unit (one that ran before stores existed, e.g. issue 39's study) has a
provenance file with a `migrated` key saying where it came from; its fields are those its
old files recorded.

`<trial>` is `TrialId.name` (`<condition>[-<variant>][-p<k>]-s<seed>`). A unit exists when
its commit record exists: every other file of the unit is written (atomically) before it,
so a crash leaves either a whole unit or none.

This module names paths, reads the small records and makes a new store (`init_store`);
the unit lock is `pmnet.store_lock`, the quarantine pre-pass `pmnet.store_repair`, a paused
unit's progress `pmnet.store_progress`; landing units is the pipeline's
(`pipelines.store`). It imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pmnet.io import atomic_write_json
from pmnet.trial_id import TrialId


def config_digest(config: Mapping[str, Any]) -> str:
    """sha256 of a configuration as JSON with sorted keys: the one spelling of a unit's
    `config_hash` (a trial's flat unit config, `pipelines.store.config_hash`; a Phase-1
    unit's Phase-1 part, `pipelines.phase1.phase1_config_hash`), recomputed by
    `pmnet.store_verify`."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def config_difference(stored: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """The first key (sorted) whose value differs between two unit configurations, with both
    values; None when they are equal."""
    missing = object()
    for k in sorted(set(stored) | set(mine)):
        if stored.get(k, missing) != mine.get(k, missing):
            return (f"{k}: {stored.get(k, '(absent)')!r} in the store vs "
                    f"{mine.get(k, '(absent)')!r} here")
    return None


class StoreError(RuntimeError):
    """A store cannot be used or a unit cannot be published; the message says why. The
    pipeline treats it as its own `PipelineError` (same exit codes, `pipelines.run`)."""


#: the store format this code reads and writes; a store of another version is refused
STORE_FORMAT = "pmnet-store"
STORE_VERSION = 1


@dataclass(frozen=True)
class StoreLayout:
    """Where each file of a store lives (see the module docstring)."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).expanduser().absolute())

    @property
    def record(self) -> Path:
        return self.root / "store.json"

    def phase1_dir(self, phase1_seed: int | None) -> Path:
        return self.root / unit_name(phase1_seed)

    def phase1_ckpt(self, phase1_seed: int | None) -> Path:
        return self.phase1_dir(phase1_seed) / "phase1.pt"

    def stage1_json(self, phase1_seed: int | None) -> Path:
        return self.phase1_dir(phase1_seed) / "stage1.json"

    def phase1_provenance(self, phase1_seed: int | None) -> Path:
        return self.phase1_dir(phase1_seed) / "provenance.json"

    def phase1_diagnose(self, phase1_seed: int | None) -> Path:
        return self.phase1_dir(phase1_seed) / "diagnose.json"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    def result(self, trial: TrialId) -> Path:
        return self.results_dir / f"{trial.name}.json"

    def provenance(self, trial: TrialId) -> Path:
        return self.root / "provenance" / f"{trial.name}.json"

    def diagnostics(self, trial: TrialId) -> Path:
        return self.root / "diagnostics" / f"{trial.name}.json"

    @property
    def diagnostics_dir(self) -> Path:
        return self.root / "diagnostics"

    def trial_progress(self, trial: TrialId) -> Path:
        """A paused trial's progress directory (not part of the unit; dropped when it lands)."""
        return self.root / "progress" / trial.name

    def lock(self, unit: str) -> Path:
        """`unit` is `phase1`, `phase1-p1s<k>` or a trial name."""
        return self.root / "locks" / f"{unit}.lock"

    def phase1_files(self, phase1_seed: int | None) -> list[Path]:
        """The files of a Phase-1 unit in the order they are written: the commit record
        `stage1.json` last (`diagnose.json` is optional)."""
        d = self.phase1_dir(phase1_seed)
        return [d / "phase1.pt", d / "phase1.pt.sha256", d / "phase1_metrics.json",
                d / "provenance.json", d / "diagnose.json", d / "stage1.json"]

    def trial_files(self, trial: TrialId) -> list[Path]:
        """The files of a trial unit in the order they are written: the commit record
        `results/<trial>.json` last (`diagnostics/<trial>.json` is optional)."""
        return [self.diagnostics(trial), self.provenance(trial), self.result(trial)]


PHASE1_UNIT = "phase1"
PHASE1_SEED_UNIT = "phase1-p1s"


def unit_name(unit: TrialId | int | None) -> str:
    """A unit's name: `phase1` (a grid's single checkpoint), `phase1-p1s<k>` (Phase-1 seed
    k) or the trial's name; the Phase-1 unit's directory, lock, MLflow run and console
    name. The one place the Phase-1 unit's name is spelled."""
    if isinstance(unit, TrialId):
        return unit.name
    return PHASE1_UNIT if unit is None else f"{PHASE1_SEED_UNIT}{unit}"


def phase1_seed_of(dirname: str) -> int | None:
    """The Phase-1 seed of a unit directory named `phase1-p1s<k>` (None otherwise)."""
    k = dirname.removeprefix(PHASE1_SEED_UNIT)
    return int(k) if dirname.startswith(PHASE1_SEED_UNIT) and k.isdigit() else None


@dataclass(frozen=True)
class StoreRecord:
    """`store.json`. ``subsets`` names sets of Phase-1 seeds the analysis reads by name, e.g.
    ``{"confirmatory": [3, 4, 5, 6, 7, 8, 9]}``, written before the units they select ran."""

    format: str = STORE_FORMAT
    version: int = STORE_VERSION
    subsets: Mapping[str, list[int]] = field(default_factory=dict)
    notes: str = ""

    def __post_init__(self):
        if self.format != STORE_FORMAT:
            raise ValueError(f"not a {STORE_FORMAT} store: store.json says format "
                             f"{self.format!r}")
        if self.version != STORE_VERSION:
            raise ValueError(f"store format version {self.version!r}; this code reads "
                             f"version {STORE_VERSION}")
        for name, seeds in self.subsets.items():
            if not isinstance(seeds, list) or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
                raise ValueError(f"store subset {name!r} must be a list of Phase-1 seeds "
                                 f"(non-negative integers), got {seeds!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "version": self.version,
                "subsets": {k: list(v) for k, v in self.subsets.items()}, "notes": self.notes}

    @classmethod
    def from_dict(cls, data: Any) -> StoreRecord:
        if not isinstance(data, dict):
            raise ValueError(f"store.json must hold a JSON object, got {type(data).__name__}")
        known = {k: data[k] for k in ("format", "version", "subsets", "notes") if k in data}
        return cls(**known)


def read_store_record(root: str | os.PathLike[str]) -> StoreRecord | None:
    """The store's record, None where `root` has no store.json; ValueError naming the file
    when it is unreadable or of another format."""
    path = StoreLayout(Path(root)).record
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    try:
        return StoreRecord.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def init_store(store: StoreLayout) -> None:
    """Make the store's directory and its `store.json` (a new store's default record) when
    it has none; an existing record is never rewritten (a hard link publishes it: the first
    of two writers wins)."""
    store.root.mkdir(parents=True, exist_ok=True)
    if store.record.is_file():
        return
    tmp = store.root / f".store.json.{uuid.uuid4().hex}"
    atomic_write_json(tmp, StoreRecord().to_dict())
    try:
        os.link(tmp, store.record)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()

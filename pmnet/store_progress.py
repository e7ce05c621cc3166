"""A Phase-1 unit in progress, kept in the store (issue 52): a long Phase 1 in durable
pieces. A paused unit's `progress/` (its last and best Lightning checkpoints and
`progress.json`, `ProgressRecord`, written last) sits beside the unit, whose commit record
stays absent; the next run of the unit checks it at planning (`check_progress`: exit 2 when
it is foreign or damaged, never used or dropped silently), restores it (`restore_progress`)
and continues; the landed unit drops it (`drop_progress`). docs/pipeline.md, "A long
Phase 1 in durable pieces", has the layout, the rules and what a SIGKILL loses.

Store format only: no Ray, MLflow or driver here. The stopping is `pmnet.train.pause`, the
driver's side (publishing at a pause, SIGTERM) `pipelines.driver`.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pmnet.io import atomic_copy, atomic_write_json, read_json, sha256_file
from pmnet.store_layout import StoreError, StoreLayout, config_difference, unit_name
from pmnet.store_lock import UnitLock

PROGRESS_DIRNAME = "progress"
RECORD_NAME = "progress.json"
PROGRESS_FORMAT = "pmnet-phase1-progress/v1"

Say = Callable[[str], None]
EpochOf = Callable[[Path], "int | None"]  # a Lightning checkpoint's epoch, None if unreadable


def progress_dir(store: StoreLayout, seed: int | None) -> Path:
    return store.phase1_dir(seed) / PROGRESS_DIRNAME


@dataclass(frozen=True)
class Phase1Unit:
    """A Phase-1 unit of a run, as its progress is checked against and copied into."""

    seed: int | None
    dir: Path  # the run's unit directory: Lightning's phase1_ckpt/, phase0_metrics.json
    config: dict  # the Phase-1 configuration, flat, as a unit records it
    config_hash: str  # the hash stage1.json will record
    max_epochs: int

    @property
    def name(self) -> str:
        return unit_name(self.seed)

    @property
    def ckpt_dir(self) -> Path:
        """Where `run_phase1` keeps (and resumes from) its Lightning checkpoints."""
        return self.dir / "phase1_ckpt"


@dataclass(frozen=True)
class ProgressRecord:
    """`progress/progress.json`: one paused Phase-1 unit's state in the store."""

    unit: str
    epoch: int  # 0-based, as last.ckpt holds it; epoch + 1 epochs are done
    max_epochs: int
    config_hash: str  # the Phase-1 config hash stage1.json will record
    config: dict  # the Phase-1 configuration it was made under (flat, as a unit records it)
    last: str  # file names inside progress/
    last_sha256: str
    best: str | None
    best_sha256: str | None
    phase0: dict | None  # Phase 0's metrics (phase0_metrics.json), when the preset has it
    reason: str  # "max-wall" or "stop requested"
    host: str
    time: float
    train_time_s: float | None
    format: str = PROGRESS_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ProgressRecord:
        if not isinstance(data, dict) or data.get("format") != PROGRESS_FORMAT:
            raise ValueError(f"not a {PROGRESS_FORMAT} record")
        fields = {f: data.get(f) for f in cls.__dataclass_fields__}
        for f in ("unit", "config_hash", "last", "last_sha256", "reason"):
            if not isinstance(fields[f], str) or not fields[f]:
                raise ValueError(f"field {f!r} is missing or not a string")
        for f in ("epoch", "max_epochs"):
            if isinstance(fields[f], bool) or not isinstance(fields[f], int) or fields[f] < 0:
                raise ValueError(f"field {f!r} must be a non-negative integer")
        if not isinstance(fields["config"], dict):
            raise ValueError("field 'config' must be an object")
        return cls(**fields)

    @property
    def epochs_done(self) -> int:
        return self.epoch + 1


def _record_path(store: StoreLayout, seed: int | None) -> Path:
    return progress_dir(store, seed) / RECORD_NAME


def _start_over(store: StoreLayout, unit: Phase1Unit) -> str:
    return (f"delete {progress_dir(store, unit.seed)} to train the unit from its start, or "
            "use the configuration it was made with")


# -- planning (reads only) ------------------------------------------------------------------


def check_progress(store: StoreLayout, unit: Phase1Unit) -> ProgressRecord | None:
    """The unit's stored progress, checked: made under this unit's Phase-1 configuration,
    every file present with the sha256 its record names. None when the unit is finished
    (its stage1.json exists) or has no progress record. StoreError (exit 2 at planning)
    naming the problem otherwise: damaged or foreign progress is refused, never used or
    dropped silently. Reads only."""
    if store.stage1_json(unit.seed).is_file():
        return None
    path = _record_path(store, unit.seed)
    if not path.is_file():
        return None
    try:
        rec = ProgressRecord.from_dict(read_json(path))
    except ValueError as e:
        raise StoreError(f"--store {store.root}: the Phase-1 progress of unit {unit.name} is "
                         f"unreadable ({path}: {e}); {_start_over(store, unit)}") from e
    if rec.config_hash != unit.config_hash:
        diff = config_difference(rec.config, unit.config)
        raise StoreError(
            f"--store {store.root}: unit {unit.name} has Phase-1 progress (after epoch "
            f"{rec.epochs_done} of {rec.max_epochs}) made with another configuration "
            f"({diff or 'its config hash differs'}); refusing to continue it. Use the same "
            f"preset and --set values as the store, or {_start_over(store, unit)}")
    for name, want in ((rec.last, rec.last_sha256), (rec.best, rec.best_sha256)):
        if name is None:
            continue
        f = progress_dir(store, unit.seed) / name
        got = sha256_file(f) if f.is_file() else None
        if got != want:
            state = "is missing" if got is None else \
                f"has sha256 {got[:12]}..., its record says {str(want)[:12]}..."
            again = _start_over(store, unit)
            raise StoreError(
                f"--store {store.root}: the Phase-1 progress of unit {unit.name} is damaged: "
                f"{f} {state}; refusing to continue from it. {again[0].upper()}{again[1:]}")
    return rec


# -- the driver: restore before Stage 1, publish at a pause, drop when the unit lands ---------


def restore_progress(store: StoreLayout, unit: Phase1Unit, epoch_of: EpochOf,
                     say: Say = print) -> int | None:
    """Put the store's progress of `unit` where Phase 1 resumes from (the unit's
    `phase1_ckpt/` and phase0_metrics.json), unless the run's own last.ckpt is as far or
    further (`epoch_of` reads its epoch: a resumed run of the same directory). Returns the
    stored epoch restored, None when nothing was. Checks the progress again first
    (`check_progress`)."""
    rec = check_progress(store, unit)
    if rec is None:
        return None
    ckdir = unit.ckpt_dir
    mine = epoch_of(ckdir / "last.ckpt") if (ckdir / "last.ckpt").is_file() else None
    if mine is not None and mine >= rec.epoch:
        say(f"[store] {unit.name}: continuing from this run's own Phase-1 checkpoint (epoch "
            f"{mine + 1}); the store's progress is at epoch {rec.epochs_done}")
        return None
    src = progress_dir(store, unit.seed)
    ckdir.mkdir(parents=True, exist_ok=True)
    if rec.best is not None:
        atomic_copy(src / rec.best, ckdir / "best.ckpt")
    else:
        (ckdir / "best.ckpt").unlink(missing_ok=True)
    atomic_copy(src / rec.last, ckdir / "last.ckpt")  # last: run_phase1 resumes when it exists
    if rec.phase0 is not None:
        atomic_write_json(unit.dir / "phase0_metrics.json", rec.phase0)
    say(f"[store] {unit.name}: continuing Phase 1 from the store's progress (epoch "
        f"{rec.epochs_done} of {rec.max_epochs}, paused on {rec.host}: {rec.reason})")
    return rec.epoch


def publish_progress(store: StoreLayout, unit: Phase1Unit, reason: str, epoch_of: EpochOf,
                     train_time_s: float | None = None,
                     say: Say = print) -> ProgressRecord | None:
    """A Phase-1 sitting of `unit` paused: copy its last.ckpt and best.ckpt into the unit's
    `progress/` (each file atomically, its sha256 computed from the bytes written), then the
    record; older progress files are removed after. Nothing when the unit is in the store
    already or the store holds progress as far. Returns the record written, or None."""
    ckdir = unit.ckpt_dir
    epoch = epoch_of(ckdir / "last.ckpt")
    if epoch is None:
        raise StoreError(f"{unit.name}: no readable {ckdir / 'last.ckpt'} to publish")
    dest = progress_dir(store, unit.seed)
    with UnitLock(store, unit.name):
        if store.stage1_json(unit.seed).is_file():
            return None
        old = read_json(_record_path(store, unit.seed))
        if isinstance(old, dict) and isinstance(old.get("epoch"), int) \
                and old["epoch"] >= epoch and old.get("config_hash") == unit.config_hash:
            return None
        last, best = f"last-e{epoch}.ckpt", None
        best_sha = None
        if (ckdir / "best.ckpt").is_file():
            best = f"best-e{epoch}.ckpt"
            best_sha = sha256_file(atomic_copy(ckdir / "best.ckpt", dest / best))
        last_sha = sha256_file(atomic_copy(ckdir / "last.ckpt", dest / last))
        p0 = read_json(unit.dir / "phase0_metrics.json")
        rec = ProgressRecord(
            unit=unit.name, epoch=epoch, max_epochs=unit.max_epochs,
            config_hash=unit.config_hash, config=unit.config, last=last, last_sha256=last_sha,
            best=best, best_sha256=best_sha, phase0=p0 if isinstance(p0, dict) else None,
            reason=reason, host=socket.gethostname(), time=time.time(),
            train_time_s=train_time_s)
        atomic_write_json(_record_path(store, unit.seed), rec.to_dict())
        for f in dest.iterdir():  # the previous sitting's files, and any a crash left
            if f.suffix == ".ckpt" and f.name not in (last, best):
                f.unlink(missing_ok=True)
    say(f"[store] {unit.name}: Phase-1 progress (epoch {rec.epochs_done} of "
        f"{rec.max_epochs}, {reason}) -> {dest}")
    return rec


def drop_progress(store: StoreLayout, seed: int | None) -> bool:
    """Remove the unit's progress once its commit record exists (the unit landed); True
    when there was some."""
    dest = progress_dir(store, seed)
    if not dest.exists() or not store.stage1_json(seed).is_file():
        return False
    with UnitLock(store, unit_name(seed)):
        shutil.rmtree(dest, ignore_errors=True)
    return True

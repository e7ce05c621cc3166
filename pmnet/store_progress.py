"""A unit in progress, kept in the store (issue 52: Phase 1; issue 61: Phase 2 too): a long
training in durable pieces. A paused unit's progress (its last and best Lightning
checkpoints and `progress.json`, `ProgressRecord`, written last) sits beside the unit, whose
commit record stays absent: a Phase-1 unit's in `phase1-p1s<k>/progress/`, a trial's in
`progress/<trial>/`. The next run of the unit checks it at planning (`check_progress`: exit
2 when it is foreign or damaged, never used or dropped silently), restores it
(`restore_progress`) and continues; the landed unit drops it (`drop_progress`).
docs/pipeline.md, "A long Phase 1 in pieces", has the layout, the rules and what a SIGKILL
loses; "A long trial in pieces" a trial's, which follows the same rules and also names the Phase-1
checkpoint it was trained from (a trial continues only on that checkpoint).

Store format only: no Ray, MLflow or driver here. The stopping is `pmnet.train.pause`, the
driver's side (landing at a pause, SIGTERM) `pipelines.driver`, a trial's
`pipelines.trial`.
"""

from __future__ import annotations

import io
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pmnet.io import atomic_copy, atomic_write_bytes, atomic_write_json, read_json, sha256_file
from pmnet.store_layout import StoreError, StoreLayout, config_difference, unit_name
from pmnet.store_lock import UnitLock
from pmnet.trial_id import TrialId

PROGRESS_DIRNAME = "progress"
RECORD_NAME = "progress.json"
PROGRESS_FORMAT = "pmnet-phase1-progress/v1"
#: a paused trial's record (`ProgressRecord.phase` 2, with the Phase-1 sha256)
TRIAL_PROGRESS_FORMAT = "pmnet-phase2-progress/v1"
FORMATS = {1: PROGRESS_FORMAT, 2: TRIAL_PROGRESS_FORMAT}

Say = Callable[[str], None]
EpochOf = Callable[[Path], "int | None"]  # a Lightning checkpoint's epoch, None if unreadable


def progress_dir(store: StoreLayout, seed: int | None) -> Path:
    """A Phase-1 unit's progress directory."""
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

    phase = 1
    phase1_sha256 = None  # (a trial's: the checkpoint it trains from)

    @property
    def ckpt_dir(self) -> Path:
        """Where `run_phase1` keeps (and resumes from) its Lightning checkpoints."""
        return self.dir / "phase1_ckpt"

    def progress(self, store: StoreLayout) -> Path:
        return progress_dir(store, self.seed)

    def landed(self, store: StoreLayout) -> Path:
        """The unit's commit record: it is in the store once this exists."""
        return store.stage1_json(self.seed)


@dataclass(frozen=True)
class TrialUnit:
    """A Phase-2 trial of a run, as its progress is checked against and copied into (issue
    61): like a Phase-1 unit, and tied to the Phase-1 checkpoint it trains from."""

    trial: TrialId
    dir: Path  # the run's trial directory: Lightning's ckpt/
    config: dict  # the trial's configuration, flat, as its unit records it
    config_hash: str  # the hash its provenance records
    max_epochs: int
    phase1_sha256: str | None  # the Phase-1 checkpoint its Phase 2 starts from (None: unknown)
    phase = 2

    @property
    def name(self) -> str:
        return self.trial.name

    @property
    def ckpt_dir(self) -> Path:
        """Where `run_phase2` keeps (and resumes from) its Lightning checkpoints."""
        return self.dir / "ckpt"

    def progress(self, store: StoreLayout) -> Path:
        return store.trial_progress(self.trial)

    def landed(self, store: StoreLayout) -> Path:
        return store.result(self.trial)


Unit = Phase1Unit | TrialUnit


@dataclass(frozen=True)
class ProgressRecord:
    """`progress.json`: one paused unit's state in the store (`phase` 1: a Phase-1 unit, 2:
    a trial, which also names its Phase-1 checkpoint)."""

    unit: str
    epoch: int  # 0-based, as last.ckpt holds it; epoch + 1 epochs are done
    max_epochs: int
    config_hash: str  # the config hash the unit will record (stage1.json; a trial's provenance)
    config: dict  # the configuration it was made under (flat, as a unit records it)
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
    phase: int = 1
    phase1_sha256: str | None = None  # a trial's: the Phase-1 checkpoint it trained from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ProgressRecord:
        if not isinstance(data, dict) or data.get("format") not in FORMATS.values():
            raise ValueError(f"not a {' or '.join(FORMATS.values())} record")
        fields = {f: data.get(f) for f in cls.__dataclass_fields__}
        fields["phase"] = next(k for k, v in FORMATS.items() if v == data["format"])
        if fields["phase"] == 2 and not (isinstance(fields["phase1_sha256"], str)
                                         and len(fields["phase1_sha256"]) == 64):
            raise ValueError("field 'phase1_sha256' must be a trial's Phase-1 sha256")
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


def _record_path(store: StoreLayout, unit: Unit) -> Path:
    return unit.progress(store) / RECORD_NAME


def _what(unit: Unit) -> str:
    return f"Phase-{unit.phase}"


def _start_over(store: StoreLayout, unit: Unit) -> str:
    return (f"delete {unit.progress(store)} to train the unit from its start, or "
            "use the configuration it was made with")


# -- planning (reads only) ------------------------------------------------------------------


def check_progress(store: StoreLayout, unit: Unit) -> ProgressRecord | None:
    """The unit's stored progress, checked: made under this unit's configuration (a trial's:
    and from its Phase-1 checkpoint), every file present with the sha256 its record names.
    None when the unit is finished (its commit record exists) or has no progress record.
    StoreError (exit 2 at planning) naming the problem otherwise: damaged or foreign
    progress is refused, never used or dropped silently. Reads only."""
    if unit.landed(store).is_file():
        return None
    path = _record_path(store, unit)
    if not path.is_file():
        return None
    what = _what(unit)
    try:
        rec = ProgressRecord.from_dict(read_json(path))
    except ValueError as e:
        raise StoreError(f"--store {store.root}: the {what} progress of unit {unit.name} is "
                         f"unreadable ({path}: {e}); {_start_over(store, unit)}") from e
    if rec.phase != unit.phase:
        raise StoreError(f"--store {store.root}: {path} is Phase-{rec.phase} progress, not "
                         f"{what} progress of unit {unit.name}; {_start_over(store, unit)}")
    if rec.config_hash != unit.config_hash:
        diff = config_difference(rec.config, unit.config)
        raise StoreError(
            f"--store {store.root}: unit {unit.name} has {what} progress (after epoch "
            f"{rec.epochs_done} of {rec.max_epochs}) made with another configuration "
            f"({diff or 'its config hash differs'}); refusing to continue it. Use the same "
            f"preset and --set values as the store, or {_start_over(store, unit)}")
    if unit.phase1_sha256 is not None and rec.phase1_sha256 != unit.phase1_sha256:
        raise StoreError(
            f"--store {store.root}: unit {unit.name} has {what} progress (after epoch "
            f"{rec.epochs_done} of {rec.max_epochs}) trained from Phase-1 checkpoint "
            f"{str(rec.phase1_sha256)[:12]}..., not {unit.phase1_sha256[:12]}...; refusing "
            f"to continue it on another checkpoint; {_start_over(store, unit)}")
    for name, want in ((rec.last, rec.last_sha256), (rec.best, rec.best_sha256)):
        if name is None:
            continue
        f = unit.progress(store) / name
        got = sha256_file(f) if f.is_file() else None
        if got != want:
            state = "is missing" if got is None else \
                f"has sha256 {got[:12]}..., its record says {str(want)[:12]}..."
            again = _start_over(store, unit)
            raise StoreError(
                f"--store {store.root}: the {what} progress of unit {unit.name} is damaged: "
                f"{f} {state}; refusing to continue from it. {again[0].upper()}{again[1:]}")
    return rec


# -- the driver: restore before training, land at a pause, drop when the unit lands -------


def restore_progress(store: StoreLayout, unit: Unit, epoch_of: EpochOf,
                     say: Say = print) -> int | None:
    """Put the store's progress of `unit` where its training resumes from (the unit's
    Lightning checkpoint directory, and a Phase-1 unit's phase0_metrics.json), unless the
    run's own last.ckpt is as far or further (`epoch_of` reads its epoch: a resumed run of
    the same directory). Returns the stored epoch restored, None when nothing was. Checks
    the progress again first (`check_progress`)."""
    rec = check_progress(store, unit)
    if rec is None:
        return None
    ckdir = unit.ckpt_dir
    mine = epoch_of(ckdir / "last.ckpt") if (ckdir / "last.ckpt").is_file() else None
    what = _what(unit)
    if mine is not None and mine >= rec.epoch:
        say(f"[store] {unit.name}: continuing from this run's own {what} checkpoint (epoch "
            f"{mine + 1}); the store's progress is at epoch {rec.epochs_done}")
        return None
    src = unit.progress(store)
    ckdir.mkdir(parents=True, exist_ok=True)
    if rec.best is not None:
        atomic_copy(src / rec.best, ckdir / "best.ckpt")
    else:
        (ckdir / "best.ckpt").unlink(missing_ok=True)
    atomic_copy(src / rec.last, ckdir / "last.ckpt")  # last: training resumes when it exists
    if rec.phase0 is not None:
        atomic_write_json(unit.dir / "phase0_metrics.json", rec.phase0)
    say(f"[store] {unit.name}: continuing {what.replace('-', ' ')} from the store's progress "
        f"(epoch {rec.epochs_done} of {rec.max_epochs}, paused on {rec.host}: {rec.reason})")
    return rec.epoch


def land_progress(store: StoreLayout, unit: Unit, reason: str, epoch_of: EpochOf,
                  train_time_s: float | None = None,
                  say: Say = print) -> ProgressRecord | None:
    """A sitting of `unit` paused: copy its last.ckpt and best.ckpt into the unit's progress
    directory (each file atomically, its sha256 computed from the bytes written; one file
    when the two are the same bytes, the best epoch being the last; an earlier best without
    the optimizer's moments, `_weights_only`), then the record; older progress files are
    removed after. Nothing when the unit is in the store
    already or the store holds progress as far. Returns the record written, or None."""
    ckdir = unit.ckpt_dir
    epoch = epoch_of(ckdir / "last.ckpt")
    if epoch is None:
        raise StoreError(f"{unit.name}: no readable {ckdir / 'last.ckpt'} to land")
    dest = unit.progress(store)
    with UnitLock(store, unit.name):
        if unit.landed(store).is_file():
            return None
        old = read_json(_record_path(store, unit))
        if isinstance(old, dict) and isinstance(old.get("epoch"), int) \
                and old["epoch"] >= epoch and old.get("config_hash") == unit.config_hash \
                and old.get("phase1_sha256") == unit.phase1_sha256:
            return None
        last, best = f"last-e{epoch}.ckpt", None
        last_sha = sha256_file(atomic_copy(ckdir / "last.ckpt", dest / last))
        best_sha = None
        if (ckdir / "best.ckpt").is_file():
            if sha256_file(ckdir / "best.ckpt") == last_sha:  # the best epoch is the last:
                best, best_sha = last, last_sha  # one file, not two (86 MB each at medium)
            else:
                best = f"best-e{epoch}.ckpt"
                best_sha = sha256_file(_weights_only(ckdir / "best.ckpt", dest / best))
        p0 = read_json(unit.dir / "phase0_metrics.json") if unit.phase == 1 else None
        rec = ProgressRecord(
            unit=unit.name, epoch=epoch, max_epochs=unit.max_epochs,
            config_hash=unit.config_hash, config=unit.config, last=last, last_sha256=last_sha,
            best=best, best_sha256=best_sha, phase0=p0 if isinstance(p0, dict) else None,
            reason=reason, host=socket.gethostname(), time=time.time(),
            train_time_s=train_time_s, format=FORMATS[unit.phase], phase=unit.phase,
            phase1_sha256=unit.phase1_sha256)
        atomic_write_json(_record_path(store, unit), rec.to_dict())
        for f in dest.iterdir():  # the previous sitting's files, and any a crash left
            if f.suffix == ".ckpt" and f.name not in (last, best):
                f.unlink(missing_ok=True)
    say(f"[store] {unit.name}: {_what(unit)} progress (epoch {rec.epochs_done} of "
        f"{rec.max_epochs}, {reason}) -> {dest}")
    return rec


def _weights_only(src: Path, dst: Path) -> Path:
    """Write Lightning checkpoint `src` to `dst` without its optimizer's moments, atomically:
    an earlier best epoch's checkpoint is only ever tested (`trainer.test(ckpt_path="best")`
    restores no optimizer), so a third of its bytes go into the store (28.7 of 86 MB at
    `medium`), not all of them. Returns `dst`."""
    import torch  # the store's other readers need no torch

    ckpt = torch.load(src, map_location="cpu", weights_only=True)
    ckpt.pop("optimizer_states", None)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    return atomic_write_bytes(dst, buf.getvalue())


def drop_progress(store: StoreLayout, seed: int | None) -> bool:
    """Remove a Phase-1 unit's progress once its commit record exists (the unit landed);
    True when there was some. (A trial's goes inside `pipelines.store.land_trial`, under
    the unit lock it already holds.)"""
    dest = progress_dir(store, seed)
    if not dest.exists() or not store.stage1_json(seed).is_file():
        return False
    with UnitLock(store, unit_name(seed)):
        shutil.rmtree(dest, ignore_errors=True)
    return True

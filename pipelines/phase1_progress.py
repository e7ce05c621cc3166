"""A Phase-1 unit in progress, kept in the store (issue 52): a long Phase 1 in durable pieces.

A Phase-1 task of every pipeline run trains with `pmnet.train.StopAtEpochEnd`: `--max-wall`
(the wall left to the run when the task starts) and a SIGTERM to the driver (which writes
the run's stop file, `stop_file`) stop it at an epoch boundary, and `run_phase1` returns a
`Phase1Paused`. The driver then publishes the unit's progress into the store, next to the
unit, and stops the run (status "stopped", exit 0):

    <store>/phase1-p1s<k>/progress/
        last-e<E>.ckpt     Lightning's last.ckpt after epoch E (0-based): weights, optimiser,
                           schedule position, RNG, history, early stopping's state
        best-e<E>.ckpt     best.ckpt as it was then (Phase 1 tests the best epoch at the end)
        progress.json      `ProgressRecord`: the epoch, the config hash and configuration it
                           was made under, each file's sha256, Phase 0's metrics; written
                           last (a crash before it leaves the previous progress whole)

The unit's commit record (`stage1.json`) stays absent, so the unit counts as not in the
store (partial) for every reader. The next run of the unit, on this machine or any other
with a copy of the store, checks the progress at planning (`check_progress`: reads only,
exit 2 when it was made under another configuration, naming the first differing key, or
when a file is missing or its sha256 differs: the progress is refused, never silently used
or silently discarded), copies it into the run's Stage-1 directory (`restore_progress`)
unless the run's own checkpoint is as far or further, and Phase 1 continues from it. When
the unit lands (`publish_phase1`) its progress is removed (`drop_progress`); a finished unit
has exactly today's files.

Progress is published at a pause only (not every N epochs): a SIGKILLed run loses what its
sitting trained unless it is resumed on the same run directory (its local last.ckpt), as
before. This module holds the store side only; the stopping is `pmnet.train.pause`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipelines.console import say
from pipelines.layout import PipelineError, read_json
from pipelines.phase1 import Phase1Slot
from pmnet.io import atomic_path, atomic_write_json
from pmnet.store_layout import StoreLayout

PROGRESS_DIRNAME = "progress"
RECORD_NAME = "progress.json"
PROGRESS_FORMAT = "pmnet-phase1-progress/v1"
#: the run's file a SIGTERM writes, which every Phase-1 task of the run polls at epoch ends
STOP_FILENAME = "phase1-stop.request"


def progress_dir(store: StoreLayout, seed: int | None) -> Path:
    return store.phase1_dir(seed) / PROGRESS_DIRNAME


def local_ckpt_dir(slot: Phase1Slot) -> Path:
    """Where `run_phase1` keeps (and resumes from) its Lightning checkpoints."""
    return slot.dir / "phase1_ckpt"


def stop_file(run_dir: Path) -> Path:
    return Path(run_dir) / STOP_FILENAME


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


def _unit(slot: Phase1Slot) -> str:
    from pipelines.store import unit_name

    return unit_name(slot.seed)


def _start_over(store: StoreLayout, slot: Phase1Slot) -> str:
    return (f"delete {progress_dir(store, slot.seed)} to train the unit from its start, or "
            "use the configuration it was made with")


# -- planning (reads only) ------------------------------------------------------------------


def check_progress(store: StoreLayout, slot: Phase1Slot) -> ProgressRecord | None:
    """The unit's stored progress, checked: made under this slot's Phase-1 configuration,
    every file present with the sha256 its record names. None when the unit is finished
    (its stage1.json exists) or has no progress record. PipelineError (exit 2) naming the
    problem otherwise: damaged or foreign progress is refused, never used or dropped
    silently. Reads only."""
    from pipelines.store import first_difference, phase1_unit_config
    from pmnet.io import sha256_file

    if store.stage1_json(slot.seed).is_file():
        return None
    path = _record_path(store, slot.seed)
    if not path.is_file():
        return None
    unit = _unit(slot)
    try:
        rec = ProgressRecord.from_dict(read_json(path))
    except ValueError as e:
        raise PipelineError(f"--store {store.root}: the Phase-1 progress of unit {unit} is "
                            f"unreadable ({path}: {e}); {_start_over(store, slot)}") from e
    config, digest = phase1_unit_config(slot)
    if rec.config_hash != digest:
        diff = first_difference(rec.config, config)
        raise PipelineError(
            f"--store {store.root}: unit {unit} has Phase-1 progress (after epoch "
            f"{rec.epochs_done} of {rec.max_epochs}) made with another configuration "
            f"({diff or 'its config hash differs'}); refusing to continue it. Use the same "
            f"preset and --set values as the store, or {_start_over(store, slot)}")
    for name, want in ((rec.last, rec.last_sha256), (rec.best, rec.best_sha256)):
        if name is None:
            continue
        f = progress_dir(store, slot.seed) / name
        got = sha256_file(f) if f.is_file() else None
        if got != want:
            state = "is missing" if got is None else \
                f"has sha256 {got[:12]}..., its record says {str(want)[:12]}..."
            raise PipelineError(
                f"--store {store.root}: the Phase-1 progress of unit {unit} is damaged: {f} "
                f"{state}; refusing to continue from it. {_start_over(store, slot)[0].upper()}"
                f"{_start_over(store, slot)[1:]}")
    return rec


# -- the driver: restore before Stage 1, publish at a pause, drop when the unit lands ---------


def restore_progress(store: StoreLayout, slot: Phase1Slot) -> int | None:
    """Put the store's progress of `slot` where Phase 1 resumes from (the slot's
    `phase1_ckpt/` and phase0_metrics.json), unless the run's own last.ckpt is as far or
    further (a resumed run of the same directory). Returns the stored epoch restored, None
    when nothing was. Checks the progress again first (`check_progress`)."""
    from pmnet.train import checkpoint_epoch

    rec = check_progress(store, slot)
    if rec is None:
        return None
    ckdir = local_ckpt_dir(slot)
    mine = checkpoint_epoch(ckdir / "last.ckpt") if (ckdir / "last.ckpt").is_file() else None
    if mine is not None and mine >= rec.epoch:
        say(f"[store] {slot.label}: continuing from this run's own Phase-1 checkpoint (epoch "
            f"{mine + 1}); the store's progress is at epoch {rec.epochs_done}")
        return None
    src = progress_dir(store, slot.seed)
    ckdir.mkdir(parents=True, exist_ok=True)
    if rec.best is not None:
        _copy(src / rec.best, ckdir / "best.ckpt")
    else:
        (ckdir / "best.ckpt").unlink(missing_ok=True)
    _copy(src / rec.last, ckdir / "last.ckpt")  # last: run_phase1 resumes when it exists
    if rec.phase0 is not None:
        atomic_write_json(slot.dir / "phase0_metrics.json", rec.phase0)
    say(f"[store] {slot.label}: continuing Phase 1 from the store's progress (epoch "
        f"{rec.epochs_done} of {rec.max_epochs}, paused on {rec.host}: {rec.reason})")
    return rec.epoch


def publish_progress(store: StoreLayout, slot: Phase1Slot, reason: str,
                     train_time_s: float | None = None) -> ProgressRecord | None:
    """A Phase-1 sitting of `slot` paused: copy its last.ckpt and best.ckpt into the unit's
    `progress/` (each file atomically, its sha256 computed from the bytes written), then the
    record; older progress files are removed after. Nothing when the unit is in the store
    already or the store holds progress as far. Returns the record written, or None."""
    from pipelines.store import UnitLock, phase1_unit_config
    from pmnet.train import checkpoint_epoch

    ckdir = local_ckpt_dir(slot)
    epoch = checkpoint_epoch(ckdir / "last.ckpt")
    if epoch is None:
        raise PipelineError(f"{slot.label}: no readable {ckdir / 'last.ckpt'} to publish")
    unit = _unit(slot)
    dest = progress_dir(store, slot.seed)
    with UnitLock(store, unit):
        if store.stage1_json(slot.seed).is_file():
            return None
        old = read_json(_record_path(store, slot.seed))
        if isinstance(old, dict) and isinstance(old.get("epoch"), int) \
                and old["epoch"] >= epoch and old.get("config_hash") == \
                phase1_unit_config(slot)[1]:
            return None
        last, best = f"last-e{epoch}.ckpt", None
        best_sha = None
        if (ckdir / "best.ckpt").is_file():
            best = f"best-e{epoch}.ckpt"
            best_sha = _copy(ckdir / "best.ckpt", dest / best)
        last_sha = _copy(ckdir / "last.ckpt", dest / last)
        config, digest = phase1_unit_config(slot)
        p0 = read_json(slot.dir / "phase0_metrics.json")
        rec = ProgressRecord(
            unit=unit, epoch=epoch, max_epochs=int(slot.cfg.phase1_max_epochs),
            config_hash=digest, config=config, last=last, last_sha256=last_sha, best=best,
            best_sha256=best_sha, phase0=p0 if isinstance(p0, dict) else None, reason=reason,
            host=socket.gethostname(), time=time.time(), train_time_s=train_time_s)
        atomic_write_json(_record_path(store, slot.seed), rec.to_dict())
        for f in dest.iterdir():  # the previous sitting's files, and any a crash left
            if f.suffix == ".ckpt" and f.name not in (last, best):
                f.unlink(missing_ok=True)
    say(f"[store] {unit}: Phase-1 progress (epoch {rec.epochs_done} of {rec.max_epochs}, "
        f"{reason}) -> {dest}")
    return rec


def drop_progress(store: StoreLayout, seed: int | None) -> bool:
    """Remove the unit's progress once its commit record exists (the unit landed); True
    when there was some."""
    from pipelines.store import UnitLock, unit_name

    dest = progress_dir(store, seed)
    if not dest.exists() or not store.stage1_json(seed).is_file():
        return False
    with UnitLock(store, unit_name(seed)):
        shutil.rmtree(dest, ignore_errors=True)
    return True


def _copy(src: Path, dst: Path) -> str:
    """Copy `src` to `dst` atomically and durably (fsynced); the sha256 of the bytes
    written."""
    h = hashlib.sha256()
    with atomic_path(dst) as tmp:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            for chunk in iter(lambda: fi.read(1 << 20), b""):
                h.update(chunk)
                fo.write(chunk)
            fo.flush()
            os.fsync(fo.fileno())
    return h.hexdigest()


# -- SIGTERM to the driver ------------------------------------------------------------------


@contextmanager
def sigterm_writes_stop_file(path: Path, store: bool = True) -> Iterator[None]:
    """While the driver waits for its Phase-1 tasks: the first SIGTERM writes the run's stop
    file (each task stops at its next epoch end, `StopAtEpochEnd(stop_file=...)`) and
    restores the previous handler, so a second SIGTERM ends the driver as before. Outside
    (and off the main thread) SIGTERM keeps its usual effect."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:
        previous = signal.SIG_DFL

    def handler(signum, frame):
        Path(path).touch()
        signal.signal(signal.SIGTERM, previous)
        say("[pipeline] SIGTERM: Phase 1 stops at its next epoch end and its progress "
            + ("goes into the store" if store else "stays in the run's unit")
            + " (a second SIGTERM ends the driver now)")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


"""A store run's first step (issue 53): every damaged unit of the store is moved aside and
trained again, so that adoption and every "is it in the store" check of the run see whole
units only.

A unit counts as present when its commit record exists (`pmnet.store_layout`); disks, copies
and crashes can leave a commit record whose unit is not whole: a truncated result, a
checkpoint whose bytes changed under its sha256, a result trained from a checkpoint the
store does not hold. `quarantine_damaged(store)` runs `pmnet.store_verify.verify_store` over
the whole store before the run plans its waves; each unit it finds corrupt or orphaned is,
under the unit's lock (`pmnet.store_lock.UnitLock`) and after a second look (another writer
may have replaced it meanwhile), moved into `<store>/quarantine/<unit>-<UTC time>/`:

- a Phase-1 unit's directory as it is (one rename: the unit is gone at once), with the
  trials of it, which are orphaned without it;
- a trial's `results/<trial>.json` first (its commit record: the unit is gone at once), then
  its `provenance/` and `diagnostics/` files, under the same relative paths;

beside `quarantine.json` (the unit, what was wrong with which file, when, by which run).
Nothing is deleted. The run says so, one line per unit naming the file and the reason, and
trains the units of its piece again, so it ends with every unit whole; the units of other
pieces train again in their pieces' runs. A unit of another configuration is not damage:
planning refuses it before this step (`pipelines.store.check_store_units`, exit 2).

Store format only: no Ray, MLflow or driver here; the driver calls it with its console.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pmnet.io import atomic_write_json
from pmnet.store_layout import StoreLayout
from pmnet.store_lock import UnitLock
from pmnet.store_verify import (
    QUARANTINE_DIR,
    UnitCheck,
    check_phase1_unit,
    check_trial_unit,
    verify_store,
)
from pmnet.trial_id import TrialId


@dataclass(frozen=True)
class Quarantined:
    """A unit moved aside: its verdict and where it went."""

    check: UnitCheck
    dest: Path


def _recheck(store: StoreLayout, unit: UnitCheck) -> UnitCheck:
    """The unit's verdict now (under its lock)."""
    if unit.kind == "phase1":
        return check_phase1_unit(store, unit.phase1_seed)
    seed = unit.phase1_seed
    own = ({seed: check_phase1_unit(store, seed)}
           if store.stage1_json(seed).is_file() else {})
    return check_trial_unit(store, unit.unit, own)


def _dest(store: StoreLayout, unit: str) -> Path:
    """`quarantine/<unit>-<UTC time>/`, made now (a suffix where that second has one)."""
    base = store.root / QUARANTINE_DIR
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1000):
        dest = base / f"{unit}-{stamp}{'' if n == 0 else f'-{n}'}"
        if not dest.exists():
            return dest
    raise FileExistsError(f"{base}/{unit}-{stamp}-*: a thousand quarantines this second")


def _move(store: StoreLayout, unit: UnitCheck) -> Path:
    dest = _dest(store, unit.unit)
    if unit.kind == "phase1":
        os.rename(store.phase1_dir(unit.phase1_seed), dest)
    else:
        dest.mkdir()
        files = [store.results_dir / f"{unit.unit}.json"]  # the commit record first
        try:
            trial = TrialId.parse(unit.unit)
            files += [store.provenance(trial), store.diagnostics(trial)]
        except ValueError:
            pass
        for src in files:
            if src.exists():
                (dest / src.parent.name).mkdir(exist_ok=True)
                os.rename(src, dest / src.parent.name / src.name)
    atomic_write_json(dest / "quarantine.json", {
        "unit": unit.unit, "kind": unit.kind, "state": unit.state, "file": unit.path,
        "reason": unit.reason, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(), "pid": os.getpid()})
    return dest


def quarantine_damaged(store: StoreLayout,
                       say: Callable[[str], None] = print) -> list[Quarantined]:
    """Move every corrupt or orphaned unit of `store` into its quarantine (module
    docstring), saying so (one `say` line per unit); the units moved."""
    moved = []
    for unit in verify_store(store.root).damaged:  # Phase-1 units first: their trials follow
        with UnitLock(store, unit.unit):
            now = _recheck(store, unit)
            if not now.damaged:
                continue
            dest = _move(store, now)
        say(f"[store] quarantined {now.unit} ({now.state}): {now.path}: {now.reason}; "
            f"moved to {dest.relative_to(store.root)}/, it trains again")
        moved.append(Quarantined(now, dest))
    return moved

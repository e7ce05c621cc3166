"""The write side of a run's one store (`Layout.units`: `--store DIR`, else the run's own
directory): checks at planning (reads only, exit 2), each unit's provenance, and its landing
(`land_phase1`, `land_trial`: under the unit's lock, the commit record last, never over a
unit already there). docs/pipeline.md, "The store", has the rules.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pipelines.addresses import STORE_HELP, storage_root
from pipelines.console import say
from pipelines.layout import PipelineError, check_writable, read_json
from pipelines.phase1 import (
    Phase1Slot,
    phase1_config_hash,
    phase1_part,
    trained_phase1_part,
)
from pipelines.provenance import device_kind, git_commit
from pipelines.records import Provenance, Stage1Record, canon
from pmnet.conditions import LATE_FIELD_DEFAULTS, WATCHDOG_FIELDS
from pmnet.io import atomic_copy
from pmnet.store_layout import (
    StoreError,
    StoreLayout,
    config_difference,
    config_digest,
    read_store_record,
    unit_name,
)
from pmnet.store_lock import UnitLock
from pmnet.store_progress import Phase1Unit, TrialUnit
from pmnet.trial_id import TrialId
from tune_spaces.grids import GRID_DECIDED_FIELDS

#: TrainConfig fields left out of a unit's configuration and its hash: its identity, how it
#: runs, not what it computes (docs/choices.md, "What a unit's config hash covers")
UNHASHED_FIELDS: tuple[str, ...] = (*GRID_DECIDED_FIELDS, *WATCHDOG_FIELDS)

# -- planning (reads only) ------------------------------------------------------------------


def open_store(path: str | os.PathLike) -> StoreLayout:
    """The store at `path`, checked without writing: a writable (or creatable) directory,
    empty or holding a `store.json` of this format; PipelineError otherwise."""
    path = storage_root(path, what="--store", help=STORE_HELP)
    root = check_writable(path, what="store", hint="pass a writable --store (STORE=... for make)")
    try:
        record = read_store_record(root)
    except ValueError as e:
        raise PipelineError(f"--store {root}: {e}; use a store of this format or a new "
                            "directory") from e
    if record is None and root.is_dir() and any(root.iterdir()):
        raise PipelineError(f"--store {root} is not empty and has no store.json: it is not a "
                            "store; give an empty or new directory, or an existing store")
    return StoreLayout(root)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted key: leaf value} (`model.hidden`)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def unit_config(config: dict) -> dict[str, Any]:
    """A configuration as a unit records it: flat keys, JSON values, UNHASHED_FIELDS out,
    and a field added since stores existed out while it holds its default
    (`LATE_FIELD_DEFAULTS`: old units keep their hash)."""
    return {k: v for k, v in canon(flatten(config)).items()
            if k.split(".")[0] not in UNHASHED_FIELDS
            and not (k in LATE_FIELD_DEFAULTS and v == LATE_FIELD_DEFAULTS[k])}


def config_hash(config: dict) -> str:
    return config_digest(unit_config(config))


def phase1_unit_config(slot: Phase1Slot) -> tuple[dict, str]:
    """(the Phase-1 part of the slot's config, flat; the hash stage1.json records)."""
    return unit_config(phase1_part(slot.cfg.to_dict())), phase1_config_hash(slot.cfg)


def progress_unit(slot: Phase1Slot) -> Phase1Unit:
    """The slot as its stored progress is checked and copied (`pmnet.store_progress`)."""
    return Phase1Unit(slot.seed, slot.work, *phase1_unit_config(slot),
                      int(slot.cfg.phase1_max_epochs))


def trial_unit(trial: TrialId, cfg, digest: str | None, trial_dir: Path) -> TrialUnit:
    """The trial as its stored progress is checked and copied (`pmnet.store_progress`, issue
    61), from Phase-1 checkpoint `digest` (None: not checked, the store has none yet)."""
    config = unit_config(cfg.flat())
    return TrialUnit(trial, Path(trial_dir), config, config_hash(config), int(cfg.max_epochs),
                     digest)


def _refuse(store: StoreLayout, unit: str, diff: str | None) -> PipelineError:
    return PipelineError(
        f"--store {store.root}: unit {unit} was made with another configuration "
        f"({diff or 'its config hash differs'}); refusing to mix it in. Use the same preset, "
        "grid and --set values as the store, or another --store")


def check_store_units(store: StoreLayout, cfg, space, slots: list[Phase1Slot],
                      trials: list[TrialId]) -> None:
    """Every stored unit among `slots` and `trials` was made with this run's configuration;
    PipelineError naming the first differing key otherwise. Reads only."""
    for slot in slots:
        rec = Stage1Record.read(store.stage1_json(slot.seed))
        if not rec.sha256:
            continue
        config, digest = phase1_unit_config(slot)
        if rec.config_hash == digest:
            continue
        # a unit without a stored config (migrated) is compared through phase1_metrics.json
        stored = Provenance.read(store.phase1_provenance(slot.seed)).config or \
            trained_phase1_part(read_json(store.phase1_dir(slot.seed) / "phase1_metrics.json"))
        diff = config_difference(unit_config(stored), config) if stored else None
        if diff or rec.config_hash is not None or not stored:
            raise _refuse(store, unit_name(slot.seed), diff)
    for trial in trials:
        res = read_json(store.result(trial))
        if not isinstance(res, dict):
            continue
        mine = unit_config(space.trial_config(cfg, trial).flat())
        prov = Provenance.read(store.provenance(trial))
        if prov.config_hash == config_hash(mine):
            continue
        # a unit without a stored config (migrated) is compared through its result's `config`
        stored = prov.config if prov.config else res.get("config")
        diff = config_difference(unit_config(stored), mine) if isinstance(stored, dict) else None
        if diff or not isinstance(stored, dict):
            raise _refuse(store, trial.name, diff)


# -- provenance ---------------------------------------------------------------------------


def start_unit(units: StoreLayout, unit: Phase1Slot | TrialId, run: str, accelerator: str,
               cfg=None, phase1_sha256: str | None = None) -> Provenance:
    """A unit starts (a Phase-1 slot, or a trial with its TrainConfig `cfg`, from Phase-1
    checkpoint `phase1_sha256`): its provenance into the store, under the unit's lock,
    unless the unit has landed (its commit record) or its start is recorded already under
    this configuration (kept from the first attempt or writer). Returns this start's."""
    if isinstance(unit, Phase1Slot):
        (config, digest), name, kind = phase1_unit_config(unit), unit.label, "phase1"
        path, commit_record = units.phase1_provenance(unit.seed), units.stage1_json(unit.seed)
    else:
        config = unit_config(cfg.flat())
        digest, name, kind = config_hash(config), unit.name, "trial"
        path, commit_record = units.provenance(unit), units.result(unit)
    prov = Provenance(unit=name, kind=kind, config_hash=digest, config=config, **git_commit(),
                      torch=version("torch"), device=device_kind(accelerator),
                      host=socket.gethostname(), pid=os.getpid(), run=run,
                      started=time.time(), phase1_sha256=phase1_sha256)
    with UnitLock(units, name):
        if not commit_record.is_file() and Provenance.read(path).config_hash != digest:
            prov.write(path)
    return prov


def landed(scratch: Path, prov_now: Provenance) -> Provenance:
    """The unit's provenance as it lands: the start record (`scratch`) completed; StoreError
    when the unit started under another configuration than it lands with."""
    start = Provenance.read(scratch)
    if start.config_hash is None:
        start = prov_now
    elif start.config_hash != prov_now.config_hash:
        diff = config_difference(*(unit_config(p.config or {}) for p in (start, prov_now)))
        raise StoreError(f"unit {prov_now.unit} started with config hash "
                         f"{start.config_hash[:12]}... and lands with "
                         f"{prov_now.config_hash[:12]}...; not landed ({diff})")
    return replace(start, landed=time.time(), device=prov_now.device or start.device,
                   landed_git_commit=prov_now.git_commit,
                   phase1_sha256=prov_now.phase1_sha256 or start.phase1_sha256,
                   threads=prov_now.threads or start.threads)


def _move(src: Path, dst: Path) -> None:
    """`src` to `dst` atomically: renamed on one file system, else copied and removed."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(src, dst)
    except OSError:
        atomic_copy(src, dst)
        src.unlink()


def land_phase1(slot: Phase1Slot, record: Stage1Record, device: str | None,
                threads: int | None = None) -> str:
    """A Phase-1 task returned (or `--phase1-from` copied a checkpoint in): under the unit's
    lock, the checkpoint and its metrics move from the training directory into the unit,
    read-only; the provenance is completed (`threads` goes there, not into the checkpoint
    file, issue 53); `record`, the commit record, last. A unit another writer landed first
    is kept. Returns the sha256 of the store's checkpoint, the one its trials train from."""
    import stat

    units = StoreLayout(slot.dir.parent)
    with UnitLock(units, slot.label):
        there = Stage1Record.read(slot.stage1_json)
        if there.sha256:
            if there.sha256 != record.sha256:
                say(f"[store] {slot.label}: the store holds checkpoint {there.sha256[:12]}"
                    f"..., this run trained {record.sha256[:12]}... (kept in {slot.work}); "
                    "the trials start from the store's")
            return there.sha256
        if slot.work != slot.dir:  # what training wrote: the checkpoint, its sidecar, metrics
            for dst in units.phase1_files(slot.seed)[:3]:
                if (slot.work / dst.name).is_file():
                    _move(slot.work / dst.name, dst)
        for p in (slot.ckpt, slot.sidecar):  # read-only from now on
            p.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        path = slot.dir / "provenance.json"
        config, digest = phase1_unit_config(slot)
        now = Provenance(unit=slot.label, kind="phase1", config_hash=digest, config=config,
                         git_commit=git_commit()["git_commit"], device=device,
                         phase1_sha256=record.sha256, threads=threads)
        landed(path, now).write(path)
        record.write(slot.stage1_json)
    return record.sha256


def stored_result(units: StoreLayout, trial: TrialId, digest: str) -> dict | None:
    """The store's result of `trial` when it was trained from Phase-1 checkpoint `digest`
    (reused, not trained again), else None."""
    res = read_json(units.result(trial))
    return res if isinstance(res, dict) and res.get("phase1_sha256") == digest else None


#: a trial's diagnostics in its training directory, before its unit lands
TRIAL_DIAGNOSTICS = "diagnostics.json"


def land_trial(units: StoreLayout, trial: TrialId, trial_dir: Path, prov: Provenance) -> str:
    """A trial trained: under the unit's lock, unless the store holds the unit already or
    its Phase-1 checkpoint is not the store's, its diagnostics, its provenance completed,
    then its result (the commit record) last; a paused sitting's progress goes. Returns what
    was done, in words ("landed", "in the store already", or why not)."""
    res = read_json(trial_dir / "result.json")
    if not isinstance(res, dict):
        raise StoreError(f"trial {trial.name}: no result.json in {trial_dir} to land")
    with UnitLock(units, trial.name):
        if units.result(trial).is_file():  # never replaced; said when it is not the same
            shutil.rmtree(units.trial_progress(trial), ignore_errors=True)
            theirs = Provenance.read(units.provenance(trial)).config_hash
            if theirs and prov.config_hash and theirs != prov.config_hash:
                return "in the store already, from another configuration (kept, not replaced)"
            return "in the store already"
        p1 = Stage1Record.read(units.stage1_json(trial.phase1_seed)).sha256
        if p1 != res.get("phase1_sha256"):
            return (f"not landed: trained from Phase-1 {str(res.get('phase1_sha256'))[:12]}"
                    f"..., the store's checkpoint is {str(p1)[:12]}...")
        if (trial_dir / TRIAL_DIAGNOSTICS).is_file():
            atomic_copy(trial_dir / TRIAL_DIAGNOSTICS, units.diagnostics(trial))
        landed(units.provenance(trial), prov).write(units.provenance(trial))
        atomic_copy(trial_dir / "result.json", units.result(trial))
        shutil.rmtree(units.trial_progress(trial), ignore_errors=True)  # issue 61
    return "landed"


# -- what is left ---------------------------------------------------------------------------


def gated(store: StoreLayout, gate, seeds) -> dict[int | None, float]:
    """Of the Phase-1 checkpoints `seeds` landed in `store`, those below the grid's `gate`
    (a `tune_spaces.grids.Phase1Gate`, or None): seed -> its reading. Their trials are held
    back, not trained (docs/pipeline.md, "The Phase-1 gate")."""
    out = {}
    for k in seeds if gate is not None else ():
        if not store.stage1_json(k).is_file():
            continue  # not landed: nothing to gate yet
        try:
            value = gate.reading(read_json(store.phase1_dir(k) / "phase1_metrics.json"))
        except (KeyError, StopIteration, TypeError, ValueError) as e:
            raise PipelineError(f"{unit_name(k)}: the grid's Phase-1 gate reads {gate.metric} "
                                f"at the selected epoch, which its phase1_metrics.json lacks "
                                f"({type(e).__name__}: {e})") from e
        if value < gate.minimum:
            out[k] = value
    return out


def units_left(store: StoreLayout, slots: list[Phase1Slot], space) -> tuple[int, int, dict]:
    """(Phase-1 units, trial units) of `slots`/`space.trials` not in `store`, and the
    checkpoints whose trials the grid's Phase-1 gate holds back (`gated`; not left: they are
    not trained)."""
    held = gated(store, space.phase1_gate, space.phase1_keys)
    trials = [t for t in space.trials if t.phase1_seed not in held]
    p1 = sum(not store.stage1_json(s.seed).is_file() for s in slots)
    return p1, sum(not store.result(t).is_file() for t in trials), held

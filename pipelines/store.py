"""The durable store a pipeline run fills (issue 45): plan against it (`open_store`,
`check_store_units`: reads only, exit 2), adopt its units before a wave trains
(`adopt_phase1`, `adopt_trials`), publish each unit as it lands (`publish_phase1`,
`publish_trial`: the commit record last, under `pmnet.store_lock.UnitLock`, never over a
unit already there), and each unit's provenance from its start to its landing. The layout
is `pmnet.store_layout`; docs/pipeline.md, "The store", has the rules.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipelines.addresses import STORE_HELP, storage_root
from pipelines.console import say
from pipelines.layout import PipelineError, check_writable, read_json
from pipelines.phase1 import (
    Phase1Slot,
    check_phase1_source,
    existing_phase1,
    install_phase1,
    phase1_config_hash,
    phase1_part,
    trained_phase1_part,
)
from pipelines.provenance import device_kind, git_commit, package_version
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
from pmnet.store_progress import Phase1Unit
from pmnet.trial_id import TrialId
from tune_spaces.grids import GRID_DECIDED_FIELDS

#: TrainConfig fields left out of a unit's configuration and its hash: those the grid
#: decides (its conditions, seeds and Phase-1 seeds: the unit's identity, its name), how a
#: unit runs (its torch threads: the CPUs a machine gives a trial; the watchdog's settings,
#: WATCHDOG_FIELDS: whether it is stopped) and the preset's prose; not what it computes
#: (docs/choices.md, "What a unit's config hash covers")
UNHASHED_FIELDS: tuple[str, ...] = (*GRID_DECIDED_FIELDS, *WATCHDOG_FIELDS)

# -- planning (reads only) ------------------------------------------------------------------


def open_store(path: str | os.PathLike) -> StoreLayout:
    """The store at `path`, checked without writing: a writable directory (or one that can
    be created), empty or holding a `store.json` of this format. PipelineError otherwise."""
    path = storage_root(path, what="--store", help=STORE_HELP)
    root = check_writable(path, what="store", hint="pass a writable --store (STORE=... for "
                          "make)")
    try:
        record = read_store_record(root)
    except ValueError as e:
        raise PipelineError(f"--store {root}: {e}; use a store of this format or a new "
                            "directory") from e
    if record is None and root.is_dir() and any(root.iterdir()):
        raise PipelineError(f"--store {root} is not empty and has no store.json: it is not a "
                            "store; give an empty or new directory, or an existing store")
    return StoreLayout(root)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted key: leaf value} (`model.hidden`)."""
    if not isinstance(d, dict):
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
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
    return Phase1Unit(slot.seed, slot.dir, *phase1_unit_config(slot),
                      int(slot.cfg.phase1_max_epochs))


def _trained_phase1_config(store: StoreLayout, seed: int | None) -> dict | None:
    """The Phase-1 part of the config a stored checkpoint was trained with (its
    `phase1_metrics.json`), as a unit records it; None when it has none."""
    part = trained_phase1_part(read_json(store.phase1_dir(seed) / "phase1_metrics.json"))
    return None if part is None else unit_config(part)


def _refuse(store: StoreLayout, unit: str, diff: str | None) -> PipelineError:
    return PipelineError(
        f"--store {store.root}: unit {unit} was made with another configuration "
        f"({diff or 'its config hash differs'}); refusing to mix it in. Use the same preset, "
        "grid and --set values as the store, or another --store")


def check_store_units(store: StoreLayout, cfg, space, slots: list[Phase1Slot],
                      trials: list[TrialId]) -> None:
    """Every stored unit among `slots` and `trials` (this run's piece) was made with this
    run's configuration; PipelineError naming the first differing key otherwise. Reads
    only."""
    for slot in slots:
        rec = Stage1Record.read(store.stage1_json(slot.seed))
        if not rec.sha256:
            continue
        config, digest = phase1_unit_config(slot)
        if rec.config_hash == digest:
            continue
        # the stored config decides; a unit without one (a migrated checkpoint: no hash, no
        # provenance config) is compared through its phase1_metrics.json's train_config
        prov = Provenance.read(store.phase1_provenance(slot.seed))
        stored = prov.config or _trained_phase1_config(store, slot.seed)
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
        # the stored config decides (the hash only summarises it); a unit without one (a
        # migrated result) is compared through its result's own `config`
        stored = prov.config if prov.config else res.get("config")
        diff = config_difference(unit_config(stored), mine) if isinstance(stored, dict) else None
        if diff or not isinstance(stored, dict):
            raise _refuse(store, trial.name, diff)


# -- provenance ---------------------------------------------------------------------------


def start_provenance(*, unit: str, kind: str, config: dict, digest: str, run: str,
                     accelerator: str = "cpu", phase1_sha256: str | None = None) -> Provenance:
    commit = git_commit()
    return Provenance(unit=unit, kind=kind, config_hash=digest, config=config,
                      git_commit=commit["git_commit"], git_dirty=commit["git_dirty"],
                      torch=package_version("torch"), device=device_kind(accelerator),
                      host=socket.gethostname(), pid=os.getpid(), run=run,
                      started=time.time(), phase1_sha256=phase1_sha256)


def write_started(run: Path, prov: Provenance, store: StoreLayout | None = None,
                  stored: Path | None = None, commit_record: Path | None = None) -> None:
    """A unit starts: its provenance into the run's unit (`run`; kept from the first attempt)
    and, with a store that does not hold the unit (no `commit_record`), into the store's
    (`stored`)."""
    if not run.is_file() or Provenance.read(run).config_hash != prov.config_hash:
        prov.write(run)
    if store is not None and not commit_record.is_file():
        with UnitLock(store, prov.unit):
            if not commit_record.is_file():
                Provenance.read(run).write(stored)


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
                         f"{prov_now.config_hash[:12]}...; not published ({diff})")
    return replace(start, landed=time.time(), device=prov_now.device or start.device,
                   landed_git_commit=prov_now.git_commit,
                   phase1_sha256=prov_now.phase1_sha256 or start.phase1_sha256,
                   threads=prov_now.threads or start.threads)


def start_phase1(plan, slot: Phase1Slot, accelerator: str) -> None:
    """A Phase-1 unit the run does not hold starts: its provenance into the run's unit and
    the store's (unless the store holds the unit)."""
    units, store = plan.layout.units, plan.store
    if units.stage1_json(slot.seed).is_file():
        return
    config, digest = phase1_unit_config(slot)
    prov = start_provenance(unit=slot.label, kind="phase1", config=config, digest=digest,
                            run=str(plan.layout.run_dir), accelerator=accelerator)
    write_started(units.phase1_provenance(slot.seed), prov, store, *(() if store is None else (
        store.phase1_provenance(slot.seed), store.stage1_json(slot.seed))))


def land_phase1(slot: Phase1Slot, sha256: str, device: str | None,
                threads: int | None = None) -> None:
    """A Phase-1 task returned: the run's unit's provenance completed (before its
    stage1.json, the commit record, is written); `threads`, how it ran, goes there and not
    into its checkpoint file (issue 53)."""
    path = slot.dir / "provenance.json"
    config, digest = phase1_unit_config(slot)
    now = Provenance(unit=slot.label, kind="phase1", config_hash=digest, config=config,
                     git_commit=git_commit()["git_commit"], device=device,
                     phase1_sha256=sha256, threads=threads)
    landed(path, now).write(path)


def start_trial(ctx, trial: TrialId, cfg, digest: str, accelerator: str) -> Provenance:
    """A trial starts: its provenance into the run's unit, and the store's unless the store
    holds the unit. A unit the run holds from this checkpoint (adopted, or finished before
    a driver died: it is reused, not trained) keeps its own."""
    units = ctx.layout.units
    held = read_json(units.result(trial))
    if isinstance(held, dict) and held.get("phase1_sha256") == digest:
        return Provenance.read(units.provenance(trial))
    config = unit_config(cfg.flat())
    prov = start_provenance(unit=trial.name, kind="trial", config=config,
                            digest=config_hash(config), run=f"{ctx.root}/{ctx.name}",
                            accelerator=accelerator, phase1_sha256=digest)
    store = StoreLayout(Path(ctx.store)) if ctx.store else None
    write_started(units.provenance(trial), prov, store, *(() if store is None else (
        store.provenance(trial), store.result(trial))))
    return prov


def land_trial(units: StoreLayout, trial: TrialId, trial_dir: Path, prov: Provenance) -> None:
    """A trial trained: its unit in the run, its provenance completed, then its result (the
    commit record) last; its diagnostics, where its grid declares them, were written
    before."""
    landed(units.provenance(trial), prov).write(units.provenance(trial))
    atomic_copy(trial_dir / "result.json", units.result(trial))


# -- adopt ----------------------------------------------------------------------------------


def copy_unit(files_from: list[Path], files_to: list[Path]) -> None:
    """Copy a unit's files that exist, each atomically, in the layout's order (the commit
    record last)."""
    for src, dst in zip(files_from, files_to):
        if src.is_file():
            atomic_copy(src, dst)


def adopt_phase1(plan, slot: Phase1Slot) -> str | None:
    """The store's checkpoint of `slot` into the run, through Stage 1's import-and-verify
    path (sha256 sidecar, Phase-1 configuration, loadable; `phase1.install_phase1`), unless
    the run has that one; its sha256, or None when the store has none (or there is no
    store). A checkpoint of the same unit that this run trained too (another writer landed
    first) is moved aside to `<slot>-not-stored-<sha>/`: the store's is the unit, and the
    trials start from it. The one place a Phase-1 unit is adopted."""
    store = plan.store
    if store is None:
        return None
    rec = Stage1Record.read(store.stage1_json(slot.seed))
    if not rec.sha256:
        return None
    have = existing_phase1(slot, repair=True)
    if have == rec.sha256:
        return have
    if have is not None:
        aside = slot.dir.with_name(f"{slot.dir.name}-not-stored-{have[:12]}")
        slot.dir.rename(aside)
        say(f"[store] {slot.label}: the store holds checkpoint {rec.sha256[:12]}..., this run "
            f"trained {have[:12]}... (moved to {aside.name}); the trials start from the "
            "store's")
    src = check_phase1_source(store.phase1_dir(slot.seed), [slot])
    if src.sha256 != rec.sha256:
        raise StoreError(f"store unit {unit_name(slot.seed)}: phase1.pt has sha256 "
                         f"{src.sha256[:12]}... but its stage1.json records "
                         f"{rec.sha256[:12]}...; the unit is damaged")
    units = plan.layout.units
    copy_unit([store.phase1_provenance(slot.seed), store.phase1_diagnose(slot.seed)],
              [units.phase1_provenance(slot.seed), units.phase1_diagnose(slot.seed)])
    return install_phase1(slot, src)


def adopt_trials(plan, trials: list[TrialId]) -> int:
    """Copy the store's units of `trials` into the run (where the run has none): each trial
    then reuses its own result when it matches. Returns how many were copied. The one place
    a trial unit is adopted."""
    n = 0
    store, units = plan.store, plan.layout.units
    for trial in trials if store is not None else ():
        if store.result(trial).is_file() and not units.result(trial).is_file():
            copy_unit(store.trial_files(trial), units.trial_files(trial))
            n += 1
    return n


# -- publish --------------------------------------------------------------------------------


def publish_phase1(store: StoreLayout, slot: Phase1Slot) -> bool:
    """A Phase-1 checkpoint landed in the run: copy its unit into the store (its files in
    the layout's order, `stage1.json` last), unless the store has it. True when published.
    The one place a Phase-1 unit is published."""
    rec = Stage1Record.read(slot.stage1_json)
    unit = unit_name(slot.seed)
    if not rec.sha256:
        raise StoreError(f"unit {unit}: no stage1.json in {slot.dir} to publish")
    with UnitLock(store, unit):
        there = Stage1Record.read(store.stage1_json(slot.seed))
        if there.sha256:
            if there.sha256 != rec.sha256:
                say(f"[store] {unit}: the store holds checkpoint {there.sha256[:12]}..., this "
                    f"run trained {rec.sha256[:12]}...; the store's is kept")
            return False
        prov = Provenance.read(slot.dir / "provenance.json")
        if prov.config_hash is not None and prov.config_hash != rec.config_hash:
            raise StoreError(f"unit {unit}: stage1.json's config hash is not the one its "
                             "provenance started with; not published")
        mine = StoreLayout(slot.dir.parent)
        copy_unit(mine.phase1_files(slot.seed)[:-1], store.phase1_files(slot.seed)[:-1])
        replace(rec, checkpoint=str(store.phase1_ckpt(slot.seed))).write(
            store.stage1_json(slot.seed))
    say(f"[store] published {unit} (sha256 {rec.sha256[:12]}...) -> {store.root}")
    return True


def publish_trial(store: StoreLayout, units: StoreLayout, trial: TrialId) -> str:
    """A trial's unit landed in the run (`units`): copy it into the store (its files in the
    layout's order, `results/<trial>.json` last), unless the store has it, or its Phase-1
    checkpoint is not the store's. Returns what was done, in words ("published", "in the
    store already", or why not). The one place a trial unit is published."""
    res = read_json(units.result(trial))
    if not isinstance(res, dict):
        raise StoreError(f"trial {trial.name}: no result at {units.result(trial)} to publish")
    prov = Provenance.read(units.provenance(trial))
    with UnitLock(store, trial.name):
        if store.result(trial).is_file():  # never replaced; said when it is not the same
            theirs = Provenance.read(store.provenance(trial)).config_hash
            if theirs and prov.config_hash and theirs != prov.config_hash:
                return "in the store already, from another configuration (kept, not replaced)"
            return "in the store already"
        p1 = Stage1Record.read(store.stage1_json(trial.phase1_seed)).sha256
        if p1 != res.get("phase1_sha256"):
            return (f"not published: trained from Phase-1 {str(res.get('phase1_sha256'))[:12]}"
                    f"..., the store's checkpoint is {str(p1)[:12]}...")
        copy_unit(units.trial_files(trial), store.trial_files(trial))
    return "published"


# -- what is left ---------------------------------------------------------------------------


def units_left(store: StoreLayout, slots: list[Phase1Slot],
               trials: list[TrialId]) -> tuple[int, int]:
    """(Phase-1 units, trial units) of `slots`/`trials` not in `store` (a store, or a run's
    own units)."""
    p1 = sum(not store.stage1_json(s.seed).is_file() for s in slots)
    return p1, sum(not store.result(t).is_file() for t in trials)

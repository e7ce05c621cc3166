"""`pmnet store verify DIR`: a read-only check of every unit of a durable store, like a
filesystem check (issue 53). The layout is `pmnet.store_layout`'s; this module reads it
back and says, for each unit, whether it is

- **whole**: its commit record (`stage1.json`, `results/<trial>.json`) parses and has the
  fields the layout requires, every file the unit needs is there and parses, a checkpoint
  matches the sha256 its commit record and its `.sha256` sidecar hold, a provenance whose
  config hash is recorded hashes to it, and a trial names the sha256 of its own Phase-1
  unit, which is whole;
- **partial**: files of a unit without its commit record (a unit being written by another
  machine, or one whose writer died before its commit record: the next writer replaces
  it). A reader never sees it (the report and every "is it in the store" check read
  commit records), so a partial unit does not fail the check;
- **corrupt**: a commit record or a file of the unit that is missing, unreadable or
  inconsistent (the reason names the file);
- **orphaned**: a trial whose Phase-1 checkpoint is not in the store: its `phase1_sha256`
  is not the sha256 of its Phase-1 unit, or that unit is absent or not whole.

`verify_store(root)` returns a `StoreCheck` (its `table()` is what the command prints);
`StoreCheck.damaged` are the units a run moves aside and trains again
(`pmnet.store_repair`) and that `make report STORE=` refuses. Whether a unit was made
with *this run's* configuration is not a property of the store: planning checks it
(`pipelines.store.check_store_units`, exit 2 naming the key).

This module imports nothing heavy (no torch): hashing the committed stores takes a second.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pmnet.io import sha256_file
from pmnet.store_layout import StoreLayout, config_digest, read_store_record
from pmnet.trial_id import TrialId

WHOLE, PARTIAL, CORRUPT, ORPHANED = "whole", "partial", "corrupt", "orphaned"
#: the states a run quarantines and a report refuses
DAMAGED = (CORRUPT, ORPHANED)
#: where a run moves a damaged unit (`<unit>-<UTC time>/`); never read as part of the store
QUARANTINE_DIR = "quarantine"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PHASE1_DIR = re.compile(r"^phase1(?:-p1s(0|[1-9][0-9]*))?$")


class NotAStore(ValueError):
    """The directory is not a store of this format (no store.json, another version, a file,
    unreadable): nothing to verify."""


@dataclass(frozen=True)
class UnitCheck:
    """One unit's verdict. `unit` is `phase1`, `phase1-p1s<k>` or the trial's name; `path`
    the file the verdict is about (relative to the store); `reason` why, for a unit that is
    not whole."""

    unit: str
    kind: str  # "phase1" | "trial"
    state: str  # WHOLE | PARTIAL | CORRUPT | ORPHANED
    path: str = ""
    reason: str = ""
    phase1_seed: int | None = None
    sha256: str | None = None  # a whole Phase-1 unit's checkpoint

    @property
    def damaged(self) -> bool:
        return self.state in DAMAGED

    def line(self) -> str:
        """`<unit>: <path> <reason>` (the quarantine's and the refusal's words)."""
        return f"{self.unit}: {self.path}: {self.reason}" if self.reason else self.unit


@dataclass(frozen=True)
class StoreCheck:
    """Every unit of a store, Phase-1 units first, each kind in name order."""

    root: Path
    units: list[UnitCheck] = field(default_factory=list)

    def of(self, state: str) -> list[UnitCheck]:
        return [u for u in self.units if u.state == state]

    @property
    def damaged(self) -> list[UnitCheck]:
        return [u for u in self.units if u.damaged]

    @property
    def ok(self) -> bool:
        """Every committed unit is whole (partial units are allowed: module docstring)."""
        return not self.damaged

    def counts(self) -> dict[str, int]:
        return {s: len(self.of(s)) for s in (WHOLE, PARTIAL, CORRUPT, ORPHANED)}

    def table(self, *, all_units: bool = False) -> str:
        """A Markdown table of the units that are not whole (every unit with `all_units`),
        and a summary line."""
        rows = self.units if all_units else [u for u in self.units if u.state != WHOLE]
        out = []
        if rows:
            out += ["| unit | kind | state | file | why |", "|---|---|---|---|---|"]
            out += [f"| {u.unit} | {u.kind} | {u.state} | {u.path} | {u.reason} |"
                    for u in rows]
        c = self.counts()
        p1 = sum(u.kind == "phase1" and u.state == WHOLE for u in self.units)
        out.append(f"store {self.root}: {len(self.units)} unit(s): {c[WHOLE]} whole "
                   f"({p1} Phase-1, {c[WHOLE] - p1} trial), {c[PARTIAL]} partial, "
                   f"{c[CORRUPT]} corrupt, {c[ORPHANED]} orphaned"
                   + ("" if self.ok else "; the store is damaged"))
        return "\n".join(out)


# -- reading ----------------------------------------------------------------------------------


class _Bad(Exception):
    """A unit's file is missing or wrong: (relative path, reason)."""

    def __init__(self, path: str, reason: str):
        super().__init__(reason)
        self.path, self.reason = path, reason


def _rel(store: StoreLayout, path: Path) -> str:
    try:
        return str(path.relative_to(store.root))
    except ValueError:
        return str(path)


def _json_object(store: StoreLayout, path: Path) -> dict[str, Any]:
    """The JSON object in `path`; _Bad naming the file otherwise."""
    rel = _rel(store, path)
    if not path.is_file():
        raise _Bad(rel, "missing")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _Bad(rel, f"unreadable ({e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Bad(rel, f"not valid JSON ({len(text.encode())} bytes; {e.msg}: byte "
                        f"{e.pos})") from e
    if not isinstance(data, dict):
        raise _Bad(rel, f"holds a JSON {type(data).__name__}, not an object")
    return data


def _sha(value: Any) -> bool:
    return isinstance(value, str) and bool(_SHA256.match(value))


def _config_hash_ok(prov: dict) -> bool:
    """A provenance's `config` hashes to its `config_hash` (`pipelines.store.config_hash` of
    a configuration already flat, which is how a unit records it). A Phase-1 unit's hash is
    of the nested Phase-1 part (`pipelines.phase1.phase1_config_hash`), so only a trial's is
    recomputed here."""
    return config_digest(prov["config"]) == prov["config_hash"]


def _check_provenance(store: StoreLayout, path: Path, unit: str, *,
                      trial: bool) -> dict[str, Any]:
    prov = _json_object(store, path)
    rel = _rel(store, path)
    if prov.get("unit") is not None and prov["unit"] != unit:
        raise _Bad(rel, f"names unit {prov['unit']!r}, not {unit!r}")
    h = prov.get("config_hash")
    if h is not None:
        if not _sha(h) or not isinstance(prov.get("config"), dict):
            raise _Bad(rel, "config_hash without a sha256 and its config")
        if trial and not _config_hash_ok(prov):
            raise _Bad(rel, f"its config does not hash to its config_hash {h[:12]}...")
    return prov


# -- one unit ---------------------------------------------------------------------------------


def check_phase1_unit(store: StoreLayout, seed: int | None) -> UnitCheck:
    """The verdict of the Phase-1 unit of `seed` (`phase1/` for None)."""
    d = store.phase1_dir(seed)
    unit = d.name
    rec_path = store.stage1_json(seed)
    if not rec_path.exists():
        return UnitCheck(unit, "phase1", PARTIAL, _rel(store, d),
                         "files without its commit record stage1.json", seed)
    try:
        rec = _json_object(store, rec_path)
        rel = _rel(store, rec_path)
        sha = rec.get("sha256")
        if not _sha(sha):
            raise _Bad(rel, f"no sha256 of its checkpoint (sha256: {sha!r})")
        if rec.get("phase1_seed") != seed and not (seed is None and "phase1_seed" not in rec):
            raise _Bad(rel, f"records phase1_seed {rec.get('phase1_seed')!r}, its directory "
                            f"is {unit}")
        ckpt = store.phase1_ckpt(seed)
        if not ckpt.is_file():
            raise _Bad(_rel(store, ckpt), "missing")
        sidecar = Path(f"{ckpt}.sha256")
        if not sidecar.is_file():
            raise _Bad(_rel(store, sidecar), "missing")
        fields = sidecar.read_text(encoding="utf-8", errors="replace").split()
        if not fields or fields[0] != sha:
            raise _Bad(_rel(store, sidecar),
                       f"records {(fields[0] if fields else '(nothing)')[:12]}..., "
                       f"stage1.json {sha[:12]}...")
        actual = sha256_file(ckpt)
        if actual != sha:
            raise _Bad(_rel(store, ckpt), f"has sha256 {actual[:12]}..., its stage1.json and "
                                          f".sha256 record {sha[:12]}...")
        _json_object(store, d / "phase1_metrics.json")
        prov = _check_provenance(store, store.phase1_provenance(seed), unit, trial=False)
        for key in ("config_hash", "phase1_sha256"):
            theirs, mine = prov.get(key), rec.get("config_hash" if key == "config_hash"
                                                  else "sha256")
            if theirs is not None and mine is not None and theirs != mine:
                raise _Bad(_rel(store, store.phase1_provenance(seed)),
                           f"its {key} {str(theirs)[:12]}... is not stage1.json's "
                           f"{str(mine)[:12]}...")
        diag = store.phase1_diagnose(seed)
        if diag.exists():
            _json_object(store, diag)
    except _Bad as e:
        return UnitCheck(unit, "phase1", CORRUPT, e.path, e.reason, seed)
    return UnitCheck(unit, "phase1", WHOLE, _rel(store, rec_path), "", seed, sha)


def check_trial_unit(store: StoreLayout, name: str,
                     phase1: dict[int | None, UnitCheck]) -> UnitCheck:
    """The verdict of the trial unit `name` (`results/<name>.json`); `phase1` the verdicts of
    the store's Phase-1 units by seed."""
    res_path = store.results_dir / f"{name}.json"
    rel = _rel(store, res_path)
    try:
        trial = TrialId.parse(name)
    except ValueError as e:
        return UnitCheck(name, "trial", CORRUPT, rel, str(e))
    if not res_path.exists():
        return UnitCheck(name, "trial", PARTIAL, _rel(store, store.provenance(trial)),
                         "files without its commit record results/<trial>.json",
                         trial.phase1_seed)
    try:
        res = _json_object(store, res_path)
        try:
            named = TrialId.from_result(res)
        except (TypeError, ValueError) as e:
            raise _Bad(rel, f"not a trial's result ({e})") from e
        if named != trial:
            raise _Bad(rel, f"holds trial {named.name}, not {name}")
        if not isinstance(res.get("test"), dict) or not res["test"]:
            raise _Bad(rel, "no test metrics")
        p1 = res.get("phase1_sha256")
        if not _sha(p1):
            raise _Bad(rel, f"no phase1_sha256 (got {p1!r})")
        orphan = _orphaned(store, trial, p1, phase1)
        if orphan:
            return UnitCheck(name, "trial", ORPHANED, rel, orphan, trial.phase1_seed)
        prov = _check_provenance(store, store.provenance(trial), name, trial=True)
        if prov.get("phase1_sha256") not in (None, p1):
            raise _Bad(_rel(store, store.provenance(trial)),
                       f"its phase1_sha256 {prov['phase1_sha256'][:12]}... is not its "
                       f"result's {p1[:12]}...")
        diag = store.diagnostics(trial)
        if diag.exists():
            _json_object(store, diag)
    except _Bad as e:
        return UnitCheck(name, "trial", CORRUPT, e.path, e.reason, trial.phase1_seed)
    return UnitCheck(name, "trial", WHOLE, rel, "", trial.phase1_seed)


def _orphaned(store: StoreLayout, trial: TrialId, p1: str,
              phase1: dict[int | None, UnitCheck]) -> str | None:
    """Why the trial's checkpoint (`p1`) is not in the store; None when its Phase-1 unit is
    whole and is that checkpoint."""
    own = phase1.get(trial.phase1_seed)
    p1_unit = store.phase1_dir(trial.phase1_seed).name
    if own is None or own.state != WHOLE:
        return (f"trained from Phase-1 {p1[:12]}...; its Phase-1 unit {p1_unit} is "
                f"{'absent' if own is None else own.state}")
    if own.sha256 != p1:
        return (f"trained from Phase-1 {p1[:12]}..., which is not in the store ({p1_unit} "
                f"holds {own.sha256[:12]}...)")
    return None


# -- the store --------------------------------------------------------------------------------


def open_for_check(root: str | os.PathLike[str]) -> StoreLayout:
    """The store at `root`; NotAStore saying why it is not one."""
    path = Path(root).expanduser().absolute()
    if not path.exists():
        raise NotAStore(f"{path} does not exist")
    if not path.is_dir():
        raise NotAStore(f"{path} is a file, not a store directory")
    try:
        record = read_store_record(path)
    except ValueError as e:
        raise NotAStore(str(e)) from e
    if record is None:
        raise NotAStore(f"{path} has no store.json: it is not a store"
                        + ("" if any(path.iterdir()) else " (an empty directory)"))
    return StoreLayout(path)


def _phase1_seeds(store: StoreLayout) -> Iterator[int | None]:
    found = []
    for d in store.root.iterdir():
        m = _PHASE1_DIR.match(d.name)
        if m and d.is_dir():
            found.append(None if m.group(1) is None else int(m.group(1)))
    yield from sorted(found, key=lambda s: -1 if s is None else s)


def _trial_names(store: StoreLayout) -> list[str]:
    """Every trial with a file in results/, provenance/ or diagnostics/ (a partial one has no
    result)."""
    names: set[str] = set()
    for sub in (store.results_dir, store.root / "provenance", store.diagnostics_dir):
        if sub.is_dir():
            names.update(p.stem for p in sub.glob("*.json") if not p.name.startswith("."))
    return sorted(names)


def verify_store(root: str | os.PathLike[str]) -> StoreCheck:
    """Every unit of the store at `root` (reads only); NotAStore when it is not one."""
    store = open_for_check(root)
    phase1 = {s: check_phase1_unit(store, s) for s in _phase1_seeds(store)}
    trials = [check_trial_unit(store, n, phase1) for n in _trial_names(store)]
    return StoreCheck(store.root, [*phase1.values(), *trials])


def verify_command(root: str | os.PathLike[str], *, all_units: bool = False) -> int:
    """`pmnet store verify DIR`: print the table; 0 when every committed unit is whole, 1
    when one is corrupt or orphaned, 2 when DIR is not a store."""
    import sys

    try:
        check = verify_store(root)
    except NotAStore as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(check.table(all_units=all_units))
    return 0 if check.ok else 1

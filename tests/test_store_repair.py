"""A store run moves its damaged units aside and trains them again (`pmnet.store_repair`,
issue 53).

Fast: each damage of issue 53 is quarantined (moved, never deleted, under the unit's lock,
one line naming the file and the reason) and the store left verifies whole; a unit of
another configuration is not damage (planning's refusal, exit 2, moves nothing); the
pre-pass runs at the start of a real store run (`pipelines.run start --store`), before
anything is planned or trained. Slow: the bar of issue 53 on a debug `checkpoints` grid: two
pieces (one SIGKILLed and run again) equal one run, unit for unit and by every
`phase1_sha256`; the pieces' store then damaged in every way of the table plus an empty,
stale lock file, run again: it exits 0 with every unit whole and equal to the one run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import time
from pathlib import Path

import pytest

from pipelines.console import say
from pmnet.store_layout import StoreLayout
from pmnet.store_repair import quarantine_damaged
from pmnet.store_verify import CORRUPT, ORPHANED, QUARANTINE_DIR, verify_store
from tests.support import store as fake


def _quarantine(store) -> tuple[list, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        moved = quarantine_damaged(store, say)  # the driver's console, as in a run
    return moved, out.getvalue()


def _quarantined(store) -> dict[str, dict]:
    """quarantine.json of every quarantined unit, by unit."""
    q = store.root / QUARANTINE_DIR
    return {json.loads(p.read_text())["unit"]: json.loads(p.read_text())
            for p in q.glob("*/quarantine.json")} if q.is_dir() else {}


def test_a_truncated_result_is_moved_aside_whole_and_named(tmp_path):
    store = fake.make_store(tmp_path / "s")
    name = "consolidator_only-p1-s42"
    damaged = fake.truncate_result(store, name).read_bytes()
    prov = (store.root / "provenance" / f"{name}.json").read_bytes()
    moved, out = _quarantine(store)
    assert [m.check.unit for m in moved] == [name]
    (line,) = out.splitlines()
    assert line.split("] ", 1)[1].startswith(
        f"[store] quarantined {name} (corrupt): results/{name}.json: not valid JSON (40 bytes"
    ) and line.endswith("it trains again"), line
    dest = moved[0].dest
    assert dest.parent == store.root / QUARANTINE_DIR and dest.name.startswith(f"{name}-")
    assert (dest / "results" / f"{name}.json").read_bytes() == damaged  # nothing deleted
    assert (dest / "provenance" / f"{name}.json").read_bytes() == prov
    assert _quarantined(store)[name]["state"] == CORRUPT
    assert not store.results_dir.joinpath(f"{name}.json").exists()
    assert not (store.root / "provenance" / f"{name}.json").exists()
    check = verify_store(store.root)
    assert check.ok and len(check.units) == 5, check.table()
    assert not list((store.root / "locks").iterdir())  # its lock was taken and released


def test_a_checkpoint_whose_bytes_changed_goes_with_its_trials(tmp_path):
    store = fake.make_store(tmp_path / "s")
    fake.change_checkpoint_bytes(store, 2)
    files = sorted(p.name for p in store.phase1_dir(2).iterdir())
    moved, out = _quarantine(store)
    assert [(m.check.unit, m.check.state) for m in moved] == [
        ("phase1-p1s2", CORRUPT), ("consolidator_only-p2-s42", ORPHANED)]
    assert "quarantined phase1-p1s2 (corrupt): phase1-p1s2/phase1.pt: has sha256" in out, out
    assert ("quarantined consolidator_only-p2-s42 (orphaned): results/consolidator_only-p2-"
            "s42.json: trained from Phase-1") in out and "phase1-p1s2 is absent" in out, out
    assert sorted(p.name for p in moved[0].dest.iterdir()) == sorted(
        [*files, "quarantine.json"])
    assert not store.phase1_dir(2).exists()
    assert verify_store(store.root).ok


def test_an_orphaned_result_is_moved_aside(tmp_path):
    store = fake.make_store(tmp_path / "s")
    fake.orphan_result(store, "consolidator_only-p0-s42")
    moved, out = _quarantine(store)
    assert [(m.check.unit, m.check.state) for m in moved] == [
        ("consolidator_only-p0-s42", ORPHANED)]
    assert "ffffffffffff..., which is not in the store" in out, out
    assert verify_store(store.root).ok


def test_a_whole_store_is_left_as_it_is(tmp_path):
    store = fake.make_store(tmp_path / "s")
    before = sorted(str(p) for p in store.root.rglob("*"))
    assert _quarantine(store) == ([], "")
    assert sorted(str(p) for p in store.root.rglob("*") if "locks" not in p.parts) == before


def test_a_unit_repaired_while_waiting_for_its_lock_stays(tmp_path, monkeypatch):
    """The verdict is taken again under the unit's lock: another writer may have replaced
    the unit (here: the result is made whole again just before the move)."""
    from pmnet import store_repair

    store = fake.make_store(tmp_path / "s")
    name = "consolidator_only-p0-s42"
    good = store.results_dir.joinpath(f"{name}.json").read_bytes()
    fake.truncate_result(store, name)
    real = store_repair._recheck

    def repaired_first(store_, unit):
        store_.results_dir.joinpath(f"{name}.json").write_bytes(good)
        return real(store_, unit)

    monkeypatch.setattr(store_repair, "_recheck", repaired_first)
    assert _quarantine(store) == ([], "")
    assert store.results_dir.joinpath(f"{name}.json").read_bytes() == good


def test_a_units_identity_does_not_depend_on_how_it_was_scheduled(tmp_path):
    """The config hashes a unit is compared by leave out its threads (2 for a checkpoint
    trained alone on 2 cores, 1 in a wave of two); the threads go to its provenance, which
    keeps them from the start record or the landing one."""
    from pipelines.phase1 import phase1_config_hash
    from pipelines.records import Provenance
    from pipelines.store import config_hash, landed, unit_config

    cfg, space = fake.grid()
    for threads in (1, 2, 7):
        other = dataclasses.replace(cfg, threads=threads)
        assert phase1_config_hash(other) == phase1_config_hash(cfg)
        trial = space.trials[0]
        assert config_hash(unit_config(space.trial_config(other, trial).flat())) == \
            config_hash(unit_config(space.trial_config(cfg, trial).flat()))
    scratch = tmp_path / "provenance.json"
    Provenance(unit="phase1-p1s0", kind="phase1", config_hash="c" * 64).write(scratch)
    now = Provenance(unit="phase1-p1s0", kind="phase1", config_hash="c" * 64, threads=2)
    assert landed(scratch, now).threads == 2


# -- through the pipeline's command line ---------------------------------------------------------


def _start(tmp_path: Path, store: Path, *extra: str) -> tuple[int, str]:
    from pipelines import run

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = run.main(["start", *fake.ARGS, "--root", str(tmp_path / "runs"), "--store",
                       str(store), *extra])
    return rc, out.getvalue()


def test_a_store_run_quarantines_before_it_plans_a_wave(tmp_path, monkeypatch):
    """`start --store` on a store with the three damages of issue 53: the pre-pass moves
    them aside first (here the run then stops at its `--max-wall` before the first wave, so
    no Ray and no training: it says which units are left to train); the store verifies
    whole. An empty lock file of one of them, older than the stale threshold, is no
    obstacle."""
    for k in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    store = fake.make_store(tmp_path / "s")
    fake.truncate_result(store, "consolidator_only-p1-s42")
    fake.change_checkpoint_bytes(store, 2)
    fake.orphan_result(store, "consolidator_only-p0-s42")
    lock = store.lock("consolidator_only-p1-s42")
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - 700, time.time() - 700))
    rc, out = _start(tmp_path, store.root, "--max-wall", "1e-9")
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if "[store] quarantined" in ln]
    assert [ln.split()[3] for ln in lines] == [
        "phase1-p1s2", "consolidator_only-p0-s42", "consolidator_only-p1-s42",
        "consolidator_only-p2-s42"], out
    assert "1 Phase-1 and 3 trial unit(s) of this run not done in" in out, out
    check = verify_store(store.root)
    assert check.ok and len(check.units) == 2, check.table()
    assert set(_quarantined(store)) == {"phase1-p1s2", "consolidator_only-p0-s42",
                                        "consolidator_only-p1-s42", "consolidator_only-p2-s42"}
    assert not lock.exists()


def test_a_unit_of_another_configuration_is_refused_not_quarantined(tmp_path, monkeypatch):
    """Not damage: planning refuses it (exit 2, naming the key) and nothing is moved."""
    for k in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    store = fake.make_store(tmp_path / "s")
    fake.truncate_result(store, "consolidator_only-p1-s42")  # damage beside it: not touched
    rc, out = _start(tmp_path, store.root, "--set", "max_epochs=7", "--max-wall", "1e-9")
    assert rc == 2, out
    assert "was made with another configuration (max_epochs: 2 in the store vs 7 here)" in out
    assert not (store.root / QUARANTINE_DIR).exists()
    assert not verify_store(store.root).ok  # left for a run of the store's configuration


# -- the bar: a checkpoints grid in pieces equals one run; a damaged store ends whole -----------


def _units(store: Path) -> dict:
    """Every unit: a Phase-1 checkpoint's sha256 and test metrics, a trial's phase1_sha256,
    test metrics and best epoch."""
    out = {}
    for rec in sorted(store.glob("phase1*/stage1.json")):
        info = json.loads(rec.read_text())
        out[rec.parent.name] = (info["sha256"], info["metrics"])
    for res in sorted((store / "results").glob("*.json")):
        r = json.loads(res.read_text())
        out[res.stem] = (r["phase1_sha256"], r["test"], r.get("best_epoch"))
    return out


def _same_units(got: dict, want: dict) -> bool:
    """`_units` of two stores alike. On an AMD CPU their test metrics (to 1e-5, relative)
    and best epochs: R trains its two checkpoints with one thread each, P with two, and
    there the thread count changes fp32 Phase 1's rounding, so the sha256s differ
    (measured at stop 63: every recall equal, two losses apart in the 7th digit;
    tests/test_train.py's byte-identity xfail)."""
    if fake.amd_cpu():
        def close(a, b) -> bool:
            if isinstance(a, dict) and isinstance(b, dict):
                return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
            if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
                return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
            if isinstance(a, float) and isinstance(b, float):
                return math.isclose(a, b, rel_tol=1e-5) or (a != a and b != b)
            return a == b

        return close({k: v[1:] for k, v in got.items()}, {k: v[1:] for k, v in want.items()})
    return got == want


@pytest.mark.slow
def test_pieces_equal_one_run_and_a_damaged_store_ends_whole(tmp_path):
    """The debug `checkpoints` grid (consolidator_only x seeds 42, 43 under Phase-1 seeds 0
    and 1), without --stage1-cpus: in one run R the two checkpoints train side by side (a
    wave of two: one thread each); into P checkpoint 0 alone (two threads), then checkpoint
    1 alone, SIGKILLed after its first trial and resumed. R and P hold the same units, by
    every checkpoint's and trial's `phase1_sha256`. Then P is damaged as in issue 53 (a
    result truncated to 40 bytes, one orphaned, bytes of checkpoint 1 changed under its
    sha256, an empty lock file 20 minutes old) and the grid is run into it again: exit 0,
    every damaged unit quarantined and trained again, P verifies whole and equals R."""
    from tests.support.pipeline import cli

    base = ["start", "--preset", "debug", "--grid", "checkpoints", "--gpus-per-trial", "0",
            "--conditions", "consolidator_only", "--seeds", "42,43"]
    ref, pieces, runs = tmp_path / "R", tmp_path / "P", str(tmp_path / "runs")
    t0 = time.time()
    rc, out = cli(*base, "--phase1-seeds", "0,1", "--store", str(ref), "--root", runs,
                  "--name", "ref", timeout=900)
    assert rc == 0, out[-4000:]
    rc, out = cli(*base, "--phase1-seeds", "0", "--store", str(pieces), "--root", runs,
                  "--name", "a", timeout=900)
    assert rc == 0, out[-4000:]
    rc, out = cli(*base, "--phase1-seeds", "1", "--store", str(pieces), "--root", runs,
                  "--name", "b", env={"PMNET_TEST_KILL_DRIVER_AT": "stage2-first-result"},
                  timeout=900)
    assert rc != 0, out[-4000:]
    rc, out = cli("resume", "--name", "b", "--root", runs, timeout=900)
    assert rc == 0, out[-4000:]
    want = _units(ref)
    assert len(want) == 6 and _same_units(_units(pieces), want)
    assert verify_store(ref).ok and verify_store(pieces).ok
    t_pieces = time.time() - t0

    store = StoreLayout(pieces)
    fake.truncate_result(store, "consolidator_only-p0-s42")
    fake.orphan_result(store, "consolidator_only-p0-s43")
    fake.change_checkpoint_bytes(store, 1)
    lock = store.lock("consolidator_only-p0-s42")
    lock.parent.mkdir(exist_ok=True)
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - 1200, time.time() - 1200))
    assert {u.unit for u in verify_store(pieces).damaged} == {
        "consolidator_only-p0-s42", "consolidator_only-p0-s43", "phase1-p1s1",
        "consolidator_only-p1-s42", "consolidator_only-p1-s43"}
    rc, out = cli(*base, "--phase1-seeds", "0,1", "--store", str(pieces), "--root", runs,
                  "--name", "c", timeout=900)
    assert rc == 0, out[-4000:]
    assert sum("[store] quarantined" in ln for ln in out.splitlines()) == 5, out[-4000:]
    check = verify_store(pieces)
    assert check.ok and len(check.units) == 6, check.table()
    assert _same_units(_units(pieces), want)
    assert len(list((pieces / QUARANTINE_DIR).iterdir())) == 5
    print(f"two pieces + reference: {t_pieces:.0f} s; damaged store run again: "
          f"{time.time() - t0 - t_pieces:.0f} s")

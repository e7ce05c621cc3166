"""`pmnet store verify DIR` (`pmnet.store_verify`, issue 53): every unit of a store read back.

Every committed store is whole or, while its study is under way, partial (found by its
store.json under experiments/results: the check CI runs); each damage of issue 53 is named
with its file and reason and fails the check (exit 1); partial units (files without a commit
record) do not; what is not a store exits 2; `make report STORE=` refuses a damaged store
with the same table.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from pathlib import Path

import pytest

from pmnet.store_layout import StoreLayout
from pmnet.store_verify import CORRUPT, ORPHANED, PARTIAL, WHOLE, NotAStore, verify_store
from tests.support import store as fake

REPO = Path(__file__).resolve().parents[1]
COMMITTED = sorted(p.parent for p in (REPO / "experiments" / "results").rglob("store.json")
                   if "quarantine" not in p.parts)


def _cli(*args: str) -> tuple[int, str, str]:
    from pmnet.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["store", "verify", *map(str, args)])
    return rc, out.getvalue(), err.getvalue()


def _states(check) -> dict[str, str]:
    return {u.unit: u.state for u in check.units}


# -- the committed stores (CI) -----------------------------------------------------------------


def test_there_is_a_committed_store_to_verify():
    assert REPO / "experiments/results/issue39/store" in COMMITTED, COMMITTED


@pytest.mark.parametrize("root", COMMITTED, ids=[str(p.relative_to(REPO)) for p in COMMITTED])
def test_every_committed_store_is_whole_or_under_way(root):
    t0 = time.time()
    check = verify_store(root)
    took = time.time() - t0
    counts = check.counts()
    # A store whose study is under way holds partial units (a paused Phase 1: its provenance
    # committed, its progress not): not damage, as `store verify` says with exit 0. Nothing
    # committed may be corrupt or orphaned.
    assert check.ok and counts[WHOLE] + counts[PARTIAL] == len(check.units), check.table()
    assert counts[CORRUPT] == counts[ORPHANED] == 0, check.table()
    assert any(u.kind == "phase1" for u in check.units)
    assert took < 30, f"{took:.1f} s"  # seconds (0.6 s for issue 39's on the 2-core VM)
    rc, out, _ = _cli(root)
    assert rc == 0 and f"{counts[WHOLE]} whole" in out, out


PROGRESS = sorted(q for root in COMMITTED for q in root.rglob("progress.json")
                  if q.parent.name == "progress" or q.parent.parent.name == "progress")


@pytest.mark.parametrize("record", PROGRESS, ids=[str(p.relative_to(REPO)) for p in PROGRESS])
def test_every_committed_progress_is_whole(record):
    """A paused unit's committed progress (stop 69: the confirmatory store commits one at a
    time, since a machine may not keep its disk) reads back as its record says: every file
    it names hashes to the recorded sha256, and it belongs to a unit not yet landed."""
    from pmnet.io import sha256_file
    from pmnet.store_progress import ProgressRecord

    rec = ProgressRecord.from_dict(json.loads(record.read_text()))
    for name, want in {(rec.last, rec.last_sha256), (rec.best, rec.best_sha256)}:
        if name is not None:
            assert sha256_file(record.parent / name) == want, name
    names = {rec.last, rec.best, "progress.json"} - {None}
    assert {f.name for f in record.parent.iterdir()} == names  # nothing stale beside it
    landed = record.parent.parent / "stage1.json" if rec.phase == 1 else \
        record.parents[2] / "results" / f"{rec.unit}.json"
    assert not landed.exists(), f"{rec.unit} landed: its progress should have gone"


# -- a fabricated store and its damages ---------------------------------------------------------


def test_a_whole_store_verifies_and_lists_its_units(tmp_path):
    store = fake.make_store(tmp_path / "s")
    check = verify_store(store.root)
    assert set(_states(check).values()) == {WHOLE}
    assert [u.unit for u in check.units][:3] == ["phase1-p1s0", "phase1-p1s1", "phase1-p1s2"]
    rc, out, _ = _cli(store.root, "--all")
    assert rc == 0 and "| consolidator_only-p0-s42 | trial | whole |" in out, out
    assert "6 unit(s): 6 whole (3 Phase-1, 3 trial), 0 partial, 0 corrupt, 0 orphaned" in out


def _truncated(store):
    fake.truncate_result(store, "consolidator_only-p1-s42")
    return {"consolidator_only-p1-s42": (CORRUPT, "results/consolidator_only-p1-s42.json",
                                         "not valid JSON (40 bytes")}


def _changed_checkpoint(store):
    fake.change_checkpoint_bytes(store, 2)
    return {"phase1-p1s2": (CORRUPT, "phase1-p1s2/phase1.pt", "has sha256 "),
            "consolidator_only-p2-s42": (ORPHANED, "results/consolidator_only-p2-s42.json",
                                         "its Phase-1 unit phase1-p1s2 is corrupt")}


def _orphan(store):
    fake.orphan_result(store, "consolidator_only-p0-s42")
    return {"consolidator_only-p0-s42": (ORPHANED, "results/consolidator_only-p0-s42.json",
                                         "trained from Phase-1 ffffffffffff..., which is not "
                                         "in the store (phase1-p1s0 holds ")}


def _sidecar(store):
    fake.change_checkpoint_bytes(store, 1)
    from pmnet.io import sha256_file
    from pmnet.model_files import write_sha256

    write_sha256(store.phase1_ckpt(1), sha256_file(store.phase1_ckpt(1)))  # sidecar follows
    return {"phase1-p1s1": (CORRUPT, "phase1-p1s1/phase1.pt.sha256", "stage1.json "),
            "consolidator_only-p1-s42": (ORPHANED, "results/consolidator_only-p1-s42.json",
                                         "phase1-p1s1 is corrupt")}


def _commit_record(store):
    path = store.stage1_json(0)
    rec = json.loads(path.read_text())
    del rec["sha256"]
    path.write_text(json.dumps(rec))
    return {"phase1-p1s0": (CORRUPT, "phase1-p1s0/stage1.json", "no sha256 of its checkpoint"),
            "consolidator_only-p0-s42": (ORPHANED, "results/consolidator_only-p0-s42.json",
                                         "phase1-p1s0 is corrupt")}


def _provenance(store):
    path = store.root / "provenance" / "consolidator_only-p0-s42.json"
    prov = json.loads(path.read_text())
    prov["config"]["lr"] = 1.0  # its hash no longer says what it is
    path.write_text(json.dumps(prov))
    return {"consolidator_only-p0-s42": (CORRUPT, "provenance/consolidator_only-p0-s42.json",
                                         "its config does not hash to its config_hash")}


def _missing_checkpoint(store):
    store.phase1_ckpt(0).unlink()
    return {"phase1-p1s0": (CORRUPT, "phase1-p1s0/phase1.pt", "missing"),
            "consolidator_only-p0-s42": (ORPHANED, "results/consolidator_only-p0-s42.json",
                                         "phase1-p1s0 is corrupt")}


def _wrong_trial(store):
    src = store.results_dir / "consolidator_only-p0-s42.json"
    (store.results_dir / "consolidator_only-p0-s43.json").write_text(src.read_text())
    return {"consolidator_only-p0-s43": (CORRUPT, "results/consolidator_only-p0-s43.json",
                                         "holds trial consolidator_only-p0-s42")}


DAMAGES = {"truncated result": _truncated, "changed checkpoint bytes": _changed_checkpoint,
           "orphaned result": _orphan, "sidecar rewritten to match": _sidecar,
           "commit record without sha256": _commit_record, "provenance edited": _provenance,
           "checkpoint missing": _missing_checkpoint, "result of another trial": _wrong_trial}


@pytest.mark.parametrize("damage", list(DAMAGES.values()), ids=list(DAMAGES))
def test_each_damage_is_named_with_its_file_and_fails_the_check(tmp_path, damage):
    store = fake.make_store(tmp_path / "s")
    want = damage(store)
    check = verify_store(store.root)
    got = {u.unit: (u.state, u.path, u.reason) for u in check.units if u.state != WHOLE}
    assert set(got) == set(want), check.table()
    for unit, (state, path, reason) in want.items():
        assert got[unit][:2] == (state, path) and reason in got[unit][2], (unit, got[unit])
    assert not check.ok and {u.unit for u in check.damaged} == set(want)
    rc, out, _ = _cli(store.root)
    assert rc == 1, out
    for unit, (state, path, _) in want.items():
        assert f"| {unit} | " in out and f"| {state} | {path} |" in out, out
    assert out.rstrip().endswith("the store is damaged"), out


def test_partial_units_are_listed_and_do_not_fail_the_check(tmp_path):
    """Files without a commit record: a unit another machine is writing (a Phase-1 unit's
    provenance written at its start, its in-progress checkpoint), or one whose writer died
    before its commit record. No reader sees them; the next writer replaces them."""
    store = fake.make_store(tmp_path / "s")
    d = store.phase1_dir(7)
    (d / "phase1_ckpt").mkdir(parents=True)
    (d / "phase1_ckpt" / "last.ckpt").write_bytes(b"in progress")
    (d / "provenance.json").write_text(json.dumps({"unit": "phase1-p1s7"}))
    (store.root / "provenance" / "consolidator_only-p9-s42.json").write_text("{}")
    check = verify_store(store.root)
    assert {u.unit: u.state for u in check.of(PARTIAL)} == {
        "phase1-p1s7": PARTIAL, "consolidator_only-p9-s42": PARTIAL}
    assert check.ok
    rc, out, _ = _cli(store.root)
    assert rc == 0 and "2 partial" in out and "| phase1-p1s7 | phase1 | partial |" in out, out


# -- not a store: exit 2 ------------------------------------------------------------------------


def _version_99(path: Path) -> None:
    fake.make_store(path)
    (path / "store.json").write_text(json.dumps({"format": "pmnet-store", "version": 99}))


NOT_STORES = {
    "store.json of version 99": (_version_99, "store format version 99; this code reads "
                                              "version 1"),
    "an empty directory": (lambda p: p.mkdir(), "has no store.json: it is not a store (an "
                                                "empty directory)"),
    "a file": (lambda p: p.write_text("x"), "is a file, not a store directory"),
    "nothing": (lambda p: None, "does not exist"),
}


@pytest.mark.parametrize("prepare, message", list(NOT_STORES.values()), ids=list(NOT_STORES))
def test_what_is_not_a_store_exits_2_saying_why(tmp_path, prepare, message):
    path = tmp_path / "s"
    prepare(path)
    with pytest.raises(NotAStore, match=re.escape(message.split(";")[0])):
        verify_store(path)
    rc, out, err = _cli(path)
    assert rc == 2 and message in err and out == "", err


# -- the report and make ------------------------------------------------------------------------


def test_the_report_of_a_damaged_store_is_refused_with_the_table(tmp_path):
    from pipelines import run

    store = fake.make_store(tmp_path / "s")
    _orphan(store)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = run.main(["report", "--store", str(store.root)])
    assert rc == 2, err.getvalue()
    msg = err.getvalue()
    assert "holds damaged units" in msg and "| consolidator_only-p0-s42 | trial | orphaned |" \
        in msg and "quarantine" in msg, msg
    assert not (store.root / "report").exists()


@pytest.mark.parametrize("store_arg", ["", "STORE=study"])
def test_make_verify_runs_the_check(store_arg):
    """`make verify STORE=DIR` runs `pmnet store verify DIR`; without STORE make says so."""
    import subprocess

    from tests.support.make import make_dry_run

    if store_arg:
        assert "-m pmnet.cli store verify study" in make_dry_run("verify", store_arg)
    else:
        out = subprocess.run(["make", "-n", "verify"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode != 0 and "make verify needs STORE=dir" in out.stderr


def test_the_layout_paths_are_the_ones_verified(tmp_path):
    """The check reads the layout's paths (one contract): a unit moved to another name is
    not whole under its own."""
    store = fake.make_store(tmp_path / "s")
    layout = StoreLayout(store.root)
    layout.stage1_json(1).rename(layout.phase1_dir(1) / "stage1.json.bak")
    assert _states(verify_store(store.root))["phase1-p1s1"] == PARTIAL


@pytest.mark.parametrize("prepare, message", [
    (_version_99, "store format version 99; this code reads version 1"),
    (lambda p: p.mkdir(), "not a store with results"),
    (lambda p: p.write_text("x"), "not a store with results"),
], ids=["store.json of version 99", "an empty directory", "a file"])
def test_the_report_and_a_run_refuse_what_is_not_a_store_with_exit_2(tmp_path, prepare,
                                                                     message):
    """Issue 53's last row (refused before; kept): `report --store` and, for a store of
    another version, `start --store`, exit 2 with one line saying why, writing nothing."""
    from pipelines import run

    path = tmp_path / "s"
    prepare(path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    runs = [["report", "--store", str(path)]]
    if path.is_dir() and any(path.iterdir()):
        runs.append(["start", *fake.ARGS, "--store", str(path), "--root", str(tmp_path / "r")])
    for argv in runs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = run.main(argv)
        assert rc == 2 and message in err.getvalue(), (argv[0], err.getvalue())
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before

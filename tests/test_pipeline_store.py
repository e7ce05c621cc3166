"""The durable store a pipeline run fills (`pipelines.store`, issue 45).

Fast: bad input refused with exit 2 before anything is written; a stored unit of another
configuration refused naming the first key that differs; per-unit locks (two processes
landing units in one store lose no unit, never overwrite one; the lock itself:
tests/test_store_lock.py);
`--max-wall` stopping a run before its first wave; the grid's diagnostics declaration.
Slow: a `debug` grid filled in two pieces (the second SIGKILLed, then resumed) equals one
uninterrupted run (same units, sha256s and test metrics).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import time
from pathlib import Path

import pytest

from pipelines import run
from pipelines.layout import PipelineError, read_json
from pipelines.records import Provenance, Stage1Record
from pipelines.store import (
    check_store_units,
    config_hash,
    land_trial,
    phase1_unit_config,
    unit_config,
)
from pmnet.store_layout import StoreError, StoreLayout, config_difference
from pmnet.trial_id import TrialId

DEBUG = ["start", "--preset", "debug", "--grid", "phase1_variance", "--stage1-cpus", "1",
         "--gpus-per-trial", "0"]


def _main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = run.main(argv)
    return rc, err.getvalue()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# -- bad input ------------------------------------------------------------------------------


def _other_format(store: Path) -> None:
    store.mkdir()
    (store / "store.json").write_text(json.dumps({"format": "someone-elses", "version": 1}))


def _not_a_store(store: Path) -> None:
    store.mkdir()
    (store / "notes.txt").write_text("not a store")


@pytest.mark.parametrize("args, prepare, message", [
    (["--store", "/proc/store"], None, "store /proc/store cannot be created or written"),
    ([], _other_format, "not a pmnet-store store: store.json says format 'someone-elses'"),
    ([], _not_a_store, "is not empty and has no store.json"),
    (["--max-wall", "0"], None, "--max-wall must be a positive number of seconds"),
    (["--max-wall", "-5"], None, "--max-wall must be a positive number of seconds"),
], ids=["store-not-writable", "store-of-another-format", "not-a-store", "max-wall-zero",
        "max-wall-negative"])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, args, prepare, message):
    store, root = tmp_path / "store", tmp_path / "runs"
    if prepare is not None:
        prepare(store)
    before = _files(tmp_path)
    argv = [*DEBUG, "--root", str(root), *args]
    if "--store" not in args:
        argv += ["--store", str(store)]
    t0 = time.time()
    rc, err = _main(argv)
    assert rc == 2, err
    assert message in err, err
    assert err.startswith("error: ") and err.count("\n") == 1  # one clear line
    assert _files(tmp_path) == before  # nothing written, the store included
    assert time.time() - t0 < 30  # refused before Ray, MLflow or training


def test_phase1_seeds_have_one_meaning_with_and_without_a_store(tmp_path):
    """--phase1-seeds sets the grid's checkpoints, with or without --store (issue 51): a
    piece of a store's study is the grid over some of its checkpoints (planning only)."""
    from pipelines.plan import build_space, plan_new
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("debug")
    assert build_space(cfg, grid="tiny", phase1_seeds="5,6").phase1_seeds == (5, 6)
    for store in (None, tmp_path / "store"):
        plan = plan_new(root=tmp_path / "runs", preset="debug", grid="phase1_variance",
                        store=store, phase1_seeds="0,7", gpus_per_trial=0)
        assert [s.seed for s in plan.phase1_slots] == [0, 7]
        assert {t.phase1_seed for t in plan.space.trials} == {0, 7}


# -- a stored unit of another configuration ---------------------------------------------------


def _plan_parts(**overrides):
    from pipelines.plan import build_space
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("debug", **overrides)
    return cfg, build_space(cfg, grid="phase1_variance", overrides=overrides)


def _store_trial(store: StoreLayout, cfg, space, trial: TrialId, *, with_provenance=True):
    tcfg = space.trial_config(cfg, trial)
    store.result(trial).parent.mkdir(parents=True, exist_ok=True)
    store.result(trial).write_text(json.dumps({"config": tcfg.flat(), "phase1_sha256": "a" * 64,
                                               "preset": "debug"}))
    if with_provenance:
        config = unit_config(tcfg.flat())
        Provenance(unit=trial.name, kind="trial", config=config,
                   config_hash=config_hash(config)).write(store.provenance(trial))


@pytest.mark.parametrize("with_provenance", [True, False], ids=["provenance", "result-only"])
def test_a_stored_trial_of_another_config_is_refused_naming_the_key(tmp_path, with_provenance):
    store = StoreLayout(tmp_path / "store")
    cfg, space = _plan_parts()
    trial = space.trials[0]
    theirs, _ = _plan_parts(lr=0.0123)
    _store_trial(store, theirs, space, trial, with_provenance=with_provenance)
    with pytest.raises(PipelineError) as e:
        check_store_units(store, cfg, space, [], space.trials)
    msg = str(e.value)
    assert f"unit {trial.name} was made with another configuration" in msg, msg
    assert f"lr: 0.0123 in the store vs {cfg.lr!r} here" in msg, msg
    # the same configuration is reused; threads (how a unit runs) are not compared
    _store_trial(store, cfg, space, trial, with_provenance=with_provenance)
    check_store_units(store, cfg, space, [], space.trials)
    import dataclasses

    threaded = dataclasses.replace(cfg, threads=7)
    check_store_units(store, threaded, space, [], space.trials)


def test_a_stored_phase1_unit_of_another_config_is_refused_naming_the_key(tmp_path):
    from pipelines.plan import Phase1Slot

    store = StoreLayout(tmp_path / "store")
    theirs, _ = _plan_parts(phase1_lr=0.0077)
    cfg, space = _plan_parts()
    import dataclasses

    slot = Phase1Slot(0, dataclasses.replace(cfg, phase1_seed=0), tmp_path / "run" / "p0")
    their_slot = Phase1Slot(0, dataclasses.replace(theirs, phase1_seed=0), slot.dir)
    config, digest = phase1_unit_config(their_slot)
    Stage1Record(config_hash=digest, sha256="b" * 64).write(store.stage1_json(0))
    Provenance(unit="phase1-p1s0", kind="phase1", config=config,
               config_hash=digest).write(store.phase1_provenance(0))
    with pytest.raises(PipelineError, match=r"unit phase1-p1s0 was made with another "
                       r"configuration \(phase1_lr: 0.0077 in the store vs"):
        check_store_units(store, cfg, space, [slot], [])
    config, digest = phase1_unit_config(slot)  # the same configuration: reused
    Stage1Record(config_hash=digest, sha256="b" * 64).write(store.stage1_json(0))
    check_store_units(store, cfg, space, [slot], [])


def test_config_difference_is_the_first_sorted_flat_key():
    def first_difference(x, y):
        return config_difference(unit_config(x), unit_config(y))

    a = {"lr": 1, "model": {"hidden": 32, "n_layer": 2}, "threads": 1}
    b = {"lr": 1, "model": {"hidden": 64, "n_layer": 3}, "threads": 8}
    assert first_difference(a, b) == "model.hidden: 32 in the store vs 64 here"
    assert first_difference(a, {**a, "threads": 3}) is None  # not part of a unit's config
    assert first_difference({"x": 1}, {}) == "x: 1 in the store vs '(absent)' here"


def test_cli_refuses_a_stored_unit_of_another_config_with_exit_2(tmp_path):
    store = StoreLayout(tmp_path / "store")
    store.root.mkdir()
    (store.root / "store.json").write_text(json.dumps({"format": "pmnet-store",
                                                       "version": 1}))
    cfg, space = _plan_parts()
    trial = next(t for t in space.trials if t.phase1_seed == 1)
    theirs, _ = _plan_parts(max_epochs=7)
    _store_trial(store, theirs, space, trial)
    before = _files(tmp_path)
    rc, err = _main([*DEBUG, "--root", str(tmp_path / "runs"), "--store", str(store.root),
                     "--phase1-seeds", "1"])
    assert rc == 2 and "max_epochs: 7 in the store vs 2 here" in err, err
    assert _files(tmp_path) == before
    # a piece that does not reach that unit is not refused for it (planning only: no Ray)
    from pipelines.plan import plan_new

    plan = plan_new(root=tmp_path / "runs", preset="debug", grid="phase1_variance",
                    store=store.root, phase1_seeds="0,2", gpus_per_trial=0)
    assert [s.seed for s in plan.phase1_slots] == [0, 2]
    assert {t.phase1_seed for t in plan.space.trials} == {0, 2}


# -- locks and publishing -------------------------------------------------------------------


def _fake_trial(base: Path, trial: TrialId, tag: str) -> Path:
    """A run's (`base/tag`) trained trial: its training directory's result.json."""
    tdir = base / tag / "trials" / trial.name
    tdir.mkdir(parents=True)
    (tdir / "result.json").write_text(json.dumps({"phase1_sha256": "d" * 64, "writer": tag}))
    return tdir


def _lander(store_root: str, base: str, tag: str, trials: list, out) -> None:
    store = StoreLayout(Path(store_root))
    got = {}
    for name in trials:
        trial = TrialId(name, 42, phase1_seed=0)
        tdir = _fake_trial(Path(base), trial, tag)
        got[trial.name] = land_trial(store, trial, tdir, Provenance(
            unit=trial.name, kind="trial", config_hash="e" * 64, config={}))
    out.put((tag, got))


def test_two_writers_landing_in_one_store_lose_no_unit_and_overwrite_none(tmp_path):
    store = StoreLayout(tmp_path / "store")
    Stage1Record(config_hash="f" * 64, sha256="d" * 64).write(store.stage1_json(0))
    names = [f"c{i}" for i in range(40)]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_lander, args=(str(store.root), str(tmp_path / "w"), tag,
                                               names, out)) for tag in ("A", "B")]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for name in names:
        trial = TrialId(name, 42, phase1_seed=0)
        res = read_json(store.result(trial))
        assert res["writer"] in ("A", "B")  # a whole unit, from one of them
        winners = sorted(t for t in ("A", "B") if got[t][trial.name] == "landed")
        assert winners == [res["writer"]], (name, got["A"][trial.name], got["B"][trial.name])
        loser = ({"A", "B"} - set(winners)).pop()
        assert got[loser][trial.name] == "in the store already"
        assert Provenance.read(store.provenance(trial)).landed is not None
    assert not list((store.root / "locks").iterdir())  # every lock released


def test_a_trial_unit_lands_once_with_its_diagnostics_and_provenance_last_but_one(tmp_path):
    """The unit lands in the store from the trial's training directory: diagnostics,
    provenance (started, then completed), the result last; nothing of the unit is written
    anywhere else."""
    store = StoreLayout(tmp_path / "store")
    Stage1Record(config_hash="f" * 64, sha256="d" * 64).write(store.stage1_json(0))
    trial = TrialId("c", 42, phase1_seed=0)
    tdir = _fake_trial(tmp_path, trial, "A")
    (tdir / "diagnostics.json").write_text(json.dumps({"checkpoint": "best_model.pt"}))
    start = Provenance(unit=trial.name, kind="trial", config_hash="e" * 64, config={"lr": 1},
                       git_commit="old", started=1.0)
    start.write(store.provenance(trial))  # written when the trial started
    now = Provenance(unit=trial.name, kind="trial", config_hash="e" * 64, config={"lr": 1},
                     git_commit="new", device="some CPU", phase1_sha256="d" * 64)
    assert land_trial(store, trial, tdir, now) == "landed"
    assert read_json(store.diagnostics(trial)) == {"checkpoint": "best_model.pt"}
    prov = Provenance.read(store.provenance(trial))
    assert (prov.started, prov.git_commit, prov.landed_git_commit) == (1.0, "old", "new")
    assert prov.device == "some CPU" and prov.phase1_sha256 == "d" * 64 and prov.landed
    times = [p.stat().st_mtime_ns for p in store.trial_files(trial)]
    assert times == sorted(times)  # the result, the unit's commit record, last
    assert land_trial(store, trial, tdir, now) == "in the store already"  # never twice
    assert not (tmp_path / "A" / "results").exists()  # one record: the store's
    # a unit that started under another configuration does not land
    other = TrialId("c", 43, phase1_seed=0)
    tdir = _fake_trial(tmp_path, other, "B")
    Provenance(unit=other.name, config_hash="1" * 64, config={"lr": 2}).write(
        store.provenance(other))
    with pytest.raises(StoreError, match=r"started with config hash 111111111111\.\.\. and "
                       r"lands with eeeeeeeeeeee\.\.\.; not landed \(lr: 2"):
        land_trial(store, other, tdir, now)
    assert not store.result(other).exists()
    assert not list((store.root / "locks").iterdir())


def test_a_result_from_another_checkpoint_does_not_land(tmp_path):
    store = StoreLayout(tmp_path / "store")
    Stage1Record(config_hash="f" * 64, sha256="9" * 64).write(store.stage1_json(0))
    trial = TrialId("c", 42, phase1_seed=0)
    tdir = _fake_trial(tmp_path, trial, "A")
    what = land_trial(store, trial, tdir, Provenance(unit=trial.name, config_hash="e" * 64))
    assert what.startswith("not landed") and not store.result(trial).exists()


# -- the deadline, before any wave ----------------------------------------------------------


def test_max_wall_stops_cleanly_and_says_what_is_left(tmp_path, capsys):
    store = tmp_path / "store"
    rc = run.main([*DEBUG, "--root", str(tmp_path / "runs"), "--store", str(store),
                   "--phase1-seeds", "1,2", "--conditions", "consolidator_only", "--seeds",
                   "42", "--name", "w", "--max-wall", "1e-9"])
    out = capsys.readouterr().out
    assert rc == 0, out
    line = next(ln for ln in out.splitlines() if "stopped at --max-wall" in ln)
    assert f"2 Phase-1 and 2 trial unit(s) of this run not done in {store}" in line, line
    assert "make resume NAME=w" in line and "PHASE1_SEEDS=1,2" in line, line
    assert read_json(store / "store.json")["format"] == "pmnet-store"
    assert not (store / "results").exists()


# -- the grid's Phase-1 gate ------------------------------------------------------------------


def _phase1_history(store: StoreLayout, k: int, values: list[float], best: int) -> None:
    (store.phase1_dir(k) / "phase1_metrics.json").write_text(json.dumps({
        "best_epoch": best, "history": [{"epoch": i, "val/mean_stm_add10": v}
                                        for i, v in enumerate(values)]}))


def test_the_phase1_gate_reads_each_landed_checkpoint_at_its_selected_epoch(tmp_path):
    """`pipelines.store.gated`: a landed checkpoint below the gate at its selected epoch is
    held back (not one whose last epoch alone is below); one not landed is not judged yet;
    a held checkpoint's trials are not left to do; a record without the metric is refused
    naming the unit and the metric."""
    from pipelines.store import gated, units_left
    from tests.support.store import grid, make_store
    from tune_spaces.grids import Phase1Gate

    store = make_store(tmp_path / "s")
    _, space = grid()
    gate = Phase1Gate("val/mean_stm_add10", 99.0)
    _phase1_history(store, 0, [99.5, 98.0], best=0)  # selected 99.5: passes, last 98 or not
    _phase1_history(store, 1, [99.9, 97.0], best=1)  # selected 97.0: held back
    _phase1_history(store, 2, [10.0], best=0)
    store.stage1_json(2).unlink()  # not landed: nothing to judge
    assert gated(store, gate, space.phase1_keys) == {1: 97.0}
    assert gated(store, None, space.phase1_keys) == {}
    for t in space.trials:
        store.result(t).unlink()
    assert units_left(store, [], space) == (0, 3, {})
    assert units_left(store, [], space.derive(phase1_gate=gate)) == (0, 2, {1: 97.0})  # held
    (store.phase1_dir(0) / "phase1_metrics.json").write_text(json.dumps({"history": []}))
    with pytest.raises(PipelineError, match=r"phase1-p1s0: the grid's Phase-1 gate reads "
                       r"val/mean_stm_add10 at the selected epoch, which its "
                       r"phase1_metrics.json lacks"):
        gated(store, gate, space.phase1_keys)


def test_a_checkpoint_below_the_phase1_gate_lands_and_no_trial_trains_on_it(tmp_path, capsys):
    """`add10_long` at `debug`, whose Phase 1 reads ADD10 STM far below the confirmatory 99%
    bar: the checkpoint lands in the store, neither arm trains (a replaced checkpoint's arms
    enter no claim), the run ends finished with both counted as held back, `status` says
    so, and a second run over the store trains nothing either."""
    from pipelines.layout import Layout
    from pipelines.status import status_text

    store, root = tmp_path / "store", tmp_path / "runs"
    argv = ["start", "--preset", "debug", "--grid", "add10_long", "--phase1-seeds", "0",
            "--stage1-cpus", "1", "--gpus-per-trial", "0", "--store", str(store),
            "--root", str(root)]
    assert run.main([*argv, "--name", "a"]) == 0
    out = capsys.readouterr().out
    assert "phase1-p1s0: val/mean_stm_add10 " in out and "< 99 at its selected epoch: its " \
        "trials are held back by the grid's Phase-1 gate, not trained" in out, out[-3000:]
    assert "finished: 0/2 trials finished, 0 errored, 2 held back by the Phase-1 gate" in out
    assert (store / "phase1-p1s0" / "phase1.pt").is_file()
    assert not any((store / "results").glob("*.json")) and "trials ->" not in out  # no Tune
    text = status_text(Layout(root, "a", store=store))
    assert text.count("HELD BACK") == 2 and "trials: 2 = 2 held back" in text, text
    record = store / "phase1-p1s0" / "phase1_metrics.json"
    kept = record.read_text()
    record.write_text(json.dumps({"history": []}))  # the gate cannot read it: rows still show
    text = status_text(Layout(root, "a", store=store))
    assert "trials: 2 = 2 gate unreadable" in text and "errors:" in text, text
    assert "phase1-p1s0: the grid's Phase-1 gate reads val/mean_stm_add10" in text, text
    record.write_text(kept)
    assert run.main([*argv, "--name", "b"]) == 0
    out = capsys.readouterr().out
    assert "skipped: " in out and "held back by the grid's Phase-1 gate" in out, out[-3000:]
    assert "trials ->" not in out and not any((store / "results").glob("*.json"))


# -- the grid declares its diagnostics -------------------------------------------------------


def test_grids_declare_diagnostics_and_a_stray_condition_is_refused():
    from pipelines.plan import build_space
    from pmnet.train import ALL_CONDITIONS, TrainConfig
    from tune_spaces import SpaceError, checkpoints

    cfg = TrainConfig.from_name("cpu")
    space = checkpoints(cfg)
    assert set(space.diagnose) == set(space.conditions)  # what the study diagnosed
    assert [t.name for t in space.trials if space.diagnosed(t) and t.phase1_seed == 0] == [
        "consolidator_only-p0-s42", "consolidator_only_routing_off-p0-s42"]  # seed 42 only
    narrowed = build_space(cfg, grid="checkpoints", conditions="consolidator_only")
    assert narrowed.diagnose == ("consolidator_only",)
    with pytest.raises(SpaceError, match=r"diagnose names condition\(s\) \['learned_full'\]"):
        space.derive(diagnose=("learned_full",)).validate(ALL_CONDITIONS, cfg)
    back = type(space).from_dict(json.loads(json.dumps(space.to_dict())))
    assert back.diagnose == space.diagnose


def test_a_units_provenance_names_this_cpu():
    """(That the CPU's name is read in one place is tests/test_test_layout.py's.)"""
    from pipelines.provenance import device_kind
    from pmnet.hardware import cpu_kind

    assert device_kind("cpu") == cpu_kind()


# -- the real thing: two pieces, one killed, equal one run -----------------------------------


def _weights_sha256(path: Path) -> str:
    """sha256 of a model file's weights (beside the file's own sha256, so that a difference
    says whether it is in the weights or in the metadata)."""
    import hashlib

    from pmnet.train import load_model_file

    model, _ = load_model_file(path)
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _store_units(store: Path) -> dict:
    """Every unit of a store: a Phase-1 checkpoint's file sha256, weights and test metrics,
    a trial's test metrics and best epoch; each checked against its own sha256 records on
    the way."""
    from pmnet.train import sha256_file

    out, shas = {}, {}
    for rec in sorted(store.glob("phase1*/stage1.json")):
        info = read_json(rec)
        assert sha256_file(rec.parent / "phase1.pt") == info["sha256"]
        shas[info["phase1_seed"]] = info["sha256"]
        out[rec.parent.name] = (info["sha256"], _weights_sha256(rec.parent / "phase1.pt"),
                                info["metrics"])
    for res in sorted((store / "results").glob("*.json")):
        r = read_json(res)
        assert r["phase1_sha256"] == shas[r["phase1_seed"]]  # trained from the stored unit
        out[res.stem] = (r["test"], r.get("best_epoch"))
    return out


@pytest.mark.slow
def test_a_grid_filled_in_two_pieces_equals_one_run(tmp_path):
    """`phase1_variance` at `debug` (consolidator_only x seeds 42, 43) under Phase-1 seeds
    0 and 1: one run into store R; into store P a piece with seed 0, then a piece with
    seed 1 SIGKILLed after its first trial finished, then resumed. P and R hold the same
    units: the same checkpoint files (sha256) and weights, and the same test metrics of
    every unit."""
    from tests.support.pipeline import cli

    base = [*DEBUG, "--conditions", "consolidator_only", "--seeds", "42,43"]
    ref, pieces = tmp_path / "R", tmp_path / "P"
    t0 = time.time()
    rc, out = cli(*base, "--phase1-seeds", "0,1", "--store", str(ref), "--root",
                  str(tmp_path / "runs"), "--name", "ref")
    assert rc == 0, out[-4000:]
    rc, out = cli(*base, "--phase1-seeds", "0", "--store", str(pieces), "--root",
                  str(tmp_path / "runs"), "--name", "a")
    assert rc == 0, out[-4000:]
    rc, out = cli(*base, "--phase1-seeds", "1", "--store", str(pieces), "--root",
                  str(tmp_path / "runs"), "--name", "b",
                  env={"PMNET_TEST_KILL_DRIVER_AT": "stage2-first-result"})
    assert rc != 0, out[-4000:]
    assert (pieces / "phase1-p1s1" / "stage1.json").is_file()  # published before the kill
    rc, out = cli("resume", "--name", "b", "--root", str(tmp_path / "runs"))
    assert rc == 0, out[-4000:]
    assert "Phase 1 as a Tune trial" not in out  # the checkpoint came from the store
    got, want = _store_units(pieces), _store_units(ref)
    assert set(got) == {"phase1-p1s0", "phase1-p1s1", "consolidator_only-p0-s42",
                        "consolidator_only-p0-s43", "consolidator_only-p1-s42",
                        "consolidator_only-p1-s43"}
    assert got == want
    for name in got:
        if not name.startswith("phase1"):
            prov = Provenance.read(pieces / "provenance" / f"{name}.json")
            assert prov.landed and prov.config_hash and prov.device and prov.git_commit
    print(f"two pieces + reference: {time.time() - t0:.0f} s")


def _unit_files(root: Path, units: list) -> dict[str, list[str]]:
    """{unit: the files of its layout that exist, relative to `root`}."""
    lay = StoreLayout(root)
    out = {}
    for u in units:
        files = lay.trial_files(u) if isinstance(u, TrialId) else lay.phase1_files(u)
        out[str(u)] = [str(p.relative_to(root)) for p in files if p.is_file()]
    return out


@pytest.mark.slow
def test_a_store_run_ends_with_its_report_and_every_unit_finished_in_mlflow(tmp_path):
    """Issue 51's bars. `phase1_variance` at `debug` (consolidator_only x seed 42 under the
    grid's 3 Phase-1 seeds): piece `a` (seed 0) into store S, then the whole grid `b` into
    S (it reads a's units where they are, trains the other two checkpoints). `b` ends with
    S's report in S/report/ (no second command) and its own, and its MLflow experiment holds
    exactly one FINISHED run per unit, a's included. Each unit is written once, in S: the
    run directories hold none of them. A run without --store (`c`) is its own store, laid
    out as S is."""
    from pipelines.layout import Layout
    from tests.support.pipeline import cli, mlflow_runs

    base = [*DEBUG, "--conditions", "consolidator_only", "--seeds", "42"]
    store, root = tmp_path / "S", tmp_path / "runs"
    t0 = time.time()
    rc, out = cli(*base, "--phase1-seeds", "0", "--store", str(store), "--root", str(root),
                  "--name", "a")
    assert rc == 0, out[-4000:]
    rc, out = cli(*base, "--store", str(store), "--root", str(root), "--name", "b")
    assert rc == 0, out[-4000:]
    assert "[stage 3/3]" in out and (store / "report" / "report.md").is_file(), out[-4000:]
    assert (root / "b" / "report" / "report.md").is_file()
    assert out.count("Phase 1 as a Tune trial") == 2  # checkpoint 0 came from the store
    trials = [TrialId("consolidator_only", 42, phase1_seed=k) for k in (0, 1, 2)]
    client, _, runs = mlflow_runs(f"sqlite:///{root / 'mlflow.db'}", "b")
    keys = [r.data.tags.get("run_key") for r in runs if r.info.status == "FINISHED"]
    for k in (0, 1, 2):
        assert keys.count(f"b/stage1-phase1-p1s{k}") == 1, keys
    for t in trials:
        assert keys.count(f"b/{t.name}") == 1, keys  # a's (p0) and b's own alike
    assert len([r for r in runs if r.data.tags.get("run_key", "").startswith("b/")
                and r.data.tags.get("stage") in ("phase2",)]) == 3  # no duplicates
    parent = next(r for r in runs if r.data.tags.get("run_key") == "b")
    assert parent.info.status == "FINISHED" and "pipeline/wall_s" in parent.data.metrics
    # one store: every unit is written once, in S; the run directories hold none of them
    units = [0, 1, 2, *trials]
    want = _unit_files(store, units)
    assert all(want[str(t)] == [f"provenance/{t.name}.json", f"results/{t.name}.json"]
               for t in trials), want
    assert all(want[str(k)][-1] == f"phase1-p1s{k}/stage1.json" for k in (0, 1, 2)), want
    for name in ("a", "b"):
        assert not any(_unit_files(Layout(root, name).run_dir, units).values())
    rc, out = cli(*base, "--phase1-seeds", "0", "--root", str(root), "--name", "c")
    assert rc == 0 and "[stage 3/3]" in out, out[-4000:]
    assert _unit_files(root / "c", [0, trials[0]]) == {k: want[k] for k in ("0", str(trials[0]))}
    print(f"two pieces into a store + a run without one: {time.time() - t0:.0f} s")


@pytest.mark.slow
def test_two_runs_filling_one_store_at_once_lose_no_unit(tmp_path):
    """Two pipelines started together into one store, with overlapping pieces (Phase-1
    seeds 0 and 0,1): both train checkpoint 0, the first to land it keeps the unit, the
    other keeps its own in its training directory and trains its trials from the store's;
    every unit lands once,
    each trial from its stored checkpoint, and no lock is left."""
    from tests.support.pipeline import kill_group, spawn

    store = tmp_path / "S"
    base = [*DEBUG, "--conditions", "consolidator_only", "--seeds", "42", "--store", str(store)]
    t0 = time.time()
    procs = [spawn(*base, "--phase1-seeds", seeds, "--root", str(tmp_path / name),
                   "--name", name) for name, seeds in (("a", "0"), ("b", "0,1"))]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            kill_group(p.pid)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    units = _store_units(store)  # each result from its stored checkpoint
    assert set(units) == {"phase1-p1s0", "phase1-p1s1", "consolidator_only-p0-s42",
                          "consolidator_only-p1-s42"}
    assert not list((store / "locks").iterdir())
    print(f"two runs at once: {time.time() - t0:.0f} s; "
          + " | ".join(ln for out in outs for ln in out.splitlines() if "[store]" in ln))


@pytest.mark.slow
def test_a_grid_that_declares_diagnostics_publishes_them(tmp_path):
    """The `checkpoints` grid declares its conditions' diagnostics: a store run of one
    checkpoint and one trial publishes `diagnostics/<trial>.json` (`pmnet diagnose` of the
    trial's best model) beside its result; the store's report builds."""
    from tests.support.pipeline import cli

    store = tmp_path / "S"
    t0 = time.time()
    rc, out = cli("start", "--preset", "debug", "--grid", "checkpoints", "--stage1-cpus", "1",
                  "--gpus-per-trial", "0", "--conditions", "consolidator_only", "--seeds", "42",
                  "--phase1-seeds", "3", "--store", str(store), "--root", str(tmp_path / "r"))
    assert rc == 0, out[-4000:]
    diag = read_json(store / "diagnostics" / "consolidator_only-p3-s42.json")
    assert diag["condition"] == "consolidator_only" and "stm" in diag, sorted(diag)
    rc, out = cli("report", "--store", str(store))
    assert rc == 0 and (store / "report" / "report.md").is_file(), out[-4000:]
    print(f"diagnosed store run + report: {time.time() - t0:.0f} s")


# -- the migrated issue-39 store --------------------------------------------------------------

ISSUE39_STORE = Path(__file__).resolve().parents[1] / "experiments/results/issue39/store"


@pytest.mark.parametrize("grid", ["checkpoints", "checkpoint_channel"])
def test_the_migrated_issue39_store_is_every_unit_of_its_grids(grid):
    """`make pipeline GRID=<grid> STORE=experiments/results/issue39/store` trains nothing:
    every Phase-1 unit (no config hash: compared through its phase1_metrics.json) and every
    trial (compared through its result's config) is this code's `cpu` configuration."""
    import dataclasses

    from pipelines.plan import Phase1Slot, build_space
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("cpu")
    space = build_space(cfg, grid=grid, overrides={})
    store = StoreLayout(ISSUE39_STORE)
    slots = [Phase1Slot(k, dataclasses.replace(cfg, phase1_seed=k), Path("/nonexistent"))
             for k in space.phase1_seeds]
    check_store_units(store, cfg, space, slots, space.trials)
    assert all(store.result(t).is_file() for t in space.trials)
    assert all(store.stage1_json(k).is_file() for k in space.phase1_seeds)
    # a Phase-1 key changed here is named, although the stored unit has no hash
    other = dataclasses.replace(cfg, phase1_lr=cfg.phase1_lr * 2)
    slot = Phase1Slot(0, dataclasses.replace(other, phase1_seed=0), Path("/nonexistent"))
    with pytest.raises(PipelineError, match=r"unit phase1-p1s0 .*\(phase1_lr: "):
        check_store_units(store, other, space, [slot], [])


# -- two pieces against one PostgreSQL-backed tracking server (issue 53) ------------------------


def _unit_runs(client, experiment_id: str) -> tuple[dict, dict]:
    """An experiment's FINISHED runs of units: ({trial: [run]}, {Phase-1 unit: [run]}), a
    trial's run by its trial key's last part (`consolidator_only-p1-s42`), a Phase-1 unit's
    by its stage `stage1-<unit>` (`phase1-p1s1`); independent of the piece's pipeline
    name."""
    trials: dict[str, list] = {}
    phase1: dict[str, list] = {}
    for r in client.search_runs([experiment_id], "attributes.status = 'FINISHED'",
                                max_results=1000):
        tags = r.data.tags
        if "trial_key" in tags:
            trials.setdefault(tags["trial_key"].rsplit("/", 1)[-1], []).append(r)
        elif tags.get("stage", "").startswith("stage1-phase1-p1s"):
            phase1.setdefault(tags["stage"][len("stage1-"):], []).append(r)
    return trials, phase1


def _check_unit_runs(trials: dict, phase1: dict, want_trials: set, want_phase1: set) -> None:
    """Exactly the wanted units, one FINISHED run each; each trial's run names the sha256
    of its checkpoint's run."""
    assert sorted(phase1) == sorted(want_phase1), sorted(phase1)
    assert sorted(trials) == sorted(want_trials), sorted(trials)
    for trial, (found,) in trials.items():
        k = trial.split("-p", 1)[1].split("-", 1)[0]
        (p1,) = phase1[f"phase1-p1s{k}"]
        assert found.data.tags["phase1_sha256"] == p1.data.tags["phase1_sha256"]
        assert "test/updated_ltm" in found.data.metrics


@pytest.mark.slow
def test_a_store_filled_in_two_pieces_leaves_one_finished_run_per_unit_on_one_server(
        tmp_path, postgres):
    """Issue 53's bar: a `debug` store filled in two pieces, as two machines would (each its
    own storage root and pipeline name), both logging to one `mlflow server` whose backend
    store is PostgreSQL. Piece `a` does Phase-1 seed 0; piece `b` seeds 0 and 1 (one
    checkpoint per wave: `--stage1-cpus 2` of 2 CPUs), so it adopts seed 0's wave whole and
    trains seed 1's. The last piece's experiment shows the whole study: one FINISHED run
    per unit (each trial, each Phase-1 checkpoint), none missing, no duplicates, each trial
    run tagged with the sha256 of its checkpoint's run; and no experiment holds a unit
    twice."""
    from mlflow import MlflowClient

    from tests.support.pipeline import MlflowServer, cli

    postgres.createdb("pieces")
    backend = postgres.uri(database="pieces")
    server = MlflowServer(backend, tmp_path / "artifacts", tmp_path / "server.log")
    store = tmp_path / "S"
    base = [*DEBUG, "--conditions", "consolidator_only", "--seeds", "42", "--num-cpus", "2",
            "--stage1-cpus", "2", "--store", str(store)]
    t0 = time.time()
    try:
        url = server.start()
        for name, seeds in (("a", "0"), ("b", "0,1")):
            rc, out = cli(*base, "--phase1-seeds", seeds, "--root", str(tmp_path / name),
                          "--name", name, env={"MLFLOW_TRACKING_URI": url})
            assert rc == 0, out[-4000:]
    finally:
        server.stop()
    client = MlflowClient(backend)  # the database itself
    exps = {e.name: e.experiment_id for e in client.search_experiments()
            if e.name.startswith("pmnet/")}
    assert sorted(exps) == ["pmnet/a", "pmnet/b"], exps
    for name, exp_id in exps.items():  # no duplicates anywhere
        trials, phase1 = _unit_runs(client, exp_id)
        assert all(len(v) == 1 for v in (*trials.values(), *phase1.values())), (
            name, {k: len(v) for k, v in (*trials.items(), *phase1.items())})
    # what each piece trained is logged in its own experiment
    _check_unit_runs(*_unit_runs(client, exps["pmnet/a"]), {"consolidator_only-p0-s42"},
                     {"phase1-p1s0"})
    b_trials, b_phase1 = _unit_runs(client, exps["pmnet/b"])
    _check_unit_runs({k: v for k, v in b_trials.items() if "-p1-" in k},
                     {k: v for k, v in b_phase1.items() if k.endswith("p1s1")},
                     {"consolidator_only-p1-s42"}, {"phase1-p1s1"})
    # the last piece's experiment: the whole study, its adopted units included (issue 51)
    _check_unit_runs(b_trials, b_phase1, {"consolidator_only-p0-s42",
                                          "consolidator_only-p1-s42"},
                     {"phase1-p1s0", "phase1-p1s1"})
    print(f"two pieces against a PostgreSQL-backed server: {time.time() - t0:.0f} s")


def test_a_field_added_since_a_store_was_written_keeps_its_units_hash_at_its_default():
    """A unit written before `phase2_families` / `lr_schedule` existed compares equal (and
    hashes the same) to today's run at their defaults; a run that sets one differs."""
    from pipelines.store import config_hash, unit_config
    from pmnet.conditions import LATE_FIELD_DEFAULTS
    from pmnet.train import TrainConfig

    now = TrainConfig.from_name("cpu").flat()
    before = {k: v for k, v in now.items() if k not in LATE_FIELD_DEFAULTS}
    assert unit_config(now) == unit_config(before)
    assert config_hash(now) == config_hash(before)
    longer = TrainConfig.from_name("cpu", lr_schedule="constant").flat()
    assert unit_config(longer)["lr_schedule"] == "constant"
    assert config_hash(longer) != config_hash(before)

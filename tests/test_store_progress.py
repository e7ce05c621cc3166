"""A paused Phase-1 unit's progress in the store (`pmnet.store_progress`, issue 52).

A debug Phase 1 stopped after epoch 2 of 4, its progress published into a store,
continued from a fresh copy of that store in another run directory (as another machine
would), ends with the same phase1.pt bytes and history as one uninterrupted run; progress
made under another configuration, or damaged, is refused (and at planning, exit 2) naming
the key or the file; a landed unit's progress is removed. The driver's side (SIGTERM, the
whole pipeline path) is tests/test_phase1_progress.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from pipelines.phase1 import Phase1Slot
from pipelines.store import progress_unit, trial_unit
from pmnet.store_layout import StoreError, StoreLayout, init_store
from pmnet.store_progress import (
    Phase1Unit,
    ProgressRecord,
    check_progress,
    drop_progress,
    land_progress,
    progress_dir,
    restore_progress,
)
from pmnet.train import (
    Phase1Paused,
    StopAtEpochEnd,
    TrainConfig,
    checkpoint_epoch,
    run_phase1,
)
from pmnet.trial_id import TrialId

CFG = dict(phase1_max_epochs=4, phase1_patience=4, phase1_episodes_per_epoch=32,
           val_episodes=16, test_episodes=16, eval_batch_size=16, batch_size=16,
           phase1_seed=1)


def _cfg(**changes) -> TrainConfig:
    return TrainConfig.from_name("debug", **{**CFG, **changes})


def _slot(run: Path, cfg: TrainConfig | None = None) -> Phase1Slot:
    return Phase1Slot(seed=1, cfg=cfg or _cfg(), dir=run / "phase1-p1s1")


def _unit(run: Path, cfg: TrainConfig | None = None) -> Phase1Unit:
    return progress_unit(_slot(run, cfg))


class _StopAfter(Callback):
    def __init__(self, epoch: int, stop: StopAtEpochEnd):
        self.epoch, self.stop = epoch, stop

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            self.stop.request()


@pytest.fixture(scope="module")
def paused(tmp_path_factory):
    """(an uninterrupted run's result and metrics, a store holding the progress of the
    same unit stopped after epoch 2 of 4, the Phase1Paused)."""
    root = tmp_path_factory.mktemp("progress")
    whole = run_phase1(_cfg(), root / "whole", progress=False)
    whole_meta = json.loads((root / "whole" / "phase1_metrics.json").read_text())
    slot = _slot(root / "runA")
    stop = StopAtEpochEnd()
    res = run_phase1(slot.cfg, slot.dir, progress=False, callbacks=[_StopAfter(1, stop)],
                     stop=stop)
    assert isinstance(res, Phase1Paused) and res.epochs_done == 2
    store = StoreLayout(root / "store")
    rec = land_progress(store, progress_unit(slot), res.reason, checkpoint_epoch,
                        res.train_time_s)
    return whole, whole_meta, store, rec


def _copy_store(store: StoreLayout, where: Path) -> StoreLayout:
    shutil.copytree(store.root, where)
    return StoreLayout(where)


def test_published_progress_is_a_partial_unit_with_a_record(paused):
    _, _, store, rec = paused
    files = sorted(p.name for p in progress_dir(store, 1).iterdir())
    assert rec.last == "last-e1.ckpt" and rec.best in ("best-e1.ckpt", "last-e1.ckpt")
    assert files == sorted({rec.last, rec.best, "progress.json"})
    # one file exactly when the best epoch's checkpoint is the last one's bytes
    assert (rec.best == rec.last) == (rec.best_sha256 == rec.last_sha256)
    assert not store.stage1_json(1).exists()  # no commit record: the unit is not in the store
    assert (rec.epoch, rec.epochs_done, rec.max_epochs) == (1, 2, 4)
    assert rec.phase0 is not None and "phase0/final_loss" in rec.phase0  # debug has Phase 0
    assert ProgressRecord.from_dict(json.loads(
        (progress_dir(store, 1) / "progress.json").read_text())) == rec
    assert check_progress(store, _unit(Path("/elsewhere"))) == rec


def test_continued_from_a_fresh_copy_of_the_store_equals_one_run(paused, tmp_path):
    whole, whole_meta, store, _ = paused
    copy = _copy_store(store, tmp_path / "store-copy")  # another machine's copy
    slot = _slot(tmp_path / "runB")  # another run root
    assert restore_progress(copy, progress_unit(slot), checkpoint_epoch) == 1
    # publishing what the store holds already (the same epoch) changes nothing
    assert land_progress(copy, progress_unit(slot), "max-wall", checkpoint_epoch) is None
    done = run_phase1(slot.cfg, slot.dir, progress=False)
    assert done["sha256"] == whole["sha256"]  # the same phase1.pt bytes
    meta = json.loads((slot.dir / "phase1_metrics.json").read_text())
    assert meta["history"] == whole_meta["history"] and len(meta["history"]) == 4
    assert meta["phase0"] == whole_meta["phase0"]
    # the run's own checkpoint, now further than the store's progress, is kept
    assert restore_progress(copy, progress_unit(slot), checkpoint_epoch) is None


def test_progress_of_another_configuration_is_refused_naming_the_key(paused, tmp_path):
    copy = _copy_store(paused[2], tmp_path / "store")
    other = _unit(tmp_path / "run", _cfg(phase1_lr=1e-3))
    with pytest.raises(StoreError, match=r"made with another configuration \(phase1_lr: "):
        check_progress(copy, other)
    with pytest.raises(StoreError, match="phase1_lr"):
        restore_progress(copy, other, checkpoint_epoch)
    assert not other.dir.exists()  # refused before anything was written


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), "has sha256"),
    (lambda f: f.unlink(), "is missing"),
], ids=["truncated", "missing"])
def test_damaged_progress_is_refused_not_used(paused, tmp_path, damage, message):
    copy = _copy_store(paused[2], tmp_path / "store")
    damage(progress_dir(copy, 1) / "last-e1.ckpt")
    unit = _unit(tmp_path / "run")
    with pytest.raises(StoreError, match=f"progress of unit phase1-p1s1 is damaged: .*"
                                         f"last-e1.ckpt {message}"):
        restore_progress(copy, unit, checkpoint_epoch)
    assert not unit.dir.exists()


def test_an_unreadable_record_is_refused(paused, tmp_path):
    copy = _copy_store(paused[2], tmp_path / "store")
    (progress_dir(copy, 1) / "progress.json").write_text('{"format": "pmnet-phase1-progress/v1"}')
    with pytest.raises(StoreError, match="progress of unit phase1-p1s1 is unreadable"):
        check_progress(copy, _unit(tmp_path / "run"))


def _main(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from pipelines import run

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = run.main(argv)
    return rc, err.getvalue()


def test_planning_checks_the_progress_exit_2_for_foreign_or_damaged(paused, tmp_path):
    """`start --store` with the progress's configuration plans (and, at --max-wall 1e-9,
    stops before any wave); with one Phase-1 key changed, or the progress damaged, it
    exits 2 naming the key or the file, and the store is left as it was."""
    copy = _copy_store(paused[2], tmp_path / "store")
    init_store(copy)
    files = sorted(str(p.relative_to(copy.root)) for p in copy.root.rglob("*"))
    sets = [x for k, v in CFG.items() if k != "phase1_seed" for x in ("--set", f"{k}={v}")]
    argv = ["start", "--preset", "debug", "--grid", "phase1_variance", "--stage1-cpus", "1",
            "--gpus-per-trial", "0", "--phase1-seeds", "1", "--conditions",
            "consolidator_only", "--seeds", "42", "--store", str(copy.root), "--root",
            str(tmp_path / "runs"), *sets]
    # each start its own name: two starts within one minute would share the default name
    rc, err = _main([*argv, "--name", "same-config", "--max-wall", "1e-9"])
    assert rc == 0, err
    rc, err = _main([*argv, "--name", "another-config", "--set", "phase1_lr=0.001"])
    assert rc == 2 and "unit phase1-p1s1 has Phase-1 progress (after epoch 2 of 4) made with " \
        "another configuration (phase1_lr: " in err, err
    best = paused[3].best
    (progress_dir(copy, 1) / best).write_bytes(b"torn")
    rc, err = _main([*argv, "--name", "damaged"])
    assert rc == 2 and "progress of unit phase1-p1s1 is damaged" in err and \
        f"{best} has sha256" in err, err
    assert sorted(str(p.relative_to(copy.root)) for p in copy.root.rglob("*")) == files


def test_a_landed_unit_drops_its_progress(paused, tmp_path):
    copy = _copy_store(paused[2], tmp_path / "store")
    assert drop_progress(copy, 1) is False  # not landed: kept
    copy.stage1_json(1).write_text("{}")  # the commit record
    assert check_progress(copy, _unit(tmp_path / "run")) is None  # finished: progress unused
    assert drop_progress(copy, 1) is True and not progress_dir(copy, 1).exists()


def test_a_record_is_checked_field_by_field():
    good = dataclasses.asdict(ProgressRecord(
        unit="phase1-p1s1", epoch=0, max_epochs=2, config_hash="h", config={}, last="l",
        last_sha256="s", best=None, best_sha256=None, phase0=None, reason="max-wall",
        host="h", time=0.0, train_time_s=None))
    assert ProgressRecord.from_dict(good).epochs_done == 1
    for bad in ({**good, "epoch": -1}, {**good, "epoch": True}, {**good, "format": "x"},
                {**good, "last_sha256": None}, {**good, "config": []}):
        with pytest.raises(ValueError):
            ProgressRecord.from_dict(bad)


# -- a paused trial (issue 61): the same rules, and tied to its Phase-1 checkpoint ---------------

#: the debug preset's Phase 2, 4 epochs that do not stop early
P2 = dict(max_epochs=4, patience=4, episodes_per_epoch=32, val_episodes=16, test_episodes=16,
          eval_batch_size=16, batch_size=16, phase2_families="add10", lr_schedule="constant",
          consolidator_init_std=0.18)
TRIAL = TrialId("consolidator_only", 42, phase1_seed=1)


@pytest.mark.parametrize("same", [True, False], ids=["best-is-last", "best-earlier"])
def test_the_best_epochs_checkpoint_travels_once_and_without_moments(tmp_path, same):
    """A paused unit whose best epoch is its last (the two files' bytes equal) keeps one
    file, which the record names for both and a restore copies to both places; an earlier
    best keeps its own file without the optimizer's moments (only its weights are ever
    tested). Nothing is trained: the checkpoints are small stand-ins of Lightning's."""
    def ckpt(epoch):
        return {"epoch": epoch, "state_dict": {"w": torch.full((3,), float(epoch))},
                "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}}]}

    unit = Phase1Unit(seed=1, dir=tmp_path / "runA" / "phase1-p1s1", config={"k": 1},
                      config_hash="h", max_epochs=40)
    unit.ckpt_dir.mkdir(parents=True)
    torch.save(ckpt(6), unit.ckpt_dir / "last.ckpt")
    if same:
        shutil.copy(unit.ckpt_dir / "last.ckpt", unit.ckpt_dir / "best.ckpt")
    else:
        torch.save(ckpt(4), unit.ckpt_dir / "best.ckpt")
    store = StoreLayout(tmp_path / "store")
    rec = land_progress(store, unit, "max-wall", lambda _: 6)
    files = sorted(p.name for p in progress_dir(store, 1).iterdir())
    assert files == (["last-e6.ckpt", "progress.json"] if same else
                     ["best-e6.ckpt", "last-e6.ckpt", "progress.json"])
    assert (rec.best == rec.last) is same
    again = dataclasses.replace(unit, dir=tmp_path / "runB" / "phase1-p1s1")
    assert restore_progress(store, again, lambda _: None) == 6
    last = again.ckpt_dir / "last.ckpt"
    assert last.read_bytes() == (unit.ckpt_dir / "last.ckpt").read_bytes()
    best = torch.load(again.ckpt_dir / "best.ckpt", weights_only=True)
    assert best["epoch"] == (6 if same else 4)
    assert torch.equal(best["state_dict"]["w"], torch.full((3,), 6.0 if same else 4.0))
    assert ("optimizer_states" in best) is same


def test_an_earlier_best_continues_from_its_weights_alone_to_one_runs_bytes(tmp_path):
    """At a rate too small to change a prediction, validation never improves on epoch 0:
    the pause after epoch 2 stores an earlier best, without its moments, which the
    continued run tests at its end, and phase1.pt equals an uninterrupted run's."""
    cfg = _cfg(phase1_lr=1e-12)
    whole = run_phase1(cfg, tmp_path / "whole", progress=False)
    slot = _slot(tmp_path / "runA", cfg)
    stop = StopAtEpochEnd()
    res = run_phase1(cfg, slot.dir, progress=False, callbacks=[_StopAfter(1, stop)],
                     stop=stop)
    store = StoreLayout(tmp_path / "store")
    rec = land_progress(store, progress_unit(slot), res.reason, checkpoint_epoch)
    assert rec.best == "best-e1.ckpt" and rec.best != rec.last
    best = torch.load(progress_dir(store, 1) / rec.best, weights_only=True)
    assert best["epoch"] == 0 and "optimizer_states" not in best
    again = _slot(tmp_path / "runB", cfg)
    assert restore_progress(_copy_store(store, tmp_path / "copy"), progress_unit(again),
                            checkpoint_epoch) == 1
    done = run_phase1(cfg, again.dir, progress=False)
    assert done["sha256"] == whole["sha256"]
    assert json.loads((again.dir / "phase1_metrics.json").read_text())["best_epoch"] == 0


def _p2cfg(**changes) -> TrainConfig:
    return TrainConfig.from_name("debug", **{**P2, **changes})


def _p2(phase1_file, out, **kw):
    from pmnet.train import run_phase2

    return run_phase2(_p2cfg(), condition="consolidator_only", seed=42,
                      phase1_ckpt=phase1_file, out_dir=out, progress=False, **kw)


@pytest.fixture(scope="module")
def paused_trial(paused, tmp_path_factory):
    """(the Phase-1 file and its sha256, an uninterrupted trial's result, a store holding
    the same trial's progress stopped after epoch 2 of 4, its record)."""
    from pmnet.train import PhasePaused, sha256_file

    root = tmp_path_factory.mktemp("trial-progress")
    p1 = Path(run_phase1(_cfg(), root / "p1", progress=False)["checkpoint"])
    digest = sha256_file(p1)
    whole = _p2(p1, root / "whole")
    stop = StopAtEpochEnd()
    res = _p2(p1, root / "runA" / TRIAL.name, stop=stop, callbacks=[_StopAfter(1, stop)])
    assert isinstance(res, PhasePaused) and (res.phase, res.epoch) == (2, 1), res
    store = StoreLayout(root / "store")
    unit = trial_unit(TRIAL, _p2cfg(), digest, root / "runA" / TRIAL.name)
    rec = land_progress(store, unit, res.reason, checkpoint_epoch, res.train_time_s)
    return p1, digest, whole, store, rec


def test_a_paused_trial_is_kept_under_progress_with_its_phase1_checkpoint(paused_trial):
    _, digest, _, store, rec = paused_trial
    where = store.trial_progress(TRIAL)
    assert where == store.root / "progress" / TRIAL.name
    assert sorted(p.name for p in where.iterdir()) == \
        sorted({rec.last, rec.best, "progress.json"})
    assert (rec.best == rec.last) == (rec.best_sha256 == rec.last_sha256)
    assert (rec.phase, rec.phase1_sha256, rec.epochs_done, rec.max_epochs) == (2, digest, 2, 4)
    assert rec.format == "pmnet-phase2-progress/v1" and rec.phase0 is None
    assert not store.result(TRIAL).exists()  # no commit record: the unit is not in the store
    assert ProgressRecord.from_dict(json.loads((where / "progress.json").read_text())) == rec


def test_a_paused_trial_continued_from_a_copy_of_the_store_equals_one_run(paused_trial,
                                                                           tmp_path):
    p1, digest, whole, store, _ = paused_trial
    copy = _copy_store(store, tmp_path / "store")  # another machine's copy
    unit = trial_unit(TRIAL, _p2cfg(), digest, tmp_path / "runB" / TRIAL.name)
    assert restore_progress(copy, unit, checkpoint_epoch) == 1
    done = _p2(p1, unit.dir)
    assert done["history"] == whole["history"] and done["test"] == whole["test"]
    assert done["best_epoch"] == whole["best_epoch"]


def test_a_trials_progress_on_another_checkpoint_or_config_is_refused(paused, paused_trial,
                                                                     tmp_path):
    _, digest, _, store, _ = paused_trial
    copy = _copy_store(store, tmp_path / "store")
    run = tmp_path / "run" / TRIAL.name
    other_p1 = trial_unit(TRIAL, _p2cfg(), "0" * 64, run)
    with pytest.raises(StoreError, match=r"Phase-2 progress \(after epoch 2 of 4\) trained "
                                         r"from Phase-1 checkpoint [0-9a-f]{12}\.\.\., not "
                                         r"000000000000"):
        restore_progress(copy, other_p1, checkpoint_epoch)
    other_cfg = trial_unit(TRIAL, _p2cfg(consolidator_lr=1e-3), digest, run)
    with pytest.raises(StoreError, match=r"another configuration \(consolidator_lr: "):
        check_progress(copy, other_cfg)
    assert not run.exists()  # refused before anything was written
    # a Phase-1 unit's record where a trial's belongs is not taken for it
    shutil.copy(progress_dir(paused[2], 1) / "progress.json",
                copy.trial_progress(TRIAL) / "progress.json")
    with pytest.raises(StoreError, match="is Phase-1 progress, not Phase-2 progress of unit "
                                         f"{TRIAL.name}"):
        check_progress(copy, trial_unit(TRIAL, _p2cfg(), digest, run))


def test_a_trials_progress_goes_when_its_unit_lands(paused_trial, tmp_path):
    from pipelines.records import Provenance, Stage1Record
    from pipelines.store import land_trial

    _, digest, whole, store, _ = paused_trial
    copy = _copy_store(store, tmp_path / "store")
    copy.phase1_dir(1).mkdir(parents=True)
    Stage1Record(sha256=digest).write(copy.stage1_json(1))
    tdir = tmp_path / "run" / TRIAL.name
    tdir.mkdir(parents=True)
    (tdir / "result.json").write_text(json.dumps(whole))
    assert land_trial(copy, TRIAL, tdir, Provenance(unit=TRIAL.name)) == "landed"
    assert copy.result(TRIAL).is_file() and not copy.trial_progress(TRIAL).exists()

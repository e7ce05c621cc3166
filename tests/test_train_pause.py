"""A Phase 1 in pieces (`pmnet.train.pause`, issue 52): stopped at an epoch boundary (a stop
request, SIGTERM, a deadline), continued from a copy of its directory elsewhere, it ends with
the same phase1.pt bytes and history as one uninterrupted run."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from pmnet.train import (
    Phase1Paused,
    StopAtEpochEnd,
    TrainConfig,
    checkpoint_epoch,
    run_phase1,
)
from pmnet.train.phases import RESUMED_METRICS

#: debug preset, 4 epochs that do not stop early (patience 4), with its Phase 0
CFG = dict(phase1_max_epochs=4, phase1_patience=4, phase1_episodes_per_epoch=32,
           val_episodes=16, test_episodes=16, eval_batch_size=16, batch_size=16)


def _cfg() -> TrainConfig:
    return TrainConfig.from_name("debug", **CFG)


class _At(Callback):
    """Calls `fn` at the end of epoch `epoch` (0-based), before the stop callback looks
    (plain callbacks run before Checkpoint ones)."""

    def __init__(self, epoch: int, fn):
        self.epoch, self.fn = epoch, fn

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            self.fn()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """One uninterrupted run of the 4 epochs."""
    out = tmp_path_factory.mktemp("whole")
    res = run_phase1(_cfg(), out, progress=False)
    return res, json.loads((out / "phase1_metrics.json").read_text())


def _continue_elsewhere(paused_dir: Path, where: Path) -> dict:
    """Copy what a stopped sitting leaves (its checkpoints and Phase 0's metrics) to another
    directory, as another machine would get it, and run Phase 1 there to its end."""
    where.mkdir()
    shutil.copytree(paused_dir / "phase1_ckpt", where / "phase1_ckpt")
    if (paused_dir / "phase0_metrics.json").is_file():
        shutil.copy(paused_dir / "phase0_metrics.json", where)
    return run_phase1(_cfg(), where, progress=False)


def test_a_stop_after_epoch_2_continued_elsewhere_equals_one_run(whole, tmp_path):
    full, full_meta = whole
    stop = StopAtEpochEnd(stop_file=tmp_path / "stop.request")
    touch = _At(1, lambda: (tmp_path / "stop.request").touch())
    res = run_phase1(_cfg(), tmp_path / "a", progress=False, callbacks=[touch], stop=stop)
    assert isinstance(res, Phase1Paused), res
    assert (res.epoch, res.epochs_done, res.max_epochs, res.reason) == (1, 2, 4,
                                                                       "stop requested")
    a = tmp_path / "a"
    # paused, not finished: no test pass, no phase1.pt, no metrics; last.ckpt holds epoch 1
    assert not (a / "phase1.pt").exists() and not (a / "phase1_metrics.json").exists()
    assert checkpoint_epoch(a / "phase1_ckpt" / "last.ckpt") == 1
    done = _continue_elsewhere(a, tmp_path / "b")
    assert done["sha256"] == full["sha256"]  # the same bytes
    meta = json.loads((tmp_path / "b" / "phase1_metrics.json").read_text())
    assert meta["history"] == full_meta["history"] and len(meta["history"]) == 4
    assert meta["best_epoch"] == full_meta["best_epoch"]
    assert meta["phase0"] == full_meta["phase0"]
    assert meta["train_time_s"] >= res.train_time_s > 0  # both sittings counted


def _rows(out: Path) -> list[dict]:
    with (out / "phase1_logs" / "metrics.csv").open(newline="") as f:
        return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def test_a_run_continued_in_its_own_directory_keeps_one_metrics_history(whole, tmp_path):
    """Lightning's CSVLogger deletes the metrics.csv it finds; a Phase 1 resumed in its own
    directory keeps the rows of the epochs its checkpoint holds, drops those of an epoch a
    kill cut short, and reads again the rows a resume cut short had set aside: after four
    sittings the file equals one run's."""
    full = _rows(Path(whole[0]["checkpoint"]).parent)
    assert sorted({r["epoch"] for r in full if "val/mean_stm" in r}) == ["0", "1", "2", "3"]
    for epoch in range(3):
        res = run_phase1(_cfg(), tmp_path, progress=False, stop=StopAtEpochEnd(deadline_s=0))
        assert isinstance(res, Phase1Paused) and res.epoch == epoch
        assert _rows(tmp_path) == [r for r in full if int(r["epoch"]) <= epoch]
    logs = tmp_path / "phase1_logs"
    # a sitting killed in epoch 3 logged a row of it; the next resume was cut short after
    # setting the file aside and before writing the kept rows back
    header = (logs / "metrics.csv").read_text().splitlines()[0]
    with (logs / "metrics.csv").open("a", newline="") as f:
        f.write("3,99" + "," * (header.count(",") - 1) + "\n")
    (logs / "metrics.csv").rename(logs / RESUMED_METRICS)
    (logs / "metrics.csv").write_text("epoch,step\n3,98\n")
    done = run_phase1(_cfg(), tmp_path, progress=False)
    assert done["sha256"] == whole[0]["sha256"]
    assert _rows(tmp_path) == full
    assert not (logs / RESUMED_METRICS).exists()


def test_sigterm_stops_at_the_epoch_end_and_gives_the_handler_back(tmp_path):
    """The first SIGTERM while the trainer fits pauses at the epoch end (Lightning alone
    would end the fit after the current batch); the handler is given back after."""
    stop = StopAtEpochEnd(sigterm=True)
    term = _At(0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    res = run_phase1(_cfg(), tmp_path, progress=False, callbacks=[term], stop=stop)
    assert signal.getsignal(signal.SIGTERM) == before
    assert isinstance(res, Phase1Paused) and (res.epoch, res.reason) == (0, "stop requested")
    assert checkpoint_epoch(tmp_path / "phase1_ckpt" / "last.ckpt") == 0


def test_a_deadline_stops_before_an_epoch_that_would_pass_it_never_the_last(tmp_path):
    # a deadline already passed: every sitting still trains one epoch, then pauses
    res = run_phase1(_cfg(), tmp_path, progress=False, stop=StopAtEpochEnd(deadline_s=0))
    assert isinstance(res, Phase1Paused) and (res.epoch, res.reason) == (0, "max-wall")
    res = run_phase1(_cfg(), tmp_path, progress=False, stop=StopAtEpochEnd(deadline_s=0))
    assert isinstance(res, Phase1Paused) and res.epoch == 1  # one more epoch, same directory
    # a deadline far away: no pause; and the last epoch finishes whatever the deadline
    res = run_phase1(_cfg(), tmp_path, progress=False, stop=StopAtEpochEnd(deadline_s=1e6))
    sha = res["sha256"]
    assert isinstance(res, dict) and (tmp_path / "phase1.pt").is_file()
    assert checkpoint_epoch(tmp_path / "phase1_ckpt" / "last.ckpt") == 3  # ran to the end
    # the last epoch is never paused, even with the deadline passed
    again = tmp_path.parent / f"{tmp_path.name}-again"
    again.mkdir()
    run_phase1(_cfg(), again, progress=False, stop=StopAtEpochEnd(deadline_s=0))
    for _ in range(2):
        run_phase1(_cfg(), again, progress=False, stop=StopAtEpochEnd(deadline_s=0))
    res = run_phase1(_cfg(), again, progress=False, stop=StopAtEpochEnd(deadline_s=0))
    assert isinstance(res, dict) and res["sha256"] == sha


def test_a_stop_file_is_read_and_a_bad_deadline_refused(tmp_path):
    stop = StopAtEpochEnd(stop_file=tmp_path / "stop")
    assert not stop.requested()
    (tmp_path / "stop").touch()
    assert stop.requested()
    with pytest.raises(ValueError, match="deadline_s"):
        StopAtEpochEnd(deadline_s=float("nan"))


# --- Phase 2 in pieces (issue 61): the long Phase-2 recipe pauses and continues -------------

#: debug preset's Phase 2 on ADD10 only at a constant rate, 4 epochs that do not stop early
P2 = dict(max_epochs=4, patience=4, episodes_per_epoch=32, val_episodes=16, test_episodes=16,
          eval_batch_size=16, batch_size=16, phase2_families=("add10",),
          lr_schedule="constant", consolidator_init_std=0.18)


@pytest.fixture(scope="module")
def phase1_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("p1")
    return Path(run_phase1(_cfg(), out, progress=False)["checkpoint"])


def _p2(phase1_file, out, **kw):
    from pmnet.train import run_phase2

    return run_phase2(TrainConfig.from_name("debug", **P2), condition="consolidator_only",
                      seed=42, phase1_ckpt=phase1_file, out_dir=out, progress=False, **kw)


@pytest.fixture(scope="module")
def whole2(phase1_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole2")
    return _p2(phase1_file, out), out


def test_a_phase2_stopped_after_epoch_2_and_continued_elsewhere_equals_one_run(
        phase1_file, whole2, tmp_path):
    from pmnet.train import PhasePaused, sha256_file

    stop = StopAtEpochEnd()
    res = _p2(phase1_file, tmp_path / "a", stop=stop,
              callbacks=[_At(1, stop.request)])
    assert isinstance(res, PhasePaused) and (res.phase, res.epoch) == (2, 1), res
    assert not (tmp_path / "a" / "result.json").exists()
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")
    done = _p2(phase1_file, tmp_path / "b")
    ref, ref_dir = whole2
    assert done["history"] == ref["history"] and done["test"] == ref["test"]
    assert done["best_epoch"] == ref["best_epoch"]
    assert sha256_file(tmp_path / "b" / "best_model.pt") == sha256_file(ref_dir / "best_model.pt")


def test_a_phase2_checkpoint_holds_the_trainable_parameters_only(phase1_file, whole2):
    import torch

    from pmnet.train import sha256_file

    _, out = whole2
    ck = torch.load(out / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    held = set(ck["state_dict"])
    assert held and all(k.startswith("model.consolidator.") for k in held), sorted(held)[:5]
    assert ck["pmnet_compact"]["phase1_sha256"] == sha256_file(phase1_file)
    assert not any(k.startswith("model.consolidator.") for k in ck["pmnet_compact"]["frozen"])
    # a few hundred KB at most for the Consolidator alone, whatever the backbone's size
    assert (out / "ckpt" / "last.ckpt").stat().st_size < 200_000


def test_a_compact_checkpoint_does_not_continue_on_another_phase1_file(phase1_file, tmp_path):
    cfg = TrainConfig.from_name("debug", **{**CFG, "phase1_seed": 1})
    other = Path(run_phase1(cfg, tmp_path / "p1b", progress=False)["checkpoint"])
    stop = StopAtEpochEnd()
    _p2(phase1_file, tmp_path / "a", stop=stop, callbacks=[_At(0, stop.request)])
    with pytest.raises(ValueError, match="Phase-1 file"):
        _p2(other, tmp_path / "a")


def test_phase2_on_add10_selects_on_add10_and_still_reads_both_families(whole2):
    res, _ = whole2
    assert res["config"]["phase2_families"] == "add10"
    vals = [h["val/updated_ltm_add10"] for h in res["history"]]
    assert res["best_epoch"] == res["history"][vals.index(max(vals))]["epoch"]
    assert res["val"]["updated_ltm_add10"] == max(vals)
    assert all("val/updated_ltm_affine10" in h for h in res["history"])
    assert "updated_ltm_affine10" in res["test"]


@pytest.mark.parametrize("schedule, at_end", [("constant", 1.0), ("cosine", 0.0)])
def test_the_phase2_rate_after_warmup_is_constant_or_cosine(schedule, at_end):
    from types import SimpleNamespace

    from pmnet.conditions import get_condition
    from pmnet.model import PMNet
    from pmnet.train.modules import Phase2Module

    cfg = TrainConfig.from_name("debug", lr_schedule=schedule, warmup_steps=2)
    m = Phase2Module(cfg, PMNet(cfg.model), get_condition("consolidator_only"))
    m._trainer = SimpleNamespace(estimated_stepping_batches=8)  # what the schedule reads
    lam = m.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]
    assert [lam(0), lam(1), lam(2)] == [0.5, 1.0, 1.0]
    assert lam(8) == pytest.approx(at_end, abs=1e-9)

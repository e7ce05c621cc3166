"""The driver's side of a Phase 1 (issue 52) and a trial (issue 61) in durable pieces
(`pipelines.driver.sigterm_writes_stop_file`; the store's side is tests/test_store_progress.py).

Fast: SIGTERM to the driver writes the stop file. Slow: the whole pipeline path (SIGTERM to
`python -m pipelines.run`, then the same `start --store` from a fresh copy of the store
under another run root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from pipelines.driver import sigterm_writes_stop_file
from pmnet.store_layout import StoreLayout
from pmnet.store_progress import progress_dir


def test_sigterm_to_the_driver_writes_the_stop_file_once(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    path = tmp_path / "stop"
    with sigterm_writes_stop_file(path):
        os.kill(os.getpid(), signal.SIGTERM)
        assert path.exists()
        assert signal.getsignal(signal.SIGTERM) == before  # a second one acts as before
    assert signal.getsignal(signal.SIGTERM) == before


# -- the pipeline: SIGTERM, then `make pipeline STORE=...` from a copy of the store ----------


def _sigterm_once_written(args: list[str], last: Path, env: dict) -> tuple[int, str]:
    """Run `python -m pipelines.run *args`, SIGTERM the driver alone once `last` (an epoch's
    checkpoint) exists, and return its exit code and output."""
    import time

    from tests.support.pipeline import kill_group, spawn

    proc = spawn(*args, env=env)
    try:
        deadline = time.time() + 400
        while not last.is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert last.is_file(), f"no epoch written: {last}"
        os.kill(proc.pid, signal.SIGTERM)  # the driver only
        out = proc.communicate(timeout=400)[0]
    finally:
        kill_group(proc.pid)
    return proc.returncode, out


@pytest.mark.slow
def test_a_pipeline_stopped_by_sigterm_continues_from_a_copy_of_its_store(tmp_path):
    """`debug`, one Phase-1 checkpoint (seed 1) of 4 epochs and one trial: a run into store
    R uninterrupted; a run into store P gets SIGTERM once Phase 1 has written its first
    epoch: it pauses at the next epoch end, publishes the unit's progress and stops (exit
    0, no commit record); a fresh copy of P, continued by another run root (as another
    machine would), lands the unit with the same phase1.pt bytes and history as R's, and
    the same trial result; its progress is gone."""
    import time

    from tests.support.pipeline import cli

    base = ["start", "--preset", "debug", "--grid", "phase1_variance", "--stage1-cpus", "1",
            "--gpus-per-trial", "0", "--conditions", "consolidator_only", "--seeds", "42",
            "--phase1-seeds", "1", "--set", "phase1_max_epochs=4", "--set",
            "phase1_patience=4"]
    t0 = time.time()
    rc, out = cli(*base, "--store", str(tmp_path / "R"), "--root", str(tmp_path / "r"))
    assert rc == 0, out[-4000:]
    # the piece stopped by SIGTERM (each Phase-1 epoch after the first waits 3 s: the test
    # hook of pipelines.faults, so that the signal lands while epoch 2 has not ended)
    rc, out = _sigterm_once_written(
        [*base, "--store", str(tmp_path / "P"), "--root", str(tmp_path / "a"), "--name", "a"],
        tmp_path / "a" / "a" / "phase1-p1s1" / "phase1_ckpt" / "last.ckpt",
        {"PMNET_TEST_EPOCH_PAUSE_S": "3"})
    assert rc == 0, out[-4000:]
    assert "phase1-p1s1: Phase 1 paused after epoch" in out and "stopped by SIGTERM" in out, \
        out[-4000:]
    p = StoreLayout(tmp_path / "P")
    record = json.loads((progress_dir(p, 1) / "progress.json").read_text())
    assert record["epoch"] in (1, 2) and record["max_epochs"] == 4, record  # mid-way
    assert not p.stage1_json(1).exists() and not p.results_dir.exists()
    # another machine: a fresh copy of the store, another run root
    shutil.copytree(tmp_path / "P", tmp_path / "P2")
    rc, out = cli(*base, "--store", str(tmp_path / "P2"), "--root", str(tmp_path / "b"))
    assert rc == 0, out[-4000:]
    assert "continuing Phase 1 from the store's progress" in out, out[-4000:]
    ref, got = StoreLayout(tmp_path / "R"), StoreLayout(tmp_path / "P2")
    assert json.loads(got.stage1_json(1).read_text())["sha256"] == \
        json.loads(ref.stage1_json(1).read_text())["sha256"]
    assert got.phase1_ckpt(1).read_bytes() == ref.phase1_ckpt(1).read_bytes()
    hist = [json.loads((s.phase1_dir(1) / "phase1_metrics.json").read_text())["history"]
            for s in (ref, got)]
    assert hist[0] == hist[1] and len(hist[0]) == 4
    trial = "consolidator_only-p1-s42.json"
    assert json.loads((got.results_dir / trial).read_text())["test"] == \
        json.loads((ref.results_dir / trial).read_text())["test"]
    assert not progress_dir(got, 1).exists()
    print(f"reference + SIGTERMed piece + continuation: {time.time() - t0:.0f} s")


@pytest.mark.slow
def test_a_trial_stopped_by_sigterm_continues_from_a_copy_of_its_store(tmp_path):
    """Issue 61, a Phase 2 in durable pieces: `debug`, one Phase-1 checkpoint and one trial
    of 4 epochs. A run into store R uninterrupted; a run into store P gets SIGTERM once the
    trial has written its first epoch: the trial pauses at the next epoch end, its progress
    goes into `P/progress/<trial>/` (no result: the unit is not in the store) and the run
    stops (exit 0); a fresh copy of P, continued by another run root (as another machine
    would), lands the trial with R's history and test result, and its progress is gone."""
    import time

    from tests.support.pipeline import cli

    trial = "consolidator_only-p1-s42"
    base = ["start", "--preset", "debug", "--grid", "phase1_variance", "--stage1-cpus", "1",
            "--gpus-per-trial", "0", "--conditions", "consolidator_only", "--seeds", "42",
            "--phase1-seeds", "1", "--set", "max_epochs=4", "--set", "patience=4"]
    t0 = time.time()
    rc, out = cli(*base, "--store", str(tmp_path / "R"), "--root", str(tmp_path / "r"))
    assert rc == 0, out[-4000:]
    # each trial epoch waits 3 s once written (the test hook of pipelines.faults), so that
    # the signal lands while epoch 2 has not ended
    rc, out = _sigterm_once_written(
        [*base, "--store", str(tmp_path / "P"), "--root", str(tmp_path / "a"), "--name", "a"],
        tmp_path / "a" / "a" / "trials" / trial / "ckpt" / "last.ckpt",
        {"PMNET_TEST_EPOCH_PAUSE_S": "3"})
    assert rc == 0, out[-4000:]
    assert f"{trial} paused after epoch" in out and "stopped by SIGTERM" in out, out[-4000:]
    p = StoreLayout(tmp_path / "P")
    record = json.loads((p.root / "progress" / trial / "progress.json").read_text())
    assert record["phase"] == 2 and record["epoch"] in (0, 1, 2), record  # mid-way
    assert record["phase1_sha256"] == json.loads(p.stage1_json(1).read_text())["sha256"]
    assert not (p.results_dir / f"{trial}.json").exists()
    # another machine: a fresh copy of the store, another run root
    shutil.copytree(tmp_path / "P", tmp_path / "P2")
    rc, out = cli(*base, "--store", str(tmp_path / "P2"), "--root", str(tmp_path / "b"))
    assert rc == 0, out[-4000:]
    assert f"{trial}: continuing Phase 2 from the store's progress" in out, out[-4000:]
    got, ref = (json.loads((StoreLayout(tmp_path / s).results_dir / f"{trial}.json")
                           .read_text()) for s in ("P2", "R"))
    assert got["history"] == ref["history"] and len(ref["history"]) == 4
    assert got["test"] == ref["test"]
    assert not (tmp_path / "P2" / "progress" / trial).exists()
    print(f"reference + SIGTERMed piece + continuation: {time.time() - t0:.0f} s")

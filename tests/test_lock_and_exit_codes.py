"""One driver per pipeline (pipelines.lock: filelock) and the exit codes of pipelines.run."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import driver, lock, run
from pipelines.layout import Layout, PipelineError
from pipelines.lock import DriverRunning
from pmnet.store_layout import StoreError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def existing(tmp_path, monkeypatch):
    """A recorded pipeline `p` under tmp_path/runs; MLflow/Ray env cleared."""
    from pipelines.plan import plan_new
    from pipelines.stages import write_meta

    for k in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    write_meta(plan_new(root=tmp_path / "runs", name="p", preset="debug", grid="tiny"),
               status="interrupted")
    return Layout(tmp_path / "runs", "p")


HOLDER = """import errno, fcntl, sys, time
from pipelines import driver, plan
def no_locks(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")
if sys.argv[2] == "1":
    fcntl.flock = no_locks
def hold(*a):
    print("held", flush=True)
    time.sleep(600)
driver.init_ray = hold
driver.execute(plan.plan_resume(root=sys.argv[1], name="p"))
"""


def _holder(root: Path, no_flock: bool = False) -> subprocess.Popen:
    """Another driver of `p` holding its run lock until killed: the real `driver.execute`,
    stopped where it would start Ray (`no_flock`: on a storage whose flock answers ENOLCK)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), str(int(no_flock))],
                            cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    if not any(line.strip() == "held" for line in proc.stdout):
        raise AssertionError(f"the holding driver ended with {proc.wait()}")
    return proc


def no_locks(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")


def _files(run_dir: Path) -> dict:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_a_second_driver_is_refused_and_changes_nothing(existing, capsys):
    proc = _holder(existing.root)
    try:
        before = _files(existing.run_dir)
        rc = run.main(["resume", "--root", str(existing.root)])  # picks LAST = p
        err = capsys.readouterr().err
        assert rc == run.Exit.BUSY == 4
        assert f"is being run by driver pid {proc.pid} on host {socket.gethostname()}" in err
        assert _files(existing.run_dir) == before
        assert lock.driver_alive(existing.run_dir)  # what `make status` asks
    finally:
        proc.kill()
        proc.wait()
    # the kernel released the dead holder's lock: status sees it gone, a new driver gets it
    assert not lock.driver_alive(existing.run_dir)
    with lock.run_lock(existing.run_dir, "p"):
        assert lock.driver_alive(existing.run_dir)
        with pytest.raises(DriverRunning):
            with lock.run_lock(existing.run_dir, "p"):
                pass
    assert not lock.driver_alive(existing.run_dir)


def test_without_flock_a_marker_keeps_the_pipeline_while_its_pid_lives(existing, monkeypatch,
                                                                       capsys):
    marker = existing.run_dir / "driver.softlock"
    proc = _holder(existing.root, no_flock=True)
    try:
        assert marker.is_file()
        monkeypatch.setattr(fcntl, "flock", no_locks)
        rc = run.main(["resume", "--root", str(existing.root), "--name", "p"])
        err = capsys.readouterr().err
        assert rc == run.Exit.BUSY, err
        assert f"driver pid {proc.pid}" in err and f"delete {marker}" in err
        assert lock.driver_alive(existing.run_dir)
    finally:
        proc.kill()
        proc.wait()
    # the marker's pid is gone from this host: the next driver takes the pipeline over
    with lock.run_lock(existing.run_dir, "p"):
        assert marker.is_file()
        with pytest.raises(DriverRunning):
            with lock.run_lock(existing.run_dir, "p"):
                pass
    assert not marker.exists() and not lock.driver_alive(existing.run_dir)


@pytest.mark.parametrize("error, code, message", [
    (RuntimeError("boom"), run.Exit.FAILED, "internal error: RuntimeError: boom"),
    (OSError(errno.ENOSPC, "No space left on device", "/full/disk"), run.Exit.FAILED,
     "no space left on the device of /full/disk"),
    (PipelineError("Stage 1 (Phase 1) failed: x"), run.Exit.FAILED, "Stage 1 .* failed"),
    (StoreError("store unit u is locked by pid 1 on h"), run.Exit.FAILED,
     "^error: store unit u is locked by pid 1 on h"),  # the store's error is the pipeline's
    (KeyboardInterrupt(), run.Exit.INTERRUPTED, "interrupted: continue with `make resume`"),
])
def test_errors_after_the_start_have_their_own_exit_codes(existing, monkeypatch, capsys, error,
                                                          code, message):
    def fail(plan):
        raise error

    monkeypatch.setattr(driver, "_execute", fail)
    rc = run.main(["resume", "--root", str(existing.root), "--name", "p"])
    err = capsys.readouterr().err
    assert rc == code, err
    assert __import__("re").search(message, err), err
    if code == run.Exit.FAILED and not isinstance(error, (PipelineError, StoreError)):
        trace = (existing.logs_dir / "driver-error.txt").read_text()
        assert type(error).__name__ in trace and "Traceback" in trace
    assert not lock.driver_alive(existing.run_dir)  # released whatever happened


def test_unfinished_trials_exit_1_and_finished_exit_0(existing, monkeypatch):
    monkeypatch.setattr(driver, "_execute", lambda plan: 1)
    assert run.main(["resume", "--root", str(existing.root)]) == run.Exit.UNFINISHED == 1
    monkeypatch.setattr(driver, "_execute", lambda plan: 0)
    assert run.main(["resume", "--root", str(existing.root)]) == run.Exit.DONE == 0

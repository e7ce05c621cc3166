"""One driver per pipeline (pipelines.lock) and the exit codes of pipelines.run (`Exit`)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import driver, lock, run
from pipelines.layout import Layout, PipelineError
from pipelines.lock import DriverRunning, RunLock
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


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds the run lock until killed."""
    code = ("import sys, time; from pipelines.lock import RunLock; "
            "RunLock(sys.argv[1], 'p').acquire(); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_driver_is_refused_and_changes_nothing(existing, capsys):
    proc = _holder(existing.run_dir)
    try:
        before = existing.pipeline_json.read_bytes()
        rc = run.main(["resume", "--root", str(existing.root)])  # picks LAST = p
        err = capsys.readouterr().err
        assert rc == run.Exit.BUSY == 4
        assert f"driver pid {proc.pid}" in err and "is being run by" in err
        assert existing.pipeline_json.read_bytes() == before
        assert not existing.logs_dir.exists()
        with pytest.raises(DriverRunning):
            RunLock(existing.run_dir, "p").acquire()
    finally:
        proc.kill()
        proc.wait()
    # the kernel released the dead holder's lock: a new driver gets it
    held = RunLock(existing.run_dir, "p").acquire()
    assert json.loads((existing.run_dir / "driver.lock").read_text())["pid"] == os.getpid()
    held.release()
    assert (existing.run_dir / "driver.lock").read_text() == ""


def test_without_flock_the_recorded_holder_liveness_decides(existing, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)
    path = existing.run_dir / "driver.lock"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        path.write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname()}))
        with pytest.raises(DriverRunning, match=f"driver pid {alive.pid}"):
            RunLock(existing.run_dir, "p").acquire()
        # a holder on another host: its heartbeat (the file's mtime) decides
        path.write_text(json.dumps({"pid": 1234, "host": "elsewhere"}))
        with pytest.raises(DriverRunning, match="on host elsewhere"):
            RunLock(existing.run_dir, "p").acquire()
        old = time.time() - 2 * lock.STALE_AFTER_S
        os.utime(path, (old, old))
        got = RunLock(existing.run_dir, "p").acquire()
        assert got.fallback
        got.release()
    finally:
        alive.kill()
        alive.wait()
    path.write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname()}))  # dead now
    RunLock(existing.run_dir, "p").acquire().release()


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
    # the lock was released whatever happened
    RunLock(existing.run_dir, "p").acquire().release()


def test_unfinished_trials_exit_1_and_finished_exit_0(existing, monkeypatch):
    monkeypatch.setattr(driver, "_execute", lambda plan: 1)
    assert run.main(["resume", "--root", str(existing.root)]) == run.Exit.UNFINISHED == 1
    monkeypatch.setattr(driver, "_execute", lambda plan: 0)
    assert run.main(["resume", "--root", str(existing.root)]) == run.Exit.DONE == 0

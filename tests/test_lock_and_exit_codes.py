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
    if code == run.Exit.FAILED and not isinstance(error, PipelineError):
        trace = (existing.logs_dir / "driver-error.txt").read_text()
        assert type(error).__name__ in trace and "Traceback" in trace
    # the lock was released whatever happened
    RunLock(existing.run_dir, "p").acquire().release()


def test_unfinished_trials_exit_1_and_finished_exit_0(existing, monkeypatch):
    monkeypatch.setattr(driver, "_execute", lambda plan: 1)
    assert run.main(["resume", "--root", str(existing.root)]) == run.Exit.UNFINISHED == 1
    monkeypatch.setattr(driver, "_execute", lambda plan: 0)
    assert run.main(["resume", "--root", str(existing.root)]) == run.Exit.DONE == 0


# -- a store's unit locks: none wedges a study (issue 53) -------------------------------------


def _unit_lock_file(tmp_path: Path, content: bytes, age_s: float) -> tuple:
    from pmnet.store_layout import StoreLayout

    store = StoreLayout(tmp_path / "store")
    path = store.lock("u")
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return store, path


UNREADABLE = {"empty": b"", "truncated": b'{"host": "vm", "pid": 12', "not JSON": b"\x00\xffzz",
              "a JSON list": b"[1, 2]", "an object without its time": b'{"pid": 1}'}


@pytest.mark.parametrize("content", list(UNREADABLE.values()), ids=list(UNREADABLE))
def test_an_unreadable_unit_lock_is_stale_once_its_file_is_older_than_the_threshold(
        tmp_path, content):
    """A writer that died between creating its lock and writing it (or a damaged lock file)
    left a lock no one can read: stale once its mtime is older than STALE_LOCK_S, taken at
    once then; a young one is waited for (it may be a writer between create and write)."""
    from pipelines.store import StoreError, UnitLock

    store, path = _unit_lock_file(tmp_path, content, age_s=lock.STALE_LOCK_S + 5)
    t0 = time.time()
    with UnitLock(store, "u", wait_s=30) as held:
        assert json.loads(path.read_text())["token"] == held.token
    assert time.time() - t0 < 2 and not path.exists()
    assert not list(path.parent.iterdir())  # the stale one is gone, not left aside
    path.write_bytes(content)  # young: a live writer's, for all we know
    with pytest.raises(StoreError, match=r"store unit u is locked by pid .* a lock older than "
                       r"600 s is stale \(its recorded time, or its file's age"):
        UnitLock(store, "u", wait_s=0.3).acquire()
    assert path.read_bytes() == content


def test_the_stale_threshold_is_configurable_and_an_empty_lock_breaks_after_it(tmp_path,
                                                                              monkeypatch):
    """PMNET_STALE_LOCK_S=1.5: a fresh empty lock wedges a writer no longer than 1.5 s (plus
    its polling); an unusable value keeps the default."""
    from pipelines.store import UnitLock

    store, path = _unit_lock_file(tmp_path, b"", age_s=0)
    monkeypatch.setenv(lock.STALE_LOCK_ENV, "1.5")
    assert lock.stale_lock_s() == 1.5
    t0 = time.time()
    with UnitLock(store, "u", wait_s=30) as held:
        waited = time.time() - t0
        assert json.loads(path.read_text())["token"] == held.token
    assert 1.4 < waited < 4, waited
    for bad in ("", "x", "-3", "0"):
        monkeypatch.setenv(lock.STALE_LOCK_ENV, bad)
        assert lock.stale_lock_s() == lock.STALE_LOCK_S


def test_another_hosts_unit_lock_is_judged_by_age_alone(tmp_path):
    """A lock of another host names a pid that means nothing here: neither a dead pid nor a
    live one of this host decides, its recorded time does."""
    from pipelines.store import StoreError, UnitLock

    young = {"host": "elsewhere", "pid": 999_999_999, "time": time.time(), "token": "t"}
    store, path = _unit_lock_file(tmp_path, json.dumps(young).encode(), age_s=0)
    assert not lock.unit_lock_stale(path, young, 600)  # the pid is dead here: not judged
    with pytest.raises(StoreError, match="locked by pid 999999999 on elsewhere"):
        UnitLock(store, "u", wait_s=0.3).acquire()
    old = {**young, "time": time.time() - 601}
    path.write_text(json.dumps(old))
    os.utime(path)  # a fresh mtime does not make it young: its recorded time decides
    assert lock.unit_lock_stale(path, old, 600)
    with UnitLock(store, "u", wait_s=5):
        pass


def test_a_fresh_lock_moved_aside_by_mistake_goes_back(tmp_path):
    """Two writers judge one stale lock; the first takes it, the second moves the first's
    fresh lock aside: `same_stale_lock` says it is not the judged one (its token; an
    unreadable one by its young mtime), so it goes back."""
    store, path = _unit_lock_file(tmp_path, b"", age_s=0)
    assert not lock.same_stale_lock(path, None, 600)  # unreadable but young
    os.utime(path, (time.time() - 700, time.time() - 700))
    assert lock.same_stale_lock(path, None, 600)
    path.write_text(json.dumps({"host": "h", "pid": 1, "time": time.time(), "token": "b"}))
    assert not lock.same_stale_lock(path, None, 600)  # written since: another writer's
    judged = {"host": "h", "pid": 1, "time": 0.0, "token": "a"}
    assert not lock.same_stale_lock(path, judged, 600)
    assert lock.same_stale_lock(path, {**judged, "token": "b"}, 600)

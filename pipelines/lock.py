"""One driver per pipeline: an exclusive lock on `<run>/driver.lock` for the whole execution
(a store's unit lock is `pmnet.store_lock`).

Two drivers on one pipeline would retrain Phase 1 over each other, run two Tuners on one
`stage2/` and write into the same MLflow runs. `RunLock.acquire()` takes an `fcntl.flock`
on the lock file (released by the kernel when the driver exits or dies, even by SIGKILL)
and writes the holder (pid, host, start time) into it, for the refusal message of the next
driver. Where the storage has no working locks (some network filesystems answer ENOLCK or
EOPNOTSUPP), it falls back to the recorded holder's liveness: a holder on this host whose
pid is alive, or on another host whose heartbeat (the lock file's mtime, touched every
`HEARTBEAT_S` seconds by the holder) is recent, keeps the pipeline.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from pipelines.layout import PipelineError
from pmnet.store_lock import pid_alive

HEARTBEAT_S = 20.0
STALE_AFTER_S = 4 * HEARTBEAT_S  # a fallback holder on another host silent this long: dead
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class DriverRunning(PipelineError):
    """Another driver holds this pipeline; the message names it and what to do."""


def driver_alive(run_dir: str | os.PathLike) -> bool:
    """Whether the driver recorded in the pipeline's lock file still runs (its pid on this
    host, or a fresh heartbeat from another); takes no lock."""
    lock = RunLock(run_dir, Path(run_dir).name)
    return lock._held_by_live_driver(lock.holder())


class RunLock:
    """Exclusive, process-lifetime lock of one pipeline directory."""

    def __init__(self, run_dir: str | os.PathLike, name: str):
        self.path = Path(run_dir) / "driver.lock"
        self.name = name
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.fallback = False  # True where the storage gave no flock

    def holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _refuse(self, info: dict) -> DriverRunning:
        who = (f"driver pid {info.get('pid', '?')} on host {info.get('host', '?')} "
               f"(started {info.get('started', '?')})")
        return DriverRunning(
            f"pipeline {self.name!r} is being run by {who}; a second driver would retrain "
            f"and log over it. Wait for it to finish (`make status NAME={self.name}` shows "
            f"its progress) or stop it (kill {info.get('pid', 'PID')} on "
            f"{info.get('host', 'its host')}), then resume.")

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refuse(self.holder()) from None
        except OSError as e:
            if e.errno not in NO_LOCKS:
                os.close(fd)
                raise
            self.fallback = True
            info = self.holder()
            if self._held_by_live_driver(info):
                os.close(fd)
                raise self._refuse(info) from None
        self._fd = fd
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "flock": not self.fallback}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name="pipeline-lock-heartbeat")
        self._beat.start()
        return self

    def _held_by_live_driver(self, info: dict) -> bool:
        pid = info.get("pid")
        if not isinstance(pid, int) or pid == os.getpid():
            return False
        if info.get("host") == socket.gethostname():
            return pid_alive(pid)
        try:
            age = time.time() - self.path.stat().st_mtime
        except OSError:
            return False
        return age < STALE_AFTER_S

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)  # no holder any more
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(fd)

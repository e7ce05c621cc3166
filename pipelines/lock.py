"""One driver per pipeline: an exclusive lock on `<run>/driver.lock` for the whole execution;
and when a store's unit lock (`pipelines.store.UnitLock`) is stale (`unit_lock_stale`).

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
from typing import Any

from pipelines.layout import PipelineError, read_json

HEARTBEAT_S = 20.0
STALE_AFTER_S = 4 * HEARTBEAT_S  # a fallback holder on another host silent this long: dead
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
#: a store's unit lock older than this is stale whoever holds it (a lock is held only while a
#: unit is checked and its files are copied in: seconds); `PMNET_STALE_LOCK_S` overrides it
STALE_LOCK_S = 600.0
STALE_LOCK_ENV = "PMNET_STALE_LOCK_S"


class DriverRunning(PipelineError):
    """Another driver holds this pipeline; the message names it and what to do."""


def _alive(pid: int) -> bool:
    """Is process `pid` of this host running (a zombie is not)?"""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_lock_s() -> float:
    """STALE_LOCK_S, or the seconds `PMNET_STALE_LOCK_S` gives (a positive number; tests)."""
    try:
        value = float(os.environ.get(STALE_LOCK_ENV, ""))
    except ValueError:
        return STALE_LOCK_S
    return value if value > 0 else STALE_LOCK_S


def _lock_record(info: Any) -> bool:
    """A unit lock's content as its writer left it: a JSON object with its time."""
    return isinstance(info, dict) and isinstance(info.get("time"), (int, float)) \
        and not isinstance(info.get("time"), bool)


def unit_lock_stale(path: Path, info: Any, stale_s: float) -> bool:
    """Whether the unit lock at `path`, whose content read as `info` (None when it did not
    parse), is stale. A readable lock (a JSON object with its `time`) is stale once that
    time is older than `stale_s`, or at once when its owner is a dead process of this host;
    a lock of another host is judged by age alone (its processes cannot be seen from here).
    A lock that cannot be read (empty: its writer died between create and write; truncated;
    not JSON; not an object with a time) is judged by its file's mtime, so it is stale
    `stale_s` after it was last written. A lock that is gone is not stale."""
    if _lock_record(info):
        if time.time() - info["time"] > stale_s:
            return True
        pid = info.get("pid")
        return info.get("host") == socket.gethostname() and isinstance(pid, int) \
            and not _alive(pid)
    try:
        return time.time() - path.stat().st_mtime > stale_s
    except OSError:
        return False


def same_stale_lock(moved: Path, judged: Any, stale_s: float) -> bool:
    """After a stale lock judged from `judged` was moved aside to `moved`: is it still that
    lock (so it may be deleted), rather than a fresh one another writer made in between? A
    readable one by its token; an unreadable one when it is still unreadable and old."""
    now = read_json(moved)
    if _lock_record(judged):
        return isinstance(now, dict) and now.get("token") == judged.get("token")
    return not _lock_record(now) and unit_lock_stale(moved, None, stale_s)


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
            return _alive(pid)
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

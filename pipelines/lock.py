"""One driver per pipeline (two would retrain and log over each other): `filelock`'s flock
on `<run>/driver.lock`, which the kernel releases when the driver dies, even by SIGKILL;
where the storage refuses flock (ENOLCK, EOPNOTSUPP), a `SoftFileLock` marker
`<run>/driver.softlock`, taken over once its pid is gone from this host.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, SoftFileLock, Timeout

from pipelines.layout import PipelineError, read_json

NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
LOCK_FILES = ("driver.lock", "driver.softlock")  # flock; the marker where flock is refused


class DriverRunning(PipelineError):
    """Another driver holds this pipeline; the message names it and what to do."""


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike, name: str) -> Iterator[None]:
    """Hold the pipeline's lock for the `with` block; DriverRunning, nothing taken, when
    another driver holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(run_dir / LOCK_FILES[0], timeout=0, fallback_to_soft=False)
    try:
        try:
            lock.acquire()
        except OSError as e:
            if isinstance(e, Timeout) or e.errno not in NO_LOCKS:
                raise
            lock = SoftFileLock(run_dir / LOCK_FILES[1], timeout=0)
            lock.acquire()
    except Timeout:
        info = (read_json(run_dir / "pipeline.json") or {}).get("driver") or {}
        pid, host = info.get("pid", "PID"), info.get("host", "its host")
        raise DriverRunning(
            f"pipeline {name!r} is being run by driver pid {pid} on host {host} (started "
            f"{info.get('started', '?')}); a second driver would retrain and log over it. "
            f"Wait for it to finish (`make status NAME={name}` shows its progress) or stop "
            f"it (kill {pid} on {host}), then resume"
            + (f" (no flock here: once that driver is gone, delete {lock.lock_file})"
               if isinstance(lock, SoftFileLock) else ".")) from None
    try:
        yield
    finally:
        lock.release()


def driver_alive(run_dir: str | os.PathLike) -> bool:
    """Whether a driver holds the pipeline's lock now, probed by taking it for an instant (a
    driver starting in that instant is refused); nothing is taken where no driver ran."""
    if not any((Path(run_dir) / f).exists() for f in LOCK_FILES):
        return False
    try:
        with run_lock(run_dir, Path(run_dir).name):
            return False
    except DriverRunning:
        return True
    except PermissionError:  # a run directory of another user: no driver of ours is known
        return False

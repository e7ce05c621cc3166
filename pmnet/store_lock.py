"""A store's unit lock (issues 45, 53): `locks/<unit>.lock`, held only while a unit is
checked and its files are copied in, and the rules that make a stale one breakable, so
that no lock can wedge a study (docs/pipeline.md, "The durable store").

Store format only: no Ray, MLflow or driver here (`pipelines.store` publishes under it).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from pmnet.io import read_json
from pmnet.store_layout import StoreError, StoreLayout

#: a store's unit lock older than this is stale whoever holds it (a lock is held only while a
#: unit is checked and its files are copied in: seconds); `PMNET_STALE_LOCK_S` overrides it
STALE_LOCK_S = 600.0
STALE_LOCK_ENV = "PMNET_STALE_LOCK_S"
#: how long a writer waits for a unit another writer holds before it gives up on it
LOCK_WAIT_S = 120.0


def pid_alive(pid: int) -> bool:
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
            and not pid_alive(pid)
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


class UnitLock:
    """`locks/<unit>.lock`, made with O_EXCL and holding its owner (host, pid, time, a
    token); removed on release only when it is still this owner's. A stale lock
    (`unit_lock_stale`: a dead owner of this host, older than `stale_s` (STALE_LOCK_S), or
    unreadable and its file older than that) is moved aside (rename, atomic) and taken; a
    writer that moved a fresh lock by mistake (another took the stale one first) puts it
    back with a hard link, which never overwrites. Waits up to `wait_s` for a live owner;
    StoreError naming it after that."""

    def __init__(self, store: StoreLayout, unit: str, wait_s: float = LOCK_WAIT_S,
                 stale_s: float | None = None):
        self.path = store.lock(unit)
        self.unit, self.wait_s = unit, wait_s
        self.stale_s = stale_lock_s() if stale_s is None else stale_s
        self.token = uuid.uuid4().hex

    def owner(self) -> dict:
        info = read_json(self.path)
        return info if isinstance(info, dict) else {}

    def _break(self, info: Any) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if not same_stale_lock(aside, info, self.stale_s):
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.link(aside, self.path)  # a fresh lock: back where it was
        with contextlib.suppress(FileNotFoundError):
            aside.unlink()

    def acquire(self) -> UnitLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "time": time.time(), "token": self.token}).encode()
        t0 = time.time()
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raw = read_json(self.path)
                if unit_lock_stale(self.path, raw, self.stale_s):
                    self._break(raw)
                    continue
                info = self.owner()
                if time.time() - t0 > self.wait_s:
                    raise StoreError(
                        f"store unit {self.unit} is locked by pid {info.get('pid', '?')} on "
                        f"{info.get('host', '?')} ({self.path}); a lock older than "
                        f"{self.stale_s:g} s is stale (its recorded time, or its file's age "
                        "when it cannot be read) and is taken over then") from None
                time.sleep(0.05)
                continue
            try:
                os.write(fd, me)
                os.fsync(fd)
            finally:
                os.close(fd)
            return self

    def release(self) -> None:
        if self.owner().get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __enter__(self) -> UnitLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
